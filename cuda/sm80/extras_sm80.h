// The optional inputs on register tiles: packed-sequence segment ids and the boolean mask
// (element-wise visibility, ElemMask), the additive bias (BiasView) and the bias gradient, and
// attention dropout (HeadDropout). The rules themselves live in common/mask.h and
// common/philox.h, shared with the CPU backend; this file only maps them onto the m16n8
// accumulator layout (rows spread over lane / 4, column pairs over lane % 4).
//
// Cost model: the kernels test one uniform flag per tile (p.q_segment_ids / p.mask / p.bias /
// p.dropout_keys), so calls without these inputs run the same loop as before; with segment ids
// every tile is classified (two warp-wide min/max reductions of the ids, tiles of disjoint
// segments are skipped whole); a boolean mask is tested element-wise on every tile (no tile is
// skipped for it); a bias is read element by element (through its broadcast strides) on every
// tile; dropout costs one Philox4x32-10 call per 4 elements of every tile.
#pragma once

#include <climits>
#include <type_traits>

#include "../common/mask.h"
#include "../common/dropout_frag.h"
#include "softmax_sm80.h"
#include "utils_sm80.h"

namespace jax_flash {
namespace sm80 {

// Smallest and largest of ids[begin, end), computed by the whole warp (every lane must call
// it; all lanes get the result). An empty range gives lo > hi.
__device__ __forceinline__ void warp_id_range(const int32_t* ids, int begin, int end, int32_t& lo, int32_t& hi) {
  const int lane = threadIdx.x % 32;
  int32_t a = INT_MAX, z = INT_MIN;
  for (int i = begin + lane; i < end; i += 32) {
    const int32_t x = ids[i];
    a = min(a, x);
    z = max(z, x);
  }
  CUTE_UNROLL
  for (int s = 16; s > 0; s /= 2) {
    a = min(a, __shfl_xor_sync(0xffffffff, a, s));
    z = max(z, __shfl_xor_sync(0xffffffff, z, s));
  }
  lo = a;
  hi = z;
}

// apply_mask (softmax_sm80.h) plus the element-wise rules: segment ids and the boolean mask.
// The interval test runs first, so ElemMask is only read in bounds.
template <typename T, typename C>
__device__ __forceinline__ void apply_mask_elem(T& rc, C const& crc, SeqMask const& mask, ElemMask const& elem,
                                                int row0, int col0) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(rc); ++mi) {
    const int64_t r = row0 + get<0>(crc(mi, 0));
    int lo, hi;
    row_interval(mask, r, col0, lo, hi);
    const ElemMask::Row row = elem.row(r < mask.q_len ? r : 0);  // rows past q_len: lo = hi = 0
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(rc); ++ni) {
      const int c = get<1>(crc(0, ni));
      if (c < lo || c >= hi || !row.visible(int64_t(col0) + c)) rc(mi, ni) = -INFINITY;
    }
  }
}

// Bias elements of one dtype: float32 or 16-bit words widened with common/dtype.h.
template <DType kDt>
using BiasStorage = std::conditional_t<kDt == DType::kFloat32, float, uint16_t>;
template <DType kDt>
__device__ __forceinline__ float widen(BiasStorage<kDt> x) {
  if constexpr (kDt == DType::kFloat32) return x;
  else if constexpr (kDt == DType::kBFloat16) return bf16_to_float(x);
  else return fp16_to_float(x);
}

// The bias at tile origin (row0, col0) of (b, h) (BiasView: the broadcast strides, shared with
// the CPU), as the dtype's storage. Tile element (r, c) is at r * row_stride + c * col_stride;
// col_stride is 1 or 0 (broadcast over keys), so a row pointer plus the column addresses the
// element without 64-bit index math per element (registers are scarce in these kernels).
template <DType kDt>
__device__ __forceinline__ const BiasStorage<kDt>* bias_tile(BiasView const& bias, int row0, int col0) {
  return static_cast<const BiasStorage<kDt>*>(bias.ptr) + int64_t(row0) * bias.row_stride +
         int64_t(col0) * bias.col_stride;
}

