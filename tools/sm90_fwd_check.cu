// Standalone check and timing of the Hopper forward kernel (csrc/sm90/) without torch: builds in seconds, so kernel
// work can iterate on the GPU machine before the extension is rebuilt. Random inputs, a naive fp32 attention kernel
// as the reference (max |error| of O and LSE, NaN counted as failure), then CUDA-event timing in TFLOP/s.
// Build: nvcc -O3 -std=c++20 --use_fast_math --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a
//        -DFLASH_WITH_CUDA -Icsrc -Icsrc/include tools/sm90_fwd_check.cu csrc/dispatch/device_attributes.cpp
//        csrc/dispatch/loaded_code_arch.cu -o sm90_fwd_check   [-DFLASH_CHECK_HEAD_DIM=128: one head dim only]
// Run:   ./sm90_fwd_check hd none|causal|local batch heads kv_heads seqlen_q seqlen_k [iters] [bf16|fp16]
//        [serial|overlap|pingpong] [block_n stages (0 0: the policy's)] [persistent 0|1] [poly-exp share 0|2|4]
//        (window of local: 100 left, 37 right)
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "sm90/fwd_launch.h"

namespace {

using flash::DType;
using flash::MaskKind;
using Launch = void (*)(const flash::FwdParams&, void*);

#define CHECK_CUDA(call)                                                                    \
  do {                                                                                      \
    cudaError_t status_ = (call);                                                           \
    if (status_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(status_)); \
      std::exit(2);                                                                         \
    }                                                                                       \
  } while (0)

using flash::sm90::FwdSchedule;
using flash::sm90::FwdTileConfig;
// dtype, head dim, mask, schedule, block_n, stages, persistent, FMA-pipe exponential share (fwd_poly_exp_every)
using Key = std::tuple<int, int, int, int, int, int, bool, int>;

// -DFLASH_CHECK_HEAD_DIM=<bucket> builds one head dim's kernels only (tools/sm90_fwd_check.sh builds the four in
// parallel); 0 builds all.
#ifndef FLASH_CHECK_HEAD_DIM
#define FLASH_CHECK_HEAD_DIM 0
#endif
constexpr int kOnlyHeadDim = FLASH_CHECK_HEAD_DIM;

Key key_of(DType d, int h, MaskKind m, FwdSchedule s, FwdTileConfig c, bool persistent, int poly) {
  return {static_cast<int>(d), h, static_cast<int>(m), static_cast<int>(s), c.block_n, c.stages, persistent, poly};
}

template <DType D, int H, MaskKind M, FwdSchedule S, FwdTileConfig C, bool P = false, int kPoly = 0>
void add_variant(std::map<Key, Launch>& table) {
  table[key_of(D, H, M, S, C, P, kPoly)] = flash::sm90::run_fwd<D, H, M, S, C, P, kPoly>;
}

