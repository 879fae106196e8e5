// The host<->kernel contract: one plain struct per direction (pointers, element strides as int64, sizes,
// scalars). Built by csrc/api/ from torch tensors; read by every backend (csrc/cpu/, csrc/sm80/, csrc/sm90/).
// No torch types here. Tensor [b, row, head, dim] lives at base + b*batch + row*row_stride + head*head + dim;
// for varlen calls batch strides are 0 and rows are offset by cu_seqlens[b].
//
// Kernel input contract for CUDA calls (enforced by csrc/api/kernel_inputs.cpp before params are built, so a
// CUDA kernel may rely on it without checking):
//   - dtype is fp16 or bf16; head_dim % 8 == 0 (other head dims are zero-padded in the last dimension to the
//     next multiple of 8 for q, k, v, out and dout, and outputs / gradients sliced back; softmax_scale is
//     always explicit, so padding does not change it);
//   - every batch / row / head stride of q, k, v, out, dout, dq, dk, dv is a multiple of 8 elements, the dim
//     stride is 1 and every base pointer is 16-byte aligned (other tensors are copied contiguous), so any
//     8-element (16-byte) chunk of a row can be moved with one vector load or store;
//   - out, dq, dk, dv are allocated by the host contiguous; for varlen calls they (and softmax_lse) are
//     pre-initialised for rows past cu_seqlens[-1], which no sequence owns, so kernels write only owned rows;
//   - cu_seqlens, seqused_k and rng_state are device pointers that kernels read from device memory; the host checks
//     cu_seqlens values at most once per tensor (csrc/api/seqlens_validation.h), never under CUDA-graph capture, so
//     kernels clamp every value they read (varlen_rows, used_keys) and stay inside the tensors whatever it is.
#pragma once

#include <cstdint>

namespace flash {

enum class DType : int { kFloat16, kBFloat16, kFloat32, kFloat64 };
enum class MaskKind : int { kNone, kCausal, kLocal };
enum class Direction : int { kForward, kBackward };

// Strides, in elements, of a (batch, seqlen, nheads, headdim) tensor; dim stride is 1.
struct TensorStrides {
  int64_t batch = 0;
  int64_t row = 0;
  int64_t head = 0;
};

// Strides of a (batch, nheads, seqlen_q, seqlen_k) tensor (attention bias, probabilities, dbias).
struct ScoreStrides {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
  int64_t col = 0;
};

// Sentinel of window_left / window_right for "no limit on this side".
constexpr int64_t kUnboundedWindow = -1;

// The lean kernels fold softmax_scale into the exponent's FFMA, p = 2^(s c - round(m c)) with c = scale log2(e), so at
// the row max the exponent is round(m c)'s rounding error, up to ulp(m c) / 2: for scores |m| ~ 100 and a scale of 256,
// m c ~ 2^15 and the error 2^-9 (below bf16's rounding of P); at a scale of 1e30 it overflows 2^x (NaN; fifty-third
// session, tools/fuzz_inputs.py --device cuda --seed 1). Other scales take the general transform, which rounds
// z = s c first and subtracts the max of z (0 at the max), as non-positive scales always did.
constexpr double kMaxFoldedSoftmaxScale = 256.0;
constexpr bool softmax_scale_folds(double softmax_scale) {
  return softmax_scale > 0.0 && softmax_scale <= kMaxFoldedSoftmaxScale;
}

// The backward recomputes p = 2^(z - LSE log2 e) from the forward's fp32 LSE, whose rounding at |LSE| ~ |m scale| is
// the same ulp: past this scale a score of ~100 already puts the error of p's exponent above 2^-9, and at 1e30 it is
// 2^80, so P is inf or 0 and the gradients NaN (fifty-fourth session, tools/fuzz_inputs.py --device cuda --seed 1,
// case 394). The backward refuses such scales instead of returning them (api/flash_api.cpp bwd).
constexpr double kMaxBackwardSoftmaxScale = kMaxFoldedSoftmaxScale;

struct AttentionShape {
  int64_t batch = 0;
  int64_t nheads_q = 0;
  int64_t nheads_k = 0;
  int64_t head_dim = 0;
  // Dense calls: the sequence lengths. Varlen calls: the largest per-sequence length.
  int64_t seqlen_q = 0;
  int64_t seqlen_k = 0;
  // Varlen calls: int32 prefix sums of the sequence lengths (batch + 1 entries); null for dense calls. Kernels read
  // them through varlen_rows() (common/seqlen.h), which clamps them to total_q / total_k rows and the max lengths.
  const int32_t* cu_seqlens_q = nullptr;
  const int32_t* cu_seqlens_k = nullptr;
  // Varlen calls: the rows of q (out, dq) and of k / v (dk, dv); batch * seqlen for dense calls.
  int64_t total_q = 0;
  int64_t total_k = 0;
  // Dense calls only (null otherwise): int32 (batch,) count of keys each sequence uses, its first seqused_k[b]
  // rows of k / v (a KV cache's filled length). Masks and ALiBi align to that length as varlen does to
  // cu_seqlens_k; kernels clamp it to [0, seqlen_k]. Read on the device, never by the host (graph capture).
  const int32_t* seqused_k = nullptr;
  // With seqused_k only (flash_attn_with_kvcache's append in the same call, FwdParams::kv_append): this many new rows
  // follow each sequence's seqused_k[b] keys, so sequence b sees min(seqused_k[b], seqlen_k - appended_keys) +
  // appended_keys keys (common/mask.h used_keys). 0: none.
  int64_t appended_keys = 0;
};

struct MaskParams {
  // Key j is visible to query i iff i + offset - left <= j <= i + offset + right (an unbounded side has
  // no limit), with offset = seqlen_k - seqlen_q of that sequence when bottom_right, else 0.
  int64_t window_left = kUnboundedWindow;
  int64_t window_right = kUnboundedWindow;
  bool bottom_right = true;
  // ALiBi: score(i, j) -= slope[b, h] * |i + offset - j|; null when unused. float32.
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  // Additive bias, (batch, nheads_q, seqlen_q, seqlen_k) with any strides (0 for broadcast dims).
  const void* bias = nullptr;
  DType bias_dtype = DType::kFloat32;
  ScoreStrides bias_strides;
};

struct DropoutParams {
  double p = 0.0;  // probability of dropping; 0 disables dropout
  // int64 [seed, offset] in the tensors' memory (device memory for CUDA calls), read by the kernel itself so
  // a call needs no host synchronisation and can be captured in a CUDA graph.
  const int64_t* rng_state = nullptr;
};

struct FwdParams {
  DType dtype = DType::kFloat16;
  AttentionShape shape;
  MaskParams mask;
  DropoutParams dropout;
  double softmax_scale = 1.0;
  double softcap = 0.0;  // 0 disables softcapping

  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  TensorStrides q_strides, k_strides, v_strides;

