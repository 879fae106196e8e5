// check_call() and helpers: every requirement the flash_attn ops place on their inputs (see input_checks.h). A failed
// check throws with the argument, the requirement, the value received and the fix; nothing is launched before.
#include "input_checks.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

#include "../dispatch/registry.h"
#include "checked_values_cache.h"
#include "error_message.h"

namespace flash::api {
namespace {

std::string shape_str(const at::Tensor& t) { return to_text(t.sizes()); }

bool dtype_supported(at::ScalarType type, bool cuda) {
  if (type == at::kHalf || type == at::kBFloat16) return true;
  return !cuda && (type == at::kFloat || type == at::kDouble);
}

void check_unit_last_stride(const char* op, const char* name, const at::Tensor& t) {
  FLASH_CHECK(t.size(-1) == 1 || t.stride(-1) == 1, op, ": ", name,
              " must have stride 1 in its last (head) dimension; got strides ", t.strides(),
              ". Pass ", name, ".contiguous() or a view whose last dimension is contiguous.");
}

// Checks what every cu_seqlens tensor must satisfy without reading its values: dtype, device, rank.
void check_cu_seqlens_layout(const char* op, const char* name, const at::Tensor& cu, const at::Tensor& like) {
  FLASH_CHECK(cu.scalar_type() == at::kInt, op, ": ", name, " must have dtype torch.int32; got ", cu.scalar_type(),
              ". Convert with ", name, ".to(torch.int32).");
  FLASH_CHECK(cu.device() == like.device(), op, ": ", name, " must be on the same device as q (", like.device(),
              "); got ", cu.device());
  FLASH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, op, ": ", name,
              " must be 1-D with batch_size + 1 >= 1 entries; got shape ", shape_str(cu));
}

// Validates the values of one host copy of a cu_seqlens tensor; returns its last entry.
int64_t check_cu_seqlens_values(const char* op, const char* name, const at::Tensor& host, int64_t total,
                                int64_t max_seqlen, const char* max_name, const char* tensor_name) {
  const int32_t* data = host.data_ptr<int32_t>();
  FLASH_CHECK(data[0] == 0, op, ": ", name, "[0] must be 0; got ", data[0]);
  int64_t longest = 0;
  for (int64_t i = 1; i < host.size(0); ++i) {
    FLASH_CHECK(data[i] >= data[i - 1], op, ": ", name, " must be non-decreasing; got ", name, "[", i - 1,
                "]=", data[i - 1], " > ", name, "[", i, "]=", data[i]);
    longest = std::max<int64_t>(longest, data[i] - data[i - 1]);
  }
  FLASH_CHECK(data[host.size(0) - 1] <= total, op, ": ", name, "[-1]=", data[host.size(0) - 1],
              " is beyond the ", total, " rows of ", tensor_name, " (", name, " must index rows of ", tensor_name,
              ")");
  FLASH_CHECK(max_seqlen >= longest, op, ": ", max_name, "=", max_seqlen,
              " is smaller than the longest sequence in ", name, " (", longest, "); pass the true maximum");
  return data[host.size(0) - 1];
}

// Checks seqused_k of a dense call (int32 (batch,), on q's device) and returns it contiguous; its values, in
// [0, seqlen_k], are read only for CPU tensors (on CUDA the kernels clamp them instead of the host reading them).
at::Tensor check_seqused_k(const char* op, const at::Tensor& used, const at::Tensor& q, int64_t batch,
                           int64_t seqlen_k) {
  FLASH_CHECK(used.scalar_type() == at::kInt, op, ": seqused_k must have dtype torch.int32; got ",
              used.scalar_type(), ". Convert with seqused_k.to(torch.int32).");
  FLASH_CHECK(used.device() == q.device(), op, ": seqused_k must be on the same device as q (", q.device(),
              "); got ", used.device());
  FLASH_CHECK(used.dim() == 1 && used.size(0) == batch, op, ": seqused_k must be 1-D with batch_size = ", batch,
              " entries (keys used per sequence); got shape ", shape_str(used));
  at::Tensor contiguous = used.contiguous();
  if (!used.is_cpu()) return contiguous;
  const int32_t* data = contiguous.data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    FLASH_CHECK(data[b] >= 0 && data[b] <= seqlen_k, op, ": seqused_k[", b, "] must be in [0, seqlen_k = ",
                seqlen_k, "] (the rows of k); got ", data[b], ". Pass at most k.shape[1] keys per sequence.");
  }
  return contiguous;
}

}  // namespace

