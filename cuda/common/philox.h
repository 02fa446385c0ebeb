// Counter-based random numbers for attention dropout, shared by the CPU and GPU kernels so
// every backend drops the same elements for the same key.
//
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// bijection of a 128-bit counter under a 64-bit key; the output words are uniform uint32.
// Random123's known-answer vectors hold (tests/test_dropout.py checks its numpy twin of this).
//
// Dropout layout. The keep decision of attention-probability element (batch b, q head h,
// query row i, key column j) is a pure function of (seed, b, h, i, j), so it does not depend
// on tiling, threads, GQA grouping or the backend:
//   key     = (seed_lo, seed_hi)            the 64-bit seed
//   counter = (j / 4, i, h, b)              one uint32 each, in Philox word order c0..c3
//   word r of the output decides column j = 4 * (j / 4) + r
// so one Philox call gives the decisions of 4 adjacent key columns (a GPU thread's MMA
// fragment holds adjacent column pairs: two lanes share each call, sm80/extras_sm80.h; a CPU
// row is contiguous).
// Element kept iff word >= threshold, threshold = round(rate * 2^32) (computed once, in
// double, by dropout_threshold), so P(drop) = threshold / 2^32 = rate to within 2^-33; kept
// values are scaled by 1 / (1 - rate). b and h are the per-(batch, head) counter coordinates of
// FlashFwdParams::dropout_keys, not necessarily the buffer's own indices (see there).
#pragma once

#include <cstdint>

#include "flash_params.h"

namespace jax_flash {

namespace philox_detail {

constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;    // round multipliers
constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;  // key schedule increments

JF_HOST_DEVICE uint32_t mulhi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return uint32_t((uint64_t(a) * b) >> 32);
#endif
}

}  // namespace philox_detail

// Philox4x32 with 10 rounds: out = Philox(counter c, key (k0, k1)).
JF_HOST_DEVICE void philox4x32_10(const uint32_t c[4], uint32_t k0, uint32_t k1, uint32_t out[4]) {
  using namespace philox_detail;
  uint32_t x0 = c[0], x1 = c[1], x2 = c[2], x3 = c[3];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = mulhi(kMul0, x0), lo0 = kMul0 * x0;
    const uint32_t hi1 = mulhi(kMul1, x2), lo1 = kMul1 * x2;
    x0 = hi1 ^ x1 ^ k0;
    x1 = lo1;
    x2 = hi0 ^ x3 ^ k1;
    x3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  out[0] = x0, out[1] = x1, out[2] = x2, out[3] = x3;
}

// threshold = round(rate * 2^32) for rate in [0, 1): drop iff the uint32 word < threshold.
JF_HOST_DEVICE uint32_t dropout_threshold(double rate) {
  const double t = rate * 4294967296.0 + 0.5;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : uint32_t(t);
}

// The dropout of one (batch, head) task: its Philox key and counter coordinates.
struct HeadDropout {
  uint32_t seed_lo = 0, seed_hi = 0;  // Philox key
  uint32_t b = 0, h = 0;              // counter words c3, c2
  uint32_t threshold = 0;             // drop iff word < threshold

  // Bit r set iff column 4 * m + r of row i is kept.
  JF_HOST_DEVICE uint32_t keep4(int64_t i, int64_t m) const {
    const uint32_t c[4] = {uint32_t(m), uint32_t(i), h, b};
    uint32_t w[4];
    philox4x32_10(c, seed_lo, seed_hi, w);
    return uint32_t(w[0] >= threshold) | uint32_t(w[1] >= threshold) << 1 | uint32_t(w[2] >= threshold) << 2 |
           uint32_t(w[3] >= threshold) << 3;
  }

  // The keep bits of columns j and j + 1 (j even, bit 0 = column j) out of keep4(i, j / 4): a
  // GPU thread's MMA accumulator holds such column pairs, half of one Philox call each.
  static JF_HOST_DEVICE uint32_t pair_bits(uint32_t keep4_bits, int64_t j) { return keep4_bits >> (j & 2) & 3u; }

  // s[0, n) holds columns [j0, j0 + n) of row i: dropped ones become 0, kept ones are multiplied
  // by kept_scale (1 / (1 - rate), or 1 where the caller folds the scale in later).
  JF_HOST_DEVICE void apply_row(float* s, int64_t i, int64_t j0, int n, float kept_scale) const {
    for (int64_t m = j0 >> 2, m_end = (j0 + n + 3) >> 2; m < m_end; ++m) {
      const uint32_t keep = keep4(i, m);
      for (int r = 0; r < 4; ++r) {
        const int64_t j = 4 * m + r - j0;
        if (j >= 0 && j < n) s[j] = (keep >> r & 1u) ? s[j] * kept_scale : 0.f;
      }
    }
  }
};

// (batch b, q head h)'s dropout, from the per-(batch, head) key table of the params.
// Only valid when p.dropout_keys != nullptr (dropout on).
JF_HOST_DEVICE HeadDropout make_head_dropout(const FlashFwdParams& p, int b, int h) {
  const uint32_t* k = p.dropout_keys + b * p.dropout_batch_stride + h * p.dropout_head_stride;
  HeadDropout d;
  d.seed_lo = k[0];
  d.seed_hi = k[1];
  d.b = k[2];
  d.h = k[3];
  d.threshold = p.dropout_threshold;
  return d;
}

}  // namespace jax_flash
