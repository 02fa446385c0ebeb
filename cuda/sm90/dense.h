// Bias and boolean mask in the sm90 forward (its Dense kernels; segment ids with them are
// checked at run time). Every element the interval rule leaves visible reads memory, so the
// reads of a key block are issued before its S GEMM is waited on and land under it: two
// consumer warpgroups per SM cannot hide the latency of reads issued at use (that first
// version ran at 0.16-0.54x the portable forward, session 16).
#pragma once

#include <cuda_runtime.h>

#include "../common/dtype.h"
#include "../common/flash_params.h"
#include "../common/mask.h"
#include "dense_tma.h"
#include "utils.h"

namespace jax_flash::sm90 {

// The thread's two accumulator rows' rules, hoisted out of the key loop.
struct DenseRows {
  ElemMask::Row elem[2];      // segment ids / mask of each row (mask.h)
  void const* bias_row[2];    // row r of this (batch, head)'s bias; nullptr = no bias
  int64_t bias_col_stride;    // in elements
  DType bias_dtype;
  float bias_mult;            // the accumulator is in units of 1 / scale (1 / softcap with softcap)
  int seqlen_k;
  bool pairs;                 // two neighbouring keys' words in one load (dense_pairs_ok)
  __device__ bool has_bias() const { return bias_row[0] != nullptr; }
};

// Whether a row's words of keys j and j + 1 (j even) can come in one load for every row of this
// (batch, head): contiguous keys, each row's start aligned to two elements, and an even seqlen_k
// (so the last pair, clamped to seqlen_k - 2, stays aligned). Uniform across the tile.
__forceinline__ __device__ bool dense_pairs_ok(void const* base, int64_t row_stride, int64_t col_stride,
                                               int elem_bytes, int seqlen_k) {
  return col_stride == 1 && row_stride % 2 == 0 && reinterpret_cast<uintptr_t>(base) % (2 * elem_bytes) == 0 &&
         seqlen_k % 2 == 0 && seqlen_k >= 2;
}

// rows: the thread's two accumulator rows (clamped to seqlen_q - 1: rows past it are not stored).
__forceinline__ __device__ DenseRows make_dense_rows(FlashFwdParams const& p, int b, int h, int const (&rows)[2],
                                                     bool softcap) {
  DenseRows d;
  ElemMask const em = make_elem_mask(p, b, h);
  BiasView const bias = make_bias_view(p, b, h);
  int const elem_bytes = bias_elem_bytes(p);
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 2; ++r) {
    d.elem[r] = em.row(rows[r]);
    d.bias_row[r] = bias.ptr ? static_cast<char const*>(bias.ptr) + rows[r] * bias.row_stride * elem_bytes : nullptr;
  }
  d.bias_col_stride = bias.col_stride;
  d.bias_dtype = bias.dtype;
  d.bias_mult = 1.f / (softcap ? p.softcap : p.scale);
  d.seqlen_k = p.seqlen_k;
  // Without a bias the words are mask bytes; with one, the mask is read at use (one at a time).
  d.pairs = bias.ptr ? dense_pairs_ok(bias.ptr, bias.row_stride, bias.col_stride, elem_bytes, p.seqlen_k)
                     : em.mask && dense_pairs_ok(em.mask, em.mask_row_stride, em.mask_col_stride, 1, p.seqlen_k);
  return d;
}

// One key block's words from memory for each accumulator element: the bias element's bits
// (float32, or 16-bit zero-extended), or without a bias the mask byte. With both, the mask is
// read at use (a second array would not fit the registers of the H = 128 consumers).
template <int kCols>
struct DenseWords {
  uint32_t w[2][kCols];
};

// The key index of accumulator column k of a block starting at n0, clamped to last (keys past
// seqlen_k are masked already). Columns are the thread's base column plus compile-time offsets.
template <class TC>
__forceinline__ __device__ int dense_col(TC const& c, int n0, int k, int last) {
  int const dj = int(get<1>(c.layout()(0, k))) - int(get<1>(c.layout()(0, 0)));
  return min(n0 + int(get<1>(c(0, 0))) + dj, last);
}

// What a word holds (kMask: no bias, the mask's byte); one loop per kind (no per-element branch
// on it). The backward's TMA tiles use the same kinds (dense_bwd.h).
enum class DenseKind { kMask, kBiasF32, kBiasBF16, kBiasF16 };

__forceinline__ __host__ __device__ DenseKind dense_kind_of(bool has_bias, DType bias_dtype) {
  if (!has_bias) return DenseKind::kMask;
  return bias_dtype == DType::kFloat32 ? DenseKind::kBiasF32
         : bias_dtype == DType::kBFloat16 ? DenseKind::kBiasBF16 : DenseKind::kBiasF16;
}
__forceinline__ __device__ DenseKind dense_kind(DenseRows const& d) { return dense_kind_of(d.has_bias(), d.bias_dtype); }