// Checks the values of cu_seqlens (on CPU always; on CUDA once per tensor version, checked_values_cache.h) and returns
// its last entry when this call read the values, or nullopt when it did not (remembered from an earlier call,
// CUDA-graph capture, or checks turned off). A last entry is not remembered across calls: a write that bypasses the
// version counter (a Triton or raw CUDA kernel, .data) could have changed it, and callers size zero fills by it.
std::optional<int64_t> check_cu_seqlens(const char* op, const char* name, const at::Tensor& cu, int64_t total,
                                        int64_t max_seqlen, const char* max_name, const char* tensor_name,
                                        CheckedArgument argument, bool* passed) {
  const Requirement requirement{static_cast<int64_t>(argument), total, max_seqlen};
  const std::optional<at::Tensor> host = values_to_check(cu, requirement);
  if (!host.has_value()) {
    if (passed != nullptr) *passed = remembered_check(cu, requirement);
    return std::nullopt;
  }
  const int64_t last = check_cu_seqlens_values(op, name, *host, total, max_seqlen, max_name, tensor_name);
  remember_checked(cu, requirement);
  if (passed != nullptr) *passed = true;
  return last;
}

DType to_dtype(at::ScalarType type) {
  switch (type) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat32;
    case at::kDouble: return DType::kFloat64;
    default: FLASH_FAIL("flash_attn: unsupported dtype ", type);
  }
}

TensorStrides strides_of(const at::Tensor& t, bool varlen) {
  if (varlen) return TensorStrides{0, t.stride(0), t.stride(1)};
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

void check_same_layout(const char* op, const char* name, const at::Tensor& t, const at::Tensor& like) {
  FLASH_CHECK(t.sizes() == like.sizes(), op, ": ", name, " must have shape ", shape_str(like), "; got ",
              shape_str(t));
  FLASH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", name, " must have dtype ", like.scalar_type(),
              "; got ", t.scalar_type());
  FLASH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(), "; got ", t.device());
  check_unit_last_stride(op, name, t);
}

int64_t check_paged_cache(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& block_table, bool varlen, bool has_seqused_k) {
  FLASH_CHECK(!varlen, op, ": block_table (a paged K / V cache) is for dense q (batch, seqlen, nheads, headdim); got "
              "it together with cu_seqlens_q / cu_seqlens_k. Pass q per sequence, or gather the pages first");
  FLASH_CHECK(has_seqused_k, op, ": block_table (a paged K / V cache) needs seqused_k, each sequence's key count");
  FLASH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op, ": with block_table, q must be 4-D (batch, seqlen, "
              "nheads, headdim) and k / v 4-D (num_pages, page_size, nheads_k, headdim); got q=", shape_str(q),
              ", k=", shape_str(k), ", v=", shape_str(v));
  FLASH_CHECK(block_table.dim() == 2 && block_table.scalar_type() == at::kInt, op,
              ": block_table must be a 2-D int32 tensor (batch, pages per sequence); got dtype ",
              block_table.scalar_type(), " and shape ", shape_str(block_table));
  FLASH_CHECK(block_table.device() == q.device(), op, ": block_table must be on ", q.device(), " (q's device); got ",
              block_table.device());
  FLASH_CHECK(block_table.size(0) == q.size(0), op, ": block_table must have one row per sequence (", q.size(0),
              "); got shape ", shape_str(block_table));
  FLASH_CHECK(k.size(1) >= 1, op, ": the pages of k / v (dim 1: page_size) must hold at least one row; got k=",
              shape_str(k));
  FLASH_CHECK(k.size(0) >= 1 || block_table.numel() == 0, op, ": block_table names pages, but k / v hold none; got k=",
              shape_str(k));
  constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
  const int64_t rows = block_table.size(1) * k.size(1);
  FLASH_CHECK(rows <= kMaxRows && k.size(0) <= kMaxRows, op, ": a paged cache of at most 2^31 - 1 rows per "
              "sequence and pages; got ", block_table.size(1), " pages of ", k.size(1), " rows and ", k.size(0),
              " pages");
  return rows;
}

