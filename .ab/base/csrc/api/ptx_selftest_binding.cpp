// torch.ops.flash_attn._ptx_selftest(name, inputs) -> outputs: a test-only op that runs one of the one-tile
// self tests of the inline-PTX wrappers (csrc/sm80/ptx_selftest.{h,cu}) on CUDA tensors and returns what the
// lanes produced; tests/test_ptx_wrappers.py compares that with the documented layouts. Builds without CUDA
// register the op too, and it raises a clear error there.
#include <ATen/ATen.h>
#include <c10/util/string_view.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "error_message.h"

#if defined(FLASH_WITH_CUDA)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../dispatch/device_attributes.h"
#include "sm80/ptx_selftest.h"
#include "sm90/wgmma_selftest.h"
#endif

namespace flash::api {
namespace {

constexpr const char* kSelftestOp = "flash_attn._ptx_selftest";
constexpr const char* kSelftestNames = "mma_m16n8k16, pack2, ldmatrix_x2_trans, ldmatrix_x4, ldmatrix_x4_trans, cp_async_16, cp_async_4, "
    "red_add_v4_f32, stmatrix_x4, bulk_reduce_add_2d, tma_load_4d, griddep, cluster_exchange, wgmma_ss, wgmma_rs, "
    "wgmma_ss_mn";

#if defined(FLASH_WITH_CUDA)

// Checks inputs[index] (named `what`) and returns it contiguous.
at::Tensor checked_input(const std::string& test, const std::vector<at::Tensor>& inputs, size_t index,
                         const char* what, std::vector<int64_t> sizes, std::vector<at::ScalarType> dtypes) {
  FLASH_CHECK(index < inputs.size(), kSelftestOp, "('", test, "'): needs input ", static_cast<int64_t>(index), " (",
              what, "); got ", static_cast<int64_t>(inputs.size()), " inputs");
  const at::Tensor& t = inputs[index];
  FLASH_CHECK(t.is_cuda(), kSelftestOp, "('", test, "'): ", what, " must be a CUDA tensor; got ", t.device());
  FLASH_CHECK(t.sizes() == at::IntArrayRef(sizes), kSelftestOp, "('", test, "'): ", what, " must have shape ",
              sizes, "; got ", t.sizes());
  bool dtype_ok = false;
  std::string allowed;
  for (at::ScalarType dtype : dtypes) {
    dtype_ok = dtype_ok || t.scalar_type() == dtype;
    allowed += (allowed.empty() ? "" : " or ") + to_text(dtype);
  }
  FLASH_CHECK(dtype_ok, kSelftestOp, "('", test, "'): ", what, " must have dtype ", allowed, "; got ",
              t.scalar_type());
  return t.contiguous();
}

DType half_dtype(at::ScalarType type) { return type == at::kHalf ? DType::kFloat16 : DType::kBFloat16; }

std::vector<at::Tensor> run_selftest(const std::string& name, const std::vector<at::Tensor>& inputs) {
  namespace st = sm80::selftest;
  FLASH_CHECK(!inputs.empty(), kSelftestOp, "('", name, "'): needs at least one input tensor");
  const c10::cuda::CUDAGuard guard(inputs[0].device());
  void* stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto int32_on = [&](std::vector<int64_t> sizes) {
    return at::empty(sizes, inputs[0].options().dtype(at::kInt));
  };
  std::vector<at::Tensor> outputs;
  if (name == "mma_m16n8k16") {
    const at::Tensor a = checked_input(name, inputs, 0, "a", {st::kTileRows, st::kTileCols}, {at::kHalf, at::kBFloat16});
    const at::Tensor b = checked_input(name, inputs, 1, "b_nk", {st::kMmaCols, st::kTileCols}, {a.scalar_type()});
    const at::Tensor c = checked_input(name, inputs, 2, "c", {st::kTileRows, st::kMmaCols}, {at::kFloat});
    at::Tensor d = at::empty_like(c);
    const bool launched = st::mma_m16n8k16(half_dtype(a.scalar_type()), a.data_ptr(), b.data_ptr(),
                                           c.data_ptr<float>(), d.data_ptr<float>(), stream);
    FLASH_CHECK(launched, kSelftestOp, "('", name, "'): no kernel for dtype ", a.scalar_type());
    outputs.push_back(d);
  } else if (name == "pack2") {
    const at::Tensor values =
        checked_input(name, inputs, 0, "values", {2 * st::kPackedPairs}, {at::kHalf, at::kBFloat16});
    at::Tensor packed = int32_on({st::kPackedPairs});
    const bool launched = st::pack2(half_dtype(values.scalar_type()), values.data_ptr(),
                                    reinterpret_cast<uint32_t*>(packed.data_ptr()), stream);
    FLASH_CHECK(launched, kSelftestOp, "('", name, "'): no kernel for dtype ", values.scalar_type());
    outputs.push_back(packed);
  } else if (name == "ldmatrix_x2_trans") {
    const at::Tensor tile = checked_input(name, inputs, 0, "tile", {st::kTileRows, st::kMmaCols}, {at::kShort});
    at::Tensor regs = int32_on({st::kWarpLanes, 2});
    st::ldmatrix_x2_trans(reinterpret_cast<const uint16_t*>(tile.data_ptr()),
                          reinterpret_cast<uint32_t*>(regs.data_ptr()), stream);
    outputs.push_back(regs);
  } else if (name == "ldmatrix_x4" || name == "ldmatrix_x4_trans") {
    const at::Tensor tile = checked_input(name, inputs, 0, "tile", {st::kTileRows, st::kTileCols}, {at::kShort});
    at::Tensor regs = int32_on({st::kWarpLanes, 4});
    st::ldmatrix_x4(reinterpret_cast<const uint16_t*>(tile.data_ptr()), reinterpret_cast<uint32_t*>(regs.data_ptr()),
                    name == "ldmatrix_x4_trans", stream);
    outputs.push_back(regs);
  } else if (name == "cp_async_16") {
    const at::Tensor src =
        checked_input(name, inputs, 0, "src", {st::kCpAsyncChunks, st::kCpAsyncChunkWords}, {at::kInt});
    const at::Tensor valid = checked_input(name, inputs, 1, "valid", {st::kCpAsyncChunks}, {at::kInt});
    at::Tensor dst = int32_on({st::kCpAsyncChunks, st::kCpAsyncChunkWords});
    st::cp_async_16(src.data_ptr<int32_t>(), valid.data_ptr<int32_t>(), dst.data_ptr<int32_t>(), stream);
    outputs.push_back(dst);
  } else if (name == "cp_async_4") {
    const at::Tensor words = checked_input(name, inputs, 0, "words", {st::kWarpLanes}, {at::kInt});
    const at::Tensor valid = checked_input(name, inputs, 1, "valid", {st::kWarpLanes}, {at::kInt});
    at::Tensor dst = int32_on({st::kWarpLanes});
    st::cp_async_4(words.data_ptr<int32_t>(), valid.data_ptr<int32_t>(), dst.data_ptr<int32_t>(), stream);
    outputs.push_back(dst);
  } else if (name == "red_add_v4_f32") {
    const at::Tensor base = checked_input(name, inputs, 0, "base", {st::kWarpLanes, st::kRedFloats}, {at::kFloat});
    const at::Tensor added = checked_input(name, inputs, 1, "added", {st::kWarpLanes, st::kRedFloats}, {at::kFloat});
    const at::Tensor extra = checked_input(name, inputs, 2, "extra", {st::kWarpLanes, st::kRedFloats}, {at::kFloat});
    const at::Tensor valid = checked_input(name, inputs, 3, "valid", {st::kWarpLanes}, {at::kInt});
    at::Tensor dst = base.clone();
    const bool launched = st::red_add_v4_f32(dst.data_ptr<float>(), added.data_ptr<float>(), extra.data_ptr<float>(),
                                             valid.data_ptr<int32_t>(), stream);
    FLASH_CHECK(launched, kSelftestOp, "('", name, "'): red.global.add.v4.f32 needs an sm90+ GPU; this one is older");
    outputs.push_back(dst);
  } else if (name == "bulk_reduce_add_2d") {
    const at::Tensor base = checked_input(name, inputs, 0, "base", {st::kBulkRows, st::kBulkCols}, {at::kFloat});
    const at::Tensor box = checked_input(name, inputs, 1, "box", {st::kBulkBoxRows, st::kBulkBoxCols}, {at::kFloat});
    const at::Tensor where = checked_input(name, inputs, 2, "where (col, row)", {2}, {at::kInt}).cpu();
    at::Tensor dst = base.clone();
    const bool launched = st::bulk_reduce_add_2d(dst.data_ptr<float>(), box.data_ptr<float>(),
                                                 where[0].item<int32_t>(), where[1].item<int32_t>(), stream);
    FLASH_CHECK(launched, kSelftestOp, "('", name, "'): the bulk tensor reduction needs an sm90+ GPU and a driver "
                "with cuTensorMapEncodeTiled; this one has neither");
    outputs.push_back(dst);
  } else if (name == "tma_load_4d") {
    const at::Tensor src = checked_input(name, inputs, 0, "src",
                                         {st::kTmaBatch, st::kTmaRows, st::kTmaHeads, st::kTmaCols}, {at::kShort});
    const at::Tensor where = checked_input(name, inputs, 1, "where (col, head, row, batch) per load",
                                           {st::kTmaLoads, 4}, {at::kInt});
    at::Tensor dst = at::empty({st::kTmaLoads, st::kTmaBoxRows, st::kTmaBoxCols}, src.options());
    const bool launched = st::tma_load_4d(reinterpret_cast<const uint16_t*>(src.data_ptr()), where.data_ptr<int32_t>(),
                                          reinterpret_cast<uint16_t*>(dst.data_ptr()), stream);
    FLASH_CHECK(launched, kSelftestOp, "('", name, "'): the TMA tile load needs an sm90+ GPU and a driver with "
                "cuTensorMapEncodeTiled; this one has neither");
    outputs.push_back(dst);
  } else if (name == "wgmma_ss" || name == "wgmma_rs" || name == "wgmma_ss_mn") {
    namespace wg = sm90::selftest;
    const wg::WgmmaForm form = name == "wgmma_rs"      ? wg::WgmmaForm::kRegistersA
                               : name == "wgmma_ss_mn" ? wg::WgmmaForm::kSharedMnMajor
                                                       : wg::WgmmaForm::kSharedKMajor;
    // Every form takes 64 x 64 operands (wgmma_selftest.h says which dimension each holds).
    const at::Tensor a = checked_input(name, inputs, 0, "a", {wg::kWgmmaM, wg::kWgmmaK}, {at::kHalf, at::kBFloat16});
    const at::Tensor b = checked_input(name, inputs, 1, "b", {wg::kWgmmaK, wg::kWgmmaN}, {a.scalar_type()});
    at::Tensor d = at::empty({wg::kWgmmaM, wg::kWgmmaN}, a.options().dtype(at::kFloat));
    const int code_arch = device_attributes(a.device().index()).code_arch;
    const bool launched =
        wg::wgmma_tile(half_dtype(a.scalar_type()), form, a.data_ptr(), b.data_ptr(), d.data_ptr<float>(), code_arch,
                       stream);
    FLASH_CHECK(launched, kSelftestOp, "('", name, "'): wgmma needs kernels compiled for sm_90a on a Hopper GPU; "
                "the loaded code is for sm", code_arch);
    outputs.push_back(d);
  } else if (name == "stmatrix_x4") {
    const at::Tensor regs = checked_input(name, inputs, 0, "regs", {st::kWarpLanes, 4}, {at::kInt});
    at::Tensor tile = at::empty({st::kTileRows, st::kTileCols}, regs.options().dtype(at::kShort));
    const bool launched = st::stmatrix_x4(reinterpret_cast<const uint32_t*>(regs.data_ptr()),
                                          reinterpret_cast<uint16_t*>(tile.data_ptr()), stream);
    FLASH_CHECK(launched, kSelftestOp, "('", name, "'): stmatrix needs an sm90+ GPU; this one is older");
    outputs.push_back(tile);
  } else if (name == "griddep") {
    const at::Tensor words = checked_input(name, inputs, 0, "words", {st::kWarpLanes}, {at::kInt});
    at::Tensor scratch = at::zeros({st::kGriddepScratchWords}, words.options());
    at::Tensor dst = at::zeros({st::kWarpLanes + 1}, words.options());
    const bool launched =
        st::griddep(words.data_ptr<int32_t>(), scratch.data_ptr<int32_t>(), dst.data_ptr<int32_t>(), stream);
    FLASH_CHECK(launched, kSelftestOp, "('", name, "'): programmatic dependent launch needs an sm90+ GPU (or the "
                "launch failed: see the CUDA error)");
    outputs.push_back(dst);
  } else if (name == "cluster_exchange") {
    const at::Tensor values =
        checked_input(name, inputs, 0, "values", {st::kClusterCtas, st::kWarpLanes, st::kClusterVec}, {at::kFloat});
    at::Tensor dst = at::zeros({st::kClusterCtas, st::kWarpLanes, 2 + st::kClusterVec}, values.options());
    const bool launched = st::cluster_exchange(values.data_ptr<float>(), dst.data_ptr<float>(), stream);
    FLASH_CHECK(launched, kSelftestOp, "('", name, "'): thread-block clusters need an sm90+ GPU (or the launch "
                "failed: see the CUDA error)");
    outputs.push_back(dst);
  } else {
    FLASH_FAIL(kSelftestOp, ": unknown self test '", name, "'; use one of ", kSelftestNames);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return outputs;
}

#endif

// The schema's str arrives as a string_view (the only string type kernel registration accepts).
std::vector<at::Tensor> ptx_selftest(c10::string_view name_view, const std::vector<at::Tensor>& inputs) {
  const std::string name(name_view);
#if defined(FLASH_WITH_CUDA)
  return run_selftest(name, inputs);
#else
  (void)inputs;
  FLASH_FAIL(kSelftestOp, "('", name, "'): this build has no CUDA code (built without nvcc or with "
             "FLASH_ATTN_SKIP_CUDA=1); the PTX self tests need a CUDA build and CUDA tensors");
#endif
}

}  // namespace
}  // namespace flash::api

TORCH_LIBRARY_FRAGMENT(flash_attn, m) {
  m.def("_ptx_selftest(str name, Tensor[] inputs) -> Tensor[]", &flash::api::ptx_selftest);
}