template <DenseKind kKind>
__forceinline__ __device__ uint32_t load_dense_word(DenseRows const& d, int r, int64_t j) {
  if constexpr (kKind == DenseKind::kMask) return __ldg(d.elem[r].mask + j * d.elem[r].mask_col_stride);
  else if constexpr (kKind == DenseKind::kBiasF32) return __ldg(static_cast<uint32_t const*>(d.bias_row[r]) + j * d.bias_col_stride);
  else return __ldg(static_cast<uint16_t const*>(d.bias_row[r]) + j * d.bias_col_stride);
}

// The words of keys j and j + 1 (j even; d.pairs) in one load of 2, 4 or 8 bytes.
template <DenseKind kKind>
__forceinline__ __device__ void load_dense_pair(DenseRows const& d, int r, int64_t j, uint32_t& w0, uint32_t& w1) {
  if constexpr (kKind == DenseKind::kMask) {
    uint32_t const v = __ldg(reinterpret_cast<uint16_t const*>(d.elem[r].mask) + j / 2);
    w0 = v & 0xffu;
    w1 = v >> 8;
  } else if constexpr (kKind == DenseKind::kBiasF32) {
    uint2 const v = __ldg(static_cast<uint2 const*>(d.bias_row[r]) + j / 2);
    w0 = v.x;
    w1 = v.y;
  } else {
    uint32_t const v = __ldg(static_cast<uint32_t const*>(d.bias_row[r]) + j / 2);
    w0 = v & 0xffffu;
    w1 = v >> 16;
  }
}

// Pairs rely on the wgmma accumulator layout: a thread's columns come in neighbouring pairs
// (2i, 2i + 1) at even offsets from its base column, which is even.
template <DenseKind kKind, bool kPairs, class TC, int kCols>
__forceinline__ __device__ void load_dense_words_as(DenseWords<kCols>& dw, TC const& c, DenseRows const& d, int n0) {
  if constexpr (kPairs) {
    static_assert(kCols % 2 == 0, "columns come in pairs");
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kCols; k += 2) {
      int64_t const j = dense_col(c, n0, k, d.seqlen_k - 2);  // the last pair's first key
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) load_dense_pair<kKind>(d, r, j, dw.w[r][k], dw.w[r][k + 1]);
    }
  } else {
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kCols; ++k) {
      int64_t const j = dense_col(c, n0, k, d.seqlen_k - 1);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) dw.w[r][k] = load_dense_word<kKind>(d, r, j);
    }
  }
}

template <bool kPairs, class TC, int kCols>
__forceinline__ __device__ void load_dense_words_paired(DenseWords<kCols>& dw, TC const& c, DenseRows const& d,
                                                        int n0) {
  switch (dense_kind(d)) {
    case DenseKind::kMask: load_dense_words_as<DenseKind::kMask, kPairs>(dw, c, d, n0); break;
    case DenseKind::kBiasF32: load_dense_words_as<DenseKind::kBiasF32, kPairs>(dw, c, d, n0); break;
    case DenseKind::kBiasBF16: load_dense_words_as<DenseKind::kBiasBF16, kPairs>(dw, c, d, n0); break;
    case DenseKind::kBiasF16: load_dense_words_as<DenseKind::kBiasF16, kPairs>(dw, c, d, n0); break;
  }
}

// Issue the loads of the block at n0 (no use of them here: the caller consumes them after a GEMM
// wait, so they land under it).
// Pairs in 64-key blocks only: with 128 (H = 64) both loops spilled 116-172 B (ptxas).
template <class TC, int kCols>
__forceinline__ __device__ void load_dense_words(DenseWords<kCols>& dw, TC const& c, DenseRows const& d, int n0) {
  if constexpr (kCols <= 16) {
    if (d.pairs) {
      load_dense_words_paired<true>(dw, c, d, n0);
      return;
    }
  }
  load_dense_words_paired<false>(dw, c, d, n0);
}

template <DenseKind kKind>
__forceinline__ __device__ float dense_bias_addend(uint32_t x, float mult) {
  float const bias = kKind == DenseKind::kBiasF32    ? float_from_bits(x)
                     : kKind == DenseKind::kBiasBF16 ? bf16_to_float(uint16_t(x))
                                                     : fp16_to_float(uint16_t(x));
  return bias * mult;
}

// -inf from the interval rule stays -inf whatever the bias (no -inf + inf).
__forceinline__ __device__ float dense_logit(float s, bool visible, float add) {
  return visible && s != -INFINITY ? s + add : -INFINITY;
}

template <DenseKind kKind, class TS, class TC, int kCols>
__forceinline__ __device__ void apply_dense_cols(TS& s, TC const& c, DenseRows const& d, DenseWords<kCols> const& w, int n0) {
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kCols; ++k) {
    int64_t const j = dense_col(c, n0, k, d.seqlen_k - 1);
    int32_t const kv_id = d.elem[0].kv_seg ? __ldg(d.elem[0].kv_seg + j) : 0;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      bool visible;
      float add;
      if constexpr (kKind == DenseKind::kMask) {
        visible = w.w[r][k] != 0;
        add = 0.f;
      } else {
        visible = d.elem[r].mask == nullptr || __ldg(d.elem[r].mask + j * d.elem[r].mask_col_stride) != 0;
        add = dense_bias_addend<kKind>(w.w[r][k], d.bias_mult);
      }
      if (d.elem[r].kv_seg) visible = visible && kv_id == d.elem[r].seg;
      s(r, k) = dense_logit(s(r, k), visible, add);
    }
  }
}

