// CPU forward and backward of exact attention (see attention_cpu.h). Forward: one task per (batch, head,
// query tile) runs the online softmax over key tiles. Backward: one task per (batch, kv head, key chunk)
// recomputes P from Q, K and the saved LSE, accumulates dK/dV in its tiles and dQ in a per-chunk float
// buffer that is summed in a fixed order, so gradients are bitwise reproducible run to run.
#include "attention_cpu.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "flash_attn/common/mask.h"
#include "flash_attn/common/philox.h"
#include "flash_attn/common/seqlen.h"
#include "row_ops.h"

namespace flash::cpu {
namespace {

// Tile sizes. Tile GEMMs go through ATen's BLAS, so a tile must be large enough to amortise the per-call
// overhead (a few microseconds) and small enough that the score tile stays in L2.
struct CpuTileConfig {
  int64_t block_q;
  int64_t block_k;
};
constexpr CpuTileConfig kFwdTiles{256, 512};
constexpr CpuTileConfig kBwdTiles{128, 128};

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename A>
constexpr A kNegInf = -std::numeric_limits<A>::infinity();
template <typename A>
constexpr A kPosInf = std::numeric_limits<A>::infinity();

// ---- row primitives: the vectorised float versions, plain loops for double (used by gradcheck only) ----

inline float max_of(const float* x, int64_t n) { return row_max(x, n); }
inline double max_of(const double* x, int64_t n) {
  double m = kNegInf<double>;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}
inline float exp_shift_sum(float* x, int64_t n, float shift) { return row_exp_sum(x, n, shift); }
inline double exp_shift_sum(double* x, int64_t n, double shift) {
  double sum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}
inline void scale_by(float* x, int64_t n, float factor) { row_scale(x, n, factor); }
inline void scale_by(double* x, int64_t n, double factor) {
  for (int64_t j = 0; j < n; ++j) x[j] *= factor;
}

// ---- GEMM on row-major tiles through ATen (MKL / oneDNN / OpenBLAS, whichever torch was built with) ----

template <typename A>
at::Tensor as_matrix(const A* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<A*>(data), {rows, cols}, {ld, 1},
                       at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value));
}

// c (m x n, leading dim ldc) (+)= op(a) * op(b), where op(a) is m x k and op(b) is k x n; a is stored as
// (trans_a ? k x m : m x k) with leading dim lda, b as (trans_b ? n x k : k x n) with leading dim ldb.
template <typename A>
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const A* a, int64_t lda, const A* b,
          int64_t ldb, A* c, int64_t ldc, bool accumulate) {
  if (m == 0 || n == 0) return;
  at::Tensor cm = as_matrix(c, m, n, ldc);
  if (k == 0) {
    if (!accumulate) cm.zero_();
    return;
  }
  at::Tensor am = trans_a ? as_matrix(a, k, m, lda).t() : as_matrix(a, m, k, lda);
  at::Tensor bm = trans_b ? as_matrix(b, n, k, ldb).t() : as_matrix(b, k, n, ldb);
  if (accumulate) {
    cm.addmm_(am, bm);
  } else {
    at::mm_out(cm, am, bm);
  }
}

// ---- tensor addressing ----

// Geometry of one batch entry: where its rows start and how long its sequences are.
struct SeqInfo {
  int64_t q_row0;  // first row of this sequence in q/out (0 for dense calls)
  int64_t k_row0;
  int64_t seqlen_q;
  int64_t seqlen_k;
  int64_t offset;  // diagonal offset of the mask and of ALiBi distances
};

SeqInfo seq_info(const FwdParams& p, int64_t b) {
  const AttentionShape& s = p.shape;
  SeqInfo info{};
  if (s.cu_seqlens_q != nullptr) {
    const SequenceRows q_rows = varlen_rows(s.cu_seqlens_q, b, s.total_q, s.seqlen_q);
    const SequenceRows k_rows = varlen_rows(s.cu_seqlens_k, b, s.total_k, s.seqlen_k);
    info.q_row0 = q_rows.row0;
    info.seqlen_q = q_rows.length;
    info.k_row0 = k_rows.row0;
    info.seqlen_k = k_rows.length;
  } else {
    info.seqlen_q = s.seqlen_q;
    info.seqlen_k = s.seqlen_k;
  }
  info.seqlen_k = used_keys(s, b, info.seqlen_k);
  info.offset = diagonal_offset(p.mask, info.seqlen_q, info.seqlen_k);
  return info;
}

