// Pieces both Hopper kernels (fwd_kernel.h, bwd_kernel.h) assemble: the 128-byte-swizzled segment geometry, the two
// wgmma GEMM forms over [segment][rows][64] tiles (SS with both operands K-major; RS with B read MN-major), packing
// fp32 accumulators into 16-bit A fragments, pipeline ring slots, and a batch entry's rows (dense or varlen).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "flash_attn/common/mask.h"
#include "flash_attn/common/seqlen.h"
#include "flash_attn/params.h"
#include "flash_attn/ptx/tma_load_sm90.h"
#include "flash_attn/ptx/warpgroup_sm90.h"
#include "flash_attn/ptx/wgmma_sm90_generated.h"

namespace flash::sm90 {

constexpr int kMaxSmemPerBlock = 232448;  // the 227 KB an sm90 block may opt into
// One producer and two consumer warpgroups: setmaxnreg splits the 64K registers as 128 x 24 (producer) + 256 x 240
// (consumers) = 64,512. At 24 the narrow backward's producer loop spills (432-572 bytes); 56 / 224, which spills
// 28-52, ran level to -7 % there (hd 128 causal 2k 324 / 337, 8k 428 / 459 TFLOP/s, H200, thirty-third session).
constexpr int kProducerRegisters = 24;
constexpr int kConsumerRegisters = 240;
// The same split for `consumers` consumer warpgroups: what is left of each thread slot's 65536 / 128 registers after
// the producer's, shared out in setmaxnreg's multiples of 8 (2: 240, 3: 160).
constexpr int kRegistersPerThreadSlot = 65536 / 128;
constexpr int kRegisterGranule = 8;
constexpr int consumer_registers(int consumers) {
  return (kRegistersPerThreadSlot - kProducerRegisters) / consumers / kRegisterGranule * kRegisterGranule;
}
static_assert(consumer_registers(2) == kConsumerRegisters, "two consumers take the split above");

// Whether a kernel's first thread prefetches its tensor maps (ptx::prefetch_tensor_map) before setting up its
// barriers, so that a CTA's first copies do not also fetch the descriptors. Pays where CTAs are many and short: one
// tile per CTA (hd 256 masked calls, ~10 us a CTA at 512 keys) and the backward (a CTA per key block). Predicted
// +0-3 % there, level where persistent CTAs walk many tiles. Not yet timed (fifty-first session: no GPU).
constexpr bool kPrefetchesTensorMaps = true;

constexpr int kSegmentElems = 64;  // head-dim columns per TMA box and per 128-byte swizzled line
constexpr int kSegmentBytes = 128;
constexpr int kK16Bytes = 32;      // one k16 step along a K-major line
constexpr int kK16MnMajorBytes = 16 * kSegmentBytes;  // one k16 step (16 rows) of an MN-major operand
constexpr int kQuadLanes = 4;      // lanes sharing one accumulator row
constexpr int kWarpSize = 32;
constexpr unsigned kFullWarp = 0xffffffffu;
constexpr int kRowsPerWarp = 16;   // a warp's rows of an m64 accumulator: lane / 4 and lane / 4 + kSecondRow
constexpr int kSecondRow = 8;

template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t packed;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 pair = __floats2half2_rn(lo, hi);
    packed = *reinterpret_cast<const uint32_t*>(&pair);
  } else {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    packed = *reinterpret_cast<const uint32_t*>(&pair);
  }
  return packed;
}

template <int kCount>
__device__ __forceinline__ void pin_all(float (&values)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) ptx::pin_register(values[i]);
}

// Issues s = A.B^T over the head dim for one warpgroup's 64 rows of A (one commit group), both operands K-major in
// [segment][rows][64] tiles: the forward's S = Q.K^T, the backward's S^T = K.Q^T and dP^T = V.dO^T. k16 steps walk
// 32 bytes along a 128-byte line, then jump to the next segment: kRowsA (the A tile's rows) or kN (B's) x 128 bytes.
template <typename T, int kHeadDim, int kRowsA, int kN>
__device__ __forceinline__ void issue_scores(float (&s)[kN / 2], uint64_t a_desc, uint64_t b_desc) {
  ptx::warpgroup_fence();
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    const uint32_t step = (kk % 4) * kK16Bytes;
    ptx::Wgmma<T, kN>::ss(s, ptx::advance_descriptor(a_desc, (kk / 4) * kRowsA * kSegmentBytes + step),
                          ptx::advance_descriptor(b_desc, (kk / 4) * kN * kSegmentBytes + step), kk > 0);
  }
  ptx::warpgroup_commit();
}