// The same from the block's tiles in smem (dense_tma.h): a pair of neighbouring keys per read.
template <DenseKind kKind, int kBlockM, class TS, class TC>
__forceinline__ __device__ void apply_dense_smem_cols(TS& s, TC const& c, DenseRows const& d, uint8_t const* stage,
                                                      int n0) {
  constexpr int kCols = decltype(size<1>(s))::value;
  static_assert(kCols % 2 == 0, "columns come in pairs");
  bool const has_mask = kKind == DenseKind::kMask || d.elem[0].mask != nullptr;
  uint8_t const* mask_tile = stage + DenseTmaStage<kBlockM>::kBiasBytes;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kCols; k += 2) {
    int const key = int(get<1>(c(0, k)));  // in the tile; key + 1 is column k + 1 (wgmma layout)
    int32_t kv_id[2] = {0, 0};
    if (d.elem[0].kv_seg) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 2; ++i) kv_id[i] = __ldg(d.elem[0].kv_seg + min(n0 + key + i, d.seqlen_k - 1));
    }
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) {
      int const row = int(get<0>(c(r, 0)));
      bool visible[2] = {true, true};
      float add[2] = {0.f, 0.f};
      if (has_mask) {
        uint32_t const m = *reinterpret_cast<uint16_t const*>(mask_tile + dense_tile_offset<kBlockM, 1>(row, key));
        visible[0] = (m & 0xffu) != 0;
        visible[1] = (m >> 8) != 0;
      }
      if constexpr (kKind == DenseKind::kBiasF32) {
        uint2 const v = *reinterpret_cast<uint2 const*>(stage + dense_tile_offset<kBlockM, 4>(row, key));
        add[0] = dense_bias_addend<kKind>(v.x, d.bias_mult);
        add[1] = dense_bias_addend<kKind>(v.y, d.bias_mult);
      } else if constexpr (kKind != DenseKind::kMask) {
        uint32_t const v = *reinterpret_cast<uint32_t const*>(stage + dense_tile_offset<kBlockM, 2>(row, key));
        add[0] = dense_bias_addend<kKind>(v & 0xffffu, d.bias_mult);
        add[1] = dense_bias_addend<kKind>(v >> 16, d.bias_mult);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 2; ++i) {
        if (d.elem[r].kv_seg) visible[i] = visible[i] && kv_id[i] == d.elem[r].seg;
        s(r, k + i) = dense_logit(s(r, k + i), visible[i], add[i]);
      }
    }
  }
}

template <int kBlockM, class TS, class TC>
__forceinline__ __device__ void apply_dense_smem_tile(TS& s, TC const& c, DenseRows const& d, uint8_t const* stage,
                                                      int n0) {
  switch (dense_kind(d)) {
    case DenseKind::kMask: apply_dense_smem_cols<DenseKind::kMask, kBlockM>(s, c, d, stage, n0); break;
    case DenseKind::kBiasF32: apply_dense_smem_cols<DenseKind::kBiasF32, kBlockM>(s, c, d, stage, n0); break;
    case DenseKind::kBiasBF16: apply_dense_smem_cols<DenseKind::kBiasBF16, kBlockM>(s, c, d, stage, n0); break;
    case DenseKind::kBiasF16: apply_dense_smem_cols<DenseKind::kBiasF16, kBlockM>(s, c, d, stage, n0); break;
  }
}

// Every element the interval rule left visible: -inf where segment ids or the mask hide it,
// else + bias (in accumulator units). s / c: (rows, cols) views of the S accumulator and its
// coordinates; w: the block's words from load_dense_words.
template <class TS, class TC, int kCols>
__forceinline__ __device__ void apply_dense_tile(TS& s, TC const& c, DenseRows const& d, DenseWords<kCols> const& w,
                                                 int n0) {
  static_assert(decltype(size<1>(s))::value == kCols, "one word per accumulator element");
  switch (dense_kind(d)) {
    case DenseKind::kMask: apply_dense_cols<DenseKind::kMask>(s, c, d, w, n0); break;
    case DenseKind::kBiasF32: apply_dense_cols<DenseKind::kBiasF32>(s, c, d, w, n0); break;
    case DenseKind::kBiasBF16: apply_dense_cols<DenseKind::kBiasBF16>(s, c, d, w, n0); break;
    case DenseKind::kBiasF16: apply_dense_cols<DenseKind::kBiasF16>(s, c, d, w, n0); break;
  }
}

}  // namespace jax_flash::sm90