// Row `row` (within the sequence) of head `head` of batch entry `b`.
template <typename T>
T* row_ptr(T* base, const TensorStrides& st, int64_t b, int64_t row0, int64_t row, int64_t head) {
  return base + b * st.batch + (row0 + row) * st.row + head * st.head;
}

// Index of (b, h, row) in an lse-shaped float tensor.
int64_t lse_index(const FwdParams& p, const SeqInfo& si, int64_t b, int64_t h, int64_t row) {
  return b * p.lse_batch_stride + h * p.lse_head_stride + si.q_row0 + row;
}

// Rows [row, row + rows) of one head as an A matrix. Returns the source itself when it is already of type A
// with BLAS-compatible strides; otherwise converts into scratch (leading dim = head_dim).
template <typename T, typename A>
const A* load_rows(const T* first, int64_t rows, int64_t row_stride, int64_t head_dim, A* scratch, int64_t& ld) {
  if constexpr (std::is_same_v<T, A>) {
    if (row_stride >= head_dim || rows == 1) {
      ld = std::max<int64_t>(row_stride, head_dim);
      return first;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = first + r * row_stride;
    A* dst = scratch + r * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<A>(src[d]);
  }
  ld = head_dim;
  return scratch;
}

template <typename T, typename A>
void store_row(T* dst, const A* src, int64_t n, A factor) {
  for (int64_t d = 0; d < n; ++d) dst[d] = static_cast<T>(src[d] * factor);
}

template <typename A>
A read_bias(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat16: return static_cast<A>(static_cast<const at::Half*>(base)[index]);
    case DType::kBFloat16: return static_cast<A>(static_cast<const at::BFloat16*>(base)[index]);
    case DType::kFloat32: return static_cast<A>(static_cast<const float*>(base)[index]);
    case DType::kFloat64: return static_cast<A>(static_cast<const double*>(base)[index]);
  }
  return A(0);
}

// ---- scores: scale, softcap, ALiBi, bias, mask applied to one row of raw q.k products ----

template <typename A>
struct ScoreRules {
  const FwdParams& p;
  A scale;
  A softcap;  // 0 when off
  A alibi_slope;
  bool has_alibi;
  const void* bias;  // bias of this (batch, head), or null
  int64_t bias_row_stride = 0;
  int64_t bias_col_stride = 0;

  ScoreRules(const FwdParams& params, int64_t b, int64_t h)
      : p(params),
        scale(static_cast<A>(params.softmax_scale)),
        softcap(static_cast<A>(params.softcap)),
        alibi_slope(0),
        has_alibi(params.mask.alibi_slopes != nullptr),
        bias(nullptr) {
    if (has_alibi) alibi_slope = params.mask.alibi_slopes[b * params.mask.alibi_batch_stride + h];
    if (params.mask.bias != nullptr) {
      const ScoreStrides& st = params.mask.bias_strides;
      const int64_t elem = params.mask.bias_dtype == DType::kFloat64 ? 8
                           : params.mask.bias_dtype == DType::kFloat32 ? 4 : 2;
      bias = static_cast<const char*>(params.mask.bias) + (b * st.batch + h * st.head) * elem;
      bias_row_stride = st.row;
      bias_col_stride = st.col;
    }
  }

