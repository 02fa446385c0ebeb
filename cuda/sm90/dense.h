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
  __device__ bool has_bias() const { return bias_row[0] != nullptr; }
};

// rows: the thread's two accumulator rows (clamped to seqlen_q - 1: rows past it are not stored).
__forceinline__ __device__ DenseRows make_dense_rows(FlashFwdParams const& p, int b, int h, int const (&rows)[2],
                                                     bool softcap) {
  DenseRows d;
  ElemMask const em = make_elem_mask(p, b, h);
  BiasView const bias = make_bias_view(p, b, h);
  int const elem_bytes = p.bias_dtype == DType::kFloat32 ? 4 : 2;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < 2; ++r) {
    d.elem[r] = em.row(rows[r]);
    d.bias_row[r] = bias.ptr ? static_cast<char const*>(bias.ptr) + rows[r] * bias.row_stride * elem_bytes : nullptr;
  }
  d.bias_col_stride = bias.col_stride;
  d.bias_dtype = bias.dtype;
  d.bias_mult = 1.f / (softcap ? p.softcap : p.scale);
  d.seqlen_k = p.seqlen_k;
  return d;
}

// One key block's words from memory for each accumulator element: the bias element's bits
// (float32, or 16-bit zero-extended), or without a bias the mask byte. With both, the mask is
// read at use (a second array would not fit the registers of the H = 128 consumers).
template <int kCols>
struct DenseWords {
  uint32_t w[2][kCols];
};

// The key index of accumulator column k of a block starting at n0 (clamped: keys past seqlen_k
// are masked already). Columns are the thread's base column plus compile-time offsets.
template <class TC>
__forceinline__ __device__ int dense_col(TC const& c, DenseRows const& d, int n0, int k) {
  int const dj = int(get<1>(c.layout()(0, k))) - int(get<1>(c.layout()(0, 0)));
  return min(n0 + int(get<1>(c(0, 0))) + dj, d.seqlen_k - 1);
}

// What a word holds; one loop per kind (no per-element branch on it).
enum class DenseKind { kMask, kBiasF32, kBiasBF16, kBiasF16 };

__forceinline__ __device__ DenseKind dense_kind(DenseRows const& d) {
  if (!d.has_bias()) return DenseKind::kMask;
  return d.bias_dtype == DType::kFloat32 ? DenseKind::kBiasF32
         : d.bias_dtype == DType::kBFloat16 ? DenseKind::kBiasBF16 : DenseKind::kBiasF16;
}

template <DenseKind kKind>
__forceinline__ __device__ uint32_t load_dense_word(DenseRows const& d, int r, int64_t j) {
  if constexpr (kKind == DenseKind::kMask) return __ldg(d.elem[r].mask + j * d.elem[r].mask_col_stride);
  else if constexpr (kKind == DenseKind::kBiasF32) return __ldg(static_cast<uint32_t const*>(d.bias_row[r]) + j * d.bias_col_stride);
  else return __ldg(static_cast<uint16_t const*>(d.bias_row[r]) + j * d.bias_col_stride);
}

template <DenseKind kKind, class TC, int kCols>
__forceinline__ __device__ void load_dense_words_as(DenseWords<kCols>& dw, TC const& c, DenseRows const& d, int n0) {
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kCols; ++k) {
    int64_t const j = dense_col(c, d, n0, k);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r) dw.w[r][k] = load_dense_word<kKind>(d, r, j);
  }
}

// Issue the loads of the block at n0 (no use of them here: the caller consumes them after a GEMM
// wait, so they land under it).
template <class TC, int kCols>
__forceinline__ __device__ void load_dense_words(DenseWords<kCols>& dw, TC const& c, DenseRows const& d, int n0) {
  switch (dense_kind(d)) {
    case DenseKind::kMask: load_dense_words_as<DenseKind::kMask>(dw, c, d, n0); break;
    case DenseKind::kBiasF32: load_dense_words_as<DenseKind::kBiasF32>(dw, c, d, n0); break;
    case DenseKind::kBiasBF16: load_dense_words_as<DenseKind::kBiasBF16>(dw, c, d, n0); break;
    case DenseKind::kBiasF16: load_dense_words_as<DenseKind::kBiasF16>(dw, c, d, n0); break;
  }
}

template <DenseKind kKind, class TS, class TC, int kCols>
__forceinline__ __device__ void apply_dense_cols(TS& s, TC const& c, DenseRows const& d, DenseWords<kCols> const& w, int n0) {
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < kCols; ++k) {
    int64_t const j = dense_col(c, d, n0, k);
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
        uint32_t const x = w.w[r][k];
        float const bias = kKind == DenseKind::kBiasF32 ? float_from_bits(x)
                           : kKind == DenseKind::kBiasBF16 ? bf16_to_float(uint16_t(x)) : fp16_to_float(uint16_t(x));
        add = bias * d.bias_mult;
      }
      if (d.elem[r].kv_seg) visible = visible && kv_id == d.elem[r].seg;
      // -inf from the interval rule stays -inf whatever the bias (no -inf + inf).
      s(r, k) = visible && s(r, k) != -INFINITY ? s(r, k) + add : -INFINITY;
    }
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
