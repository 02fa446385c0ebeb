// Online softmax on a warpgroup's 64 x kBlockN score tile (each thread owns 2 rows; a row
// is spread over the 4 threads of a quad), plus element-wise masking for boundary tiles.
#pragma once

#include <cmath>

#include "../common/mask.h"
#include "utils.h"

namespace jax_flash::sm90 {

__forceinline__ __device__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}
__forceinline__ __device__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Softcap before masking: logits become tanh(s * scale / cap); the cap*log2(e) factor is
// folded into scale_log2 so the exp2 step below is the same FFMA+EX2 as without softcap.
template <class TS>
__forceinline__ __device__ void softcap_tile(TS& s, float mult) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) s(i) = tanhf(s(i) * mult);
}

// Element-wise masking with the shared SeqMask interval rule. s/c are rowcol views of the
// scores and of their (row, col) coordinates within the CTA tile. A thread's columns are its
// base column plus compile-time offsets (c's layout is static): bounds are taken relative to
// the base so each column compares as an immediate. Comparing c(r, k) itself made ptxas hoist
// kBlockN / 4 column registers out of the mainloop (the spills of the N = 176 tile, v17).
template <class TS, class TC>
__forceinline__ __device__ void mask_tile(TS& s, TC const& c, SeqMask const& m, int m0, int n0) {
  int const col0 = n0 + int(get<1>(c(0, 0)));
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < size<0>(s); ++r) {
    int lo, hi;  // visible column offsets relative to col0
    m.keys_from(int64_t(m0) + get<0>(c(r, 0)), col0, &lo, &hi);
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < size<1>(s); ++k) {
      int const j = int(get<1>(c.layout()(r, k))) - int(get<1>(c.layout()(0, 0)));
      if (j < lo || j >= hi) s(r, k) = -INFINITY;
    }
  }
}

