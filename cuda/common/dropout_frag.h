// Attention dropout on tensor-core accumulator fragments, shared by the sm80 (mma.sync m16n8)
// and sm90 (wgmma) kernels: both give a warp the same C layout, 16 accumulator rows over
// lane / 4 (and + 8) and column pairs (c, c + 1), c = 2 * (lane % 4) plus a multiple of 8. The
// keep rule itself is common/philox.h's (one Philox4x32-10 call decides 4 adjacent key columns
// of one query row), so every kernel drops the elements the CPU backend drops.
//
// Two orientations:
//   (query rows, keys)  the forward's S and the sm80 backward's: lanes l and l ^ 1 hold the two
//                       halves of each 4-key group of their rows (dropout_keep_row).
//   (keys, query rows)  the sm90 backward's S^T: the 4 keys of a group sit on the 4 lanes
//                       {16a + 4b + c : b = 0..3} (same query rows) (dropout_keep_bits_t).
// Either way each lane runs Philox for its share of the groups and the lanes swap results by
// shuffles: one call per 4 elements, none wasted.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>

#include "philox.h"

namespace jax_flash {

// (rows, keys) orientation. Bit ni set iff element (mi, ni) of the (rows, cols) accumulator view
// is kept (every lane must call it: shuffles). crc: the tile coordinates; (row0, col0): the tile
// origin in the sequence. Of each two consecutive pairs of a row, the even lane runs Philox for
// the first one's group and the odd lane for the second one's, and they swap results.
template <typename C>
__device__ __forceinline__ uint32_t dropout_keep_row(HeadDropout const& drop, C const& crc, int mi, int row0,
                                                     int col0) {
  constexpr int kCols = decltype(cute::size<1>(crc))::value;
  static_assert(kCols % 4 == 0 && kCols <= 32, "pairs come in lane-shared couples; one bit per column");
  const bool odd = threadIdx.x & 1;
  const int row = row0 + cute::get<0>(crc(mi, 0));
  uint32_t bits = 0;
  CUTE_UNROLL
  for (int ni = 0; ni < kCols; ni += 4) {
    const int c0 = col0 + cute::get<1>(crc(0, ni)), c1 = col0 + cute::get<1>(crc(0, ni + 2));  // this lane's two pairs
    const uint32_t mine = drop.keep4(row, (odd ? c1 : c0) >> 2);
    const uint32_t theirs = __shfl_xor_sync(0xffffffff, mine, 1);
    bits |= HeadDropout::pair_bits(odd ? theirs : mine, c0) << ni;
    bits |= HeadDropout::pair_bits(odd ? mine : theirs, c1) << (ni + 2);
  }
  return bits;
}

// Row mi of rc: dropped elements (bits from dropout_keep_row) become 0. Any element type: the
// forward drops from the 16-bit P (rounding commutes with zeroing, so that equals dropping
// before the conversion), the backward from float32 P.
template <typename T>
__device__ __forceinline__ void drop_row(T& rc, int mi, uint32_t keep_bits) {
  using V = typename std::remove_reference_t<T>::value_type;
  CUTE_UNROLL
  for (int ni = 0; ni < cute::size<1>(rc); ++ni)
    if (!(keep_bits >> ni & 1u)) rc(mi, ni) = V(0.f);
}

// Row mi of rc: kept elements times kept_scale, dropped ones 0 (Z o dP in the backward).
template <typename T>
__device__ __forceinline__ void drop_row(T& rc, int mi, uint32_t keep_bits, float kept_scale) {
  CUTE_UNROLL
  for (int ni = 0; ni < cute::size<1>(rc); ++ni) rc(mi, ni) = (keep_bits >> ni & 1u) ? rc(mi, ni) * kept_scale : 0.f;
}

// Zero the dropped elements of a whole (rows, keys) tile, one row of keep bits at a time.
template <typename T, typename C>
__device__ __forceinline__ void apply_dropout(T& rc, C const& crc, HeadDropout const& drop, int row0, int col0) {
  CUTE_UNROLL
  for (int mi = 0; mi < cute::size<0>(rc); ++mi) drop_row(rc, mi, dropout_keep_row(drop, crc, mi, row0, col0));
}

// (keys, rows) orientation: the keep bits of a thread's whole S^T fragment, element (i, j) of
// the (keys, rows) view at bit i * kRows + j of keep[(i * kRows + j) / 32]. crc: its
// coordinates (key, row) in the step's tile at (key0, row0); key0 % 4 == 0.
// The lanes {16a + 4b + c : b = 0..3} hold keys 4q + b of the same key groups q and the same
// query rows, so of each 4 consecutive elements (the fragment's columns j..j+3, j % 4 == 0) lane
// b runs the call of element j + b's (row, group) and each lane takes its own key's bit of all
// four calls. Up to 8 rounds' 4-bit results travel in one word: 3 shuffles per 32 elements.
template <typename C, int kWords>
__device__ __forceinline__ void dropout_keep_bits_t(HeadDropout const& drop, C const& crc, int64_t key0, int64_t row0,
                                                    uint32_t (&keep)[kWords]) {
  constexpr int kKeys = decltype(cute::size<0>(crc))::value, kRows = decltype(cute::size<1>(crc))::value;
  constexpr int kElems = kKeys * kRows;
  static_assert(kRows % 4 == 0 && kWords == (kElems + 31) / 32, "4-row groups; one bit per element");
  int const lane = threadIdx.x % 32, b = (lane >> 2) & 3;
  // Row offset of fragment column j + b from column j (the same for every j % 4 == 0).
  int const db = int(cute::get<1>(crc(0, b))) - int(cute::get<1>(crc(0, 0)));
  CUTE_UNROLL
  for (int w = 0; w < kWords; ++w) keep[w] = 0;
  CUTE_UNROLL
  for (int e0 = 0; e0 < kElems; e0 += 32) {  // up to 8 rounds of 4 elements
    uint32_t mine = 0;
    CUTE_UNROLL
    for (int s = 0; s < 8 && e0 + 4 * s < kElems; ++s) {
      int const e = e0 + 4 * s, i = e / kRows, j = e % kRows;
      int64_t const row = row0 + int(cute::get<1>(crc(0, j))) + db;
      int64_t const group = (key0 + int(cute::get<0>(crc(i, 0)))) >> 2;  // the same on the 4 lanes
      mine |= drop.keep4(row, group) << (4 * s);
    }
    // From lane b' (same a, c): its call of element e0 + 4s + b', whose bit b is this lane's key.
    CUTE_UNROLL
    for (int bs = 0; bs < 4; ++bs) {
      uint32_t const theirs = __shfl_sync(0xffffffff, mine, (lane & ~12) | (bs << 2)) >> b;
      CUTE_UNROLL
      for (int s = 0; s < 8 && e0 + 4 * s < kElems; ++s) {
        int const e = e0 + 4 * s + bs;
        keep[e / 32] |= (theirs >> (4 * s) & 1u) << (e % 32);
      }
    }
  }
}

}  // namespace jax_flash
