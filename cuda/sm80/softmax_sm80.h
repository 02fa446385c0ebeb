// Online softmax and masking on register tiles (rows spread over the 4 lanes of a quad).
#pragma once

#include "utils_sm80.h"
#include "../common/mask.h"

namespace jax_flash {
namespace sm80 {

// Visible columns [lo, hi) of sequence row r from the interval rule, relative to col0.
__device__ __forceinline__ void row_interval(SeqMask const& mask, int64_t r, int col0, int& lo, int& hi) {
  lo = 0;
  hi = 0;
  if (r < mask.q_len) {
    int64_t l = mask.key_lo(r) - col0, h = mask.key_hi(r) - col0;
    lo = int(max(int64_t(-1), min(l, int64_t(1 << 20))));
    hi = int(max(int64_t(-1), min(h, int64_t(1 << 20))));
  }
}

// Row mi of this thread's accumulator sees the tile columns [lo, hi): -inf elsewhere.
template <typename T, typename C>
__device__ __forceinline__ void mask_row_outside(T& rc, C const& crc, int mi, int lo, int hi) {
  CUTE_UNROLL
  for (int ni = 0; ni < size<1>(rc); ++ni) {
    const int c = get<1>(crc(0, ni));
    if (c < lo || c >= hi) rc(mi, ni) = -INFINITY;
  }
}

// Set logits of invisible (row, key) pairs to -inf. Only called on boundary tiles; interior
// tiles are known visible from SeqMask::tile_full. rc/crc: (rows, cols) views of the
// accumulator and of its tile coordinates; row0/col0: tile origin in the sequence.
// (extras_sm80.h: apply_mask_elem adds segment ids and the boolean mask.)
template <typename T, typename C>
__device__ __forceinline__ void apply_mask(T& rc, C const& crc, SeqMask const& mask, int row0, int col0) {
  CUTE_UNROLL
  for (int mi = 0; mi < size<0>(rc); ++mi) {
    const int64_t r = row0 + get<0>(crc(mi, 0));
    int lo, hi;  // visible columns of this row, relative to col0
    row_interval(mask, r, col0, lo, hi);
    mask_row_outside(rc, crc, mi, lo, hi);
  }
}

// apply_mask with the rows' visible keys precomputed: row mi of this thread sees the absolute
// keys [key_lo[mi], key_hi[mi]) (both in [0, kv_len]; empty for rows past q_len).
template <typename T, typename C, int kRows>
__device__ __forceinline__ void apply_mask_rows(T& rc, C const& crc, const int (&key_lo)[kRows],
                                                const int (&key_hi)[kRows], int col0) {
  static_assert(decltype(size<0>(rc))::value == kRows);
  CUTE_UNROLL
  for (int mi = 0; mi < kRows; ++mi) mask_row_outside(rc, crc, mi, key_lo[mi] - col0, key_hi[mi] - col0);
}

// Running max / sum per accumulator row of this thread.
// kLazyLog2 > 0 (sm90 NOTES.md v64, FA4's conditional rescale): a row keeps its running max until
// the tile's max exceeds it by more than kLazyLog2 in the exp2 domain, so P stays below
// 2^kLazyLog2 and most tiles leave O alone; the warp skips the multiplies when no row of it moved.
// 8 everywhere (0 is the exact rescale): +0.3-1% at H=128 bf16 4k / 8k (NOTES.md, session 25).
template <int kRows, int kLazyLog2 = 8>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];

  __device__ __forceinline__ void init() {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) { row_max[i] = -INFINITY; row_sum[i] = 0.f; }
  }

  // s: (rows, cols) logits of this tile, replaced by unnormalised probabilities.
  // o: (rows, cols) output accumulator, rescaled when the running max grows.
  template <typename S, typename O>
  __device__ __forceinline__ void update(S& s, O& o, float scale_log2) {
    static_assert(decltype(size<0>(s))::value == kRows);
    float corr[kRows];
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      float cur = row_max[mi];
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) cur = fmaxf(cur, s(mi, ni));
      cur = quad_max(cur);
      float ms;
      corr[mi] = 1.f;
      // Lazy: keep the max (NaN-safe: -inf - -inf and NaN compare false and take the exact path).
      if (kLazyLog2 > 0 && (cur - row_max[mi]) * scale_log2 <= float(kLazyLog2)) {
        ms = row_max[mi] * scale_log2;  // finite here: cur > -inf would give an infinite gap
      } else {
        // A row with nothing visible yet keeps max -inf; use 0 so exp2(-inf - 0) = 0, not NaN.
        ms = (cur == -INFINITY ? 0.f : cur) * scale_log2;
        corr[mi] = fast_exp2(row_max[mi] * scale_log2 - ms);
        row_max[mi] = cur;
      }
      row_sum[mi] *= corr[mi];
      float sum = 0.f;
      CUTE_UNROLL
      for (int ni = 0; ni < size<1>(s); ++ni) {
        const float e = fast_exp2(fmaf(s(mi, ni), scale_log2, -ms));
        s(mi, ni) = e;
        sum += e;
      }
      row_sum[mi] += sum;
    }
    // O's multiplies behind one warp-uniform test (ptxas predicates them rather than branch).
    bool moved = false;
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) moved = moved || corr[mi] != 1.f;
    if (__any_sync(0xffffffff, moved)) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int di = 0; di < size<1>(o); ++di) o(mi, di) *= corr[mi];
      }
    }
  }

  // Normalise o (times o_scale: dropout's 1 / (1 - rate)); lse_out[mi] = natural-log logsumexp
  // (scale_nat: logit units per max unit).
  template <typename O>
  __device__ __forceinline__ void finalize(O& o, float scale_nat, float* lse_out, float o_scale = 1.f) {
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const float sum = quad_sum(row_sum[mi]);
      // No visible key: out = 0, lse = -inf. A NaN input makes sum NaN, which propagates.
      const bool empty = sum == 0.f;
      const float inv = empty ? 0.f : o_scale / sum;
      lse_out[mi] = empty ? -INFINITY : row_max[mi] * scale_nat + logf(sum);
      CUTE_UNROLL
      for (int di = 0; di < size<1>(o); ++di) o(mi, di) *= inv;
    }
  }
};

}  // namespace sm80
}  // namespace jax_flash
