// plan_cuda_fwd (fwd_cuda_plan.h).
#include "fwd_cuda_plan.h"

#include "../dispatch/fwd_plan.h"

#if defined(FLASH_WITH_CUDA)
#include <cuda_runtime_api.h>

#include "sm80/smem_limit_env.h"
#endif

namespace flash::api {

namespace {
constexpr int64_t kHeadDimGranule = 32;  // split_out rows are padded to the kernel's head-dim bucket
}  // namespace

void plan_cuda_fwd(FwdParams& p, const at::Tensor& q, std::vector<at::Tensor>& scratch) {
#if defined(FLASH_WITH_CUDA)
  pack_gqa_decode(p);
  // A device attribute, not at::cuda::getDeviceProperties: ATen's CUDA context header needs the cuSPARSE
  // headers, which CUDA toolkits without the math libraries (our CI image) lack.
  const int device = q.device().index();
  int num_sms = 0;
  sm80::SmemLimits smem{0, 0};
  cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&smem.per_block_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  cudaDeviceGetAttribute(&smem.per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
  // Under FLASH_ATTN_FWD_SMEM_LIMIT the launcher takes a smaller device's tiles; the plan must assume the same.
  p.num_splits = choose_fwd_num_splits(p, num_sms, sm80::fwd_smem_limits(smem));
  if (p.num_splits > 1) {
    const int64_t rows = p.num_splits * p.shape.batch * p.shape.nheads_q * p.shape.seqlen_q;
    const int64_t bucket = (p.shape.head_dim + kHeadDimGranule - 1) / kHeadDimGranule * kHeadDimGranule;
    const auto options = q.options().dtype(at::kFloat);
    scratch.push_back(at::empty({rows * bucket}, options));
    scratch.push_back(at::empty({rows}, options));
    p.split_out = scratch[0].data_ptr<float>();
    p.split_lse = scratch[1].data_ptr<float>();
  }
#else
  (void)p;
  (void)q;
  (void)scratch;
#endif
}

}  // namespace flash::api
