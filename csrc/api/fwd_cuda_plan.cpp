// plan_cuda_fwd (fwd_cuda_plan.h): runs the torch-free forward plan (dispatch/fwd_plan.h, sm90_policy.h) on a checked
// call and allocates the split-KV scratch it asks for through torch's caching allocator (no host sync).
#include "fwd_cuda_plan.h"

#include "../dispatch/device_attributes.h"
#include "../dispatch/fwd_plan.h"
#include "../dispatch/sm90_policy.h"

#if defined(FLASH_WITH_CUDA)
#include "sm80/smem_limit_env.h"
#endif

namespace flash::api {

namespace {
constexpr int64_t kHeadDimGranule = 32;  // split_out rows are padded to the kernel's head-dim bucket
}  // namespace

void plan_cuda_fwd(FwdParams& p, const at::Tensor& q, std::vector<at::Tensor>& scratch, int64_t requested_splits) {
#if defined(FLASH_WITH_CUDA)
  pack_gqa_decode(p);
  // Device attributes, not at::cuda::getDeviceProperties: ATen's CUDA context header needs the cuSPARSE
  // headers, which CUDA toolkits without the math libraries (our CI image) lack.
  const DeviceAttributes device = device_attributes(q.device().index());
  // Under FLASH_ATTN_FWD_SMEM_LIMIT the launcher takes a smaller device's tiles; the plan must assume the same.
  // A call the Hopper forward will take (the registry's rule, kernel table aside) gets that path's split plan
  // (sm90_fwd_num_splits: it runs a CTA per SM); under FLASH_ATTN_HOPPER=force a call it declines is planned
  // unsplit and then fails naming what the path lacks.
  const HopperSwitch mode = hopper_switch();
  const bool hopper_forced = mode == HopperSwitch::kForce && device.code_arch >= kHopperCodeArch;
  const bool hopper = device.code_arch >= kHopperCodeArch && mode != HopperSwitch::kOff &&
                      sm90_fwd_declines(p) == nullptr && (hopper_forced || sm90_fwd_pays(p));
  const sm80::SmemLimits smem = sm80::fwd_smem_limits(device.smem);
  if (hopper) {
    p.sm90_tall_rows = sm90_fwd_tall_rows(p);
    p.sm90_packed_heads = sm90_fwd_packed_heads(p);
    p.num_splits = requested_splits > 0 ? requested_fwd_num_splits(p, requested_splits)
                                        : sm90_fwd_num_splits(p, device.num_sms);
  } else {
    p.decode_key_warps = !hopper_forced && fwd_decode_takes_key_warps(p, device.num_sms, smem);
    p.num_splits = requested_splits > 0 ? requested_fwd_num_splits(p, requested_splits)
                   : hopper_forced      ? 1
                                        : choose_fwd_num_splits(p, device.num_sms, smem);
  }
  if (requested_splits == 0 && !hopper_forced && p.shape.appended_keys > 0 && p.num_splits > 1) {
    FwdParams plain = p;  // the split the plan added for the appended rows, if it did
    plain.shape.appended_keys = 0;
    p.appended_split = p.num_splits > choose_fwd_num_splits(plain, device.num_sms, smem);
  }
  p.splits_meet_in_cluster = !hopper && fwd_splits_meet_in_cluster(p, device.code_arch, smem);
  if (p.num_splits > 1 && !p.splits_meet_in_cluster) {
    // One allocation for both (each at::empty is ~3 us of host time there): the partial outputs, then the lses.
    // rows * bucket floats are a multiple of 32, so split_lse keeps 16-byte alignment.
    const int64_t rows = p.num_splits * p.shape.batch * p.shape.nheads_q * p.shape.seqlen_q;
    const int64_t bucket = (p.shape.head_dim + kHeadDimGranule - 1) / kHeadDimGranule * kHeadDimGranule;
    scratch.push_back(at::empty({rows * bucket + rows}, q.options().dtype(at::kFloat)));
    p.split_out = scratch[0].data_ptr<float>();
    p.split_lse = p.split_out + rows * bucket;
  }
#else
  (void)p;
  (void)q;
  (void)scratch;
  (void)requested_splits;
#endif
}

bool cuda_fwd_takes_append(const FwdParams& p, const at::Tensor& q) {
#if defined(FLASH_WITH_CUDA)
  const DeviceAttributes device = device_attributes(q.device().index());
  return fwd_decode_takes_append(p, sm80::fwd_smem_limits(device.smem));
#else
  (void)p;
  (void)q;
  return false;
#endif
}

bool cuda_fwd_reads_pages(const FwdParams& p, const at::Tensor& q) {
#if defined(FLASH_WITH_CUDA)
  const DeviceAttributes device = device_attributes(q.device().index());
  // The Hopper forward reads the pages itself where it takes the call (sm90_policy.cpp: pages that fit its key
  // blocks); the portable decode kernels read them for decode shapes.
  const HopperSwitch mode = hopper_switch();
  if (device.code_arch >= kHopperCodeArch && mode != HopperSwitch::kOff && sm90_fwd_declines(p) == nullptr &&
      (mode == HopperSwitch::kForce || sm90_fwd_pays(p))) {
    return true;
  }
  return fwd_reads_pages(p, sm80::fwd_smem_limits(device.smem));
#else
  (void)p;
  (void)q;
  return false;
#endif
}

}  // namespace flash::api