  // s[0..n) holds q.k for query `row` and keys col0..col0+n; turns it into the softmax input z in place.
  // With softcap, tanh_out (if given) receives tanh(q.k * scale / softcap) for the backward.
  void apply(A* s, int64_t n, int64_t row, int64_t col0, const SeqInfo& si, A* tanh_out) const {
    if (softcap > A(0)) {
      const A inv_cap = scale / softcap;
      for (int64_t j = 0; j < n; ++j) {
        const A t = std::tanh(s[j] * inv_cap);
        if (tanh_out != nullptr) tanh_out[j] = t;
        s[j] = softcap * t;
      }
    } else {
      scale_by(s, n, scale);
    }
    if (has_alibi) {
      const int64_t diag = row + si.offset - col0;
      for (int64_t j = 0; j < n; ++j) s[j] -= alibi_slope * static_cast<A>(std::abs(diag - j));
    }
    if (bias != nullptr) {
      const int64_t base = row * bias_row_stride + col0 * bias_col_stride;
      for (int64_t j = 0; j < n; ++j) s[j] += read_bias<A>(bias, p.mask.bias_dtype, base + j * bias_col_stride);
    }
    const KeyRange keys = visible_keys(p.mask, row, si.offset, si.seqlen_k);
    const int64_t masked_head = std::clamp<int64_t>(keys.begin - col0, 0, n);
    const int64_t visible_end = std::clamp<int64_t>(keys.end - col0, masked_head, n);
    std::fill(s, s + masked_head, kNegInf<A>);
    std::fill(s + visible_end, s + n, kNegInf<A>);
  }
};

// Key range any row of [row_begin, row_end) can see; empty when begin >= end.
KeyRange tile_keys(const MaskParams& mask, int64_t row_begin, int64_t row_end, const SeqInfo& si) {
  const KeyRange first = visible_keys(mask, row_begin, si.offset, si.seqlen_k);
  const KeyRange last = visible_keys(mask, row_end - 1, si.offset, si.seqlen_k);
  return KeyRange{std::max<int64_t>(first.begin, 0), std::min<int64_t>(last.end, si.seqlen_k)};
}

// ---- dropout ----

struct DropoutRule {
  bool active;
  uint64_t seed;
  uint64_t offset;
  uint64_t threshold;
  double inv_keep;

  explicit DropoutRule(const DropoutParams& d)
      : active(d.p > 0.0),
        seed(d.p > 0.0 ? static_cast<uint64_t>(d.rng_state[0]) : 0),
        offset(d.p > 0.0 ? static_cast<uint64_t>(d.rng_state[1]) : 0),
        threshold(dropout_keep_threshold(d.p)),
        inv_keep(d.p > 0.0 ? 1.0 / (1.0 - d.p) : 1.0) {}

  // keep[j] = 1 if key col0 + j of (batch_head, row) survives dropout, else 0.
  void keep_flags(int64_t batch_head, int64_t row, int64_t col0, int64_t n, uint8_t* keep) const {
    int64_t j = 0;
    while (j < n) {
      const int64_t col = col0 + j;
      const PhiloxBlock block = dropout_words(seed, offset, batch_head, row, col / kPhiloxWordsPerCall);
      for (int64_t w = col % kPhiloxWordsPerCall; w < kPhiloxWordsPerCall && j < n; ++w, ++j) {
        keep[j] = static_cast<uint64_t>(block.word[w]) < threshold ? 1 : 0;
      }
    }
  }
};

// ---- forward ----

