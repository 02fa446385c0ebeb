// Tile shapes, shared-memory layouts and copy/MMA atoms of the SM80 kernels.
// Everything is swizzled in 8 x 64 (or 8 x 32) element atoms so that both the 16-byte
// cp.async stores and the ldmatrix loads (row or transposed) are bank-conflict free.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/numeric_types.h>

namespace jax_flash {
namespace sm80 {

using namespace cute;

template <typename Element>
using MmaAtomFor = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                      MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                      MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;

template <typename Element_, int kHeadDim_, int kNWarps_>
struct TraitsBase {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  // Width of one swizzle atom along the head dim (96 is not a multiple of 64).
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 32 ? 2 : 3;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzle, 3, 3>{}, Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));

  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;

  // 16-byte chunks; a warp covers whole 128-byte rows of a swizzle atom.
  static constexpr int kGmemElemsPerLoad = 8;
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerLoad;
  static_assert(kNThreads % kGmemThreadsPerRow == 0);
  using GmemThreadLayout = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                  Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>, Element>{}, GmemThreadLayout{},
      Layout<Shape<_1, _8>>{}));
  using GmemTiledStore = decltype(make_tiled_copy(Copy_Atom<UniversalCopy<cute::uint128_t>, Element>{},
                                                  GmemThreadLayout{}, Layout<Shape<_1, _8>>{}));
  // Register -> smem of an accumulator tile (pairs of adjacent columns).
  using SmemCopyAtomC = Copy_Atom<UniversalCopy<uint32_t>, Element>;
};

// Forward: one CTA = kBlockM query rows of one (batch, head); warps split the rows.
// kLean: the predicate-free variant for aligned shapes (flash_fwd_kernel's kEven) and masks from
// per-row key ranges computed once per CTA (apply_mask_rows) instead of per-tile SeqMask
// arithmetic. Measured per head dim (NOTES.md "Session 12"): H=256 +16% (its spills go from 60 B
// to 0), H=128 -8% and H=64 -6% (H=128's spills grow 148 -> 192 B), so only H=256 takes it.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, bool kLean_ = false,
          bool kEvenVariant_ = kLean_>
struct FwdTraits : TraitsBase<Element_, kHeadDim_, kNWarps_> {
  using Base = TraitsBase<Element_, kHeadDim_, kNWarps_>;
  using Element = Element_;
  static constexpr bool kLean = kLean_;
  // The launcher may pick flash_fwd_kernel's predicate-free kEven variant for aligned shapes.
  static constexpr bool kEvenVariant = kEvenVariant_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;

  using TiledMma = TiledMMA<MmaAtomFor<Element>, Layout<Shape<Int<kNWarps>, _1, _1>>,
                            Tile<Int<16 * kNWarps>, _16, _16>>;

  using SmemLayoutQ = decltype(tile_to_shape(typename Base::SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(typename Base::SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V^T (head_dim x keys) for the B operand of P @ V, read with ldmatrix.trans.
  using SmemLayoutVt = decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutQ;

  static constexpr int kSmemQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemKV = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemSize = kSmemQ + 2 * kSmemKV;  // Q, K, V (O reuses Q)
};

// Backward dK/dV: one CTA = kBlockN keys of one (batch, kv head); loops over the query
// blocks (and the q heads of its GQA group) that can see them.
template <typename Element_, int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int AtomMSdP_,
          int AtomNdKV_, int AtomMdQ_>
struct BwdTraits : TraitsBase<Element_, kHeadDim_, kNWarps_> {
  using Base = TraitsBase<Element_, kHeadDim_, kNWarps_>;
  using Element = Element_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;

  // S = Q K^T and dP = dO V^T (kBlockM x kBlockN).
  using TiledMmaSdP = TiledMMA<MmaAtomFor<Element>, Layout<Shape<Int<AtomMSdP_>, Int<kNWarps / AtomMSdP_>, _1>>,
                               Tile<Int<16 * AtomMSdP_>, Int<16 * (kNWarps / AtomMSdP_)>, _16>>;
  // dV = P^T dO and dK = dS^T Q (kBlockN x kHeadDim).
  using TiledMmadKV = TiledMMA<MmaAtomFor<Element>, Layout<Shape<Int<AtomNdKV_>, Int<kNWarps / AtomNdKV_>, _1>>,
                               Tile<Int<16 * AtomNdKV_>, Int<16 * (kNWarps / AtomNdKV_)>, _16>>;
  // dQ = dS K (kBlockM x kHeadDim).
  using TiledMmadQ = TiledMMA<MmaAtomFor<Element>, Layout<Shape<Int<AtomMdQ_>, Int<kNWarps / AtomMdQ_>, _1>>,
                              Tile<Int<16 * AtomMdQ_>, Int<16 * (kNWarps / AtomMdQ_)>, _16>>;

  using SmemLayoutQ = decltype(tile_to_shape(typename Base::SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutQtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQt{}));
  using SmemLayoutKV = decltype(tile_to_shape(typename Base::SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));

  // P and dS (kBlockM x kBlockN), also read transposed for the dK/dV GEMMs.
  static constexpr int kPBlockN = kBlockN % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzlePdS = kPBlockN == 64 ? 3 : 2;
  using SmemLayoutAtomPdS = decltype(composition(
      Swizzle<kSwizzlePdS, 3, 3>{}, Layout<Shape<_8, Int<kPBlockN>>, Stride<Int<kPBlockN>, _1>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(composition(SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

  static constexpr int kSmemQ = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemKV = kBlockN * kHeadDim * int(sizeof(Element));
  static constexpr int kSmemP = kBlockM * kBlockN * int(sizeof(Element));
  // Q x2, dO x2 (double-buffered over query blocks), K, V, P, dS.
  static constexpr int kSmemSize = 4 * kSmemQ + 2 * kSmemKV + 2 * kSmemP;
};

}  // namespace sm80
}  // namespace jax_flash
