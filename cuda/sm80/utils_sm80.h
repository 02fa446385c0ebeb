// Small CuTe helpers shared by the forward and backward kernels: smem->register GEMM
// pipelines, accumulator re-views and predicated global<->shared copies.
#pragma once

#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace jax_flash {
namespace sm80 {

using namespace cute;

// acc_s/P/dP GEMMs: both operands in smem. The ldmatrix of k-slice i+1 is issued before the
// mma of slice i so shared-memory latency hides behind the tensor cores.
template <typename Acc, typename RA, typename RB, typename SA, typename SB, typename Mma,
          typename CopyA, typename CopyB, typename ThrA, typename ThrB>
__device__ __forceinline__ void gemm_ss(Acc& acc, RA& tCrA, RB& tCrB, SA const& tCsA, SB const& tCsB,
                                        Mma& mma, CopyA const& cpA, CopyB const& cpB, ThrA const& thrA,
                                        ThrB const& thrB) {
  Tensor vA = thrA.retile_D(tCrA);
  Tensor vB = thrB.retile_D(tCrB);
  copy(cpA, tCsA(_, _, _0{}), vA(_, _, _0{}));
  copy(cpB, tCsB(_, _, _0{}), vB(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k + 1 < size<2>(tCrA)) {
      copy(cpA, tCsA(_, _, k + 1), vA(_, _, k + 1));
      copy(cpB, tCsB(_, _, k + 1), vB(_, _, k + 1));
    }
    gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// A operand already in registers (P in the forward), B streamed from smem.
template <typename Acc, typename RA, typename RB, typename SB, typename Mma, typename CopyB, typename ThrB>
__device__ __forceinline__ void gemm_rs(Acc& acc, RA const& tCrA, RB& tCrB, SB const& tCsB, Mma& mma,
                                        CopyB const& cpB, ThrB const& thrB) {
  Tensor vB = thrB.retile_D(tCrB);
  copy(cpB, tCsB(_, _, _0{}), vB(_, _, _0{}));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    if (k + 1 < size<2>(tCrA)) copy(cpB, tCsB(_, _, k + 1), vB(_, _, k + 1));
    gemm(mma, tCrA(_, _, k), tCrB(_, _, k), acc);
  }
}

// m16n8 accumulator ((2,2), MMA_M, MMA_N) seen as (rows, cols) = ((2, MMA_M), (2, MMA_N)):
// value mode (c, r) is (adjacent column, row +8).
template <typename L>
__device__ __forceinline__ auto rowcol_layout(L const& l) {
  static_assert(decltype(rank<0>(l))::value == 2);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// The same registers re-viewed as the A operand of the next m16n8k16 MMA: two n8 accumulator
// tiles form one k16 slice, ((2,2), MMA_M, MMA_N) -> ((2,2,2), MMA_M, MMA_N/2).
template <typename L>
__device__ __forceinline__ auto acc_to_a_layout(L const& l) {
  auto d = logical_divide(l, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(d), get<2, 0>(d)), get<1>(d), get<2, 1>(d));
}

template <typename To, typename Tensor_>
__device__ __forceinline__ auto convert_type(Tensor_ const& t) {
  using From = typename Tensor_::value_type;
  constexpr int N = decltype(size(t))::value;
  cutlass::NumericArrayConverter<To, From, N> conv;
  auto frag = conv(*reinterpret_cast<const cutlass::Array<From, N>*>(t.data()));
  return make_tensor(make_rmem_ptr<To>(&frag), t.layout());
}

// Global -> shared tile copy (16-byte cp.async chunks). Rows >= max_rows and columns >=
// max_cols are zero-filled in smem: padded head dims and ragged sequence tails must read as
// exact zeros (0 * garbage could be NaN in P@V or dS^T@Q).
template <typename TiledCopy, typename S, typename D, typename C>
__device__ __forceinline__ void copy_pred(TiledCopy const& tc, S const& src, D& dst, C const& coord,
                                          int max_rows, int max_cols) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    bool row_ok = get<0>(coord(0, m, 0)) < max_rows;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      if (row_ok && get<1>(coord(0, m, k)) < max_cols) {
        copy(tc, src(_, m, k), dst(_, m, k));
      } else {
        clear(dst(_, m, k));
      }
    }
  }
}

// copy_pred, or a plain copy when the tile is known to be entirely in range (kEven).
template <bool kEven, typename TiledCopy, typename S, typename D, typename C>
__device__ __forceinline__ void copy_tile(TiledCopy const& tc, S const& src, D& dst, C const& coord, int max_rows,
                                          int max_cols) {
  if constexpr (kEven) {
    copy(tc, src, dst);
  } else {
    copy_pred(tc, src, dst, coord, max_rows, max_cols);
  }
}

// Shared -> global store of a finished tile; only rows < max_rows, cols < max_cols are written.
template <typename TiledCopy, typename S, typename D, typename C>
__device__ __forceinline__ void store_pred(TiledCopy const& tc, S const& src, D& dst, C const& coord,
                                           int max_rows, int max_cols) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < max_rows) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) {
        if (get<1>(coord(0, m, k)) < max_cols) copy(tc, src(_, m, k), dst(_, m, k));
      }
    }
  }
}

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
  return x;
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  x += __shfl_xor_sync(0xffffffff, x, 2);
  return x;
}

// tanh for softcap: tanh.approx is too coarse (logit = cap * tanh amplifies its error) and
// tanhf is a large branchy routine; 1 - 2 / (e^2x + 1) is accurate to ~1e-7 absolute and
// saturates correctly (e = inf -> 1, e = 0 -> -1).
__device__ __forceinline__ float tanh_accurate(float x) {
  const float e = __expf(2.f * x);
  return 1.f - 2.f * __frcp_rn(e + 1.f);
}

}  // namespace sm80
}  // namespace jax_flash

namespace jax_flash {
namespace sm80 {
// ex2.approx: one MUFU op; exp2(-inf) = +0, which is what masked logits need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
constexpr float kLog2e = 1.4426950408889634f;
}  // namespace sm80
}  // namespace jax_flash