// The policy's tile with every mask and schedule (and persistent with the overlapped schedules); other tiles (to time
// against it) with the overlapped schedules and the masks of the standard table.
template <DType D, int H, FwdTileConfig... kOthers>
void add_head_dim(std::map<Key, Launch>& table) {
  if constexpr (kOnlyHeadDim == 0 || kOnlyHeadDim == H) {
    constexpr FwdTileConfig kPolicy = flash::sm90::fwd_tile_config(H);
    // Local masks may take another tile (fwd_tile_config); ping-pong pairs two consumers (128 rows) at any policy.
    constexpr FwdTileConfig kLocalPolicy = flash::sm90::fwd_tile_config(H, MaskKind::kLocal);
    constexpr FwdTileConfig kPair{2 * flash::sm90::kRowsPerConsumer, kPolicy.block_n, kPolicy.stages};
    add_variant<D, H, MaskKind::kNone, FwdSchedule::kSerial, kPolicy>(table);
    add_variant<D, H, MaskKind::kCausal, FwdSchedule::kSerial, kPolicy>(table);
    add_variant<D, H, MaskKind::kLocal, FwdSchedule::kSerial, kLocalPolicy>(table);
    add_variant<D, H, MaskKind::kNone, FwdSchedule::kOverlap, kPolicy>(table);
    add_variant<D, H, MaskKind::kCausal, FwdSchedule::kOverlap, kPolicy>(table);
    add_variant<D, H, MaskKind::kLocal, FwdSchedule::kOverlap, kLocalPolicy>(table);
    add_variant<D, H, MaskKind::kNone, FwdSchedule::kPingpong, kPair>(table);
    add_variant<D, H, MaskKind::kCausal, FwdSchedule::kPingpong, kPair>(table);
    add_variant<D, H, MaskKind::kLocal, FwdSchedule::kPingpong, kPair>(table);
    add_variant<D, H, MaskKind::kNone, FwdSchedule::kOverlap, kPolicy, true>(table);
    add_variant<D, H, MaskKind::kCausal, FwdSchedule::kOverlap, kPolicy, true>(table);
    add_variant<D, H, MaskKind::kLocal, FwdSchedule::kOverlap, kLocalPolicy, true>(table);
    add_variant<D, H, MaskKind::kNone, FwdSchedule::kPingpong, kPair, true>(table);
    add_variant<D, H, MaskKind::kCausal, FwdSchedule::kPingpong, kPair, true>(table);
    // A quarter and a half of the exponentials on the FMA pipe (exp2_polynomial).
    add_variant<D, H, MaskKind::kNone, FwdSchedule::kPingpong, kPair, false, 4>(table);
    add_variant<D, H, MaskKind::kCausal, FwdSchedule::kPingpong, kPair, false, 4>(table);
    add_variant<D, H, MaskKind::kNone, FwdSchedule::kPingpong, kPair, false, 2>(table);
    add_variant<D, H, MaskKind::kCausal, FwdSchedule::kPingpong, kPair, false, 2>(table);
    add_variant<D, H, MaskKind::kNone, FwdSchedule::kOverlap, kPolicy, false, 4>(table);
    (add_variant<D, H, MaskKind::kNone, FwdSchedule::kOverlap, kOthers>(table), ...);
    (add_variant<D, H, MaskKind::kCausal, FwdSchedule::kOverlap, kOthers>(table), ...);
    (add_variant<D, H, MaskKind::kNone, FwdSchedule::kPingpong, kOthers>(table), ...);
    (add_variant<D, H, MaskKind::kCausal, FwdSchedule::kPingpong, kOthers>(table), ...);
  }
}

template <typename T>
__global__ void reference_kernel(flash::FwdParams p, float* out, float* lse) {
  const int64_t row = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int head = blockIdx.y, batch = blockIdx.z;
  if (row >= p.shape.seqlen_q) return;
  const int kv_head = head / (p.shape.nheads_q / p.shape.nheads_k);
  const int d = static_cast<int>(p.shape.head_dim);
  const T* q = static_cast<const T*>(p.q) + batch * p.q_strides.batch + row * p.q_strides.row + head * p.q_strides.head;
  const T* k = static_cast<const T*>(p.k) + batch * p.k_strides.batch + kv_head * p.k_strides.head;
  const T* v = static_cast<const T*>(p.v) + batch * p.v_strides.batch + kv_head * p.v_strides.head;
  const int64_t offset = flash::diagonal_offset(p.mask, p.shape.seqlen_q, p.shape.seqlen_k);
  const flash::KeyRange keys = flash::visible_keys(p.mask, row, offset, p.shape.seqlen_k);
  const int64_t begin = keys.begin > 0 ? keys.begin : 0;
  const int64_t end = keys.end < p.shape.seqlen_k ? keys.end : p.shape.seqlen_k;
  float acc[256];
  for (int c = 0; c < d; ++c) acc[c] = 0.f;
  float max = -INFINITY, sum = 0.f;
  for (int64_t j = begin; j < end; ++j) {
    float score = 0.f;
    for (int c = 0; c < d; ++c) score += float(q[c]) * float(k[j * p.k_strides.row + c]);
    score *= static_cast<float>(p.softmax_scale);
    const float new_max = fmaxf(max, score);
    const float factor = expf(max - new_max);
    const float prob = expf(score - new_max);
    sum = sum * factor + prob;
    for (int c = 0; c < d; ++c) acc[c] = acc[c] * factor + prob * float(v[j * p.v_strides.row + c]);
    max = new_max;
  }
  const int64_t base = ((batch * p.shape.nheads_q + head) * p.shape.seqlen_q + row);
  for (int c = 0; c < d; ++c) out[base * d + c] = sum > 0.f ? acc[c] / sum : 0.f;
  lse[base] = sum > 0.f ? max + logf(sum) : INFINITY;
}

template <typename T>
void fill_random(std::vector<T>& values, uint32_t seed) {
  for (size_t i = 0; i < values.size(); ++i) {
    seed = seed * 1664525u + 1013904223u;
    values[i] = T(((seed >> 8) * (1.0f / 16777216.0f)) * 2.f - 1.f);
  }
}