// Forward: logits s (units of scale_nat: raw q.k, or tanh(...) under softcap) -> natural-log
// logits plus the bias. Elements past the sequence ends (rows >= rows, cols >= cols of the
// tile) read no bias: they are masked anyway.
template <DType kDt, typename T, typename C>
__device__ __forceinline__ void add_bias_t(T& rc, C const& crc, BiasView const& bias, int row0, int col0, int rows,
                                           int cols, float scale_nat) {
  const BiasStorage<kDt>* base = bias_tile<kDt>(bias, row0, col0);
  const bool per_key = bias.col_stride != 0;
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(rc); ++mi) {
    const int r = get<0>(crc(mi, 0));
    const BiasStorage<kDt>* row = base + int64_t(r < rows ? r : 0) * bias.row_stride;
    const float row_bias = (!per_key && r < rows) ? widen<kDt>(row[0]) : 0.f;
    CUTE_UNROLL
    for (int ni = 0; ni < size<1>(rc); ++ni) {
      const int c = get<1>(crc(0, ni));
      const float bv = per_key ? ((r < rows && c < cols) ? widen<kDt>(row[c]) : 0.f) : row_bias;
      rc(mi, ni) = fmaf(rc(mi, ni), scale_nat, bv);
    }
  }
}

template <typename T, typename C>
__device__ __forceinline__ void add_bias(T& rc, C const& crc, BiasView const& bias, int row0, int col0, int rows,
                                         int cols, float scale_nat) {
  switch (bias.dtype) {
    case DType::kFloat32: add_bias_t<DType::kFloat32>(rc, crc, bias, row0, col0, rows, cols, scale_nat); break;
    case DType::kBFloat16: add_bias_t<DType::kBFloat16>(rc, crc, bias, row0, col0, rows, cols, scale_nat); break;
    default: add_bias_t<DType::kFloat16>(rc, crc, bias, row0, col0, rows, cols, scale_nat); break;
  }
}

// Backward: dS w.r.t. the final logit (the bias's gradient) of one tile, summed into the float32
// dbias (zeroed by the launcher) over the bias's broadcast axes. A key- or query-broadcast bias
// is pre-reduced in registers and across the lanes sharing a row / column, so one atomic per
// warp and row (or column) remains. The float atomics make the sum order-dependent whenever an
// element has several contributors (dbias_is_reduced); a full-size dbias gets exactly one add
// onto zero per element, which is exact.
template <int kRows, int kCols>
struct DbiasTile {
  enum Mode { kElem = 0, kOverRows = 1, kOverCols = 2, kOverBoth = 3 };
  float* base;  // dbias at (b, h); nullptr = no dbias
  int64_t row_stride, col_stride;
  int mode;
  float rows_acc[kRows];
  float cols_acc[kCols];

  __device__ __forceinline__ DbiasTile(const FlashBwdParams& p, int b, int h)
      : base(p.dbias ? p.dbias + dbias_offset(p, b, h) : nullptr),
        row_stride(p.dbias_row_stride),
        col_stride(p.dbias_col_stride),
        mode((row_stride == 0 ? kOverRows : 0) | (col_stride == 0 ? kOverCols : 0)) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) rows_acc[i] = 0.f;
    CUTE_UNROLL
    for (int i = 0; i < kCols; ++i) cols_acc[i] = 0.f;
  }

  // dbias row r (a sequence row < seqlen_q) from key 0; kElem mode only (then col_stride is 1).
  __device__ __forceinline__ float* row_ptr(int64_t r) const { return base + r * row_stride; }
  // (mi, ni): register coordinates; row: row_ptr of the element's row, c: its key (may be past
  // the ends, !in_bounds: ds is 0 there and nothing is written).
  __device__ __forceinline__ void add(int mi, int ni, float* row, int64_t c, bool in_bounds, float ds) {
    if (mode == kElem) {
      if (in_bounds) atomicAdd(row + c, ds);
    } else if (mode == kOverRows) {
      cols_acc[ni] += ds;
    } else {
      rows_acc[mi] += ds;  // kOverCols and kOverBoth (summed over rows in flush)
    }
  }

  // After the tile: the lane reductions and the remaining atomics. crc: (rows, cols) tile
  // coordinates; rows/cols: valid extent of the tile. Every lane calls it (shuffles).
  template <typename C>
  __device__ __forceinline__ void flush(C const& crc, int row0, int col0, int rows, int cols) {
    const int lane = threadIdx.x % 32;
    if (mode == kOverRows) {
      CUTE_UNROLL
      for (int ni = 0; ni < kCols; ++ni) {
        float v = cols_acc[ni];
        v += __shfl_xor_sync(0xffffffff, v, 4);
        v += __shfl_xor_sync(0xffffffff, v, 8);
        v += __shfl_xor_sync(0xffffffff, v, 16);
        const int c = get<1>(crc(0, ni));
        if (lane < 4 && c < cols) atomicAdd(base + int64_t(col0 + c) * col_stride, v);
        cols_acc[ni] = 0.f;
      }
    } else if (mode == kOverCols) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        float v = quad_sum(rows_acc[mi]);
        const int r = get<0>(crc(mi, 0));
        if (lane % 4 == 0 && r < rows) atomicAdd(base + int64_t(row0 + r) * row_stride, v);
        rows_acc[mi] = 0.f;
      }
    } else if (mode == kOverBoth) {
      float v = 0.f;
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        v += rows_acc[mi];
        rows_acc[mi] = 0.f;
      }
      CUTE_UNROLL
      for (int s = 16; s > 0; s /= 2) v += __shfl_xor_sync(0xffffffff, v, s);
      if (lane == 0) atomicAdd(base, v);
    }
  }
};

