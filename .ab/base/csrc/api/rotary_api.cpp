// The rotary ops torch.ops.flash_attn.rotary (out of place) and rotary_ (in place): checks, RotaryParams, and the
// CPU (csrc/cpu/rotary_cpu.cpp) or CUDA (csrc/sm80/rotary_kernel.cu) implementation. Fake implementations and
// autograd live in flash_attn/layers/rotary.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <limits>
#include <optional>

#include "../cpu/rotary_cpu.h"
#include "error_message.h"
#include "input_checks.h"

#if defined(FLASH_WITH_CUDA)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../sm80/rotary_kernel.h"
#endif

namespace flash::api {
namespace {

constexpr const char* kRotaryOp = "flash_attn.rotary";

void check_rotary_table(const char* name, const at::Tensor& table, const at::Tensor& x) {
  FLASH_CHECK(table.dim() == 2, kRotaryOp, ": ", name, " must be 2-D (seqlen_ro, rotary_dim / 2); got shape ",
              table.sizes());
  FLASH_CHECK(table.scalar_type() == x.scalar_type(), kRotaryOp, ": ", name, " must have x's dtype ", x.scalar_type(),
              "; got ", table.scalar_type(), ". Convert with ", name, ".to(x.dtype).");
  FLASH_CHECK(table.device() == x.device(), kRotaryOp, ": ", name, " must be on ", x.device(), "; got ",
              table.device());
}

RotaryParams make_params(const at::Tensor& x, const at::Tensor& out, const at::Tensor& cos, const at::Tensor& sin,
                         const std::optional<at::Tensor>& seqlen_offsets, int64_t seqlen_offset,
                         const std::optional<at::Tensor>& cu_seqlens, int64_t max_seqlen, bool interleaved,
                         bool conjugate) {
  const bool varlen = cu_seqlens.has_value();
  FLASH_CHECK(x.dim() == (varlen ? 3 : 4), kRotaryOp, ": x must be ",
              varlen ? "3-D (total_tokens, nheads, headdim) with cu_seqlens" : "4-D (batch, seqlen, nheads, headdim)",
              "; got shape ", x.sizes());
  FLASH_CHECK(x.size(-1) <= 1 || x.stride(-1) == 1, kRotaryOp,
              ": x must have stride 1 in its last (head) dimension; got strides ", x.strides());
  FLASH_CHECK(x.is_cpu() || x.is_cuda(), kRotaryOp, ": x must be a CPU or CUDA tensor; got ", x.device());
  FLASH_CHECK(x.is_cpu() || x.scalar_type() != at::kDouble, kRotaryOp,
              ": float64 is supported on CPU only; cast x, cos and sin to float32 for CUDA");
  check_rotary_table("cos", cos, x);
  check_rotary_table("sin", sin, x);
  FLASH_CHECK(cos.sizes() == sin.sizes(), kRotaryOp, ": cos and sin must have the same shape; got ", cos.sizes(),
              " and ", sin.sizes());
  FLASH_CHECK(cos.size(1) <= 1 || (cos.stride(1) == 1 && sin.stride(1) == 1), kRotaryOp,
              ": cos and sin must be contiguous in their last dimension");
  const int64_t rotary_dim = 2 * cos.size(1);
  FLASH_CHECK(rotary_dim <= x.size(-1), kRotaryOp, ": rotary_dim (2 x cos.shape[1] = ", rotary_dim,
              ") must be at most the head dim ", x.size(-1));

  RotaryParams p;
  p.dtype = to_dtype(x.scalar_type());
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  p.x_strides = strides_of(x, varlen);
  p.out_strides = strides_of(out, varlen);
  p.cos = cos.data_ptr();
  p.sin = sin.data_ptr();
  p.cos_row_stride = cos.stride(0);
  p.sin_row_stride = sin.stride(0);
  p.nheads = x.size(-2);
  p.head_dim = x.size(-1);
  p.rotary_dim = rotary_dim;
  p.seqlen_ro = cos.size(0);
  p.interleaved = interleaved;
  p.conjugate = conjugate;
  p.seqlen_offset = seqlen_offset;
  if (varlen) {
    const at::Tensor& cu = *cu_seqlens;
    FLASH_CHECK(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.size(0) >= 1 && cu.device() == x.device(),
                kRotaryOp, ": cu_seqlens must be int32 (batch + 1,) on ", x.device(), "; got ", cu.scalar_type(), " ",
                cu.sizes(), " on ", cu.device());
    FLASH_CHECK(max_seqlen >= 0, kRotaryOp, ": max_seqlen must be >= 0 with cu_seqlens; got ", max_seqlen);
    check_cu_seqlens(kRotaryOp, "cu_seqlens", cu, x.size(0), max_seqlen, "max_seqlen", "x",
                     CheckedArgument::kRotaryCuSeqlens);
    p.cu_seqlens = cu.data_ptr<int32_t>();
    p.batch = cu.size(0) - 1;
    p.seqlen = max_seqlen;
    p.total_rows = x.size(0);
  } else {
    p.batch = x.size(0);
    p.seqlen = x.size(1);
  }
  if (seqlen_offsets.has_value()) {
    const at::Tensor& offsets = *seqlen_offsets;
    FLASH_CHECK((offsets.scalar_type() == at::kInt || offsets.scalar_type() == at::kLong) && offsets.dim() == 1 &&
                    offsets.size(0) == p.batch && offsets.device() == x.device() && offsets.is_contiguous(),
                kRotaryOp, ": seqlen_offsets must be a contiguous int32 or int64 (batch,) = (", p.batch,
                ",) tensor on ", x.device(), "; got ", offsets.scalar_type(), " ", offsets.sizes(), " on ",
                offsets.device());
    p.seqlen_offsets = offsets.data_ptr();
    p.seqlen_offsets_int64 = offsets.scalar_type() == at::kLong;
  } else {
    FLASH_CHECK(seqlen_offset >= 0 && seqlen_offset + p.seqlen <= p.seqlen_ro, kRotaryOp, ": positions ",
                seqlen_offset, " ... ", seqlen_offset + p.seqlen - 1, " (seqlen_offsets + seqlen) must lie in the ",
                p.seqlen_ro, " rows of cos / sin; pass longer tables");
  }
  FLASH_CHECK(p.batch * p.seqlen < std::numeric_limits<int32_t>::max(), kRotaryOp,
              ": more than 2^31 - 1 rows (batch x seqlen); split the call");
  return p;
}

void run(const RotaryParams& p, const at::Tensor& x) {
  if (x.numel() == 0) return;
  if (x.is_cpu()) {
    cpu::run_rotary(p);
    return;
  }
#if defined(FLASH_WITH_CUDA)
  const c10::cuda::CUDAGuard guard(x.device());
  FLASH_CHECK(sm80::launch_rotary(p, c10::cuda::getCurrentCUDAStream().stream()), kRotaryOp,
              ": CUDA x must be float16, bfloat16 or float32; got ", x.scalar_type());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
#else
  FLASH_FAIL(kRotaryOp, ": this build has no CUDA code; rebuild with the CUDA toolkit, or pass CPU tensors");
#endif
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  const std::optional<at::Tensor>& seqlen_offsets, int64_t seqlen_offset,
                  const std::optional<at::Tensor>& cu_seqlens, int64_t max_seqlen, bool interleaved, bool conjugate) {
  // Varlen rows past cu_seqlens[-1] belong to no sequence and are not visited: they keep x's values.
  at::Tensor out = cu_seqlens.has_value() ? x.clone(at::MemoryFormat::Contiguous) : at::empty(x.sizes(), x.options());
  run(make_params(x, out, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate), x);
  return out;
}

void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
             const std::optional<at::Tensor>& seqlen_offsets, int64_t seqlen_offset,
             const std::optional<at::Tensor>& cu_seqlens, int64_t max_seqlen, bool interleaved, bool conjugate) {
  run(make_params(x, x, cos, sin, seqlen_offsets, seqlen_offset, cu_seqlens, max_seqlen, interleaved, conjugate), x);
}

}  // namespace
}  // namespace flash::api

TORCH_LIBRARY_FRAGMENT(flash_attn, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, Tensor? seqlen_offsets, int seqlen_offset, Tensor? cu_seqlens, "
        "int max_seqlen, bool interleaved, bool conjugate) -> Tensor");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor? seqlen_offsets, int seqlen_offset, "
        "Tensor? cu_seqlens, int max_seqlen, bool interleaved, bool conjugate) -> ()");
}

TORCH_LIBRARY_IMPL(flash_attn, CPU, m) {
  m.impl("rotary", &flash::api::rotary);
  m.impl("rotary_", &flash::api::rotary_);
}

TORCH_LIBRARY_IMPL(flash_attn, CUDA, m) {
  m.impl("rotary", &flash::api::rotary);
  m.impl("rotary_", &flash::api::rotary_);
}
