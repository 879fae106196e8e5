// The flash_attn custom ops: schemas (TORCH_LIBRARY), their CPU and CUDA implementations (checks, output
// allocation, params, dispatch to csrc/cpu/ or the CUDA kernel table), and the Python module exposing the
// capability query. Fake/meta implementations and autograd live in flash_attn/ops.py.
#include <ATen/ATen.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../cpu/attention_cpu.h"
#include "../dispatch/device_attributes.h"
#include "../dispatch/fwd_plan.h"
#include "../dispatch/registry.h"
#include "../dispatch/sm90_policy.h"
#include "flash_attn/bwd_workspace.h"
#include "checked_values_cache.h"
#include "error_message.h"
#include "fwd_cuda_plan.h"
#include "input_checks.h"
#include "kernel_inputs.h"
#include "kvcache_append_api.h"

#if defined(FLASH_WITH_CUDA)
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>

#include "../sm80/probs_kernel.h"
#include "../sm80/zero_unowned_rows_kernel.h"
#endif

namespace flash::api {
namespace {

constexpr const char* kFwdOp = "flash_attn.fwd";
constexpr const char* kBwdOp = "flash_attn.bwd";
constexpr const char* kDecodeOp = "flash_attn.kvcache_decode_";

int device_sm(const at::Device& device) { return device_attributes(device.index()).sm; }
int device_code_arch(const at::Device& device) { return device_attributes(device.index()).code_arch; }

// softmax_lse is float32, float64 for float64 inputs (so float64 gradients keep float64 accuracy).
at::ScalarType lse_dtype(const at::Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

[[noreturn]] void fail_no_cuda_kernel(const FwdParams& params, const at::Device& device, Direction direction) {
#if defined(FLASH_WITH_CUDA)
  FLASH_FAIL(missing_kernel_message(device_sm(device), params, direction));
#else
  (void)params;
  (void)device;
  FLASH_FAIL("flash_attn: this build has no CUDA kernels (it was built without nvcc, with "
              "FLASH_ATTN_SKIP_CUDA=1, or before any CUDA kernel existed for ", direction_name(direction),
              "). Rebuild with the CUDA toolkit available, or run on CPU tensors.");
#endif
}

// FLASH_ATTN_HOPPER=force and the call went elsewhere: say why.
constexpr int kHopperArch = 90;
[[noreturn]] void fail_hopper_not_taken(const FwdParams& params, const BwdParams* bwd_params,
                                        const at::Device& device) {
  const Direction direction = bwd_params == nullptr ? Direction::kForward : Direction::kBackward;
  const char* declined = bwd_params == nullptr ? sm90_fwd_declines(params) : sm90_bwd_declines(*bwd_params);
  const DeviceAttributes attributes = device_attributes(device.index());
  std::string why;
  if (attributes.code_arch < kHopperArch) {
    why = "the loaded kernels were not compiled for sm_90a (GPU sm" + std::to_string(attributes.sm) +
          ", code compiled for sm" + std::to_string(attributes.code_arch) + ")";
  } else if (declined != nullptr) {
    why = std::string("it does not serve ") + declined + " yet";
  } else {
    why = "this build has no sm90 kernel for " + describe(canonical_key(kHopperArch, params, direction)) +
          " (the forward has kernels for head dims 64, 128, 192 and 256, which serve every head dim up to 256, the "
          "backward for 64 and 128; build knobs may have left them out)";
  }
  FLASH_FAIL(kHopperSwitchEnv, "=force: the Hopper ", direction_name(direction), " path did not take this call: ",
             why, ". Unset ", kHopperSwitchEnv, " (or set it to 1) to let such calls run on the portable kernels.");
}

// Whether the driver found code of this build it can run on the device (SASS for its arch, or PTX it can compile):
// a build with SASS only for older GPUs (e.g. FLASH_ATTN_CUDA_ARCHS=90 on an sm_100 GPU) has none.
bool device_runs_this_build(const at::Device& device) { return device_attributes(device.index()).code_arch > 0; }

// Runs the CUDA kernel for this call on the current stream, or fails naming what is missing. `found`: the call's
// find_kernel() result where the caller already looked it up (the backward, to size its workspace).
void launch_cuda(const FwdParams& params, const BwdParams* bwd_params, const at::Device& device,
                 const KernelEntry* found = nullptr) {
  const Direction direction = bwd_params == nullptr ? Direction::kForward : Direction::kBackward;
  const KernelEntry* entry =
      found != nullptr ? found
                       : find_kernel(device_sm(device), device_code_arch(device), params, direction, bwd_params);
  if (entry == nullptr) fail_no_cuda_kernel(params, device, direction);
  if (entry->key.arch != kHopperArch && hopper_switch() == HopperSwitch::kForce) {
    fail_hopper_not_taken(params, bwd_params, device);
  }
#if defined(FLASH_WITH_CUDA)
  FLASH_CHECK(device_runs_this_build(device), "flash_attn: this build has no code that GPU sm", device_sm(device),
              " can run (its kernels were compiled as SASS for other GPUs, without PTX). Rebuild with "
              "FLASH_ATTN_CUDA_ARCHS including compute_80 (the default) or this GPU's arch, or run on CPU tensors.");
#endif
#if defined(FLASH_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(device);
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  if (bwd_params == nullptr) {
    entry->fwd(params, stream);
  } else {
    entry->bwd(*bwd_params, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#endif
}

// Varlen outputs (contiguous, rows first) whose rows past cu_seqlens[-1] belong to no sequence and must read 0.
struct UnownedOutput {
  const at::Tensor* tensor;
  const at::Tensor* cu_seqlens;  // contiguous int32, batch + 1 entries
};

// Zeroes those rows of each output on the current stream (sm80/zero_unowned_rows_kernel.h: the end is read on the
// device, so a call whose host did not read cu_seqlens writes only the rows that need it, not the whole tensor).
void zero_unowned_rows(const std::vector<UnownedOutput>& outputs, int64_t batch, const at::Device& device) {
#if defined(FLASH_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(device);
  sm80::UnownedRowsParams params;
  for (const UnownedOutput& output : outputs) {
    const at::Tensor& t = *output.tensor;
    FLASH_CHECK(t.is_contiguous() && t.dim() >= 1 && params.count < sm80::kMaxUnownedRowTensors,
                "flash_attn internal error: zero_unowned_rows takes up to ", sm80::kMaxUnownedRowTensors,
                " contiguous outputs; got ", t.dim(), " dims, contiguous=", t.is_contiguous());
    params.tensors[params.count++] = sm80::UnownedRows{t.data_ptr(), t.stride(0) * t.element_size(), t.size(0),
                                                       output.cu_seqlens->data_ptr<int32_t>() + batch};
  }
  sm80::launch_zero_unowned_rows(params, c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#else
  (void)outputs;
  (void)batch;
  (void)device;
#endif
}

// return_attn_probs on CUDA: a separate kernel recomputes P from q, k and the lse the forward kernel wrote.
void launch_cuda_probs(const FwdParams& params, const at::Device& device) {
#if defined(FLASH_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(device);
  FLASH_CHECK(sm80::launch_probs(params, c10::cuda::getCurrentCUDAStream().stream()), kFwdOp,
              ": return_attn_probs=True on CUDA needs fp16 or bf16 inputs with head_dim <= ", sm80::kProbsMaxHeadDim,
              "; got ", dtype_name(params.dtype), " head_dim=", params.shape.head_dim,
              ". Call without return_attn_probs, or on CPU tensors");
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#else
  fail_no_cuda_kernel(params, device, Direction::kForward);
#endif
}

// The sequences of a paged cache's pool (num_pages, page_size, nheads_k, head_dim) as a dense (batch, rows, nheads_k,
// head_dim) copy, for the calls the kernels do not read pages in (fwd_reads_pages). Page numbers are clamped.
at::Tensor gather_pages(const at::Tensor& pool, const at::Tensor& block_table, int64_t rows) {
  const at::Tensor pages = block_table.to(at::kLong).clamp(0, std::max<int64_t>(pool.size(0) - 1, 0)).reshape({-1});
  return pool.index_select(0, pages).reshape({block_table.size(0), rows, pool.size(2), pool.size(3)});
}

// flash_attn_with_kvcache's append inside the decode kernel (kvcache_decode_): the new rows, checked as the append op
// checks them, and the rotary tables, which the kernel applies to its queries and to the new keys.
struct AppendInCall {
  KvAppendParams append;
  FwdParams::Rotary rotary;
};

// The fwd op; with `append`, k and v are the caches the decode kernel appends to and seqused_k their lengths before
// the new rows (the caller, kvcache_decode_, has checked that the call takes a portable decode tile with one CTA per
// kv head, reading k and v in place).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_impl(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double dropout_p, double softmax_scale, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias,
    const std::optional<at::Tensor>& rng_state, bool return_probs, bool deterministic,
    const std::optional<at::Tensor>& seqused_k, int64_t num_splits, const std::optional<at::Tensor>& block_table,
    const AppendInCall* append = nullptr) {
  FLASH_CHECK(num_splits >= 0, kFwdOp, ": num_splits must be >= 0 (0 lets flash_attn choose); got ", num_splits,
              ". Pass 0, or the number of key splits wanted.");
  const int64_t paged_rows =
      block_table.has_value() ? check_paged_cache(kFwdOp, q, k, v, *block_table,
                                                  cu_seqlens_q.has_value() || cu_seqlens_k.has_value(),
                                                  seqused_k.has_value())
                              : 0;
  const CallArgs args{q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q.expect_int(), max_seqlen_k.expect_int(),
                      dropout_p, softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes,
                      attn_bias, rng_state, seqused_k, paged_rows};
  CheckedCall call = check_call(kFwdOp, args);
  FwdParams& p = call.params;
  if (paged_rows > 0) {
    // The decode kernels, and the Hopper forward where a page holds whole key blocks (sm90 fwd_pages_fit), read the
    // pages in place; every other call (and CPU) reads a dense copy of its sequences.
    FwdParams probe = p;
    probe.block_table = block_table->data_ptr<int32_t>();
    probe.page_size = static_cast<int>(k.size(1));
    probe.lse_head_stride = p.shape.seqlen_q;  // the dense lse (batch, nheads, seqlen_q) allocated below
    if (return_probs || !q.is_cuda() || !cuda_fwd_reads_pages(probe, q)) {
      FLASH_CHECK(append == nullptr, kFwdOp, ": an append in the call needs pages read in place (a flash_attn bug)");
      return fwd_impl(q, gather_pages(k, *block_table, paged_rows), gather_pages(v, *block_table, paged_rows),
                 cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, window_left,
                 window_right, bottom_right, softcap, alibi_slopes, attn_bias, rng_state, return_probs, deterministic,
                 seqused_k, num_splits, std::nullopt);
    }
  }
  const auto lse_options = q.options().dtype(lse_dtype(q));
  if (call.no_work) {
    // Every row (if any) sees no key: O = 0, LSE = +inf, as torch's empty-input semantics; no attention kernel runs.
    if (append != nullptr) launch_kvcache_append(append->append, k);
    const std::vector<int64_t> lse_shape = call.varlen ? std::vector<int64_t>{p.shape.nheads_q, call.total_q}
                                                       : std::vector<int64_t>{p.shape.batch, p.shape.nheads_q,
                                                                              p.shape.seqlen_q};
    const std::vector<int64_t> probs_shape = return_probs ? std::vector<int64_t>{p.shape.batch, p.shape.nheads_q,
                                                                                 p.shape.seqlen_q, p.shape.seqlen_k}
                                                          : std::vector<int64_t>{0};
    return {at::zeros(q.sizes(), q.options()),
            at::full(lse_shape, std::numeric_limits<double>::infinity(), lse_options),
            at::zeros(probs_shape, q.options())};
  }
  const KernelInputs in = prepare_kernel_inputs(call, q, k, v);
  // Allocated in the kernel layout: contiguous, head dim padded like q's (the contract in params.h).
  // Varlen rows past cu_seqlens_q[-1] belong to no sequence: O = 0 there (zeroed after the kernel where the values
  // passed the checks on CUDA, zero_unowned_rows; zero-filled otherwise, CheckedCall::cu_seqlens_passed).
  const bool unowned_out = call.varlen && call.unowned_rows_q;
  const bool zero_after = unowned_out && !q.is_cpu() && call.cu_seqlens_passed;
  at::Tensor out = unowned_out && !zero_after ? at::zeros(in.q.sizes(), q.options())
                                              : at::empty(in.q.sizes(), q.options());
  at::Tensor lse = call.varlen ? at::full({p.shape.nheads_q, call.total_q}, std::numeric_limits<float>::infinity(),
                                         lse_options)
                               : at::empty({p.shape.batch, p.shape.nheads_q, p.shape.seqlen_q}, lse_options);
  at::Tensor probs = return_probs ? at::zeros({p.shape.batch, p.shape.nheads_q, p.shape.seqlen_q, p.shape.seqlen_k},
                                              q.options())
                                  : at::empty({0}, q.options());
  p.out = out.data_ptr();
  p.out_strides = strides_of(out, call.varlen);
  p.lse = lse.data_ptr();
  p.lse_batch_stride = call.varlen ? 0 : lse.stride(0);
  p.lse_head_stride = call.varlen ? lse.stride(0) : lse.stride(1);
  if (return_probs) {
    p.probs = probs.data_ptr();
    p.probs_strides = ScoreStrides{probs.stride(0), probs.stride(1), probs.stride(2), probs.stride(3)};
  }
  const at::Tensor table = paged_rows > 0 ? block_table->contiguous() : at::Tensor();
  if (paged_rows > 0) {
    p.block_table = table.data_ptr<int32_t>();
    p.block_table_stride = table.stride(0);
    p.page_size = static_cast<int>(in.k.size(1));
    p.num_pages = static_cast<int>(in.k.size(0));
  }
  if (q.is_cpu()) {
    cpu::run_fwd(p);
  } else {
    std::vector<at::Tensor> scratch;
    if (append != nullptr) {
      const KvAppendParams& a = append->append;
      p.shape.appended_keys = a.new_rows;  // before the split plan, which gives the new rows a split of their own
      p.kv_append = FwdParams::KvAppend{a.k, a.v, a.k_strides, a.v_strides};
      p.rotary = append->rotary;
    }
    plan_cuda_fwd(p, q, scratch, num_splits);
    const bool parts_keys = p.num_splits > 1 || p.decode_key_warps;  // the key-warps tile parts a CTA's keys too
    if (append != nullptr && parts_keys && !p.appended_split && append->append.new_rows > 1) {
      // Several new rows in a split plan without a split of their own for them (a num_splits asked for, or no slot
      // for one more) may straddle two splits' tiles, so the append kernel writes them first and every decode CTA
      // waits for it (sm80/fwd_kernel.h); the kernel still counts the keys and rotates its queries. One new row lies
      // in one split's tiles, whose CTA writes it.
      p.kv_append = FwdParams::KvAppend{};
      launch_kvcache_append(append->append, k);
    }
    launch_cuda(p, nullptr, q.device());
    if (zero_after) zero_unowned_rows({{&out, &call.cu_seqlens_q_device}}, p.shape.batch, q.device());
    if (return_probs) launch_cuda_probs(p, q.device());
  }
  out = from_kernel_layout(out, in.head_dim);
  return {out, lse, probs};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const std::optional<at::Tensor>& cu_seqlens_q,
    const std::optional<at::Tensor>& cu_seqlens_k, c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k,
    double dropout_p, double softmax_scale, int64_t window_left, int64_t window_right, bool bottom_right,
    double softcap, const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias,
    const std::optional<at::Tensor>& rng_state, bool return_probs, bool deterministic,
    const std::optional<at::Tensor>& seqused_k, int64_t num_splits, const std::optional<at::Tensor>& block_table) {
  return fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                  window_left, window_right, bottom_right, softcap, alibi_slopes, attn_bias, rng_state, return_probs,
                  deterministic, seqused_k, num_splits, block_table);
}

// Whether a kvcache_decode_ call's decode kernel can write its new rows: one query per sequence on a CUDA device,
// int32 lengths, caches the decode kernels read as they are (no padding copy, pages in place), a portable decode tile
// with one CTA per kv head (not the Hopper kernels, which do not take appended keys).
bool decode_takes_append(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
                         double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
                         const std::optional<at::Tensor>& alibi_slopes) {
  if (!q.is_cuda() || q.dim() != 4 || q.size(1) != 1 || cache_seqlens.scalar_type() != at::kInt ||
      input_action(k_cache) != InputAction::kUse || input_action(v_cache) != InputAction::kUse) {
    return false;
  }
  const int64_t paged_rows =
      block_table.has_value() ? check_paged_cache(kFwdOp, q, k_cache, v_cache, *block_table, false, true) : 0;
  const CallArgs args{q, k_cache, v_cache, std::nullopt, std::nullopt, 0, 0, 0.0, softmax_scale, window_left,
                      window_right, true, softcap, alibi_slopes, std::nullopt, std::nullopt, cache_seqlens,
                      paged_rows};
  CheckedCall call = check_call(kFwdOp, args);
  if (call.no_work) return false;
  FwdParams& p = call.params;
  p.lse_head_stride = p.shape.seqlen_q;  // the dense lse (batch, nheads, seqlen_q) the forward allocates
  if (paged_rows > 0) {
    p.block_table = block_table->data_ptr<int32_t>();
    p.page_size = static_cast<int>(k_cache.size(1));
    if (!cuda_fwd_reads_pages(p, q)) return false;
  }
  if (!cuda_fwd_takes_append(p, q)) return false;
  const KernelEntry* entry =
      find_kernel(device_sm(q.device()), device_code_arch(q.device()), p, Direction::kForward, nullptr);
  return entry != nullptr && entry->key.arch != kHopperArch;
}

// torch.ops.flash_attn.kvcache_decode_: flash_attn_with_kvcache's append (k, v written into the caches at
// cache_seqlens, k and q rotated when the tables are given) and its attention in one op, for calls without
// cache_batch_idx / cache_leftpad and without gradients. Where decode_takes_append holds, one kernel: the decode CTA
// that holds a sequence's last key tile writes its kv head's new rows, every CTA rotates its own queries (no append
// kernel, whose latency chain cost 5-6 us before the attention could read the cache); elsewhere the append (rotating
// q into a copy, counting the keys) and then the forward, as kvcache_append_ and fwd run them.
std::tuple<at::Tensor, at::Tensor> kvcache_decode_(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& block_table,
    const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin, bool interleaved,
    double softmax_scale, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits) {
  const std::optional<at::Tensor> none;
  // Dao's rule for the queries' positions (flash_attn/kvcache.py _rotate_queries): per row when causal or local.
  const bool q_per_row = window_left != kUnboundedWindow || window_right != kUnboundedWindow;
  if (!decode_takes_append(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale, window_left,
                           window_right, softcap, alibi_slopes)) {
    const bool rotary = rotary_cos.has_value();
    const auto [seqused, q_rotated] = kvcache_append_(k_cache, v_cache, k, v, cache_seqlens, none, block_table, none,
                                                      rotary_cos, rotary_sin, interleaved,
                                                      rotary ? std::optional<at::Tensor>(q) : none, q_per_row);
    const auto [out, lse, probs] =
        fwd(rotary ? q_rotated : q, k_cache, v_cache, none, none, 0, 0, 0.0, softmax_scale, window_left, window_right,
            true, softcap, alibi_slopes, none, none, false, false, seqused, num_splits, block_table);
    return {out, lse};
  }
  AppendInCall in_call;
  in_call.append = kvcache_append_params(k_cache, v_cache, k, v, cache_seqlens, none, block_table, none, rotary_cos,
                                         rotary_sin, interleaved);
  const KvAppendParams& a = in_call.append;
  if (a.cos != nullptr) {
    FLASH_CHECK(q.scalar_type() == k.scalar_type() && q.size(3) == k.size(3), kDecodeOp,
                ": q must have the dtype and head dim of k (", k.scalar_type(), ", ", k.size(3), "); got ",
                q.scalar_type(), ", ", q.size(3));
    in_call.rotary = FwdParams::Rotary{a.cos, a.sin, a.cos_row_stride, a.sin_row_stride, a.rotary_dim, a.seqlen_ro,
                                       a.interleaved};
  }
  const auto [out, lse, probs] =
      fwd_impl(q, k_cache, v_cache, none, none, 0, 0, 0.0, softmax_scale, window_left, window_right, true, softcap,
               alibi_slopes, none, none, false, false, cache_seqlens, num_splits, block_table, &in_call);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> bwd(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& softmax_lse, const std::optional<at::Tensor>& dlse,
    const std::optional<at::Tensor>& cu_seqlens_q, const std::optional<at::Tensor>& cu_seqlens_k,
    c10::SymInt max_seqlen_q, c10::SymInt max_seqlen_k, double dropout_p, double softmax_scale,
    int64_t window_left, int64_t window_right, bool bottom_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, const std::optional<at::Tensor>& attn_bias,
    const std::optional<at::Tensor>& rng_state, bool deterministic, bool bias_requires_grad) {
  const std::optional<at::Tensor> no_seqused_k;  // the backward has no seqused_k (flash_attn/ops.py refuses it)
  const CallArgs args{q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q.expect_int(), max_seqlen_k.expect_int(),
                      dropout_p, softmax_scale, window_left, window_right, bottom_right, softcap, alibi_slopes,
                      attn_bias, rng_state, no_seqused_k};
  CheckedCall call = check_call(kBwdOp, args);
  FLASH_CHECK(std::abs(softmax_scale) <= kMaxBackwardSoftmaxScale, kBwdOp, ": |softmax_scale| must be at most ",
              kMaxBackwardSoftmaxScale, " for the backward, which recomputes the probabilities from the fp32 "
              "softmax_lse and cannot resolve them at larger scales; got ", softmax_scale, ". A softmax this sharp is "
              "an argmax, whose gradient is 0 away from ties: train with a smaller scale (the forward alone accepts "
              "any finite scale)");
  check_same_layout(kBwdOp, "dout", dout, q);
  check_same_layout(kBwdOp, "out", out, q);
  const std::vector<int64_t> lse_shape =
      call.varlen ? std::vector<int64_t>{call.params.shape.nheads_q, call.total_q}
                  : std::vector<int64_t>{call.params.shape.batch, call.params.shape.nheads_q, call.params.shape.seqlen_q};
  FLASH_CHECK(softmax_lse.scalar_type() == lse_dtype(q) && softmax_lse.sizes() == at::IntArrayRef(lse_shape), kBwdOp,
              ": softmax_lse must be ", lse_dtype(q), " of shape ", at::IntArrayRef(lse_shape), "; got ",
              softmax_lse.scalar_type(), " ", softmax_lse.sizes());
  FLASH_CHECK(!bias_requires_grad || attn_bias.has_value(), kBwdOp, ": bias_requires_grad needs attn_bias");
  const at::Tensor lse_c = softmax_lse.contiguous();
  at::Tensor dlse_c;
  if (dlse.has_value()) {
    FLASH_CHECK(dlse->sizes() == softmax_lse.sizes(), kBwdOp, ": dlse must have the shape of softmax_lse ",
                softmax_lse.sizes(), "; got ", dlse->sizes());
    dlse_c = dlse->to(lse_dtype(q)).contiguous();
  }

  if (call.no_work) {
    // The forward computed nothing (no query, key or sequence): every gradient is 0; no kernel runs.
    const std::vector<int64_t> dbias_shape =
        bias_requires_grad ? std::vector<int64_t>{call.params.shape.batch, call.params.shape.nheads_q,
                                                  call.params.shape.seqlen_q, call.params.shape.seqlen_k}
                           : std::vector<int64_t>{0};
    return {at::zeros(q.sizes(), q.options()), at::zeros(k.sizes(), k.options()), at::zeros(v.sizes(), v.options()),
            at::zeros(dbias_shape, q.options().dtype(lse_dtype(q)))};
  }
  const KernelInputs in = prepare_kernel_inputs(call, q, k, v);
  BwdParams bp;
  bp.fwd = call.params;
  FwdParams& p = bp.fwd;
  const at::Tensor out_k = q.is_cuda() ? to_kernel_layout(out) : out;
  const at::Tensor dout_k = q.is_cuda() ? to_kernel_layout(dout) : dout;
  p.out = const_cast<void*>(out_k.data_ptr());
  p.out_strides = strides_of(out_k, call.varlen);
  p.lse = const_cast<void*>(lse_c.data_ptr());
  p.lse_batch_stride = call.varlen ? 0 : lse_c.stride(0);
  p.lse_head_stride = call.varlen ? lse_c.stride(0) : lse_c.stride(1);
  bp.dout = dout_k.data_ptr();
  bp.dout_strides = strides_of(dout_k, call.varlen);
  bp.dlse = dlse.has_value() ? dlse_c.data_ptr() : nullptr;
  bp.deterministic = deterministic;

  // Gradients are allocated contiguous in the kernel layout (head dim padded like the inputs'). Varlen rows
  // past cu_seqlens[-1] belong to no sequence: their gradient is 0 (see CheckedCall::unowned_rows_q), zeroed after
  // the kernels where the values passed the checks on CUDA (zero_unowned_rows), zero-filled otherwise.
  const bool zero_after = call.varlen && !q.is_cpu() && call.cu_seqlens_passed;
  auto grad_like = [&](const at::Tensor& t, bool unowned_rows) {
    return call.varlen && unowned_rows && !zero_after ? at::zeros(t.sizes(), t.options())
                                                      : at::empty(t.sizes(), t.options());
  };
  at::Tensor dq = grad_like(in.q, call.unowned_rows_q);
  at::Tensor dk = grad_like(in.k, call.unowned_rows_k);
  at::Tensor dv = grad_like(in.v, call.unowned_rows_k);
  at::Tensor dbias = bias_requires_grad
                         ? at::zeros({p.shape.batch, p.shape.nheads_q, p.shape.seqlen_q, p.shape.seqlen_k},
                                     q.options().dtype(lse_dtype(q)))
                         : at::empty({0}, q.options().dtype(lse_dtype(q)));
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  bp.dq_strides = strides_of(dq, call.varlen);
  bp.dk_strides = strides_of(dk, call.varlen);
  bp.dv_strides = strides_of(dv, call.varlen);
  if (bias_requires_grad) {
    bp.dbias = dbias.data_ptr();
    bp.dbias_strides = ScoreStrides{dbias.stride(0), dbias.stride(1), dbias.stride(2), dbias.stride(3)};
  }
  if (q.is_cpu()) {
    cpu::run_bwd(bp);
  } else {
    // Kernel scratch (flash_attn/bwd_workspace.h) from the caching allocator on the current stream: no
    // cudaMalloc, no host sync, so the call stays capturable in a CUDA graph.
    const int num_sms = std::max(device_attributes(q.device().index()).num_sms, 1);
    bp.total_q = call.total_q;
    bp.dq_splits = bwd_dq_splits(bp, num_sms);
    // Either backward may split a KV head's query heads over several CTAs, whose dK / dV accumulators are part of
    // the workspace (each by its own rule); the Hopper one also reads the statistics in blocks.
    const KernelEntry* entry =
        find_kernel(device_sm(q.device()), device_code_arch(q.device()), p, Direction::kBackward, &bp);
    if (entry != nullptr && entry->key.arch == kHopperArch) {
      bp.head_splits = sm90_bwd_head_splits(bp, num_sms);
      bp.dq_splits = sm90_bwd_dq_splits(bp, num_sms);
      bp.block_stats = true;
    } else {
      bp.head_splits = bwd_head_splits(bp, num_sms);
    }
    const at::Tensor workspace = at::empty({bwd_workspace_bytes(bp)}, q.options().dtype(at::kByte));
    bp.workspace = workspace.data_ptr();
    launch_cuda(p, &bp, q.device(), entry);
    std::vector<UnownedOutput> unowned;
    if (zero_after && call.unowned_rows_q) unowned.push_back({&dq, &call.cu_seqlens_q_device});
    if (zero_after && call.unowned_rows_k) {
      unowned.push_back({&dk, &call.cu_seqlens_k_device});
      unowned.push_back({&dv, &call.cu_seqlens_k_device});
    }
    if (!unowned.empty()) zero_unowned_rows(unowned, p.shape.batch, q.device());
  }
  dq = from_kernel_layout(dq, in.head_dim);
  dk = from_kernel_layout(dk, in.head_dim);
  dv = from_kernel_layout(dv, in.head_dim);
  return {dq, dk, dv, dbias};
}

DType dtype_from_name(const std::string& name) {
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
    if (name == dtype_name(dtype)) return dtype;
  }
  FLASH_FAIL("flash_attn.is_supported: unknown dtype name '", name, "'; use fp16, bf16, fp32 or fp64");
}

// Whether flash_attn runs (forward, and backward if asked; every mask kind) for this device, dtype, head dim.
bool is_supported(const std::string& device_type, int64_t device_index, const std::string& dtype, int64_t head_dim,
                  bool backward) {
  const DType d = dtype_from_name(dtype);
  if (device_type == "cpu") return cpu_supports(d, head_dim);
  if (device_type != "cuda" || d == DType::kFloat32 || d == DType::kFloat64) return false;
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  return device_runs_this_build(device) &&
         cuda_supports(device_sm(device), device_code_arch(device), d, head_dim, backward);
}

// The kernel input contract's action for one tensor ("use", "copy" or "pad"), on any device: lets the tests
// check the layout rules of kernel_inputs.h without a GPU.
std::string kernel_input_action(const at::Tensor& t) {
  FLASH_CHECK(t.dim() >= 1, "flash_attn._C.kernel_input_action: the tensor must have a head dimension; got shape ",
              t.sizes());
  return input_action_name(input_action(t));
}

// Checks that every value of an integer index tensor (cache_seqlens, cache_batch_idx) is in [low, high]: on CPU always,
// on CUDA once per tensor version (checked_values_cache.h). Fails naming `op` and `name` and the first bad entry.
void check_index_values(const at::Tensor& t, const std::string& op, const std::string& name, int64_t low,
                        int64_t high) {
  FLASH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must have dtype torch.int32 or torch.int64; got ", t.scalar_type());
  const Requirement requirement{static_cast<int64_t>(CheckedArgument::kIndexRange), low, high};
  const std::optional<at::Tensor> host = values_to_check(t, requirement);
  if (!host.has_value()) return;
  const at::Tensor values = host->to(at::kLong).flatten();
  const int64_t* data = values.data_ptr<int64_t>();
  for (int64_t i = 0; i < values.numel(); ++i) {
    FLASH_CHECK(data[i] >= low && data[i] <= high, op, ": ", name, "[", i, "]=", data[i], " is outside [", low, ", ",
                high, "]", (high < low ? " (no value fits: the cache has too few rows for the new keys)" : ""));
  }
  remember_checked(t, requirement);
}

// The loaded kernels on a CUDA device (device_attributes.h): (code arch, binary arch), e.g. (90, 90) for sm_90 SASS,
// (80, 90) where the driver JIT-compiled compute_80 PTX on an H200; (0, 0) without a loadable image or CUDA build.
std::tuple<int64_t, int64_t> loaded_code(int64_t device_index) {
  const DeviceAttributes attributes = device_attributes(static_cast<int>(device_index));
  return {attributes.code_arch, attributes.binary_arch};
}

pybind11::list built_kernels() {
  pybind11::list kernels;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
    for (Direction direction : {Direction::kForward, Direction::kBackward}) {
      pybind11::dict entry;
      entry["device"] = "cpu";
      entry["arch"] = pybind11::none();
      entry["dtype"] = dtype_name(dtype);
      entry["head_dim"] = pybind11::make_tuple(1, kMaxHeadDim);
      entry["mask"] = "any";
      entry["direction"] = direction_name(direction);
      entry["name"] = std::string("cpu_") + direction_name(direction) + "_" + dtype_name(dtype);
      kernels.append(entry);
    }
  }
  for (const KernelEntry& kernel : kernel_table()) {
    pybind11::dict entry;
    entry["device"] = "cuda";
    entry["arch"] = "sm" + std::to_string(kernel.key.arch);
    entry["dtype"] = dtype_name(kernel.key.dtype);
    entry["head_dim"] = kernel.key.head_dim;
    entry["mask"] = mask_name(kernel.key.mask);
    entry["direction"] = direction_name(kernel.key.direction);
    entry["name"] = kernel.name;
    kernels.append(entry);
  }
  return kernels;
}

}  // namespace
}  // namespace flash::api

TORCH_LIBRARY(flash_attn, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
      "SymInt max_seqlen_k, float dropout_p, float softmax_scale, int window_left, int window_right, "
      "bool bottom_right, float softcap, Tensor? alibi_slopes, Tensor? attn_bias, Tensor? rng_state, "
      "bool return_probs, bool deterministic=False, Tensor? seqused_k=None, int num_splits=0, "
      "Tensor? block_table=None) "
      "-> (Tensor out, Tensor softmax_lse, Tensor probs)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor softmax_lse, Tensor? dlse, "
      "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, "
      "float softmax_scale, int window_left, int window_right, bool bottom_right, float softcap, "
      "Tensor? alibi_slopes, Tensor? attn_bias, Tensor? rng_state, bool deterministic, bool bias_requires_grad) "
      "-> (Tensor dq, Tensor dk, Tensor dv, Tensor dbias)");
  m.def(
      "kvcache_decode_(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor k, Tensor v, Tensor cache_seqlens, "
      "Tensor? block_table, Tensor? rotary_cos, Tensor? rotary_sin, bool interleaved, float softmax_scale, "
      "int window_left, int window_right, float softcap, Tensor? alibi_slopes, int num_splits) "
      "-> (Tensor out, Tensor softmax_lse)");
}

