// Masking and logit rules shared by the CPU and GPU kernels, so every backend computes
// the same function.
//
// Every supported mask (lengths, causal in either alignment, sliding window) leaves each
// query row a single contiguous interval of visible keys [lo, hi), and lo/hi never
// decrease as the row grows. Kernels use the interval to skip whole tiles and to decide
// which tiles need element-wise masking.
#pragma once

#include <cmath>
#include <cstdint>

#include "flash_params.h"

namespace jax_flash {

// The mask of one (batch) sequence pair.
struct SeqMask {
  int q_len;       // valid query rows
  int kv_len;      // valid key rows
  int64_t offset;  // query row i sits at key position i + offset
  int left;        // -1 = unbounded
  int right;       // -1 = unbounded

  // First visible key of row i (may be >= hi: the row is empty).
  JF_HOST_DEVICE int64_t key_lo(int64_t i) const {
    if (left < 0) return 0;
    int64_t lo = i + offset - left;
    return lo < 0 ? 0 : lo;
  }
  // One past the last visible key of row i.
  JF_HOST_DEVICE int64_t key_hi(int64_t i) const {
    int64_t hi = kv_len;
    if (right >= 0) {
      int64_t r = i + offset + right + 1;
      if (r < hi) hi = r;
    }
    return hi < 0 ? 0 : hi;
  }
  JF_HOST_DEVICE bool visible(int64_t i, int64_t j) const {
    return i < q_len && j >= key_lo(i) && j < key_hi(i);
  }
  // Keys any row of [row_begin, row_end) can see: [lo, hi). Empty when hi <= lo.
  JF_HOST_DEVICE void key_range(int64_t row_begin, int64_t row_end, int64_t* lo, int64_t* hi) const {
    int64_t last = (row_end < q_len ? row_end : q_len) - 1;
    if (last < row_begin) { *lo = 0; *hi = 0; return; }
    *lo = key_lo(row_begin);
    *hi = key_hi(last);
  }
  // Rows that can see any key of [key_begin, key_end): [lo, hi). Used by backward kernels
  // that iterate over query blocks for a fixed key block.
  JF_HOST_DEVICE void row_range(int64_t key_begin, int64_t key_end, int64_t* lo, int64_t* hi) const {
    int64_t kend = key_end < kv_len ? key_end : kv_len;
    if (kend <= key_begin) { *lo = 0; *hi = 0; return; }
    // Row i sees key j iff j - offset - right <= i (right bound) and i <= j - offset + left.
    int64_t r_lo = 0;
    if (right >= 0) { r_lo = key_begin - offset - right; if (r_lo < 0) r_lo = 0; }
    int64_t r_hi = q_len;
    if (left >= 0) { int64_t h = kend - 1 - offset + left + 1; if (h < r_hi) r_hi = h; }
    if (r_hi < 0) r_hi = 0;
    *lo = r_lo; *hi = r_hi;
  }
  // True when every (i, j) in the tile is visible, so element-wise masking can be skipped.
  JF_HOST_DEVICE bool tile_full(int64_t r0, int64_t r1, int64_t k0, int64_t k1) const {
    if (r1 > q_len) return false;
    return key_lo(r1 - 1) <= k0 && key_hi(r0) >= k1;
  }
};

JF_HOST_DEVICE SeqMask make_seq_mask(const FlashFwdParams& p, int b) {
  SeqMask m;
  m.q_len = p.q_lens ? p.q_lens[b] : p.seqlen_q;
  m.kv_len = p.kv_lens ? p.kv_lens[b] : p.seqlen_k;
  if (m.q_len > p.seqlen_q) m.q_len = p.seqlen_q;
  if (m.q_len < 0) m.q_len = 0;
  if (m.kv_len > p.seqlen_k) m.kv_len = p.seqlen_k;
  if (m.kv_len < 0) m.kv_len = 0;
  m.offset = p.q_offset + (p.bottom_right ? int64_t(m.kv_len) - int64_t(m.q_len) : 0);
  m.left = p.window_left;
  m.right = p.window_right;
  return m;
}

// Logit transform applied before masking. Returns the logit in natural-log units.
JF_HOST_DEVICE float apply_softcap(float s, float softcap) {
  return softcap > 0.f ? softcap * tanhf(s / softcap) : s;
}
// d(softcapped logit)/d(raw scaled logit), given the softcapped value.
JF_HOST_DEVICE float softcap_grad(float capped, float softcap) {
  if (softcap <= 0.f) return 1.f;
  float t = capped / softcap;
  return 1.f - t * t;
}

}  // namespace jax_flash