// Backward, with a bias: P = exp2(t * scale_log2 + bias * log2(e) - lse_l2) and dS = P (dP - D)
// of one tile in place (s_rc: t -> P, dp_rc: dP -> dS), dS before the softcap chain rule added
// into dbias. The dtype is a template parameter (dispatched once per tile).
template <DType kDt, int kRows, int kCols, typename TS, typename TP, typename C>
__device__ __forceinline__ void bias_probs_grads_t(TS& s_rc, TP& dp_rc, C const& crc, BiasView const& bias,
                                                   DbiasTile<kRows, kCols>& dbias, int row0, int col0, int rows, int cols,
                                                   float scale_log2, const float* lse_l2, const float* dsum_r,
                                                   bool softcap_on) {
  const BiasStorage<kDt>* base = bias_tile<kDt>(bias, row0, col0);
  const bool per_key = bias.col_stride != 0;
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) {
    const int r = get<0>(crc(mi, 0));
    const int rr = r < rows ? r : 0;
    const BiasStorage<kDt>* row = base + int64_t(rr) * bias.row_stride;
    float* drow = dbias.base && dbias.mode == dbias.kElem ? dbias.row_ptr(int64_t(row0) + rr) + col0 : nullptr;
    const float row_bias = (!per_key && r < rows) ? widen<kDt>(row[0]) * kLog2e : 0.f;
    CUTE_UNROLL
    for (int ni = 0; ni < kCols; ++ni) {
      const int c = get<1>(crc(0, ni));
      const bool in_bounds = r < rows && c < cols;
      const float bias_l2 = per_key ? (in_bounds ? widen<kDt>(row[c]) * kLog2e : 0.f) : row_bias;
      const float t = s_rc(mi, ni);
      float pv = fast_exp2(fmaf(t, scale_log2, bias_l2 - lse_l2[mi]));
      pv = t == -INFINITY ? 0.f : pv;
      float ds = pv * (dp_rc(mi, ni) - dsum_r[mi]);
      if (dbias.base) dbias.add(mi, ni, drow, c, in_bounds, ds);
      if (softcap_on) ds = t == -INFINITY ? 0.f : ds * (1.f - t * t);
      s_rc(mi, ni) = pv;
      dp_rc(mi, ni) = ds;
    }
  }
  if (dbias.base) dbias.flush(crc, row0, col0, rows, cols);
}

template <int kRows, int kCols, typename TS, typename TP, typename C>
__device__ __forceinline__ void bias_probs_grads(TS& s_rc, TP& dp_rc, C const& crc, BiasView const& bias,
                                                 DbiasTile<kRows, kCols>& dbias, int row0, int col0, int rows, int cols,
                                                 float scale_log2, const float* lse_l2, const float* dsum_r,
                                                 bool softcap_on) {
  switch (bias.dtype) {
    case DType::kFloat32:
      bias_probs_grads_t<DType::kFloat32>(s_rc, dp_rc, crc, bias, dbias, row0, col0, rows, cols, scale_log2, lse_l2,
                                          dsum_r, softcap_on);
      break;
    case DType::kBFloat16:
      bias_probs_grads_t<DType::kBFloat16>(s_rc, dp_rc, crc, bias, dbias, row0, col0, rows, cols, scale_log2, lse_l2,
                                           dsum_r, softcap_on);
      break;
    default:
      bias_probs_grads_t<DType::kFloat16>(s_rc, dp_rc, crc, bias, dbias, row0, col0, rows, cols, scale_log2, lse_l2,
                                          dsum_r, softcap_on);
      break;
  }
}

}  // namespace sm80
}  // namespace jax_flash