// Issues o += A.B (one commit group): A from registers (kK / 16 fragments), B read MN-major (kHeadDim columns
// contiguous), 16 rows (2048 bytes) per k16 step: the forward's O += P.V, the backward's dV += P^T.dO, dK += dS^T.Q.
template <typename T, int kHeadDim, int kK>
__device__ __forceinline__ void issue_pv(float (&o)[kHeadDim / 2], const uint32_t (&a)[kK / 16][4], uint64_t b_desc) {
  ptx::warpgroup_fence();
#pragma unroll
  for (int kk = 0; kk < kK / 16; ++kk) {
    ptx::Wgmma<T, kHeadDim>::rs(o, a[kk], ptx::advance_descriptor(b_desc, kk * kK16MnMajorBytes), true);
  }
  ptx::warpgroup_commit();
}

// P as the A operand: the k16 slice kk of an m64 accumulator is registers 8kk .. 8kk + 7, packed pairwise
// (HOPPER_NOTES.md 1.7: the accumulator and RS A-fragment layouts coincide for 16-bit types).
template <typename T, int kBlockN>
__device__ __forceinline__ void pack_probs(const float (&s)[kBlockN / 2], uint32_t (&a)[kBlockN / 16][4]) {
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
    for (int w = 0; w < 4; ++w) a[kk][w] = pack_pair<T>(s[8 * kk + 2 * w], s[8 * kk + 2 * w + 1]);
  }
}

// Where stage slots and parities come from: iteration i of the key loop uses slot i % kStages, and its barriers'
// phase (i / kStages) & 1.
// The kernel's dynamic shared memory from the first kSwizzleAtomBytes boundary (the swizzled tiles' alignment), by
// pointer arithmetic on the __shared__ array so that the compiler still knows every pointer derived from it to be
// shared: rounded through an integer, the backward's statistics and dS^T accesses compiled to generic LD.E / ST.E,
// whose long-scoreboard waits were ~10 % of its stall samples (ncu, hd 128, 4k, H200).
__device__ __forceinline__ uint8_t* align_dynamic_smem(uint8_t* raw) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  return raw + (ptx::kSwizzleAtomBytes - address % ptx::kSwizzleAtomBytes) % ptx::kSwizzleAtomBytes;
}

template <int kStages>
struct RingSlot {
  int stage;
  uint32_t parity;
  __device__ __forceinline__ explicit RingSlot(int i) : stage(i % kStages), parity((i / kStages) & 1) {}
};

// The mbarriers of one CTA's pipeline, initialised by one thread: a once-per-tile (or per key block) operand pair's
// full / empty barriers, then per stage the two ring operands' (full: the producer's one arrival plus the TMA bytes;
// empty: a_empty_arrivals and b_empty_arrivals, one per consumer warpgroup or one per consumer thread).
__device__ __forceinline__ void init_pipeline_barriers(uint64_t* once_full, uint64_t* once_empty, uint64_t* a_full,
                                                       uint64_t* b_full, uint64_t* a_empty, uint64_t* b_empty,
                                                       int stages, int consumers, int a_empty_arrivals,
                                                       int b_empty_arrivals) {
  ptx::mbarrier_init(once_full, 1);
  ptx::mbarrier_init(once_empty, consumers);
  for (int s = 0; s < stages; ++s) {
    ptx::mbarrier_init(&a_full[s], 1);
    ptx::mbarrier_init(&b_full[s], 1);
    ptx::mbarrier_init(&a_empty[s], a_empty_arrivals);
    ptx::mbarrier_init(&b_empty[s], b_empty_arrivals);
  }
  ptx::fence_barrier_init();
}

// One batch entry's rows: dense calls start at row 0 of their batch entry, with seqused_k[b] keys where the call gives
// the KV-cache lengths (common/mask.h used_keys, clamped to [0, seqlen_k]); varlen calls at cu_seqlens (clamped, so
// any values keep every access inside the tensors: common/seqlen.h).
struct Sequence {
  int64_t q_row0;
  int64_t k_row0;
  int64_t seqlen_q;
  int64_t seqlen_k;
};

__device__ __forceinline__ Sequence locate_sequence(const AttentionShape& shape, int batch) {
  if (shape.cu_seqlens_q == nullptr) return Sequence{0, 0, shape.seqlen_q, used_keys(shape, batch, shape.seqlen_k)};
  const SequenceRows q = varlen_rows(shape.cu_seqlens_q, batch, shape.total_q, shape.seqlen_q);
  const SequenceRows k = varlen_rows(shape.cu_seqlens_k, batch, shape.total_k, shape.seqlen_k);
  return Sequence{q.row0, k.row0, q.length, k.length};
}

}  // namespace flash::sm90