TORCH_LIBRARY_IMPL(flash_attn, CPU, m) {
  m.impl("fwd", &flash::api::fwd);
  m.impl("bwd", &flash::api::bwd);
  m.impl("kvcache_decode_", &flash::api::kvcache_decode_);
}

TORCH_LIBRARY_IMPL(flash_attn, CUDA, m) {
  m.impl("fwd", &flash::api::fwd);
  m.impl("bwd", &flash::api::bwd);
  m.impl("kvcache_decode_", &flash::api::kvcache_decode_);
}

#define FLASH_STRINGIZE_VALUE(x) #x
#define FLASH_STRINGIZE(x) FLASH_STRINGIZE_VALUE(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.doc() = "flash_attn native extension: registers torch.ops.flash_attn.* and the capability query";
  module.attr("__version__") = FLASH_STRINGIZE(FLASH_ATTN_VERSION);  // setup.py's -DFLASH_ATTN_VERSION
  module.def("built_kernels", &flash::api::built_kernels, "Every compiled kernel as a list of dicts");
  module.def("is_supported", &flash::api::is_supported, "Whether a (device, dtype, head dim) runs here");
  module.def("check_index_values", &flash::api::check_index_values,
             "Checks that an index tensor's values lie in [low, high] (CUDA: once per tensor version)");
  module.def("loaded_code", &flash::api::loaded_code,
             "(code arch, binary arch) of the kernels loaded on a CUDA device: (80, 90) = compute_80 PTX JIT-compiled");
  module.def("kernel_input_action", &flash::api::kernel_input_action,
             "What the CUDA kernel input contract does to a q/k/v/out/dout tensor: use, copy or pad");
}