template <typename T>
void fwd_impl(const FwdParams& p) {
  using A = acc_t<T>;
  const AttentionShape& shape = p.shape;
  const int64_t head_dim = shape.head_dim;
  const int64_t group = shape.nheads_q / shape.nheads_k;
  const int64_t block_q = kFwdTiles.block_q;
  const int64_t block_k = kFwdTiles.block_k;
  // max_seqlen_q is the caller's bound; no sequence is longer than the rows of q, so tasks past those are never work
  // (a bound of 2^31 - 1 over a few rows would otherwise walk 2^23 empty tiles of 256 rows per head).
  const int64_t longest_q = shape.cu_seqlens_q != nullptr ? std::min(shape.seqlen_q, shape.total_q) : shape.seqlen_q;
  const int64_t q_tiles = (longest_q + block_q - 1) / block_q;
  const DropoutRule dropout(p.dropout);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  T* out = static_cast<T*>(p.out);
  A* lse = static_cast<A*>(p.lse);

  at::parallel_for(0, shape.batch * shape.nheads_q * q_tiles, 1, [&](int64_t task_begin, int64_t task_end) {
    std::vector<A> q_buf(block_q * head_dim), k_buf(block_k * head_dim), v_buf(block_k * head_dim);
    std::vector<A> scores(block_q * block_k), acc(block_q * head_dim), row_max_v(block_q), row_sum(block_q);
    std::vector<uint8_t> keep(block_k);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t b = task / (shape.nheads_q * q_tiles);
      const int64_t h = (task / q_tiles) % shape.nheads_q;
      const int64_t hk = h / group;
      const int64_t row_begin = (task % q_tiles) * block_q;
      const SeqInfo si = seq_info(p, b);
      if (row_begin >= si.seqlen_q) continue;
      const int64_t rows = std::min(block_q, si.seqlen_q - row_begin);
      const ScoreRules<A> rules(p, b, h);
      const int64_t batch_head = b * shape.nheads_q + h;

      int64_t ldq = 0;
      const A* q_tile = load_rows(row_ptr(q, p.q_strides, b, si.q_row0, row_begin, h), rows, p.q_strides.row,
                                  head_dim, q_buf.data(), ldq);
      std::fill(acc.begin(), acc.begin() + rows * head_dim, A(0));
      std::fill(row_max_v.begin(), row_max_v.begin() + rows, kNegInf<A>);
      std::fill(row_sum.begin(), row_sum.begin() + rows, A(0));

      const KeyRange keys = tile_keys(p.mask, row_begin, row_begin + rows, si);
      for (int64_t col0 = keys.begin; col0 < keys.end; col0 += block_k) {
        const int64_t cols = std::min(block_k, keys.end - col0);
        int64_t ldk = 0, ldv = 0;
        const A* k_tile = load_rows(row_ptr(k, p.k_strides, b, si.k_row0, col0, hk), cols, p.k_strides.row,
                                    head_dim, k_buf.data(), ldk);
        gemm<A>(false, true, rows, cols, head_dim, q_tile, ldq, k_tile, ldk, scores.data(), cols, false);
        for (int64_t r = 0; r < rows; ++r) {
          A* s = scores.data() + r * cols;
          rules.apply(s, cols, row_begin + r, col0, si, nullptr);
          const A new_max = std::max(row_max_v[r], max_of(s, cols));
          if (new_max == kNegInf<A>) {
            std::fill(s, s + cols, A(0));
            continue;
          }
          const A tile_sum = exp_shift_sum(s, cols, new_max);
          const A rescale = std::exp(row_max_v[r] - new_max);
          if (rescale != A(1)) scale_by(acc.data() + r * head_dim, head_dim, rescale);
          row_sum[r] = row_sum[r] * rescale + tile_sum;
          row_max_v[r] = new_max;
          if (dropout.active) {
            dropout.keep_flags(batch_head, row_begin + r, col0, cols, keep.data());
            const A inv_keep = static_cast<A>(dropout.inv_keep);
            for (int64_t j = 0; j < cols; ++j) s[j] = keep[j] ? s[j] * inv_keep : A(0);
          }
        }
        const A* v_tile = load_rows(row_ptr(v, p.v_strides, b, si.k_row0, col0, hk), cols, p.v_strides.row,
                                    head_dim, v_buf.data(), ldv);
        gemm<A>(false, false, rows, head_dim, cols, scores.data(), cols, v_tile, ldv, acc.data(), head_dim, true);
      }

      for (int64_t r = 0; r < rows; ++r) {
        const bool empty = row_sum[r] == A(0);
        T* dst = row_ptr(out, p.out_strides, b, si.q_row0, row_begin + r, h);
        store_row(dst, acc.data() + r * head_dim, head_dim, empty ? A(0) : A(1) / row_sum[r]);
        lse[lse_index(p, si, b, h, row_begin + r)] = empty ? kPosInf<A> : row_max_v[r] + std::log(row_sum[r]);
      }

      if (p.probs == nullptr) continue;
      // Probabilities were asked for: recompute each visible tile against the final lse.
      T* probs = static_cast<T*>(p.probs);
      const ScoreStrides& ps = p.probs_strides;
      for (int64_t col0 = keys.begin; col0 < keys.end; col0 += block_k) {
        const int64_t cols = std::min(block_k, keys.end - col0);
        int64_t ldk = 0;
        const A* k_tile = load_rows(row_ptr(k, p.k_strides, b, si.k_row0, col0, hk), cols, p.k_strides.row,
                                    head_dim, k_buf.data(), ldk);
        gemm<A>(false, true, rows, cols, head_dim, q_tile, ldq, k_tile, ldk, scores.data(), cols, false);
        for (int64_t r = 0; r < rows; ++r) {
          A* s = scores.data() + r * cols;
          const int64_t row = row_begin + r;
          rules.apply(s, cols, row, col0, si, nullptr);
          exp_shift_sum(s, cols, lse[lse_index(p, si, b, h, row)]);
          if (dropout.active) dropout.keep_flags(batch_head, row, col0, cols, keep.data());
          T* dst = probs + b * ps.batch + h * ps.head + row * ps.row + col0 * ps.col;
          for (int64_t j = 0; j < cols; ++j) {
            const bool dropped = dropout.active && !keep[j];
            dst[j * ps.col] = static_cast<T>(dropped ? -s[j] : s[j]);
          }
        }
      }
    }
  });
}