  void* out = nullptr;
  TensorStrides out_strides;
  // Log-sum-exp per (batch, head, row): dense (B, H, Sq); varlen (H, total_q) with batch stride 0. float32,
  // or float64 when the inputs are float64 (so float64 gradients are exact to float64 rounding).
  void* lse = nullptr;
  int64_t lse_batch_stride = 0;
  int64_t lse_head_stride = 0;
  // Optional normalised probabilities, sign-flipped where dropout dropped; null unless requested.
  void* probs = nullptr;
  ScoreStrides probs_strides;

  // Split-KV (decode-shaped CUDA calls with too few CTAs to fill the GPU): the key range is cut into
  // num_splits parts; each CTA writes its part's normalised fp32 output and natural-log lse (-inf when it saw no
  // key) to these buffers and a combine kernel merges them into out / lse. Laid out as
  // split_out[split][batch][nheads_q][seqlen_q][head_dim] and split_lse[split][batch][nheads_q][seqlen_q] with
  // seqlen_q the (maximum) query length. Unused when num_splits == 1.
  int num_splits = 1;
  // Decode calls with appended keys (AttentionShape::appended_keys): the last split holds only the key tiles of the
  // new rows, the others share the tiles before them (the plan added that split, api/fwd_cuda_plan.cpp).
  bool appended_split = false;
  float* split_out = nullptr;
  float* split_lse = nullptr;
  // sm90 decode calls of at most sm80::kMaxClusterSplits splits: a sequence's splits run as one thread-block cluster
  // and merge their partials through distributed shared memory (sm80/fwd_kernel.h combine_splits_in_cluster), with
  // no split_out / split_lse and no combine kernel (dispatch/fwd_plan.h fwd_splits_meet_in_cluster).
  bool splits_meet_in_cluster = false;
  // Decode calls of at most one CTA per SM: the key-warps decode tile (sm80/fwd_tile_config.h kDecodeKeyWarps), its
  // warps on their own key tiles, merged in shared memory, in place of the one-warp tile (dispatch/fwd_plan.h
  // fwd_decode_takes_key_warps). num_splits counts its CTAs' splits.
  bool decode_key_warps = false;
  // Single-query GQA calls whose query heads of a KV head became rows (dispatch/fwd_plan.h pack_gqa_decode): decode
  // calls, whatever seqlen_q now says.
  bool packed_gqa_decode = false;
  // Hopper forward calls of few query rows with GQA: this many query heads of one KV head share each tile's rows
  // (dispatch/sm90_policy.h sm90_fwd_packed_heads; sm90/fwd_kernel.h FwdKernelArgs::pack_shift). 1: one head a tile.
  int sm90_packed_heads = 1;
  // Hopper forward calls at hd 96 from 4k queries: 192-row tiles on three consumer warpgroups
  // (sm90/fwd_tile_config.h kFwdTallTile; dispatch/sm90_policy.h sm90_fwd_tall_rows).
  bool sm90_tall_rows = false;

