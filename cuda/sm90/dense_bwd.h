// Bias, boolean mask and the bias gradient in the sm90 backward (its Dense kernels). The rules
// are common/mask.h's (BiasView, ElemMask, dbias over the broadcast axes, as the CPU and sm80
// backwards); this file maps them onto the backward's S^T accumulator, (keys, query rows): a
// thread holds 2 keys (lane / 4 and lane / 4 + 8 of its warp's 16) and pairs of query rows
// (2 (lane % 4) + 8g + {0, 1}), so one load (or RED) of a register index covers 8 consecutive
// keys x 4 rows: 4 whole 32-byte sectors of a row-major bias. Two ways to read bias and mask:
// - tiles by TMA (H = 128 where dense_bwd_tiles_by_tma; NOTES.md v53): each consumer WG's 64 x 64
//   tile in its own smem stage, read at use (DenseTileRead);
// - otherwise element by element at use, from lines each warp prefetched into L1 before its GEMM
//   waits (no registers to hold them across the GEMMs; dense_bwd_logit).
#pragma once

#include <cuda_runtime.h>

#include "../common/dtype.h"
#include "../common/flash_params.h"
#include "../common/mask.h"
#include "dense.h"
#include "dense_tma.h"
#include "utils.h"

namespace jax_flash::sm90 {

// One step's (batch, q head) bases of the bias, the mask and dbias. Strides, dtype and lengths
// stay in the kernel parameters (constant bank operands): the consumers, at the register cap,
// hold only these three pointers.
struct DenseBwd {
  FlashBwdParams const* p = nullptr;
  char const* bias = nullptr;     // at (b, hq); nullptr = none
  uint8_t const* mask = nullptr;  // at (b, hq); nullptr = none
  float* dbias = nullptr;         // at (b, hq); nullptr = none
};

__forceinline__ __device__ DenseBwd make_dense_bwd(FlashBwdParams const& p, int b, int hq) {
  return {&p, static_cast<char const*>(make_bias_view(p, b, hq).ptr), make_elem_mask(p, b, hq).mask,
          p.dbias ? p.dbias + dbias_offset(p, b, hq) : nullptr};
}

// log2(e) x bias(row, key) (row, key in range). The dtype test is uniform across the kernel.
__forceinline__ __device__ float dense_bias_log2(DenseBwd const& d, int64_t row, int64_t key) {
  return load_float(d.bias, d.p->bias_dtype, row * d.p->bias_row_stride + key * d.p->bias_col_stride) *
         1.44269504088896340736f;
}

// The exp2 argument with the bias term, and the mask's verdict, for (row, key); rows / keys past
// the ends read row / key 0's (the interval rule masks them anyway). Per element, at use: a
// version hoisting the per-row / per-key address and interval work out of the loop (v50c) made
// ptxas spill 250-1500 B more in these kernels at the register cap.
__forceinline__ __device__ float dense_bwd_logit(DenseBwd const& d, float x_l2, int64_t row, int64_t key, bool& visible) {
  int64_t const r = row < d.p->seqlen_q ? row : 0, k = key < d.p->seqlen_k ? key : 0;
  if (d.mask && __ldg(d.mask + r * d.p->mask_row_stride + k * d.p->mask_col_stride) == 0) visible = false;
  return d.bias ? x_l2 + dense_bias_log2(d, r, k) : x_l2;
}

// Byte offsets of a thread's S^T fragment elements (c: their (key, row) coordinates; keys of
// this WG from key_shift) in a WG's tile of kElemBytes elements (dense_tma.h's layout). The
// swizzle repeats every 8 rows and a thread's rows are those of columns 0 and 1 plus multiples of
// 8, so element (i, j) sits at base[i][j % 2] + (its row - the row of column j % 2) x the row's
// bytes: four bases, formed per step from coordinates the compiler cannot hoist (the offsets of
// every element, hoisted out of the step loop, spilled 0.5-1.4 KB: NOTES.md v53).
template <int kBlockM, int kElemBytes>
struct DenseTileOffsets {
  int base[2][2];
  template <class TC>
  __forceinline__ __device__ DenseTileOffsets(TC const& c, int key_shift) {
    static_assert(decltype(size<0>(c))::value == 2, "two keys per thread");
    int row0 = int(get<1>(c(0, 0))), key0 = int(get<0>(c(0, 0))) - key_shift;
    asm volatile("" : "+r"(row0), "+r"(key0));
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 2; ++i) {
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 2; ++e)
        base[i][e] = dense_tile_offset<kBlockM, kElemBytes>(row0 + int(get<1>(c(i, e))) - int(get<1>(c(0, 0))),
                                                            key0 + int(get<0>(c(i, e))) - int(get<0>(c(0, 0))));
    }
  }
  template <class TC>
  __forceinline__ __device__ int at(TC const& c, int i, int j) const {
    return base[i][j % 2] + (int(get<1>(c(i, j))) - int(get<1>(c(i, j % 2)))) * dense_box_bytes(kElemBytes);
  }
};