// Two shapes of the same step (NOTES.md v16): kChains == 1 runs row by row, one serial max and
// sum chain per row, so row 0's exp2s (MUFU) overlap row 1's max chain (ALU): best at H = 128.
// kChains > 1 reduces both rows at once over kChains independent chains and a tree (a single
// chain is latency-bound, ~4 cycles per column): +1-3% at H = 64 and 256, -2% at H = 128.
// kPolyEvery > 0: on tiles without -inf scores, every kPolyEvery-th exp2 of a row runs as a
// polynomial on the FMA pipe (exp2_fma) instead of the MUFU.
// kLazyLog2 > 0 (v64, FA4's conditional rescale): a row keeps its running max until the new max
// exceeds it by more than kLazyLog2 in the exp2 domain, so most steps leave O alone (rescale 1).
// P then reaches at most 2^kLazyLog2, which bf16 / fp16 and the float32 sums hold exactly as
// well; the lse and the final 1 / sum use the same kept max, so the result is the same up to
// rounding.
template <int kRows, int kChains = 1, int kPolyEvery = 0, int kLazyLog2 = 0>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // per-thread partial sums; reduced across the quad in finalize()
  float scale_log2;

  // Updates the running max and turns s into unnormalised probabilities. Returns in
  // `rescale` the factor the O accumulator must be multiplied by.
  // hook(Int<1>{}) runs after the row max, hook(Int<2>{}) after half of the exp2s.
  template <bool Is_first, bool Check_inf, class TS, class Hook>
  __forceinline__ __device__ void step(TS& s, float (&rescale)[kRows], Hook&& hook) {
    constexpr int kCols = decltype(size<1>(s))::value;
    static_assert(kCols % kChains == 0);
    if constexpr (kChains == 1) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        float m = Is_first ? -INFINITY : row_max[r];
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kCols; ++k) m = fmaxf(m, s(r, k));
        float const m_scaled = new_max<Is_first, Check_inf>(r, quad_max(m), rescale);
        if (r == 0) hook(Int<1>{});
        float sum = 0.f;
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kCols; ++k) {
          float p = exp2_at<kPolyEvery, Check_inf>(k, fmaf(s(r, k), scale_log2, -m_scaled));
          s(r, k) = p;
          sum += p;
        }
        add_sum<Is_first>(r, sum, rescale);
        if (r == 0) hook(Int<2>{});
      }
    } else {
      float mx[kRows][kChains];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kChains; ++j) mx[r][j] = s(r, j);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int k = kChains; k < kCols; k += kChains) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kChains; ++j) mx[r][j] = fmaxf(mx[r][j], s(r, k + j));
        }
      }
      float m_scaled[kRows];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        tree<kChains>(mx[r], [](float x, float y) { return fmaxf(x, y); });
        mx[r][0] = quad_max(Is_first ? mx[r][0] : fmaxf(row_max[r], mx[r][0]));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) m_scaled[r] = new_max<Is_first, Check_inf>(r, mx[r][0], rescale);
      hook(Int<1>{});
      float sum[kRows][kChains];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kCols; k += kChains) {
        if (k == kCols / 2) hook(Int<2>{});
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kChains; ++j) {
            float p = exp2_at<kPolyEvery, Check_inf>(k + j, fmaf(s(r, k + j), scale_log2, -m_scaled[r]));
            s(r, k + j) = p;
            sum[r][j] = k == 0 ? p : sum[r][j] + p;
          }
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        tree<kChains>(sum[r], [](float x, float y) { return x + y; });
        add_sum<Is_first>(r, sum[r][0], rescale);
      }
    }
  }

  // Records row r's new max m (already quad-reduced); returns the exp2-domain offset and sets
  // rescale[r], the factor the running O and sum of the row must be multiplied by.
  template <bool Is_first, bool Check_inf>
  __forceinline__ __device__ float new_max(int r, float m, float (&rescale)[kRows]) {
    if constexpr (kLazyLog2 > 0 && !Is_first) {
      // NaN-safe: -inf - -inf and NaN inputs compare false and take the exact path below.
      if ((m - row_max[r]) * scale_log2 <= float(kLazyLog2)) {
        rescale[r] = 1.f;
        return (Check_inf && row_max[r] == -INFINITY) ? 0.f : row_max[r] * scale_log2;
      }
    }
    // A fully masked row keeps max = -inf; use 0 as the offset so exp2 gives 0, not NaN.
    float const m_scaled = (Check_inf && m == -INFINITY) ? 0.f : m * scale_log2;
    rescale[r] = Is_first ? 1.f : ex2(row_max[r] * scale_log2 - m_scaled);
    row_max[r] = m;
    return m_scaled;
  }
  template <bool Is_first>
  __forceinline__ __device__ void add_sum(int r, float sum, float const (&rescale)[kRows]) {
    row_sum[r] = Is_first ? sum : fmaf(row_sum[r], rescale[r], sum);
  }
  // x[0] = op over x[0..n) as a pairwise tree.
  template <int n, class Op>
  static __forceinline__ __device__ void tree(float (&x)[n], Op op) {
    CUTLASS_PRAGMA_UNROLL
    for (int w = n / 2; w >= 1; w /= 2) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < w; ++j) x[j] = op(x[j], x[j + w]);
    }
  }

  // Returns 1/rowsum (0 for empty rows) and the natural-log LSE (-inf for empty rows).
  __forceinline__ __device__ void finalize(float (&inv)[kRows], float (&lse)[kRows]) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float sum = quad_sum(row_sum[r]);
      bool empty = sum == 0.f;  // no visible key; a NaN input makes sum NaN, which propagates
      inv[r] = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? -INFINITY : (row_max[r] * scale_log2 + __log2f(sum)) * 0.69314718055994530942f;
    }
  }
};

// kSkipOnes (v64): the warp skips the multiplies when none of its rows changed its max (every
// factor exactly 1), a warp-uniform branch.
template <bool kSkipOnes = false, class TO, int kRows>
__forceinline__ __device__ void rescale_rows(TO& o_rc, float const (&f)[kRows]) {
  if constexpr (kSkipOnes) {
    bool ones = true;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) ones = ones && f[r] == 1.f;
    if (__all_sync(0xffffffff, ones)) return;
  }
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < kRows; ++r) {
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < size<1>(o_rc); ++k) o_rc(r, k) *= f[r];
  }
}

}  // namespace jax_flash::sm90