  // Paged K / V (flash_attn_with_kvcache's block_table; dense decode-tile CUDA calls whose pages hold whole key
  // blocks, with seqused_k: dispatch/fwd_plan.h fwd_reads_pages): k and v are (num_pages, page_size, nheads_k,
  // head_dim) pools whose batch strides step one page, and key row r of sequence b is row r % page_size of page
  // block_table[b * block_table_stride + r / page_size], a device value the kernels clamp to [0, num_pages). Null:
  // k / v are dense.
  const int32_t* block_table = nullptr;
  int64_t block_table_stride = 0;
  int page_size = 0;
  int num_pages = 0;

  // flash_attn_with_kvcache's append inside a decode call (api/flash_api.cpp kvcache_decode_; decode tiles with one
  // CTA per sequence, kv head and split): the new rows k, v (batch, appended_keys, nheads_k, head_dim), which the
  // CTA of each sequence and kv head that holds the last key tile writes into the caches k / v (rows
  // keys_before_append + i, through the block table when paged; k rotated at that position by `rotary`) before it
  // loads its tiles. Null k: nothing to write.
  struct KvAppend {
    const void* k = nullptr;
    const void* v = nullptr;
    TensorStrides k_strides, v_strides;
  } kv_append;

  // Rotary of a decode call with an append (flash_attn_with_kvcache's rotary_cos / rotary_sin): the decode kernels
  // rotate their queries as they load them, every row of sequence b at position keys_before_append (its one query),
  // and the appended keys at keys_before_append + i, by the (seqlen_ro, rotary_dim / 2) cos / sin tables, GPT-J pairs
  // when interleaved; a position past the tables leaves the row as it is. Null cos: no rotation.
  struct Rotary {
    const void* cos = nullptr;
    const void* sin = nullptr;
    int64_t cos_row_stride = 0;
    int64_t sin_row_stride = 0;
    int64_t rotary_dim = 0;
    int64_t seqlen_ro = 0;
    bool interleaved = false;
  } rotary;
};

// What the CUDA backward kernels may rely on (the API layer guarantees it, padding or copying otherwise):
// head_dim % 8 == 0 and head_dim <= the kernel's head-dim bucket; every row/head/batch stride of q, k, v, out,
// dout, dq, dk, dv a multiple of 8 elements; base pointers 16-byte aligned. (The sm80 kernels still fall back
// to element-wise loads and stores when this does not hold, so a violation is slow, not wrong.)
struct BwdParams {
  FwdParams fwd;  // the forward call's inputs, out and lse (probs unused)

  const void* dout = nullptr;
  TensorStrides dout_strides;
  // Optional gradient of the lse output, same layout and dtype as lse.
  const void* dlse = nullptr;

  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  TensorStrides dq_strides, dk_strides, dv_strides;
  // Optional gradient of the attention bias, full (batch, nheads_q, seqlen_q, seqlen_k), in lse's dtype.
  void* dbias = nullptr;
  ScoreStrides dbias_strides;
  bool deterministic = false;

  // CUDA only: scratch of bwd_workspace_bytes() bytes (flash_attn/bwd_workspace.h), allocated by the caller
  // on the call's stream; its layout follows from the fields below. Unused (null) on CPU.
  void* workspace = nullptr;
  int64_t total_q = 0;  // rows of q over all sequences: batch * seqlen_q dense, total_q varlen
  int64_t dq_splits = 1;  // fp32 dq accumulators, summed in a fixed order (> 1 only when deterministic)
  // CUDA only (dispatch/sm90_policy.h sm90_bwd_head_splits for the Hopper backward, bwd_workspace.h bwd_head_splits
  // for the portable one; 1 on CPU): a KV head's query heads are split over this many CTAs per key block, which add
  // dK and dV into fp32 accumulators of the workspace.
  int64_t head_splits = 1;
  // The Hopper backward only (false elsewhere): the workspace also holds every query block's LSE (log2 units) and D
  // side by side, padded per sequence to whole blocks (bwd_workspace.h), for the kernel's bulk copies.
  bool block_stats = false;
};

}  // namespace flash