CheckedCall check_call(const char* op, const CallArgs& a) {
  const at::Tensor& q = a.q;
  const at::Tensor& k = a.k;
  const at::Tensor& v = a.v;
  CheckedCall call;
  call.varlen = a.cu_seqlens_q.has_value() || a.cu_seqlens_k.has_value();
  FLASH_CHECK(a.cu_seqlens_q.has_value() == a.cu_seqlens_k.has_value(), op,
              ": cu_seqlens_q and cu_seqlens_k must be given together (varlen) or both omitted (dense)");
  const int64_t rank = call.varlen ? 3 : 4;
  const char* layout = call.varlen ? "(total_tokens, nheads, headdim)" : "(batch, seqlen, nheads, headdim)";
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{"q", q}, {"k", k}, {"v", v}}) {
    FLASH_CHECK(t.dim() == rank, op, ": ", name, " must be ", rank, "-D ", layout, "; got shape ", shape_str(t));
    check_unit_last_stride(op, name, t);
  }
  FLASH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
              ": q, k, v must have the same dtype; got q=", q.scalar_type(), ", k=", k.scalar_type(),
              ", v=", v.scalar_type());
  FLASH_CHECK(q.device() == k.device() && q.device() == v.device(), op,
              ": q, k, v must be on the same device; got q=", q.device(), ", k=", k.device(), ", v=", v.device());
  const bool cuda = q.is_cuda();
  FLASH_CHECK(q.is_cpu() || cuda, op, ": q must be a CPU or CUDA tensor; got device ", q.device());
  FLASH_CHECK(dtype_supported(q.scalar_type(), cuda), op, ": q has dtype ", q.scalar_type(), ", but ",
              cuda ? "CUDA tensors must be float16 or bfloat16 (the CUDA kernels take only 16-bit inputs, with "
                     "float32 accumulation); cast q, k, v with .to(torch.bfloat16) or .half(), or run on CPU tensors"
                   : "CPU tensors must be float16, bfloat16, float32 or float64");

  const int64_t head_dim = q.size(-1);
  FLASH_CHECK(head_dim >= 1 && head_dim <= kMaxHeadDim, op, ": head dim (last dim of q) must be in [1, ",
              kMaxHeadDim, "]; got ", head_dim);
  FLASH_CHECK(k.size(-1) == head_dim && v.size(-1) == head_dim, op,
              ": q, k, v must have the same head dim (last dim); got q=", head_dim, ", k=", k.size(-1),
              ", v=", v.size(-1));
  FLASH_CHECK(k.sizes() == v.sizes(), op, ": k and v must have the same shape; got k=", shape_str(k),
              ", v=", shape_str(v));
  const int64_t nheads_q = q.size(-2), nheads_k = k.size(-2);
  FLASH_CHECK(nheads_k > 0 || nheads_q == 0, op, ": k and v have no heads but q has ", nheads_q,
              "; give k / v at least one head (nheads of q must be a multiple of it)");
  FLASH_CHECK(nheads_k == 0 || nheads_q % nheads_k == 0, op, ": nheads of q (", nheads_q,
              ") must be divisible by nheads of k/v (", nheads_k, ") for MQA/GQA");

  FwdParams& p = call.params;
  p.dtype = to_dtype(q.scalar_type());
  p.shape.nheads_q = nheads_q;
  p.shape.nheads_k = nheads_k;
  p.shape.head_dim = head_dim;
  if (call.varlen) {
    const at::Tensor& cu_q = *a.cu_seqlens_q;
    const at::Tensor& cu_k = *a.cu_seqlens_k;
    FLASH_CHECK(cu_q.dim() == 1 && cu_k.dim() == 1 && cu_q.size(0) == cu_k.size(0), op,
                ": cu_seqlens_q and cu_seqlens_k must be 1-D with the same length batch_size + 1; got ",
                shape_str(cu_q), " and ", shape_str(cu_k));
    FLASH_CHECK(a.max_seqlen_q >= 0 && a.max_seqlen_k >= 0, op, ": max_seqlen_q and max_seqlen_k must be >= 0; got ",
                a.max_seqlen_q, " and ", a.max_seqlen_k);
    // The kernels' grids and row indices take a sequence's length as 32 bits: a larger bound would wrap the grid.
    constexpr int64_t kMaxSeqlen = std::numeric_limits<int32_t>::max();
    FLASH_CHECK(a.max_seqlen_q <= kMaxSeqlen && a.max_seqlen_k <= kMaxSeqlen, op,
                ": max_seqlen_q and max_seqlen_k must be at most 2^31 - 1 (a bound on one sequence's length); got ",
                a.max_seqlen_q, " and ", a.max_seqlen_k, ". Pass the longest sequence's length.");
    check_cu_seqlens_layout(op, "cu_seqlens_q", cu_q, q);
    check_cu_seqlens_layout(op, "cu_seqlens_k", cu_k, q);
    p.shape.batch = cu_q.size(0) - 1;
    p.shape.seqlen_q = a.max_seqlen_q;
    p.shape.seqlen_k = a.max_seqlen_k;
    call.total_q = q.size(0);
    call.total_k = k.size(0);
    call.cu_seqlens_q_device = cu_q.contiguous();
    call.cu_seqlens_k_device = cu_k.contiguous();
    bool passed_q = false;
    bool passed_k = false;
    const std::optional<int64_t> last_q = check_cu_seqlens(op, "cu_seqlens_q", call.cu_seqlens_q_device, call.total_q,
                                                           a.max_seqlen_q, "max_seqlen_q", "q",
                                                           CheckedArgument::kCuSeqlensQ, &passed_q);
    const std::optional<int64_t> last_k = check_cu_seqlens(op, "cu_seqlens_k", call.cu_seqlens_k_device, call.total_k,
                                                           a.max_seqlen_k, "max_seqlen_k", "k",
                                                           CheckedArgument::kCuSeqlensK, &passed_k);
    call.cu_seqlens_passed = passed_q && passed_k;
    // Rows past cu_seqlens[-1] belong to no sequence; unless this call read the values any row may be such a row.
    call.unowned_rows_q = !last_q.has_value() || *last_q < call.total_q;
    call.unowned_rows_k = !last_k.has_value() || *last_k < call.total_k;
    p.shape.cu_seqlens_q = call.cu_seqlens_q_device.data_ptr<int32_t>();
    p.shape.cu_seqlens_k = call.cu_seqlens_k_device.data_ptr<int32_t>();
  } else {
    FLASH_CHECK(a.paged_rows > 0 || k.size(0) == q.size(0), op, ": q and k must have the same batch size; got q=",
                q.size(0), ", k=", k.size(0));
    p.shape.batch = q.size(0);
    p.shape.seqlen_q = q.size(1);
    p.shape.seqlen_k = a.paged_rows > 0 ? a.paged_rows : k.size(1);
    call.total_q = q.size(0) * q.size(1);
    call.total_k = k.size(0) * k.size(1);
  }
  p.shape.total_q = call.total_q;
  p.shape.total_k = call.total_k;
  call.no_work = q.numel() == 0 || k.numel() == 0 || p.shape.batch == 0;
  if (a.seqused_k.has_value()) {
    FLASH_CHECK(!call.varlen, op, ": seqused_k is only supported for dense calls (q, k, v of shape (batch, seqlen, "
                "nheads, headdim)); got it together with cu_seqlens_q / cu_seqlens_k. Give each sequence's key "
                "count through cu_seqlens_k instead, or pass seqused_k=None");
    call.seqused_k_device = check_seqused_k(op, *a.seqused_k, q, p.shape.batch, p.shape.seqlen_k);
    p.shape.seqused_k = call.seqused_k_device.data_ptr<int32_t>();
  }

  FLASH_CHECK(a.dropout_p >= 0.0 && a.dropout_p < 1.0, op, ": dropout_p must be in [0, 1); got ", a.dropout_p);
  FLASH_CHECK(std::isfinite(a.softmax_scale), op, ": softmax_scale must be finite; got ", a.softmax_scale);
  FLASH_CHECK(std::isfinite(a.softcap) && a.softcap >= 0.0, op,
              ": softcap must be finite and >= 0 (0 disables it); got ", a.softcap);
  FLASH_CHECK(a.window_left >= kUnboundedWindow && a.window_right >= kUnboundedWindow, op,
              ": window_size entries must be >= -1 (-1 means unbounded); got (", a.window_left, ", ",
              a.window_right, ")");
  p.softmax_scale = a.softmax_scale;
  p.softcap = a.softcap;
  p.mask.window_left = a.window_left;
  p.mask.window_right = a.window_right;
  p.mask.bottom_right = a.bottom_right;

  if (a.dropout_p > 0.0) {
    FLASH_CHECK(a.rng_state.has_value(), op, ": dropout_p > 0 needs rng_state (int64 tensor [seed, offset])");
    const at::Tensor& rng = *a.rng_state;
    FLASH_CHECK(rng.scalar_type() == at::kLong && rng.numel() == 2, op,
                ": rng_state must be an int64 tensor of 2 elements [seed, offset]; got dtype ", rng.scalar_type(),
                " and shape ", shape_str(rng));
    FLASH_CHECK(rng.device() == q.device() && rng.is_contiguous(), op, ": rng_state must be a contiguous tensor on ",
                q.device(), "; got one on ", rng.device());
    p.dropout.p = a.dropout_p;
    p.dropout.rng_state = rng.data_ptr<int64_t>();
  }

  if (a.alibi_slopes.has_value()) {
    const at::Tensor& s = *a.alibi_slopes;
    FLASH_CHECK(s.scalar_type() == at::kFloat, op, ": alibi_slopes must have dtype torch.float32; got ",
                s.scalar_type());
    FLASH_CHECK(s.device() == q.device(), op, ": alibi_slopes must be on ", q.device(), "; got ", s.device());
    const bool per_head = s.dim() == 1 && s.size(0) == nheads_q;
    const bool per_batch = s.dim() == 2 && s.size(0) == p.shape.batch && s.size(1) == nheads_q;
    FLASH_CHECK(per_head || per_batch, op, ": alibi_slopes must have shape (nheads,) = (", nheads_q,
                ",) or (batch, nheads) = (", p.shape.batch, ", ", nheads_q, "); got ", shape_str(s));
    check_unit_last_stride(op, "alibi_slopes", s);
    p.mask.alibi_slopes = s.data_ptr<float>();
    p.mask.alibi_batch_stride = per_batch ? s.stride(0) : 0;
  }

  if (a.attn_bias.has_value()) {
    const at::Tensor& bias = *a.attn_bias;
    FLASH_CHECK(!call.varlen, op, ": attn_bias is only supported for dense (non-varlen) calls");
    FLASH_CHECK(bias.scalar_type() == q.scalar_type() || bias.scalar_type() == at::kFloat, op,
                ": attn_bias must have the dtype of q (", q.scalar_type(), ") or float32; got ",
                bias.scalar_type());
    FLASH_CHECK(bias.device() == q.device(), op, ": attn_bias must be on ", q.device(), "; got ", bias.device());
    const std::vector<int64_t> want{p.shape.batch, nheads_q, p.shape.seqlen_q, p.shape.seqlen_k};
    FLASH_CHECK(bias.sizes() == at::IntArrayRef(want), op, ": attn_bias must have shape (batch, nheads, seqlen_q, seqlen_k) = ",
                at::IntArrayRef(want), " (expand a broadcastable mask first); got ", shape_str(bias));
    p.mask.bias = bias.data_ptr();
    p.mask.bias_dtype = to_dtype(bias.scalar_type());
    p.mask.bias_strides = ScoreStrides{bias.stride(0), bias.stride(1), bias.stride(2), bias.stride(3)};
  }

  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_strides = strides_of(q, call.varlen);
  p.k_strides = strides_of(k, call.varlen);
  p.v_strides = strides_of(v, call.varlen);
  return call;
}

}  // namespace flash::api