// One step's reads of a WG's stage, for a bias of kind kKind (dense.h's DenseKind; kMask: no
// bias): the exp2 argument with log2(e) x bias, and the mask's verdict, of element (i, j) of a
// thread's S^T fragment. Rows / keys past the ends read zeros (TMA's fill; the interval rule masks
// them).
template <DenseKind kKind, int kBlockM>
struct DenseTileRead {
  uint8_t const* stage;
  DenseTmaDescs const& d;
  DenseTileOffsets<kBlockM, 1> mask;
  DenseTileOffsets<kBlockM, kKind == DenseKind::kBiasF32 ? 4 : 2> bias;
  template <class TC>
  __forceinline__ __device__ DenseTileRead(uint8_t const* stage_, DenseTmaDescs const& d_, TC const& c, int key_shift)
      : stage(stage_), d(d_), mask(c, key_shift), bias(c, key_shift) {}
  template <class TC>
  __forceinline__ __device__ float logit(float x_l2, TC const& c, int i, int j, bool& visible) const {
    if (d.has_mask && stage[d.mask_offset + mask.at(c, i, j)] == 0) visible = false;
    if constexpr (kKind == DenseKind::kMask) {
      return x_l2;
    } else {
      uint8_t const* const at = stage + bias.at(c, i, j);
      uint32_t const bits = kKind == DenseKind::kBiasF32 ? *reinterpret_cast<uint32_t const*>(at)
                                                         : *reinterpret_cast<uint16_t const*>(at);
      return x_l2 + dense_bias_addend<kKind>(bits, 1.44269504088896340736f);
    }
  }
};

// Before the step's GEMM waits: the lines of the warp's bias / mask tile (its 16 keys from key0 x
// n_rows rows from row0) into L1, so that the reads at use (dense_bwd_logit) hit L1 instead of
// each waiting ~1000 cycles on L2 / HBM: the consumers have no registers to hold the words across
// the GEMMs (read at use with no prefetch: 5x slower than a plain backward at H = 128, v50).
__forceinline__ __device__ void prefetch_l1(void const* ptr) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(ptr));
}
__forceinline__ __device__ void dense_bwd_prefetch(DenseBwd const& d, int64_t key0, int64_t row0, int n_rows) {
  FlashBwdParams const& p = *d.p;
  int const lane = threadIdx.x % 32;
  int64_t const k0 = key0 < p.seqlen_k ? key0 : p.seqlen_k - 1;
  int64_t const k1 = key0 + 15 < p.seqlen_k ? key0 + 15 : p.seqlen_k - 1;  // the 16 keys may span two lines
  int const elem_bytes = bias_elem_bytes(p);
  for (int r = lane; r < n_rows; r += 32) {
    int64_t const row = row0 + r < p.seqlen_q ? row0 + r : p.seqlen_q - 1;
    if (d.bias) {
      char const* const b = d.bias + row * p.bias_row_stride * elem_bytes;
      prefetch_l1(b + k0 * p.bias_col_stride * elem_bytes);
      prefetch_l1(b + k1 * p.bias_col_stride * elem_bytes);
    }
    if (d.mask) {
      uint8_t const* const m = d.mask + row * p.mask_row_stride;
      prefetch_l1(m + k0 * p.mask_col_stride);
      prefetch_l1(m + k1 * p.mask_col_stride);
    }
  }
}

// v summed over the lanes that differ from this one in the bits kFirst..kLast (powers of 2).
template <int kFirst, int kLast>
__forceinline__ __device__ float lane_sum(float v) {
  CUTLASS_PRAGMA_UNROLL
  for (int m = kFirst; m <= kLast; m *= 2) v += __shfl_xor_sync(0xffffffff, v, m);
  return v;
}

// dS (the gradient of the final logit, before any softcap chain rule) of one step into dbias,
// summed over its broadcast axes: per element (a RED onto zero: exact for a full-size dbias), or
// reduced in registers and across the lanes sharing a key (over rows) or a row (over keys) first,
// then one RED per key / row / warp. ds / c: (keys, rows) views of the dS^T accumulator and its
// coordinates in the step's tile at (key0, row0). Every lane of the warp calls it (shuffles).
template <class TD, class TC>
__forceinline__ __device__ void dense_bwd_dbias(DenseBwd const& d, TD const& ds, TC const& c, int64_t key0,
                                                int64_t row0) {
  constexpr int kKeys = decltype(size<0>(ds))::value, kRows = decltype(size<1>(ds))::value;
  if (!d.dbias) return;
  int const lane = threadIdx.x % 32;
  bool const over_rows = d.p->dbias_row_stride == 0, over_keys = d.p->dbias_col_stride == 0;
  if (!over_rows && !over_keys) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRows; ++j) {
      int64_t const row = row0 + int(get<1>(c(0, j)));
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kKeys; ++i) {
        int64_t const key = key0 + int(get<0>(c(i, 0)));
        if (row < d.p->seqlen_q && key < d.p->seqlen_k)
          atomicAdd(d.dbias + row * d.p->dbias_row_stride + key * d.p->dbias_col_stride, ds(i, j));
      }
    }
  } else if (over_rows && !over_keys) {  // a key's rows: this thread's, then the lanes of its quad
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kKeys; ++i) {
      float v = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRows; ++j) v += ds(i, j);
      v = lane_sum<1, 2>(v);
      int64_t const key = key0 + int(get<0>(c(i, 0)));
      if (lane % 4 == 0 && key < d.p->seqlen_k) atomicAdd(d.dbias + key * d.p->dbias_col_stride, v);
    }
  } else if (!over_rows) {  // a row's keys: this thread's, then the lanes of the same lane % 4
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRows; ++j) {
      float v = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kKeys; ++i) v += ds(i, j);
      v = lane_sum<4, 16>(v);
      int64_t const row = row0 + int(get<1>(c(0, j)));
      if (lane < 4 && row < d.p->seqlen_q) atomicAdd(d.dbias + row * d.p->dbias_row_stride, v);
    }
  } else {  // one sum per warp
    float v = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kKeys * kRows; ++i) v += ds(i);
    v = lane_sum<1, 16>(v);
    if (lane == 0) atomicAdd(d.dbias, v);
  }
}

}  // namespace jax_flash::sm90
