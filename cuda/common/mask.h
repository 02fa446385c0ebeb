// Masking and logit rules shared by the CPU and GPU kernels, so every backend computes
// the same function. The logit of (i, j) is softcap(scale * q_i.k_j) + bias_ij; it is -inf
// unless j is visible to i under SeqMask (interval) and ElemMask (segment ids, boolean mask).
//
// Every interval mask (lengths, causal in either alignment, sliding window) leaves each
// query row a single contiguous interval of visible keys [lo, hi), and lo/hi never
// decrease as the row grows. Kernels use the interval to skip whole tiles and to decide
// which tiles need element-wise masking.
#pragma once

#include <cmath>
#include <cstdint>

#include "dtype.h"
#include "flash_params.h"

namespace jax_flash {

// SeqMask of one tile relative to its origin (row0, key0), in 32-bit arithmetic: row row0 + c
// sees key key0 + d iff visible(c, d), for 0 <= c, d < 2^20 (offsets inside a tile). With the
// kernels' per-thread base folded in, each element costs two compares against immediates
// instead of SeqMask::visible's 64-bit interval (NOTES.md v77). Bounds are clamped to +-2^21,
// which keeps every comparison of in-tile offsets exact.
struct TileMask {
  int lo;  // d - c >= lo: the left (window) bound
  int hi;  // d - c < hi: the right (causal / window) bound
  int kv;  // d < kv: keys before kv_len
  int q;   // c < q: rows before q_len
  JF_HOST_DEVICE bool visible(int c, int d) const { return c < q && d < kv && d - c >= lo && d - c < hi; }
  // The same mask for offsets from (c0, d0): visible(c0 + c, d0 + d) == from(c0, d0).visible(c, d).
  // A kernel thread shifts once to its own first element, so that each of its elements compares
  // compile-time offsets against registers.
  JF_HOST_DEVICE TileMask from(int c0, int d0) const { return {lo - (d0 - c0), hi - (d0 - c0), kv - d0, q - c0}; }
};

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
  // The tile mask of origin (row0, key0), key0 >= 0 (see TileMask).
  JF_HOST_DEVICE TileMask tile_mask(int64_t row0, int64_t key0) const {
    auto clamp = [](int64_t x) { return int(x < -(1 << 21) ? -(1 << 21) : x > (1 << 21) ? (1 << 21) : x); };
    TileMask t;
    t.lo = left < 0 ? -(1 << 21) : clamp(row0 + offset - left - key0);
    t.hi = right < 0 ? (1 << 21) : clamp(row0 + offset + right + 1 - key0);
    t.kv = clamp(kv_len - key0);
    t.q = clamp(q_len - row0);
    return t;
  }
  // Row i's visible keys as offsets from key k0: for 0 <= d < 2^20, key k0 + d is visible iff
  // lo <= d < hi. Clamped to [-1, 2^20] so a tile's element offsets compare as small ints
  // (compile-time immediates in the kernels' element-wise masks); rows past q_len give lo > hi.
  JF_HOST_DEVICE void keys_from(int64_t i, int64_t k0, int* lo, int* hi) const {
    if (i >= q_len) { *lo = 1; *hi = 0; return; }
    int64_t const l = key_lo(i) - k0, h = key_hi(i) - k0;
    *lo = int(l < -1 ? -1 : (l > 1 << 20 ? 1 << 20 : l));
    *hi = int(h < -1 ? -1 : (h > 1 << 20 ? 1 << 20 : h));
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
  // tile_full hoisted out of a loop over tiles. Keys: for rows [r0, r1) (r1 <= q_len), the tile
  // with keys [k0, k1) is full iff lo <= k0 && k1 <= hi. Rows: for keys [k0, k1) (0 <= k0 < k1),
  // the tile with rows [r0, r1) is full iff lo <= r0 && r1 <= hi. Both clamped to int ranges
  // ([0, kv_len], [0, q_len]); lo >= hi means no tile is full.
  JF_HOST_DEVICE void full_keys(int64_t r0, int64_t r1, int* lo, int* hi) const {
    int64_t const l = key_lo(r1 - 1), h = key_hi(r0);  // key_hi is within [0, kv_len]
    *hi = r1 > q_len ? 0 : int(h);
    *lo = l < *hi ? int(l) : *hi;
  }
  JF_HOST_DEVICE void full_rows(int64_t k0, int64_t k1, int* lo, int* hi) const {
    // Row i sees all of [k0, k1) iff key_lo(i) <= k0, i.e. i <= k0 + left - offset, and
    // key_hi(i) >= k1, i.e. k1 <= kv_len and i >= k1 - 1 - right - offset.
    int64_t l = 0, h = k1 > kv_len ? 0 : q_len;
    if (right >= 0 && k1 - 1 - right - offset > l) l = k1 - 1 - right - offset;
    if (left >= 0 && k0 + left - offset + 1 < h) h = k0 + left - offset + 1;
    *hi = h < 0 ? 0 : int(h);
    *lo = l < *hi ? int(l) : *hi;
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

// The element-wise rules beyond SeqMask's interval, for one (batch, head): packed-sequence
// segment ids and a boolean mask. They can leave a row any set of keys, so kernels test them
// per element, after the interval rule; segment-id ranges still let whole tiles be skipped.
struct ElemMask {
  const int32_t* q_seg = nullptr;   // this batch's query segment ids (row i: q_seg[i]), or nullptr
  const int32_t* kv_seg = nullptr;  // this batch's key segment ids
  const uint8_t* mask = nullptr;    // this (batch, head)'s mask; (i, j) at i * row_stride + j * col_stride
  int64_t mask_row_stride = 0, mask_col_stride = 0;

  // The rules of one query row i, hoisted out of a loop over keys.
  struct Row {
    int32_t seg;              // q_seg[i] (when q_seg is set)
    const int32_t* kv_seg;    // nullptr = no segment ids
    const uint8_t* mask;      // row i of the mask, or nullptr
    int64_t mask_col_stride;
    JF_HOST_DEVICE bool visible(int64_t j) const {
      if (kv_seg && seg != kv_seg[j]) return false;
      return !mask || mask[j * mask_col_stride] != 0;
    }
  };

  JF_HOST_DEVICE bool active() const { return q_seg != nullptr || mask != nullptr; }
  JF_HOST_DEVICE Row row(int64_t i) const {
    return Row{q_seg ? q_seg[i] : 0, q_seg ? kv_seg : nullptr, mask ? mask + i * mask_row_stride : nullptr,
               mask_col_stride};
  }
  JF_HOST_DEVICE bool visible(int64_t i, int64_t j) const { return row(i).visible(j); }
};

JF_HOST_DEVICE ElemMask make_elem_mask(const FlashFwdParams& p, int b, int h) {
  ElemMask e;
  if (p.q_segment_ids) {
    e.q_seg = p.q_segment_ids + b * p.q_seg_batch_stride;
    e.kv_seg = p.kv_segment_ids + b * p.kv_seg_batch_stride;
  }
  if (p.mask) {
    e.mask = p.mask + b * p.mask_batch_stride + h * p.mask_head_stride;
    e.mask_row_stride = p.mask_row_stride;
    e.mask_col_stride = p.mask_col_stride;
  }
  return e;
}

// Smallest and largest segment id over [begin, end) (end > begin).
JF_HOST_DEVICE void segment_range(const int32_t* ids, int64_t begin, int64_t end, int32_t* lo, int32_t* hi) {
  int32_t a = ids[begin], z = ids[begin];
  for (int64_t i = begin + 1; i < end; ++i) {
    a = ids[i] < a ? ids[i] : a;
    z = ids[i] > z ? ids[i] : z;
  }
  *lo = a;
  *hi = z;
}

// How a (rows x keys) tile relates to the mask, so kernels can skip it or drop per-element tests.
enum class TileKind { kSkip, kFull, kPartial };

// The decision of classify_tile from the segment-id ranges of the tile's rows [qlo, qhi] and
// keys [klo, khi] (ignored without segment ids). Disjoint id ranges share no segment (skip);
// one id on both sides means every pair matches. Packed sequences have sorted ids, so most
// off-diagonal tiles are skipped. A boolean mask is never "full" (no tile is skipped for it).
JF_HOST_DEVICE TileKind classify_ranges(bool interval_full, bool has_mask, bool has_seg, int32_t qlo, int32_t qhi,
                                        int32_t klo, int32_t khi) {
  bool full = interval_full && !has_mask;
  if (has_seg) {
    if (qhi < klo || khi < qlo) return TileKind::kSkip;
    full = full && qlo == qhi && klo == khi;
  }
  return full ? TileKind::kFull : TileKind::kPartial;
}

// interval_full: SeqMask::tile_full of the tile (rows [r0, r1), keys [k0, k1)). GPU kernels
// compute the id ranges warp-cooperatively and call classify_ranges directly.
JF_HOST_DEVICE TileKind classify_tile(const ElemMask& e, bool interval_full, int64_t r0, int64_t r1, int64_t k0,
                                      int64_t k1) {
  int32_t qlo = 0, qhi = 0, klo = 0, khi = 0;
  if (e.q_seg) {
    segment_range(e.q_seg, r0, r1, &qlo, &qhi);
    segment_range(e.kv_seg, k0, k1, &klo, &khi);
  }
  return classify_ranges(interval_full, e.mask != nullptr, e.q_seg != nullptr, qlo, qhi, klo, khi);
}

// Where (batch b, head h)'s bias / dbias rows start; broadcast axes have stride 0.
JF_HOST_DEVICE int64_t bias_offset(const FlashFwdParams& p, int b, int h) {
  return b * p.bias_batch_stride + h * p.bias_head_stride;
}
JF_HOST_DEVICE int64_t dbias_offset(const FlashBwdParams& p, int b, int h) {
  return b * p.dbias_batch_stride + h * p.dbias_head_stride;
}

// The bias of one (batch, head): element (i, j) through the broadcast strides (never expanded).
struct BiasView {
  const void* ptr = nullptr;  // at (b, h); nullptr = no bias
  DType dtype = DType::kFloat32;
  int64_t row_stride = 0, col_stride = 0;
  JF_HOST_DEVICE float at(int64_t i, int64_t j) const {
    return load_float(ptr, dtype, i * row_stride + j * col_stride);
  }
};
JF_HOST_DEVICE BiasView make_bias_view(const FlashFwdParams& p, int b, int h) {
  BiasView v;
  if (p.bias) {
    v.ptr = static_cast<const char*>(p.bias) +
            bias_offset(p, b, h) * bias_elem_bytes(p);
    v.dtype = p.bias_dtype;
    v.row_stride = p.bias_row_stride;
    v.col_stride = p.bias_col_stride;
  }
  return v;
}

// The dbias buffer's own extents: the bias's shape, 1 along each broadcast (stride-0) axis.
struct DbiasExtents {
  int batch, heads;
  int64_t rows, cols;
  JF_HOST_DEVICE explicit DbiasExtents(const FlashBwdParams& p)
      : batch(p.dbias_batch_stride ? p.batch : 1),
        heads(p.dbias_head_stride ? p.heads_q : 1),
        rows(p.dbias_row_stride ? p.seqlen_q : 1),
        cols(p.dbias_col_stride ? p.seqlen_k : 1) {}
  JF_HOST_DEVICE int64_t elements() const { return int64_t(batch) * heads * rows * cols; }
};

// Elements of the (broadcast-shaped) float32 dbias buffer: what is zeroed before the sum.
JF_HOST_DEVICE int64_t dbias_elements(const FlashBwdParams& p) { return DbiasExtents(p).elements(); }

// True when two (batch, kv head) work items of a backward that owns one kv head per item
// would add into the same dbias element (the bias is broadcast across them), so dbias must be
// reduced in a separate pass rather than written by the item that computes dS.
JF_HOST_DEVICE bool dbias_shared_across_kv_heads(const FlashBwdParams& p) {
  return (p.dbias_batch_stride == 0 && p.batch > 1) || (p.dbias_head_stride == 0 && p.heads_kv > 1);
}

// True when some dbias element sums dS over more than one (batch, head, row, key): the bias is
// broadcast over an axis of size > 1. The GPU backward then adds into dbias with float atomics
// in no fixed order, so it refuses deterministic=True for such biases.
JF_HOST_DEVICE bool dbias_is_reduced(const FlashBwdParams& p) {
  return (p.dbias_batch_stride == 0 && p.batch > 1) || (p.dbias_head_stride == 0 && p.heads_q > 1) ||
         (p.dbias_row_stride == 0 && p.seqlen_q > 1) || (p.dbias_col_stride == 0 && p.seqlen_k > 1);
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