template <typename T>
int run(int hd, MaskKind mask, int64_t b, int64_t h, int64_t hk, int64_t sq, int64_t sk, int iters, Launch launch,
        int64_t left, int64_t right, const std::string& variant) {
  std::vector<T> hq(b * sq * h * hd), hkv(b * sk * hk * hd), hv(b * sk * hk * hd);
  fill_random(hq, 1), fill_random(hkv, 2), fill_random(hv, 3);
  T *q, *k, *v, *o;
  float *lse, *ref_o, *ref_lse;
  CHECK_CUDA(cudaMalloc(&q, hq.size() * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&k, hkv.size() * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&v, hv.size() * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&o, hq.size() * sizeof(T)));
  CHECK_CUDA(cudaMalloc(&lse, b * h * sq * sizeof(float)));
  CHECK_CUDA(cudaMemcpy(q, hq.data(), hq.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(k, hkv.data(), hkv.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(v, hv.data(), hv.size() * sizeof(T), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(o, 0xff, hq.size() * sizeof(T)));  // NaN pattern: unwritten outputs fail the check

  flash::FwdParams p;
  p.dtype = std::is_same_v<T, __half> ? DType::kFloat16 : DType::kBFloat16;
  p.shape.batch = b, p.shape.nheads_q = h, p.shape.nheads_k = hk, p.shape.head_dim = hd;
  p.shape.seqlen_q = sq, p.shape.seqlen_k = sk, p.shape.total_q = b * sq, p.shape.total_k = b * sk;
  p.softmax_scale = 1.0 / std::sqrt(static_cast<double>(hd));
  p.q = q, p.k = k, p.v = v, p.out = o, p.lse = lse;
  p.q_strides = {sq * h * hd, h * hd, hd};
  p.k_strides = p.v_strides = {sk * hk * hd, hk * hd, hd};
  p.out_strides = p.q_strides;
  p.lse_batch_stride = h * sq, p.lse_head_stride = sq;
  if (mask == MaskKind::kCausal) p.mask.window_right = 0;
  if (mask == MaskKind::kLocal) p.mask.window_left = left, p.mask.window_right = right;

  launch(p, nullptr);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  double max_err = 0, max_lse_err = 0;
  int64_t bad = 0;
  if (sq * sk <= int64_t{1} << 22) {
    CHECK_CUDA(cudaMalloc(&ref_o, hq.size() * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&ref_lse, b * h * sq * sizeof(float)));
    reference_kernel<T><<<dim3((sq + 63) / 64, h, b), 64>>>(p, ref_o, ref_lse);
    CHECK_CUDA(cudaDeviceSynchronize());
    std::vector<T> got(hq.size());
    std::vector<float> want(hq.size()), got_lse(b * h * sq), want_lse(b * h * sq);
    CHECK_CUDA(cudaMemcpy(got.data(), o, got.size() * sizeof(T), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(want.data(), ref_o, want.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(got_lse.data(), lse, got_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(want_lse.data(), ref_lse, want_lse.size() * sizeof(float), cudaMemcpyDeviceToHost));
    for (int64_t bi = 0; bi < b; ++bi)
      for (int64_t r = 0; r < sq; ++r)
        for (int64_t hi = 0; hi < h; ++hi)
          for (int c = 0; c < hd; ++c) {
            const float g = float(got[((bi * sq + r) * h + hi) * hd + c]);
            const float w = want[(((bi * h + hi) * sq) + r) * hd + c];
            const double err = std::fabs(double(g) - w);
            if (!(err <= 1e9)) ++bad;
            else if (err > max_err) max_err = err;
          }
    for (size_t i = 0; i < got_lse.size(); ++i) {
      if (std::isinf(want_lse[i]) && got_lse[i] == want_lse[i]) continue;
      const double err = std::fabs(double(got_lse[i]) - want_lse[i]);
      if (!(err <= 1e9)) ++bad;
      else if (err > max_lse_err) max_lse_err = err;
    }
  }
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int i = 0; i < 3; ++i) launch(p, nullptr);
  CHECK_CUDA(cudaEventRecord(start));
  for (int i = 0; i < iters; ++i) launch(p, nullptr);
  CHECK_CUDA(cudaEventRecord(stop));
  CHECK_CUDA(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
  ms /= iters;
  double flops = 4.0 * b * h * sq * sk * hd;
  if (mask == MaskKind::kCausal) flops *= 0.5;
  std::printf("%s %s hd%d %s b%ld h%ld/%ld sq%ld sk%ld: max|dO| %.3e max|dLSE| %.3e nonfinite %ld | %.3f ms %.1f TFLOP/s\n",
              variant.c_str(), std::is_same_v<T, __half> ? "fp16" : "bf16", hd, mask == MaskKind::kNone ? "none" : mask == MaskKind::kCausal ? "causal" : "local", long(b),
              long(h), long(hk), long(sq), long(sk), max_err, max_lse_err, long(bad), ms, flops / ms / 1e9);
  return bad > 0 || max_err > 2e-2 || max_lse_err > 1e-2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 8) {
    std::fprintf(stderr, "usage: %s hd none|causal|local batch heads kv_heads seqlen_q seqlen_k [iters] [bf16|fp16] "
                 "[serial|overlap|pingpong] [block_n stages] [persistent] [poly]\n",
                 argv[0]);
    return 2;
  }
  std::map<Key, Launch> table;
  // Tiles timed beside each head dim's policy tile: wider key blocks where registers and shared memory allow, a
  // deeper ring at the policy's width.
  add_head_dim<DType::kBFloat16, 64, FwdTileConfig{128, 192, 2}, FwdTileConfig{128, 128, 4}>(table);
  add_head_dim<DType::kBFloat16, 128, FwdTileConfig{128, 176, 2}, FwdTileConfig{128, 128, 3}>(table);
  add_head_dim<DType::kBFloat16, 192, FwdTileConfig{128, 96, 2}, FwdTileConfig{128, 64, 3}>(table);
  add_head_dim<DType::kBFloat16, 256, FwdTileConfig{128, 64, 2}, FwdTileConfig{128, 48, 3}>(table);
  add_head_dim<DType::kFloat16, 128>(table);
  const int hd = std::atoi(argv[1]);
  const std::string mask_name = argv[2];
  const MaskKind mask = mask_name == "causal" ? MaskKind::kCausal : mask_name == "local" ? MaskKind::kLocal
                                                                                          : MaskKind::kNone;
  const int iters = argc > 8 ? std::atoi(argv[8]) : 10;
  const bool fp16 = argc > 9 && std::string(argv[9]) == "fp16";
  const std::string schedule_name = argc > 10 ? argv[10] : "serial";
  const FwdSchedule schedule = schedule_name == "pingpong" ? FwdSchedule::kPingpong
                               : schedule_name == "overlap" ? FwdSchedule::kOverlap
                                                            : FwdSchedule::kSerial;
  const int bucket = hd <= 64 ? 64 : hd <= 128 ? 128 : hd <= 192 ? 192 : 256;
  FwdTileConfig tile = flash::sm90::fwd_tile_config(bucket);
  if (argc > 12 && std::atoi(argv[11]) > 0) tile = FwdTileConfig{tile.block_m, std::atoi(argv[11]), std::atoi(argv[12])};
  const bool persistent = argc > 13 && std::atoi(argv[13]) != 0;
  const int poly = argc > 14 ? std::atoi(argv[14]) : 0;
  const DType dtype = fp16 ? DType::kFloat16 : DType::kBFloat16;
  const auto found = table.find(key_of(dtype, bucket, mask, schedule, tile, persistent, poly));
  if (found == table.end()) {
    std::fprintf(stderr,
                 "not instantiated in this build (FLASH_CHECK_HEAD_DIM=%d): hd %d %s %s block_n %d stages %d "
                 "persistent %d poly %d\n",
                 kOnlyHeadDim, hd, mask_name.c_str(), schedule_name.c_str(), tile.block_n, tile.stages,
                 int(persistent), poly);
    return 2;
  }
  const int64_t b = std::atol(argv[3]), h = std::atol(argv[4]), hk = std::atol(argv[5]);
  const int64_t sq = std::atol(argv[6]), sk = std::atol(argv[7]);
  const int64_t left = 100, right = 37;
  const std::string variant =
      schedule_name + " " + std::to_string(tile.block_m) + "x" + std::to_string(tile.block_n) + "x" +
      std::to_string(tile.stages) + (persistent ? " persistent" : "") +
      (poly > 0 ? " poly-exp 1/" + std::to_string(poly) : "");
  return fp16 ? run<__half>(hd, mask, b, h, hk, sq, sk, iters, found->second, left, right, variant)
              : run<__nv_bfloat16>(hd, mask, b, h, hk, sq, sk, iters, found->second, left, right, variant);
}
