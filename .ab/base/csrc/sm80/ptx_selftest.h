// Host launchers of the one-tile self tests of the inline-PTX wrappers in include/flash_attn/ptx/ (test-only:
// called through torch.ops.flash_attn._ptx_selftest by tests/test_ptx_wrappers.py). Each runs one warp on
// one tile on `stream` and writes what the wrapper produced, so Python can compare it with the documented
// fragment layouts. Pointers are device pointers to contiguous row-major buffers; no torch types here.
#pragma once

#include <cstdint>

#include "flash_attn/params.h"

namespace flash::sm80::selftest {

constexpr int kWarpLanes = 32;
constexpr int kTileRows = 16;                // mma M, ldmatrix 16-row tiles
constexpr int kTileCols = 16;                // mma K, width of the ldmatrix.x4 tile
constexpr int kMmaCols = 8;                  // mma N, width of the ldmatrix.x2.trans tile
constexpr int kPackedPairs = kWarpLanes;     // pack2: one pair per lane
constexpr int kCpAsyncChunks = 2 * kWarpLanes;  // two commit groups of one 16-byte chunk per lane
constexpr int kCpAsyncChunkWords = 4;        // 16 bytes as int32 words
constexpr int kRedFloats = 4;                // red.global.add.v4.f32: four floats per lane
constexpr int kBulkBoxRows = 16;             // bulk_reduce_add_2d: the box added
constexpr int kBulkBoxCols = 16;
constexpr int kBulkRows = 40;                // ... into this fp32 matrix (rows past 40 are clipped by the map)
constexpr int kBulkCols = 48;
constexpr int kTmaCols = 96;                 // tma_load_4d: the source tensor (batch, rows, heads, cols), 16-bit
constexpr int kTmaHeads = 3;
constexpr int kTmaRows = 40;
constexpr int kTmaBatch = 2;
constexpr int kTmaBoxRows = 32;              // ... and the box: 32 rows x 64 columns of one head and batch entry
constexpr int kTmaBoxCols = 64;
constexpr int kTmaLoads = 2;                 // two loads through one barrier: its phases 0 and 1
constexpr unsigned long long kGriddepTimeoutNs = 200000000;  // griddep: the primary waits up to 200 ms for its dependent
constexpr int kGriddepScratchWords = kWarpLanes + 2;         // griddep: data, started, saw_started
constexpr int kClusterCtas = 4;                              // cluster: one cluster of 4 one-warp CTAs
constexpr int kClusterVec = 4;                               // ... each lane reading 4 floats of its neighbour

// d (16x8 fp32) = a (16x16) * b_nk(8x16)^T + c (16x8 fp32); a, b_nk in `dtype` (kFloat16 or kBFloat16),
// loaded into fragments by the layout documented in ptx/mma_sm80.h. Returns false for another dtype.
bool mma_m16n8k16(DType dtype, const void* a, const void* b_nk, const float* c, float* d, void* stream);

// packed[l] = pack2(values[2l], values[2l + 1]) for the 32 lanes; 16-bit values of `dtype`.
bool pack2(DType dtype, const void* values, uint32_t* packed, void* stream);

// tile: 16 (k) x 8 (n) 16-bit values; regs[l][0..1] = what lane l received from ldmatrix_x2_trans when
// lane r < 16 passes the address of row r.
void ldmatrix_x2_trans(const uint16_t* tile, uint32_t* regs, void* stream);

// tile: 16x16 16-bit values; lane l passes the address of row l % 16, column 8 * (l / 16); regs[l][0..3] =
// what lane l received. `transposed` selects ldmatrix_x4_trans instead of ldmatrix_x4.
void ldmatrix_x4(const uint16_t* tile, uint32_t* regs, bool transposed, void* stream);

// src: kCpAsyncChunks chunks of 16 bytes; valid[i] != 0 copies chunk i, 0 zero-fills it. Lane l copies
// chunks l (first commit group) and 32 + l (second group) into shared memory pre-filled with a non-zero
// pattern; after wait<1> the warp reads the first group into dst, after wait<0> the second.
void cp_async_16(const int32_t* src, const int32_t* valid, int32_t* dst, void* stream);

// words: kWarpLanes int32; lane l copies word l with cp_async_4 (valid[l] != 0) or zero-fills it, into shared
// memory pre-filled with a non-zero pattern; after wait<0> lane l writes word (l + 1) % 32 to dst (another
// lane's copy, so the wait must cover the whole warp's copies).
void cp_async_4(const int32_t* words, const int32_t* valid, int32_t* dst, void* stream);

// dst: kWarpLanes x kRedFloats floats, updated in place: lane l adds added[l] with the unpredicated
// red_add_v4_f32, then extra[l] with the predicated one under valid[l] != 0. Returns false below sm90 (no
// vector reduction there), launching nothing.
bool red_add_v4_f32(float* dst, const float* added, const float* extra, const int32_t* valid, void* stream);

// dst: kBulkRows x kBulkCols fp32, updated in place: one warp copies box (kBulkBoxRows x kBulkBoxCols fp32) into
// shared memory and adds it at (col, row) of dst with one bulk_reduce_add_2d through a tensor map of dst, then
// waits for it. Returns false below sm90 or where no tensor map could be made, launching nothing.
bool bulk_reduce_add_2d(float* dst, const float* box, int col, int row, void* stream);

// src: kTmaBatch x kTmaRows x kTmaHeads x kTmaCols 16-bit values; where: kTmaLoads x 4 coordinates (col, head, row,
// batch entry). One warp loads box i (kTmaBoxRows x kTmaBoxCols at where[i]) with tma_load_4d through a 128-byte
// swizzled tensor map into one shared tile pre-filled with a non-zero pattern, waits on one mbarrier (phase parity
// i), and writes the tile, read through kernel_common.h SegmentSwizzledRows, to dst[i] (row-major). Returns false
// below sm90 or where no tensor map could be made, launching nothing.
bool tma_load_4d(const uint16_t* src, const int32_t* where, uint16_t* dst, void* stream);

// regs: kWarpLanes x 4 words; lane l stores regs[l][0..3] with stmatrix_x4, passing the address of row l % 16,
// column 8 * (l / 16) of a 16x16 16-bit shared tile pre-filled with a non-zero pattern; tile receives that
// shared tile. Returns false below sm90 (no stmatrix there), launching nothing.
bool stmatrix_x4(const uint32_t* regs, uint16_t* tile, void* stream);

// words: kWarpLanes int32; scratch: kGriddepScratchWords int32 zeros; dst: kWarpLanes + 1 int32. A primary kernel
// allows its dependent launch and waits (up to kGriddepTimeoutNs) for the dependent, launched with programmatic stream
// serialization, to start; it then writes the words. After wait_for_primary_grid() the dependent copies them into
// dst[0..31] and into dst[kWarpLanes] whether the primary saw it start (1) or timed out (0: no early launch). Returns
// false below sm90 or when the dependent launch failed.
bool griddep(const int32_t* words, int32_t* scratch, int32_t* dst, void* stream);

// values: kClusterCtas x kWarpLanes x kClusterVec floats; dst: kClusterCtas x kWarpLanes x (2 + kClusterVec) floats.
// One cluster of kClusterCtas one-warp CTAs, launched as clusters along z; CTA z stages values[z] in its shared
// memory, cluster_sync(), then lane l of the CTA of cluster rank r reads, from the CTA of rank (r + 1) % kClusterCtas
// (map_shared_to_rank), word l * kClusterVec with ld_shared_cluster_f32 and its kClusterVec words with
// ld_shared_cluster_v4_f32, writing [r, the word, the vector] to dst[z][l]; a second sync keeps the shared memory
// alive until the neighbour has read it. Returns false below sm90 or when the cluster launch failed.
bool cluster_exchange(const float* values, float* dst, void* stream);

}  // namespace flash::sm80::selftest