// ---- backward ----

template <typename T>
void bwd_impl(const BwdParams& bp) {
  using A = acc_t<T>;
  const FwdParams& p = bp.fwd;
  const AttentionShape& shape = p.shape;
  const int64_t head_dim = shape.head_dim;
  const int64_t group = shape.nheads_q / shape.nheads_k;
  const int64_t block_q = kBwdTiles.block_q;
  const int64_t block_k = kBwdTiles.block_k;
  const bool varlen = shape.cu_seqlens_q != nullptr;
  // Rows of q over all sequences: dense (batch * seqlen_q), varlen (total_q).
  const int64_t total_rows = varlen ? shape.cu_seqlens_q[shape.batch] : shape.batch * shape.seqlen_q;
  auto global_row = [&](const SeqInfo& si, int64_t b, int64_t row) {
    return varlen ? si.q_row0 + row : b * shape.seqlen_q + row;
  };
  const DropoutRule dropout(p.dropout);
  const T* q = static_cast<const T*>(p.q);
  const T* k = static_cast<const T*>(p.k);
  const T* v = static_cast<const T*>(p.v);
  const T* out = static_cast<const T*>(p.out);
  const T* dout = static_cast<const T*>(bp.dout);
  const A* lse = static_cast<const A*>(p.lse);
  const A* dlse = static_cast<const A*>(bp.dlse);
  const auto acc_options = at::TensorOptions().dtype(c10::CppTypeToScalarType<A>::value);

  // D_i = rowsum(dO * O) - dlse_i: the softmax backward's row term (dlse enters exactly like -D).
  at::Tensor delta = at::empty({shape.nheads_q, total_rows}, acc_options);
  A* delta_data = delta.data_ptr<A>();
  at::parallel_for(0, shape.batch * shape.nheads_q, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / shape.nheads_q, h = bh % shape.nheads_q;
      const SeqInfo si = seq_info(p, b);
      for (int64_t row = 0; row < si.seqlen_q; ++row) {
        const T* o_row = row_ptr(out, p.out_strides, b, si.q_row0, row, h);
        const T* do_row = row_ptr(dout, bp.dout_strides, b, si.q_row0, row, h);
        A dot = 0;
        for (int64_t d = 0; d < head_dim; ++d) dot += static_cast<A>(o_row[d]) * static_cast<A>(do_row[d]);
        if (dlse != nullptr) dot -= dlse[lse_index(p, si, b, h, row)];
        delta_data[h * total_rows + global_row(si, b, row)] = dot;
      }
    }
  });

  // Enough key chunks per (batch, kv head) to give every thread work; each chunk has its own dQ buffer.
  const int64_t max_key_tiles = std::max<int64_t>(1, (shape.seqlen_k + block_k - 1) / block_k);
  const int64_t heads_total = shape.batch * shape.nheads_k;
  const int64_t chunks =
      std::min<int64_t>(max_key_tiles, std::max<int64_t>(1, (at::get_num_threads() + heads_total - 1) / heads_total));
  at::Tensor dq_accum = at::zeros({chunks, shape.nheads_q, total_rows, head_dim}, acc_options);
  A* dq_accum_data = dq_accum.data_ptr<A>();

  at::parallel_for(0, heads_total * chunks, 1, [&](int64_t task_begin, int64_t task_end) {
    std::vector<A> q_buf(block_q * head_dim), do_buf(block_q * head_dim);
    std::vector<A> k_buf(block_k * head_dim), v_buf(block_k * head_dim);
    std::vector<A> dk_acc(block_k * head_dim), dv_acc(block_k * head_dim);
    std::vector<A> probs(block_q * block_k), dprobs(block_q * block_k), dropped_probs(block_q * block_k);
    std::vector<A> tanh_buf(p.softcap > 0 ? block_q * block_k : 0);
    std::vector<uint8_t> keep(block_q * block_k);
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t b = task / (shape.nheads_k * chunks);
      const int64_t hk = (task / chunks) % shape.nheads_k;
      const int64_t chunk = task % chunks;
      const SeqInfo si = seq_info(p, b);
      const int64_t key_tiles = (si.seqlen_k + block_k - 1) / block_k;
      const int64_t tiles_per_chunk = (key_tiles + chunks - 1) / chunks;
      const int64_t tile_end = std::min(key_tiles, (chunk + 1) * tiles_per_chunk);
      A* dq_chunk = dq_accum_data + chunk * shape.nheads_q * total_rows * head_dim;

      for (int64_t tile = chunk * tiles_per_chunk; tile < tile_end; ++tile) {
        const int64_t col0 = tile * block_k;
        const int64_t cols = std::min(block_k, si.seqlen_k - col0);
        int64_t ldk = 0, ldv = 0;
        const A* k_tile = load_rows(row_ptr(k, p.k_strides, b, si.k_row0, col0, hk), cols, p.k_strides.row,
                                    head_dim, k_buf.data(), ldk);
        const A* v_tile = load_rows(row_ptr(v, p.v_strides, b, si.k_row0, col0, hk), cols, p.v_strides.row,
                                    head_dim, v_buf.data(), ldv);
        std::fill(dk_acc.begin(), dk_acc.end(), A(0));
        std::fill(dv_acc.begin(), dv_acc.end(), A(0));

        for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          const ScoreRules<A> rules(p, b, h);
          const int64_t batch_head = b * shape.nheads_q + h;
          for (int64_t row_begin = 0; row_begin < si.seqlen_q; row_begin += block_q) {
            const int64_t rows = std::min(block_q, si.seqlen_q - row_begin);
            const KeyRange keys = tile_keys(p.mask, row_begin, row_begin + rows, si);
            if (keys.begin >= col0 + cols || keys.end <= col0) continue;
            int64_t ldq = 0, lddo = 0;
            const A* q_tile = load_rows(row_ptr(q, p.q_strides, b, si.q_row0, row_begin, h), rows, p.q_strides.row,
                                        head_dim, q_buf.data(), ldq);
            const A* do_tile = load_rows(row_ptr(dout, bp.dout_strides, b, si.q_row0, row_begin, h), rows,
                                         bp.dout_strides.row, head_dim, do_buf.data(), lddo);

            // P = exp(z - lse), recomputed; P_drop = P * keep / (1 - p) is what multiplied V.
            gemm<A>(false, true, rows, cols, head_dim, q_tile, ldq, k_tile, ldk, probs.data(), cols, false);
            for (int64_t r = 0; r < rows; ++r) {
              A* s = probs.data() + r * cols;
              const int64_t row = row_begin + r;
              rules.apply(s, cols, row, col0, si, p.softcap > 0 ? tanh_buf.data() + r * cols : nullptr);
              exp_shift_sum(s, cols, lse[lse_index(p, si, b, h, row)]);
              if (dropout.active) {
                uint8_t* kr = keep.data() + r * cols;
                dropout.keep_flags(batch_head, row, col0, cols, kr);
                A* pd = dropped_probs.data() + r * cols;
                const A inv_keep = static_cast<A>(dropout.inv_keep);
                for (int64_t j = 0; j < cols; ++j) pd[j] = kr[j] ? s[j] * inv_keep : A(0);
              }
            }
            const A* p_used = dropout.active ? dropped_probs.data() : probs.data();
            // dV += P_drop^T dO
            gemm<A>(true, false, cols, head_dim, rows, p_used, cols, do_tile, lddo, dv_acc.data(), head_dim, true);
            // dP = dO V^T, then dZ = P * (dP * keep / (1 - p) - D), dS = dZ * dz/ds.
            gemm<A>(false, true, rows, cols, head_dim, do_tile, lddo, v_tile, ldv, dprobs.data(), cols, false);
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t row = row_begin + r;
              const A delta_r = delta_data[h * total_rows + global_row(si, b, row)];
              const A* pr = probs.data() + r * cols;
              A* dpr = dprobs.data() + r * cols;
              if (dropout.active) {
                const uint8_t* kr = keep.data() + r * cols;
                const A inv_keep = static_cast<A>(dropout.inv_keep);
                for (int64_t j = 0; j < cols; ++j) dpr[j] = kr[j] ? dpr[j] * inv_keep : A(0);
              }
              for (int64_t j = 0; j < cols; ++j) dpr[j] = pr[j] * (dpr[j] - delta_r);
              if (bp.dbias != nullptr) {
                const ScoreStrides& ds = bp.dbias_strides;
                A* dst = static_cast<A*>(bp.dbias) + b * ds.batch + h * ds.head + row * ds.row + col0 * ds.col;
                for (int64_t j = 0; j < cols; ++j) dst[j * ds.col] = dpr[j];
              }
              if (p.softcap > 0) {
                const A* t = tanh_buf.data() + r * cols;
                for (int64_t j = 0; j < cols; ++j) dpr[j] *= rules.scale * (A(1) - t[j] * t[j]);
              } else {
                scale_by(dpr, cols, rules.scale);
              }
            }
            // dK += dS^T Q;  dQ += dS K
            gemm<A>(true, false, cols, head_dim, rows, dprobs.data(), cols, q_tile, ldq, dk_acc.data(), head_dim, true);
            A* dq_rows = dq_chunk + (h * total_rows + global_row(si, b, row_begin)) * head_dim;
            gemm<A>(false, false, rows, head_dim, cols, dprobs.data(), cols, k_tile, ldk, dq_rows, head_dim, true);
          }
        }

        T* dk = static_cast<T*>(bp.dk);
        T* dv = static_cast<T*>(bp.dv);
        for (int64_t c = 0; c < cols; ++c) {
          store_row(row_ptr(dk, bp.dk_strides, b, si.k_row0, col0 + c, hk), dk_acc.data() + c * head_dim, head_dim,
                    A(1));
          store_row(row_ptr(dv, bp.dv_strides, b, si.k_row0, col0 + c, hk), dv_acc.data() + c * head_dim, head_dim,
                    A(1));
        }
      }
    }
  });

  // dQ = sum of the chunk buffers, always in chunk order.
  T* dq = static_cast<T*>(bp.dq);
  at::parallel_for(0, shape.batch * shape.nheads_q, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / shape.nheads_q, h = bh % shape.nheads_q;
      const SeqInfo si = seq_info(p, b);
      for (int64_t row = 0; row < si.seqlen_q; ++row) {
        const int64_t offset = (h * total_rows + global_row(si, b, row)) * head_dim;
        T* dst = row_ptr(dq, bp.dq_strides, b, si.q_row0, row, h);
        for (int64_t d = 0; d < head_dim; ++d) {
          A sum = 0;
          for (int64_t c = 0; c < chunks; ++c) sum += dq_accum_data[c * shape.nheads_q * total_rows * head_dim + offset + d];
          dst[d] = static_cast<T>(sum);
        }
      }
    }
  });
}

}  // namespace

void run_fwd(const FwdParams& params) {
  switch (params.dtype) {
    case DType::kFloat16: return fwd_impl<at::Half>(params);
    case DType::kBFloat16: return fwd_impl<at::BFloat16>(params);
    case DType::kFloat32: return fwd_impl<float>(params);
    case DType::kFloat64: return fwd_impl<double>(params);
  }
}

void run_bwd(const BwdParams& params) {
  switch (params.fwd.dtype) {
    case DType::kFloat16: return bwd_impl<at::Half>(params);
    case DType::kBFloat16: return bwd_impl<at::BFloat16>(params);
    case DType::kFloat32: return bwd_impl<float>(params);
    case DType::kFloat64: return bwd_impl<double>(params);
  }
}

}  // namespace flash::cpu
