// Compile-time configuration of one sm90 forward instantiation: tile sizes, thread roles,
// swizzled smem layouts, wgmma atoms and TMA descriptor types.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/pipeline/pipeline.hpp>

#include "../common/flash_params.h"
#include "dense_tma.h"
#include "scheduler.h"
#include "timeline.h"

namespace jax_flash::sm90 {
using namespace cute;

// The smem a Dense kernel with TMA-staged bias / mask tiles needs per K / V stage (dense_tma.h).
struct NoDenseTma {};
template <int kBytesPerStage, int kStages, class Pipeline>
struct DenseTmaStorage {
  cute::array_aligned<uint8_t, kBytesPerStage * kStages, 1024> tiles;
  alignas(16) typename Pipeline::SharedStorage pipe;
};

// kDenseTma: a Dense kernel whose producer stages the bias / mask tiles in smem by TMA.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, class Element_, int kSoftmaxChains_ = 1,
          int kPolyEvery_ = 0, int kSchedArrive_ = 0, int kLazyMax_ = 0, bool kDenseTma_ = false>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kSoftmaxChains = kSoftmaxChains_;  // OnlineSoftmax's kChains
  static constexpr int kPolyEvery = kPolyEvery_;          // OnlineSoftmax's kPolyEvery
  // Where a consumer WG passes the GEMM-issue ring to the next WG: 0 right after issuing its
  // GEMMs (the WGs' softmaxes overlap, offset by the tensor pipe's order), 1 after its row max,
  // 2 after half of its exp2s, 3 after its softmax (the softmaxes strictly alternate).
  static constexpr int kSchedArrive = kSchedArrive_;
  // v64: 0 rescales O and the row sums whenever a row's max grows (exact); k > 0 keeps a row's
  // max until it grows by more than 2^k (FA4's rule: P stays <= 2^k, well inside bf16 / fp16 and
  // float32) and skips a warp's O rescale when every factor is 1 (OnlineSoftmax, rescale_rows).
  static constexpr int kLazyMax = kLazyMax_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kDenseTma = kDenseTma_;
  static_assert(!kDenseTma || kBlockN == kDenseTmaKeys, "the TMA bias / mask tiles are 64 keys wide");
  // Accumulator columns per thread of an S tile (two rows each).
  static constexpr int kAccCols = kBlockN / 4;
  // One consumer warpgroup per 64 query rows; warpgroup 0 is the TMA producer.
  static constexpr int kMmaWGs = kBlockM / 64;
  static constexpr int kMmaThreads = kMmaWGs * 128;
  static constexpr int kThreads = kMmaThreads + 128;
  static_assert(kMmaWGs >= 1 && kMmaWGs <= 3);
  // One consumer WG (kBlockM = 64): two CTAs per SM, whose WGs overlap each other's softmax,
  // Q wait and epilogue without a ping-pong barrier (the hardware interleaves them).
  static constexpr int kCtasPerSm = kMmaWGs == 1 ? 2 : 1;
  // setmaxnreg budgets: producer shrinks, consumers grow (sum <= 64K regs per SM).
  static constexpr int kProducerRegs = kMmaWGs == 3 ? 32 : 24;
  static constexpr int kConsumerRegs = kMmaWGs == 1 ? 232 : kMmaWGs == 2 ? 240 : 160;
  // setmaxnreg only moves registers within the CTA's launch allocation (the launch-bounds
  // register count per thread, a multiple of 8): producer 32 / consumers 240 hung (NOTES.md v31).
  static_assert(kProducerRegs * 128 + kConsumerRegs * kMmaThreads <= (65536 / (kThreads * kCtasPerSm)) / 8 * 8 * kThreads,
                "setmaxnreg budgets exceed the launch allocation");

  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using AtomLayout = Layout<Shape<Int<kMmaWGs>, _1, _1>>;
  // S = Q K^T with both operands from smem; O += P V with P from registers (no smem round trip).
  using TiledMmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileShapeQK>(), AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K, GMMA::Major::MN>(), AtomLayout{}));

  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  // V is stored as loaded (head_dim contiguous) and read by wgmma as an MN-major B operand (V^T view).
  using SmemAtomVt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::MN, Element, Int<kHeadDim>, Int<kBlockN>>());
  using SmemLayoutVt = decltype(tile_to_shape(SmemAtomVt{}, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));

  // Global views: (seq, head_dim, heads, batch); V transposed to (head_dim, seq, heads, batch).
  using ShapeT = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideT = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideVt = Stride<_1, int64_t, int64_t, int64_t>;
  using TMA_Q = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideT{}),
                                       SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TMA_K = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideT{}),
                                       take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TMA_V = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideVt{}),
                                       take<0, 2>(SmemLayoutVt{}), Shape<Int<kHeadDim>, Int<kBlockN>>{}, _1{}));
  // Epilogue: each consumer WG's 64 x kHeadDim O tile goes registers -> smem (stmatrix) -> TMA
  // store, so a WG hands O off in a few instructions and starts the next tile (per-element
  // register stores were ~20% of the time at S = 1k causal, NOTES.md v24). TMA clips the rows
  // past seqlen_q and the columns past head_dim. The buffer holds kOCols columns per WG: at
  // H = 256 (128 KB K/V ring + 64 KB Q leave 32 KB) O goes out in two 128-column rounds.
  static constexpr int kOCols = kHeadDim < 128 ? kHeadDim : 128;
  static constexpr int kORounds = kHeadDim / kOCols;
  using SmemAtomO = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, _64, Int<kOCols>>());
  using SmemLayoutO = decltype(tile_to_shape(SmemAtomO{}, Shape<_64, Int<kOCols>>{}));  // one WG's rows
  using TMA_O = decltype(make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideT{}),
                                       SmemLayoutO{}, Shape<_64, Int<kOCols>>{}, _1{}));
  // One WG's O fragment for kOCols columns: the layout the copy to smem works on (the
  // accumulator's registers run over column groups last, so round r's columns are the r-th
  // contiguous slice of the m64 x kHeadDim fragment).
  using TiledMmaOWG = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kOCols>, Int<kBlockN>>, GMMA::Major::K, GMMA::Major::MN>()));
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesK = kBlockN * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesV = kBytesK;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutVt>, 1024> v;
    cute::array_aligned<Element, kMmaWGs * cute::cosize_v<SmemLayoutO>, 1024> o;
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_q;
    alignas(16) typename Pipeline::SharedStorage pipe_k;
    alignas(16) typename Pipeline::SharedStorage pipe_v;
    int next_tile;  // dynamic schedule: producer -> consumers hand-off (scheduler.h)
    // Last, so the other kernels' smem offsets do not depend on it.
    std::conditional_t<kDenseTma, DenseTmaStorage<DenseTmaStage<kBlockM>::kBytes, kStages, Pipeline>, NoDenseTma> dense;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  // An SM has 228 KB of smem, 1 KB of it reserved per resident CTA.
  static_assert((kSmemBytes + 1024) * kCtasPerSm <= 228 * 1024, "kCtasPerSm CTAs do not fit one SM's smem");
};

// Everything the kernel reads, passed as one __grid_constant__ parameter (TMA descriptors
// must live in param/const space).
template <class Traits>
struct KernelParams {
  FlashFwdParams p;
  typename Traits::TMA_Q tma_q;
  typename Traits::TMA_K tma_k;
  typename Traits::TMA_V tma_v;
  typename Traits::TMA_O tma_o;
  float scale_log2;    // multiplier of raw (or tanh-capped) logits in the exp2 domain
  float softcap_mult;  // scale / softcap (tanh argument multiplier), softcap variant only
  TileSchedule sched;  // (query block, q head, batch) tiles
  uint32_t* timeline;  // diagnostic builds only (timeline.h), else nullptr
  int* tile_counter;   // dynamic persistent schedule (scheduler.h), else nullptr: static snake
  std::conditional_t<Traits::kDenseTma, DenseTmaDescs, NoDenseTma> dense;  // TMA of the bias / mask tiles
};

}  // namespace jax_flash::sm90
