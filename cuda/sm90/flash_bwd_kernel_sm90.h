// sm90 (Hopper) FlashAttention backward: FlashAttention-3 style. A tile is one key block of one
// kv head; a CTA runs one tile (or, persistent, several in snake order).
//   warpgroup 0   : producer; one thread loads the tile's K, V (TMA, once per tile, after the
//                   consumers released the previous ones) and streams Q / dO blocks of kBlockM
//                   query rows, with their lse / D rows, through a kStages mbarrier ring. Key
//                   split: warps 1-2 are the dQ writers (below); in the Dense kernels with TMA
//                   tiles (kDenseTma) warp 3 copies each step's bias / mask tiles (v53).
//   warpgroups 1-2: consumers, in one of two work splits (BwdTraits::kSplitD):
//   key split (head_dim 64 / 128, 128 keys per CTA): WG w owns keys [64w, 64w+64) whole:
//       S^T  = K Q^T, dP^T = V dO^T           (wgmma SS, 64 keys x kBlockM rows per WG)
//       P^T  = exp2(S^T*scale*log2e - lse*log2e) while dP^T is in flight,
//       dS^T = P^T (dP^T - D) [* softcap grad]
//       dV  += P^T dO, dK += dS^T Q           (wgmma RS: P^T / dS^T straight from registers)
//       dS^T -> smem (MN-major dS, double buffer, stmatrix; full / empty mbarriers), then the
//       previous step's dQ = dS K (wgmma SS, head_dim split over WGs: it needs both WGs' dS
//       halves, so it runs a step late and no barrier holds the WGs in lockstep; WG 1 runs about
//       half a step behind WG 0, NOTES.md v43) issued before dK; while dK runs, dQ -> smem
//       (fragment order), handed to the WG's writer warp (producer WG warps 1-2), which issues one bulk reduce-add
//       (cp.reduce.async.bulk) into dq_accum: no per-thread atomics, and the consumers never
//       wait for the bulk engine (NOTES.md v19). The writers walk the same tile / step
//       sequence (bwd_round_tile), so only the fragment passes through smem (v21).
//   head-dim split (head_dim 256, 64 keys per CTA): 64 keys x 256 of dK + dV would need 256
//       accumulator registers per thread in one WG, so both WGs share the 64 keys. S^T / dP^T
//       are split by query rows (64 keys x kBlockM/2 each), P^T and dS^T meet in smem (double
//       buffer), and dV, dK, dQ are split by head_dim (wgmma SS): the kernels with softcap,
//       dropout, bias / mask, segment ids or the deterministic mode. Plain launches take kSdPByRole
//       instead: WG 0 computes S^T and WG 1 dP^T for all kBlockM
//       rows (fewer smem bytes per step), P^T crossing to WG 1 through smem (NOTES.md v57b); then
//       WG 0 accumulates all of dV from its P^T registers and WG 1 all of dK from its dS^T
//       registers (kdKVByRole, v69), only dQ split by head_dim. To fit smem, dO has one
//       stage (released as soon as dV has read it) and dQ is staged half a WG tile at a time
//       (two bulk reduce-adds per WG per step). Vector atomics from registers instead were
//       1.3x slower: the register operands of the REDs stay held until the LSU drains them.
//   lse (log2 domain) and D = rowsum(dO*O) ride with Q and dO: the producer bulk-copies their
//   padded rows into the same pipeline stage, so consumers read them from smem when needed
//   instead of holding 2 x 16 registers across the GEMMs.
//   dK / dV live in registers for the whole tile (all q heads of a GQA group are looped here,
//   so no atomics for dK / dV), then leave through smem by TMA stores (wg_tma_store: a buffer
//   of their own in the key split, the P / dS buffers in the head-dim split). Deterministic
//   variant: per (q head, row block) turn counters order the dQ reduce-adds by key block.
// Preprocess (D, lse*log2e into padded rows, zeroed dq_accum) and postprocess (dq =
// scale*dq_accum) kernels are at the end.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "../common/dropout_frag.h"
#include "../common/mask.h"
#include "../common/red_add.h"
#include "dense_bwd.h"
#include "dense_tma.h"
#include "scheduler.h"
#include "segments.h"
#include "traits.h"
#include "utils.h"

// The 80-row steps' m64n80k16 wgmmas: without the macro CuTe's op selector silently splits them
// into m64n16k16 (5x the instructions: -30% measured, NOTES.md v65).
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#error "compile the sm90 kernels with -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (cmake/cuda_backend.cmake)"
#endif

#ifndef JF_BWD_ASYNC_DS
#define JF_BWD_ASYNC_DS 1
#endif
// 1: the S^T / dP^T-by-role instantiation (H=256) splits dV / dK by role as well: WG 0 accumulates
// all of dV from its P^T registers, WG 1 all of dK from its dS^T registers (m64n256k16 RS wgmmas),
// instead of both WGs reading P^T and dS^T back from smem for a head_dim half each (v69).
#ifndef JF_BWD_DKV_BY_ROLE
#define JF_BWD_DKV_BY_ROLE 1
#endif

// 1: the by-role (H=256) epilogue stages each WG's two head-dim halves of dV / dK at once, the
// second in the WG's dQ staging buffer, instead of one after the other through its P / dS buffer
// (session 50's tile timeline: that epilogue takes ~6.3k cycles, more than a step).
#ifndef JF_BWD_EPI_ONE_ROUND
#define JF_BWD_EPI_ONE_ROUND 0
#endif

// 1: masked steps test each element against the step's TileMask (32-bit compares, mask.h; v77);
// 0: against SeqMask::visible in 64-bit arithmetic (the A/B baseline).
#ifndef JF_BWD_TILE_MASK
#define JF_BWD_TILE_MASK 1
#endif

namespace jax_flash::sm90 {

// Is this thread's element (i, j) of the masked step's tile at (row0, key0) visible under the
// interval mask? cS: the thread's (key, row) coordinates; tm: the step's TileMask shifted to
// cS(0, 0), so that only compile-time offsets vary per element. kTileMask false: SeqMask's 64-bit
// test (the 80-row kernel, whose only masks are the lengths: its constants keep that cheap, and
// the TileMask cost it 24 B more spills).
template <bool kTileMask, class Coords>
__forceinline__ __device__ bool bwd_visible(SeqMask const& msk, TileMask const& tm, int64_t row0, int64_t key0,
                                            Coords const& cS, int i, int j) {
  if constexpr (kTileMask)
    return tm.visible(int(get<1>(cS(i, j))) - int(get<1>(cS(0, 0))), int(get<0>(cS(i, j))) - int(get<0>(cS(0, 0))));
  else
    return msk.visible(row0 + int(get<1>(cS(i, j))), key0 + int(get<0>(cS(i, j))));
}
// The masked step's TileMask at (row0, key0), shifted to this thread's first element cS(0, 0)
// (the base bwd_visible's offsets count from).
template <class Coords>
__forceinline__ __device__ TileMask bwd_tile_mask(SeqMask const& msk, int64_t row0, int64_t key0, Coords const& cS) {
  return msk.tile_mask(row0, key0).from(int(get<1>(cS(0, 0))), int(get<0>(cS(0, 0))));
}

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, class Element_, int kPolyEvery_ = 0,
          bool kDenseTma_ = false, bool kSdPByRole_ = false>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per mainloop step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kStages = kStages_;  // Q stages
  // > 0: on full tiles every kPolyEvery-th exp2 of P runs on the FMA pipe (exp2_fma), relieving
  // the MUFU while both WGs form P at once.
  static constexpr int kPolyEvery = kPolyEvery_;
  static constexpr int kMmaWGs = 2;
  static constexpr int kMmaThreads = kMmaWGs * 128;
  static constexpr int kThreads = kMmaThreads + 128;
  // Work split of the two consumer WGs (see the top of this file): by keys when the CTA has
  // 128 keys, by head_dim (and query rows for S / dP) when it has 64.
  static constexpr bool kSplitD = kBlockN == 64;
  static constexpr int kTileRing = 2;  // dynamic schedule: tiles handed over ahead of their use
  // Key split: the WGs exchange dS through mbarriers and each step's dQ GEMM runs a step late
  // (on the previous step's dS), so no barrier holds the two WGs in lockstep; WG 1 starts each
  // tile half a step behind WG 0, and one WG forms P / dS while the other's GEMMs run (v43).
  static constexpr bool kAsyncDS = !kSplitD && JF_BWD_ASYNC_DS;
  // 80-row steps (key split only, FA3's non-causal H=128 tile): every per-step cost over 25% more
  // rows (NOTES.md v65). wgmma's M is 64, so dQ is computed transposed there (kdQTransposed).
  static_assert((kBlockN == 128 || kBlockN == 64) && (kBlockM % 64 == 0 || (kBlockM == 80 && kBlockN == 128)));
  // dQ^T = K^T dS^T (head_dim x rows, WGs split head_dim) instead of dQ = dS K, when kBlockM is
  // not a multiple of 64. dq_accum then holds the transposed fragment (the convert kernel reads
  // it through the same TiledMmadQ).
  static constexpr bool kdQTransposed = kBlockM % 64 != 0;
  static constexpr int kStagesdO = kSplitD ? 1 : kStages;
  // Dense kernels whose bias / mask tiles come by TMA (key split only): producer warp 3 copies
  // each step's tile of every consumer WG (its 64 keys x kBlockM rows, dense_tma.h's layout) into
  // one kDenseStageBytes stage per WG (room for a float32 bias; NOTES.md v53).
  static constexpr bool kDenseTma = kDenseTma_;
  // Head-dim split only: S^T on WG 0 and dP^T on WG 1 for all kBlockM rows, instead of both
  // split by rows (NOTES.md v57). Its own instantiation (the two step bodies do not fit one
  // kernel's registers), for the plain launches, causal ones included since v69 made it cheaper.
  static constexpr bool kSdPByRole = kSdPByRole_;
  // kSdPByRole with dV on WG 0 and dK on WG 1, each over all of head_dim, A from registers (v69).
  static constexpr bool kdKVByRole = kSdPByRole && JF_BWD_DKV_BY_ROLE;
  // The 80-row (dQ transposed) instantiation: launches without a causal / window bound only
  // (never on the dynamic schedule, which is for bounded masks).
  static constexpr bool kUnboundedOnly = kdQTransposed;
  static_assert(!kDenseTma || kBlockN == 128, "TMA tiles in the key split");
  static constexpr int kDenseStageBytes = kDenseTma ? kBlockM * 64 * 4 : 0;
  // Key split with 3+ Q / dO stages (or the dense tiles): smem has no room for the dK / dV
  // epilogue buffer, so each WG stages its dK / dV in its dQ staging buffer (v44;
  // kBwdBarDQEmpty protocol in the kernel).
  static constexpr bool kdKVInDQStage = !kSplitD && (kStages >= 3 || kDenseTma || kdQTransposed);
  // dQ partial of one step: kdQFrag floats per consumer thread, one WG's part contiguous.
  static constexpr int kdQFrag = kBlockM * kHeadDim / kMmaThreads;
  static constexpr int kdQWGFloats = 128 * kdQFrag;
  static_assert(kdQFrag % 4 == 0);
  // dQ goes through smem in kdQRounds pieces of kdQStageFloats per WG (one bulk reduce each).
  static constexpr int kdQRounds = kSplitD ? 2 : 1;
  static constexpr int kdQStageFloats = kdQWGFloats / kdQRounds;
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kMmaThreads <= (65536 / kThreads) / 8 * 8 * kThreads,
                "setmaxnreg budgets exceed the launch allocation (see FwdTraits)");

  // S^T / dP^T: (keys, rows), reduction over head_dim; per-WG tile. WGs split the keys, or
  // (kSplitD) the rows.
  using TileShapeSdP = Shape<_64, Int<kSplitD ? kBlockM / 2 : kBlockM>, Int<kHeadDim>>;
  using AtomLayoutSdP = std::conditional_t<kSplitD, Layout<Shape<_1, _2, _1>>, Layout<Shape<_2, _1, _1>>>;
  // dK / dV: (keys, head_dim), reduction over rows; per-WG tile. WGs split the keys (P^T / dS^T
  // from registers), or (kSplitD) head_dim (P^T / dS^T from smem).
  using TileShapedKV = Shape<_64, Int<kSplitD ? kHeadDim / 2 : kHeadDim>, Int<kBlockM>>;
  using AtomLayoutdKV = std::conditional_t<kSplitD, Layout<Shape<_1, _2, _1>>, Layout<Shape<_2, _1, _1>>>;
  using MmaAtomdKV = std::conditional_t<
      kSplitD, decltype(GMMA::ss_op_selector<Element, Element, float, TileShapedKV, GMMA::Major::K, GMMA::Major::MN>()),
      decltype(GMMA::rs_op_selector<Element, Element, float, TileShapedKV, GMMA::Major::K, GMMA::Major::MN>())>;
  // dQ: (rows, head_dim), reduction over keys; per-atom tile, WGs split head_dim. Transposed:
  // dQ^T (head_dim, rows) = K^T dS^T, both operands MN-major views of sK / sdS.
  using TileShapedQAtom = std::conditional_t<kdQTransposed, Shape<Int<kHeadDim / 2>, Int<kBlockM>, Int<kBlockN>>,
                                             Shape<Int<kBlockM>, Int<kHeadDim / 2>, Int<kBlockN>>>;
  using ShapedQ = std::conditional_t<kdQTransposed, Shape<Int<kHeadDim>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kHeadDim>>>;
  using TiledMmaSdP = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileShapeSdP>(), AtomLayoutSdP{}));
  // kSdPByRole's GEMM: one WG's whole 64 keys x kBlockM tile (m64n64k16 wgmmas read 4 KB of
  // smem per 32 cycles; the row split's m64n32k16 read 3 KB per 16).
  using TiledMmaSdPRole = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>()));
  // kdKVByRole: one WG's 64 keys x head_dim (the WGs run the same GEMM on different operands).
  using TiledMmadKV = std::conditional_t<
      kdKVByRole,
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>,
                                                   GMMA::Major::K, GMMA::Major::MN>())),
      decltype(make_tiled_mma(MmaAtomdKV{}, AtomLayoutdKV{}))>;
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileShapedQAtom, GMMA::Major::MN,
                           kdQTransposed ? GMMA::Major::K : GMMA::Major::MN>(),
      std::conditional_t<kdQTransposed, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, _2, _1>>>{}));

  // Q / dO: (rows, head_dim, stage), head_dim contiguous. The "t" views are the transposes
  // (head_dim, rows, stage) of the same memory, read as MN-major B operands.
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  using SmemLayoutdO = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStagesdO>>{}));
  using SmemLayoutdOt = decltype(composition(
      SmemLayoutdO{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStagesdO>>{},
                                  Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  // K / V: (keys, head_dim); Kt = (head_dim, keys) view.
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // dS: (rows, keys), rows contiguous (MN-major A of dQ = dS K), so the dS^T accumulator goes
  // to smem by stmatrix (8 adjacent query rows of one key per 8x8 row) through the
  // dSt = (keys, rows) view. Under kSplitD the same view is the K-major A operand of
  // dK += dS^T Q (and, on the P buffer, of dV += P^T dO).
  // kdQTransposed (80 rows: no 128-byte swizzle along them) has keys contiguous instead, the
  // K-major B of dQ^T = K^T dS^T, stored by the transposing stmatrix (FA3's layout; the 32-byte
  // swizzle a rows-contiguous 80-row tile gets cost 30%, NOTES.md v65).
  using SmemAtomdS = std::conditional_t<
      kdQTransposed, decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kBlockN>>()),
      decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::MN, Element, Int<kBlockM>, Int<kBlockN>>())>;
  using SmemLayoutdS = decltype(tile_to_shape(SmemAtomdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{},
                                              std::conditional_t<kdQTransposed, Step<_1, _2>, Step<_2, _1>>{}));
  // stmatrix of a (keys, rows) accumulator into the dSt view: 8 adjacent rows of one key per
  // 16-byte row, or (kdQTransposed) transposed, 8 adjacent keys of one row.
  using StoreAtomdS = std::conditional_t<kdQTransposed, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>;
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));

  using ShapeT = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideT = Stride<int64_t, _1, int64_t, int64_t>;
  using TMA_Q = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideT{}),
                                       take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TMA_K = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideT{}),
                                       SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  // Epilogue: each WG's dK and dV (64 keys x kdKVCols) leave through a 16 KB smem buffer per WG
  // by TMA stores (wg_tma_store): a buffer of their own (key split), or the P / dS buffers once
  // the last step's GEMMs have read them (head-dim split). TiledMmadKVWG is one WG's share of
  // TiledMmadKV, whose C fragment is the same per thread.
  static constexpr int kdKVCols = kSplitD ? kHeadDim / 2 : kHeadDim;
  using SmemLayoutdKV = decltype(tile_to_shape(
      cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, _64, Int<kdKVCols>>(), Shape<_64, Int<kdKVCols>>{}));
  using TMA_dKV = decltype(make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideT{}),
                                         SmemLayoutdKV{}, Shape<_64, Int<kdKVCols>>{}, _1{}));
  using TiledMmadKVWG = decltype(make_tiled_mma(MmaAtomdKV{}));
  // One pipeline stage: a Q (dO) tile plus its lse (D) rows.
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element) + kBlockM * sizeof(float);
  static constexpr uint32_t kBytesK = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;
  using PipelinedO = cutlass::PipelineTmaAsync<kStagesdO>;
  using PipelineStatedO = cutlass::PipelineState<kStagesdO>;

  static constexpr int kdSSize = cute::cosize_v<SmemLayoutdS>;
  // The dS / P stages' per-thread copies take the swizzle relative to the stage base
  // (smem_tensor_for_copy): every stage must start on the swizzle's 1 KB period.
  static_assert(kdSSize * sizeof(Element) % 1024 == 0, "dS / P stages on the 1 KB swizzle period");
  static_assert(!kSplitD || cute::cosize_v<SmemLayoutdKV> <= 2 * kdSSize, "dK / dV staging in the P / dS buffers");
  static_assert(!(kdKVInDQStage || (kdKVByRole && JF_BWD_EPI_ONE_ROUND)) ||
                    cute::cosize_v<SmemLayoutdKV> * sizeof(Element) <= kdQStageFloats * sizeof(float),
                "dK / dV staging in the dQ staging buffer");
  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdO>, 1024> dout;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> v;
    cute::array_aligned<Element, 2 * kdSSize, 1024> ds;  // double buffer
    // (An empty array_aligned still takes its alignment in bytes: kdKVInDQStage, which needs every
    // byte, gives its empty members 16.)
    cute::array_aligned<Element, kSplitD ? 2 * kdSSize : 0, kdKVInDQStage ? 16 : 1024> p;  // P, same layout as dS
    // (1024-aligned where it stages swizzled dK / dV tiles: kdKVInDQStage, JF_BWD_EPI_ONE_ROUND.)
    cute::array_aligned<float, kMmaWGs * kdQStageFloats, kdKVInDQStage || (kdKVByRole && JF_BWD_EPI_ONE_ROUND) ? 1024 : 128> dq;  // dQ staging
    cute::array_aligned<Element, kSplitD || kdKVInDQStage ? 0 : kMmaWGs * cute::cosize_v<SmemLayoutdKV>,
                        kdKVInDQStage ? 16 : 1024> dkv;  // epilogue
    alignas(16) float lse[kStages][kBlockM];   // lse * log2(e)
    alignas(16) float dsum[kStagesdO][kBlockM];  // rowsum(dO * O)
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;  // K, V of the tile landed
    alignas(16) cutlass::arch::ClusterBarrier barrier_kv_empty;         // consumers done with them
    alignas(16) typename Pipeline::SharedStorage pipe_q;
    alignas(16) typename PipelinedO::SharedStorage pipe_do;
    // Dynamic schedule only (bwd_next_tile): the producer's tile hand-off ring (inside the
    // struct's 1024-byte tail padding, so the size stays the same).
    alignas(16) cutlass::arch::ClusterBarrier tile_full[kTileRing];
    alignas(16) cutlass::arch::ClusterBarrier tile_empty[kTileRing];
    int tile_ring[kTileRing];
    // Key split with kAsyncDS: the dS double buffer's full / empty barriers (both WGs arrive).
    // cutlass's ClusterBarrier wait / arrive asm has no memory clobber: the ring is sound because
    // every dS access is itself volatile asm (stmatrix, fence.proxy.async, wgmma); plain C++ stores
    // into it would need clobbering waits (utils.h named_sync style).
    alignas(16) cutlass::arch::ClusterBarrier ds_full[2];
    alignas(16) cutlass::arch::ClusterBarrier ds_empty[2];
    // kDenseTma: per WG, its stage's tiles landed / the WG formed its P from them.
    alignas(16) cutlass::arch::ClusterTransactionBarrier dense_full[2];
    alignas(16) cutlass::arch::ClusterBarrier dense_empty[2];
    // kDenseTma: one stage per WG. Last, after the small members: placed between the 1024-byte
    // aligned arrays, its alignment padding would not fit at H=128 (227 KB exactly).
    std::conditional_t<kDenseTma, cute::array_aligned<uint8_t, kMmaWGs * kDenseStageBytes, 1024>, uint8_t> dense;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
  static_assert(kSmemBytes <= 227 * 1024, "sm90 shared memory per block");
};

// The static schedule's split tail (bwd_static_tile, launch_bwd). Per slot (a tile of the tail)
// and consumer WG: the steps whose partial dK / dV have been added so far, and
// kBwdSplitWGFloats floats of those sums (layout: flash_params.h, kBwdSplitSlotInts), zeroed by
// the row statistics kernel.
constexpr int kBwdSplitWGFloats = 16384;
static_assert(kBwdSplitSlotInts == 4 + 2 * kBwdSplitWGFloats);
struct BwdSplitTail {
  int tile0 = 0;         // the tail's first tile (the main launch ran the tiles before it)
  SplitDeal deal;        // its tiles' steps over the CTAs (scheduler.h split_piece)
  FastDiv by_rows;       // by the row blocks per q head (nm)
  int* slots = nullptr;  // the workspace's slots (tile_counter + 4)
  __device__ int* steps_done(int slot, int wg) const { return slots + slot * kBwdSplitSlotInts + wg; }
  __device__ float* partial(int slot, int wg) const {
    return reinterpret_cast<float*>(slots + slot * kBwdSplitSlotInts + 4) + wg * kBwdSplitWGFloats;
  }
};

template <class Traits>
struct BwdKernelParams {
  FlashBwdParams p;
  typename Traits::TMA_Q tma_q;
  typename Traits::TMA_Q tma_do;
  typename Traits::TMA_K tma_k;
  typename Traits::TMA_K tma_v;
  typename Traits::TMA_dKV tma_dk;  // stores
  typename Traits::TMA_dKV tma_dv;
  float scale_log2;    // multiplier of the raw (or tanh) logit in the exp2 domain
  float softcap_mult;  // scale / softcap (tanh argument), softcap variant only
  int64_t acc_rows, acc_cols;
  TileSchedule sched;  // (key block, kv head, batch) tiles
  int* tile_counter;   // dynamic schedule (flash_bwd_kernel<..., Dynamic = true>), else nullptr
  uint32_t* timeline;  // diagnostic builds only (timeline.h, JF_BWD_TIMELINE), else nullptr
  DenseTmaDescs dense;  // Traits::kDenseTma only
  BwdSplitTail split;   // static schedule: the last round's tiles in pieces (bwd_static_tile)
  // Early dQ conversion (launch_bwd, NOTES.md v83): per (batch, kv head), the steps whose dQ
  // reduce-adds have landed, counted by each writer warp once per tile (bwd_dq_writer); the dQ
  // conversion, launched as a programmatic dependent, converts a head's rows once its count is
  // complete, on the SMs the last round leaves idle. nullptr: not counted (converted after).
  int* dq_ready;
};

// Query row blocks [m_min, m_min + nm) that key block n_block can see.
template <int kBlockM, int kBlockN>
__forceinline__ __device__ void row_block_range(SeqMask const& msk, int n_block, int& m_min, int& nm) {
  int64_t r_lo, r_hi;
  msk.row_range(int64_t(n_block) * kBlockN, int64_t(n_block + 1) * kBlockN, &r_lo, &r_hi);
  m_min = r_hi > r_lo ? int(r_lo / kBlockM) : 0;
  nm = r_hi > r_lo ? int((r_hi + kBlockM - 1) / kBlockM) - m_min : 0;
}

// The tile a CTA runs in round r (snake order), with its visible query row blocks
// [m_min, m_min + nm) and steps (n_iters = nm per q head of the group; 0: nothing to do).
// Producer, consumers and dQ writers all walk this same sequence.
// A step's (q head, row block); steps run row blocks innermost, q heads of the group outermost.
struct BwdStep {
  int hq, m;
};
struct BwdTile {
  TileCoord t;
  int m_min, nm, n_iters;
  bool done;  // past the last tile of this CTA
  BwdStep start;  // the first step: the group's first q head, row block m_min
  // A piece of a split tile (bwd_static_tile): its steps start later (start) and stop earlier
  // (n_iters), and its dK / dV are partial sums that meet in slot `slot` of the split workspace
  // (-1: a whole tile).
  int slot;
  __device__ BwdStep first_step() const { return start; }
  // Counting instead of dividing the step index by nm (an integer division per step and warp).
  __device__ void next_step(BwdStep& s) const {
    if (++s.m == m_min + nm) {
      s.m = m_min;
      ++s.hq;
    }
  }
};
// Segments: the row blocks narrowed to the key block's segments (segments.h).
template <class T, bool Segments>
__forceinline__ __device__ BwdTile bwd_tile(BwdKernelParams<T> const& kp, int linear) {
  BwdTile w{};
  w.done = linear >= kp.sched.num_tiles;
  if (w.done) return w;
  w.t = get_tile(linear, kp.sched);
  row_block_range<T::kBlockM, T::kBlockN>(make_seq_mask(kp.p, w.t.b), w.t.m_block, w.m_min, w.nm);
  if constexpr (Segments) narrow_rows_to_segments<T::kBlockM, T::kBlockN>(kp.p, w.t.b, w.t.m_block, w.m_min, w.nm);
  int const group = kp.p.heads_q / kp.p.heads_kv;
  w.n_iters = w.nm * group;
  w.start = {w.t.h * group, w.m_min};
  w.slot = -1;
  return w;
}

// The dynamic schedule's tile of round r for the consumers and dQ writers of a CTA (a linear
// index; >= num_tiles: none left). Persistent causal launches (BwdTileConfig::DynamicCausalMaxS):
// the producer claims tiles from a global counter, each once it has issued the previous tile's
// loads (as the forward's v39), and hands them over through a kTileRing-deep ring in smem: it
// waits tile_empty, writes the slot, arrives on tile_full (release); every reader thread waits
// tile_full (acquire), reads, arrives on tile_empty.
template <class T>
__forceinline__ __device__ int bwd_next_tile(typename T::SharedStorage& ss, int r) {
  int const slot = r % T::kTileRing;
  ss.tile_full[slot].wait((r / T::kTileRing) & 1);
  int const linear = *reinterpret_cast<int volatile*>(&ss.tile_ring[slot]);
  ss.tile_empty[slot].arrive();
  return linear;
}
// The static schedule's work of round r for this CTA: round r's tile in snake order. The split
// tail's launch (Split; launch_bwd: persistent, unbounded mask, no lengths) runs only the tiles
// that a last round would leave to fewer CTAs than the grid, cut into pieces: their steps
// (split.deal.tile_units per tile) are dealt out to every CTA as one contiguous range, which covers
// at most two tiles (round k: piece k). Without it the last round leaves gridDim.x - L CTAs idle
// for a whole tile (H=128, S=4k: 2048 tiles on 132 SMs; NOTES.md v82, v82b: +1% at 4k / 16k).
template <class T, bool Segments, bool Split>
__forceinline__ __device__ BwdTile bwd_static_tile(BwdKernelParams<T> const& kp, int r) {
  if constexpr (!Split) {
    return bwd_tile<T, Segments>(kp, snake_tile(r));
  } else {
    BwdSplitTail const& sp = kp.split;
    SplitPiece const pc = split_piece(sp.deal, int(blockIdx.x), r);
    if (r > 1 || pc.s1 <= pc.s0) {
      BwdTile none{};
      none.done = true;
      return none;
    }
    BwdTile w = bwd_tile<T, Segments>(kp, sp.tile0 + pc.tile);
    int const hq_off = sp.by_rows.div(pc.s0);  // every tile has nm = tile_units / group here
    w.start = {w.start.hq + hq_off, w.m_min + (pc.s0 - hq_off * w.nm)};
    w.n_iters = pc.s1 - pc.s0;
    w.slot = w.n_iters < sp.deal.tile_units ? pc.tile : -1;
    return w;
  }
}
// Consumers, dQ writers and the dense tile loader: round r's tile on either schedule.
template <class T, bool Segments, bool Dynamic, bool Split>
__forceinline__ __device__ BwdTile bwd_round_tile(BwdKernelParams<T> const& kp, typename T::SharedStorage& ss, int r) {
  if constexpr (Dynamic) return bwd_tile<T, Segments>(kp, bwd_next_tile<T>(ss, r));
  else return bwd_static_tile<T, Segments, Split>(kp, r);
}

// Reader threads per hand-off: both consumer WGs, the key split's two dQ writer warps and
// (kDenseTma) the dense tile loader warp.
template <class T>
constexpr int kBwdTileReaders = T::kMmaThreads + (T::kSplitD ? 0 : 64) + (T::kDenseTma ? 32 : 0);

// Named barrier ids, as passed to cutlass::arch::NamedBarrier (which adds its 8 reserved ids:
// hardware ids 8..15, so user ids must stay below 8).
constexpr int kBwdBarDS = 0;   // both consumer WGs stored their dS^T (P^T) half; kAsyncDS: WG 1 may start a tile
constexpr int kBwdBarDQ = 1;   // + wg: the WG stored its dQ fragment (head-dim split)
constexpr int kBwdBarEpilogue = kBwdBarDQ;  // + wg: the WG's dK / dV stores (after its last dQ use)
// Key split: consumer WG wg hands its dQ fragment to writer warp 1 + wg of the producer WG.
constexpr int kBwdBarDQFull = 3;   // + wg: the fragment is staged (WG arrives, writer syncs)
constexpr int kBwdBarDQEmpty = 5;  // + wg: the writer's reduce has read it (writer arrives)
static_assert(kBwdBarDQEmpty + 1 + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount < 16, "16 hardware barriers");
constexpr int kBwdDQHandoffThreads = 128 + 32;

// Offset of element i of consumer thread t's dQ fragment inside one kBlockM-row block of
// dq_accum (and of the smem staging buffer): fragment-major, 4 floats per thread per chunk.
template <class T>
__forceinline__ __device__ int dq_frag_offset(int t, int i) {
  return (t / 128) * T::kdQWGFloats + (i / 4) * 512 + (t % 128) * 4 + (i % 4);
}

// Deterministic dQ: the reduce-adds into one (q head, row block) happen in key-block order.
// The counter counts finished WG reduces; key block n waits for 2 * (n - first key block).
__forceinline__ __device__ void dq_wait_turn(int const* sem, int target) {
  int v;
  // Bounded: a wrong turn count must never hang the GPU (it would only cost determinism).
  for (int spin = 0; spin < (1 << 26); ++spin) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(sem) : "memory");
    if (v >= target) return;
    __nanosleep(32);
  }
}

// One step's dQ addresses, shared by the consumers (head-dim split) and the writer warps (key
// split): WG wg's part of row block row0 of q head hq in dq_accum; the row block's turn counter;
// key block n_block's turn (deterministic mode).
template <class T>
__forceinline__ __device__ float* dq_block_ptr(BwdKernelParams<T> const& kp, int b, int hq, int row0, int wg) {
  return kp.p.dq_accum + ((int64_t(b) * kp.p.heads_q + hq) * kp.acc_rows + row0) * kp.acc_cols + wg * T::kdQWGFloats;
}
template <class T>
__forceinline__ __device__ int* dq_counter_ptr(BwdKernelParams<T> const& kp, int b, int hq, int row0) {
  return kp.p.dq_semaphore + (int64_t(b) * kp.p.heads_q + hq) * (kp.acc_rows / 64) + row0 / 64;
}
template <class T>
__forceinline__ __device__ int dq_turn_of(SeqMask const& msk, int m, int n_block) {
  int n_lo, n_hi;
  key_block_range<T::kBlockM, T::kBlockN>(msk, m, n_lo, n_hi);
  return 2 * (n_block - n_lo);
}

// JF_BWD_DIAG_DQ (diagnostic harness builds only; dQ comes out wrong): 1 skips the dQ reduce-adds,
// 2 makes them plain bulk stores (the same bytes without L2's read-modify-write), 3 reduce-adds
// half of each piece (the L2 traffic of a pre-summed CTA pair), to see how much of a step the dQ
// traffic costs (NOTES.md, next steps after sessions 20 and 28).
#ifndef JF_BWD_DIAG_DQ
#define JF_BWD_DIAG_DQ 0
#endif
__forceinline__ __device__ void bulk_reduce_add_f32(float* gmem, float const* smem, int bytes) {
#if JF_BWD_DIAG_DQ == 3
  bytes /= 2;
#endif
#if JF_BWD_DIAG_DQ == 1
  return;
#elif JF_BWD_DIAG_DQ == 2
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
               :
               : "l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
               : "memory");
#else
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :
               : "l"(gmem), "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
               : "memory");
#endif
}

// A piece of a split tile (BwdTile::slot >= 0): this WG's partial dK / dV (fragments a and b;
// b empty when the WG holds one accumulator, kdKVByRole) are reduce-added into the slot, and the
// WG whose steps complete the tile's count gets the sums back in a and b and stores them; the
// others store nothing. Returns whether this WG stores. Fragment order (dq_frag_offset's): each
// warp's 16-byte reductions cover 512 contiguous bytes. No wgmma may be in flight (the branch on
// the count is not provably uniform).
template <class T, class FragA, class FragB>
__forceinline__ __device__ bool bwd_piece_combine(BwdKernelParams<T> const& kp, int slot, int steps, int wg, int tidx,
                                                  FragA& a, FragB&& b) {
  constexpr int kA = decltype(size(a))::value;
  constexpr int kB = [] {
    if constexpr (std::is_same_v<std::decay_t<FragB>, std::nullptr_t>) return 0;
    else return int(decltype(size(std::declval<std::decay_t<FragB>&>()))::value);
  }();
  static_assert(kA % 4 == 0 && kB % 4 == 0 && (kA + kB) * 128 <= kBwdSplitWGFloats, "split slot too small");
  int const t = tidx % 128;
  float* const ws = kp.split.partial(slot, wg) + t * 4;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kA; i += 4) red_add_f32x4(ws + i * 128, a(i), a(i + 1), a(i + 2), a(i + 3));
  if constexpr (kB > 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kB; i += 4) red_add_f32x4(ws + (kA + i) * 128, b(i), b(i + 1), b(i + 2), b(i + 3));
  }
  __threadfence();  // (release) the adds before the count, as CUDA's threadFenceReduction sample
  named_sync(128, kBwdBarEpilogue + wg);
  int done = 0;
  if (t == 0) done = atomicAdd(kp.split.steps_done(slot, wg), steps) + steps;
  bool const last = named_sync_or(128, kBwdBarEpilogue + wg, done == kp.split.deal.tile_units);
  if (last) {
    __threadfence();  // (acquire) the other pieces' adds; L2 reads below, past the SM's L1
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kA; i += 4) {
      float4 const v = __ldcg(reinterpret_cast<float4 const*>(ws + i * 128));
      a(i) = v.x, a(i + 1) = v.y, a(i + 2) = v.z, a(i + 3) = v.w;
    }
    if constexpr (kB > 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kB; i += 4) {
        float4 const v = __ldcg(reinterpret_cast<float4 const*>(ws + (kA + i) * 128));
        b(i) = v.x, b(i + 1) = v.y, b(i + 2) = v.z, b(i + 3) = v.w;
      }
    }
  }
  return last;
}

// Key split: the writer warp of consumer WG wg. Each staged dQ fragment goes into dq_accum with
// one bulk reduce-add issued here, so the consumers never wait for the bulk engine: they only
// sync on kBwdBarDQEmpty before restaging, a step later. The writer walks the same tile / step
// sequence as the consumers (bwd_round_tile), so only the fragment passes through smem.
// Deterministic: the turn wait is here too, off the consumers' path.
template <class T, bool Deterministic, bool Dynamic, bool Segments, bool Split>
__device__ void bwd_dq_writer(BwdKernelParams<T> const& kp, typename T::SharedStorage& ss, int wg) {
  FlashBwdParams const& p = kp.p;
  float const* stage = ss.dq.data() + wg * T::kdQStageFloats;
  bool const leader = threadIdx.x % 32 == 0;
  // Starts empty. kdKVInDQStage: a tile's first handoff waits for the previous epilogue's stores
  // instead, and the epilogue takes the arrival of the tile's last reduce, so each arrival still
  // meets exactly one consumer sync (a second arrival before it would break the barrier).
  if constexpr (!T::kdKVInDQStage) named_arrive(kBwdDQHandoffThreads, kBwdBarDQEmpty + wg);
  for (int r = 0;; ++r) {
    BwdTile const w = bwd_round_tile<T, Segments, Dynamic, Split>(kp, ss, r);
    if (w.done) break;
    SeqMask const msk = make_seq_mask(p, w.t.b);
    BwdStep st = w.first_step();
    // The step's piece of dq_accum: the q head's base once per head, plus the row block's
    // offset (dq_block_ptr's whole 64-bit chain per step cost ~20 instructions, NOTES.md
    // session 33).
    int base_hq = -1;
    float* head_base = nullptr;
    for (int it = 0; it < w.n_iters; ++it, w.next_step(st)) {
      int const hq = st.hq, m = st.m;
      int const row0 = m * T::kBlockM;
      if (hq != base_hq) {
        base_hq = hq;
        head_base = dq_block_ptr(kp, w.t.b, hq, 0, wg);
      }
      named_sync(kBwdDQHandoffThreads, kBwdBarDQFull + wg);
      if (leader) {
        int* const sem = dq_counter_ptr(kp, w.t.b, hq, row0);
        if constexpr (Deterministic) dq_wait_turn(sem, dq_turn_of<T>(msk, m, w.t.m_block));
        bulk_reduce_add_f32(head_base + row0 * kp.acc_cols, stage, T::kdQStageFloats * sizeof(float));
        tma_store_arrive();
        if constexpr (Deterministic) {
          asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the adds are done, not just read
          __threadfence();
          atomicAdd(sem, 1);
        } else {
          tma_store_wait<0>();  // the staging buffer has been read
        }
      }
      __syncwarp();
      named_arrive(kBwdDQHandoffThreads, kBwdBarDQEmpty + wg);
    }
    // Early conversion: the tile's (piece's) steps count once its reduce-adds have landed (the
    // bulk engine's writes, then a release to the converting CTA on another SM). Once per tile,
    // where the writer has a whole epilogue and step of slack (per step it cost 15-20%, v61).
    if constexpr (!Deterministic) {
      if (kp.dq_ready != nullptr && leader && w.n_iters > 0) {
        asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
        asm volatile("fence.proxy.async.global;\n" ::: "memory");
        __threadfence();
        atomicAdd(kp.dq_ready + int64_t(w.t.b) * p.heads_kv + w.t.h, w.n_iters);
      }
    }
  }
  if (leader) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// kDenseTma: consumer WG wg's bias / mask stage.
template <class T>
__forceinline__ __device__ uint8_t* bwd_dense_stage(typename T::SharedStorage& ss, int wg) {
  if constexpr (T::kDenseTma) return ss.dense.data() + wg * T::kDenseStageBytes;
  else return nullptr;
}

// kDenseTma: producer warp 3 copies each step's bias / mask tile of consumer WG wg (its 64 keys x
// the step's kBlockM rows) into the WG's stage by TMA. One stage per WG is enough: a WG is done
// with it once its P is formed, early in the step, so the next step's copy lands under the rest
// of the step. Walks the same tile / step sequence as the consumers (bwd_round_tile).
template <class T, bool Dynamic>
__device__ void bwd_dense_loader(BwdKernelParams<T> const& kp, typename T::SharedStorage& ss) {
  int count = 0;  // steps issued
  for (int r = 0;; ++r) {
    BwdTile const w = bwd_round_tile<T, false, Dynamic, false>(kp, ss, r);
    if (w.done) break;
    BwdStep st = w.first_step();
    for (int it = 0; it < w.n_iters; ++it, w.next_step(st), ++count) {
      CUTLASS_PRAGMA_UNROLL
      for (int wg = 0; wg < T::kMmaWGs; ++wg) {
        ss.dense_empty[wg].wait((count & 1) ^ 1);  // passes at once for the first step
        if (threadIdx.x % 32 == 0) {
          ss.dense_full[wg].arrive_and_expect_tx(kp.dense.stage_tx_bytes);
          issue_dense_tma<T::kBlockM>(kp.dense, reinterpret_cast<uint64_t*>(&ss.dense_full[wg]),
                                      bwd_dense_stage<T>(ss, wg), w.t.m_block * T::kBlockN + 64 * wg,
                                      st.m * T::kBlockM, st.hq, w.t.b);
        }
        __syncwarp();
      }
    }
  }
}

template <class Pipe, class State>
__forceinline__ __device__ void bwd_consumer_wait(Pipe& pipe, State& st) {
  auto tok = pipe.consumer_try_wait(st);
  pipe.consumer_wait(st, tok);
}

// Segments: packed sequences (segment ids; segments.h, the ranges in p.tile_counter's
// workspace), an instantiation of its own so the other kernels' code is unchanged. Dense: a bias
// and / or a boolean mask, with dbias (dense_bwd.h): read element by element from global memory on
// every step, or (Traits::kDenseTma) from the WG's smem tile, the interval rule on boundary steps
// only.
// Dropout: attention dropout (common/dropout_frag.h), without the other optional inputs.
// SplitTail: the static schedule's last round in pieces, as a launch of its own after the whole
// rounds (bwd_static_tile; plain and softcap launches that split; its own instantiation, so the
// main launch keeps its register allocation: in one kernel the split cost 4-5%, NOTES.md v82).
template <class Traits, bool Softcap, bool Deterministic, bool Dynamic = false, bool Segments = false,
          bool Dense = false, bool Dropout = false, bool SplitTail = false>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_bwd_kernel(__grid_constant__ const BwdKernelParams<Traits> kp) {
  using T = Traits;
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kHeadDim = T::kHeadDim;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  FlashBwdParams const& p = kp.p;
  static_assert(!(Dense && (Softcap || Deterministic || Segments)), "bias / mask run without these (routing)");
  static_assert(!(Dropout && (Softcap || Deterministic || Segments || Dense)), "dropout runs alone (routing)");
  static_assert(!SplitTail || !(Dynamic || Deterministic || Segments || Dense || Dropout), "split tail: plain / softcap");

  int const warp_group = __shfl_sync(0xffffffff, int(threadIdx.x) / 128, 0);
  int const warp_in_wg = __shfl_sync(0xffffffff, (int(threadIdx.x) / 32) % 4, 0);

  if (threadIdx.x == 0) {
    ss.barrier_kv.init(1);
    ss.barrier_kv_empty.init(T::kMmaThreads);
    if constexpr (Dynamic) {
      for (int i = 0; i < T::kTileRing; ++i) {
        ss.tile_full[i].init(1);
        ss.tile_empty[i].init(kBwdTileReaders<T>);
      }
    }
    if constexpr (T::kAsyncDS) {
      for (int i = 0; i < 2; ++i) {
        ss.ds_full[i].init(T::kMmaThreads);
        ss.ds_empty[i].init(T::kMmaThreads);
      }
    }
    if constexpr (T::kDenseTma) {
      for (int i = 0; i < 2; ++i) {
        ss.dense_full[i].init(1);
        ss.dense_empty[i].init(128);
      }
    }
  }
  typename T::Pipeline::Params pp;
  pp.role = warp_group == 0 ? T::Pipeline::ThreadCategory::Producer : T::Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = T::kMmaThreads;
  pp.transaction_bytes = T::kBytesQ;
  typename T::Pipeline pipe_q(ss.pipe_q, pp, Shape<_1, _1, _1>{});
  typename T::PipelinedO::Params ppdo;
  ppdo.role = warp_group == 0 ? T::PipelinedO::ThreadCategory::Producer : T::PipelinedO::ThreadCategory::Consumer;
  ppdo.is_leader = pp.is_leader;
  ppdo.num_consumers = pp.num_consumers;
  ppdo.transaction_bytes = pp.transaction_bytes;
  typename T::PipelinedO pipe_do(ss.pipe_do, ppdo, Shape<_1, _1, _1>{});
  __syncthreads();
  // Early conversion: the dQ conversion's CTAs may take each SM this launch leaves (it never
  // waits for them; they wait for dq_ready).
  if (kp.dq_ready != nullptr) pdl_trigger();

  // Tiles of this CTA: blockIdx.x, then (persistent launch) one per round in snake order.
  // Tiles with no visible row load nothing and store zero dK / dV; `loaded` counts the others,
  // which each take one phase of barrier_kv and barrier_kv_empty.
  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (warp_in_wg == 0 && threadIdx.x == 0) {
      Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
      Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutdO{});
      Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
      Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
      Tensor mQ = kp.tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads_q, p.batch));
      Tensor mdO = kp.tma_do.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads_q, p.batch));
      Tensor mK_all = kp.tma_k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.heads_kv, p.batch));
      Tensor mV_all = kp.tma_v.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.heads_kv, p.batch));
      auto cq = kp.tma_q.get_slice(_0{});
      auto cdo = kp.tma_do.get_slice(_0{});
      auto ck = kp.tma_k.get_slice(_0{});
      auto cv = kp.tma_v.get_slice(_0{});
      Tensor tQs = group_modes<0, 3>(cq.partition_D(sQ));    // (TMA, stage)
      Tensor tdOs = group_modes<0, 3>(cdo.partition_D(sdO));
      using BarrierT = cutlass::arch::ClusterTransactionBarrier::ValueType;
      auto wr = cutlass::make_producer_start_state<typename T::Pipeline>();
      auto wr_do = cutlass::make_producer_start_state<typename T::PipelinedO>();
      int loaded = 0;
      BwdProducerTimeline ptl;
      ptl.init(kp.timeline, kProducerTimelineOffset, blockIdx.x == 0);
      int claimed = int(blockIdx.x);  // dynamic: the CTA's first tile is its own index
      auto claim_next = [&] {  // dynamic: the next tile (the counter counts tiles past the first grid)
        if constexpr (Dynamic) claimed = atomicAdd(kp.tile_counter, 1) + int(gridDim.x);
      };
      for (int r = 0;; ++r) {
        ptl.mark(kBProdTop);
        if constexpr (Dynamic) {  // hand this round's tile to the consumers and dQ writers
          int const slot = r % T::kTileRing;
          ss.tile_empty[slot].wait(((r / T::kTileRing) & 1) ^ 1);  // passes at once in the first rounds
          *reinterpret_cast<int volatile*>(&ss.tile_ring[slot]) = claimed;
          ss.tile_full[slot].arrive();
        }
        BwdTile const w = Dynamic ? bwd_tile<T, Segments>(kp, claimed) : bwd_static_tile<T, Segments, SplitTail>(kp, r);
        if (w.done) break;
        TileCoord const t = w.t;
        int const n_iters = w.n_iters;
        if (n_iters == 0) {
          ptl.end_tile();
          claim_next();
          continue;
        }
        // K / V are single-buffered: the previous tile's consumers must be done with them.
        if (loaded > 0) ss.barrier_kv_empty.wait((loaded - 1) & 1);
        ptl.mark(kBProdKVFree);
        Tensor gK = local_tile(mK_all(_, _, t.h, t.b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(t.m_block, _0{}));
        Tensor gV = local_tile(mV_all(_, _, t.h, t.b), Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(t.m_block, _0{}));
        ss.barrier_kv.arrive_and_expect_tx(2 * T::kBytesK);
        copy(kp.tma_k.with(reinterpret_cast<BarrierT&>(ss.barrier_kv), 0, TMA::CacheHintSm90::EVICT_FIRST),
             ck.partition_S(gK), ck.partition_D(sK));
        copy(kp.tma_v.with(reinterpret_cast<BarrierT&>(ss.barrier_kv), 0, TMA::CacheHintSm90::EVICT_FIRST),
             cv.partition_S(gV), cv.partition_D(sV));
        ptl.mark(kBProdKVIssued);
        BwdStep st = w.first_step();
        for (int it = 0; it < n_iters; ++it, w.next_step(st)) {
          int const hq = st.hq, m = st.m;
          Tensor gQ = local_tile(mQ(_, _, hq, t.b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
          Tensor gdO = local_tile(mdO(_, _, hq, t.b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
          int64_t const stats = row_stats_offset(p, t.b, hq) + int64_t(m) * kBlockM;
          pipe_q.producer_acquire(wr);
          copy(kp.tma_q.with(*pipe_q.producer_get_barrier(wr), 0, TMA::CacheHintSm90::EVICT_LAST),
               group_modes<0, 3>(cq.partition_S(gQ)), tQs(_, wr.index()));
          SM90_BULK_COPY_G2S::copy(p.lse_log2 + stats, pipe_q.producer_get_barrier(wr), ss.lse[wr.index()],
                                   kBlockM * sizeof(float));
          pipe_do.producer_acquire(wr_do);
          copy(kp.tma_do.with(*pipe_do.producer_get_barrier(wr_do), 0, TMA::CacheHintSm90::EVICT_LAST),
               group_modes<0, 3>(cdo.partition_S(gdO)), tdOs(_, wr_do.index()));
          SM90_BULK_COPY_G2S::copy(p.dsum + stats, pipe_do.producer_get_barrier(wr_do), ss.dsum[wr_do.index()],
                                   kBlockM * sizeof(float));
          ++wr;
          ++wr_do;
          if (it == 0) ptl.mark(kBProdQIssued);
        }
        ptl.end_tile();
        ++loaded;
        // Dynamic: the next tile is claimed once this one's loads are all issued, near its end.
        claim_next();
      }
      pipe_q.producer_tail(wr);
      pipe_do.producer_tail(wr_do);
    } else if (!T::kSplitD && (warp_in_wg == 1 || warp_in_wg == 2)) {
      bwd_dq_writer<T, Deterministic, Dynamic, Segments, SplitTail>(kp, ss, warp_in_wg - 1);
    } else if (T::kDenseTma && warp_in_wg == 3) {
      bwd_dense_loader<T, Dynamic>(kp, ss);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  int const tidx = int(threadIdx.x) - 128;
  int const wg = consumer_warpgroup();
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmadKV mma_dkv;
  typename T::TiledMmadQ mma_dq;
  // kdKVByRole: tdVrdV is this WG's role accumulator (dV on WG 0, dK on WG 1, 64 x head_dim) and
  // tdKrdK is never used (no registers).
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutdO{});
  Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutdOt{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
  Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKt{});

  auto wg_sdp = mma_sdp.get_slice(wg * 128);
  Tensor tSrK = wg_sdp.partition_fragment_A(sK);     // (MMA, MMA_M, MMA_K)
  Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stage)
  Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
  Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);
  auto wg_dkv = mma_dkv.get_slice(T::kdKVByRole ? 0 : wg * 128);  // (by role: a one-WG tiled MMA)
  Tensor tdVrdO = wg_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);
  auto wg_dq = mma_dq.get_slice(wg * 128);
  // K as dQ's B operand, or (kdQTransposed) K^T as dQ^T's A operand.
  auto tdQrK = [&] {
    if constexpr (T::kdQTransposed) return wg_dq.partition_fragment_A(sKt);
    else return wg_dq.partition_fragment_B(sKt);
  }();

  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));  // (key, row)
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));

  float const scale_log2 = kp.scale_log2;
  constexpr int kCols = decltype(size<1>(cS_rc))::value;  // query rows owned by this thread
  constexpr int kRowsK = decltype(size<0>(cS_rc))::value;  // keys owned by this thread

  typename T::PipelineState rd;
  typename T::PipelineStatedO rd_do;
  // dQ staging (see the step's end): piece r of this thread's fragment goes to
  // stage + dq_piece_offset(r, i). Head-dim split, non-deterministic: the last piece of a step
  // waits in registers (dq_held) and is staged in the middle of the next step (after P / dS are
  // stored, when no wgmma is in flight), so the bulk engine's read of each piece overlaps GEMMs
  // instead of stalling the WG (the back-to-back two-piece handoff took ~20% of stall samples,
  // NOTES.md v12).
  constexpr bool kDeferLastPiece = T::kSplitD && !Deterministic;
  // S^T / dP^T by role (BwdTraits::kSdPByRole): not with softcap (dS needs tanh' of S, on the
  // other WG), dropout (dS needs the undropped P, dV the dropped one), bias / mask (dbias) nor
  // segment ids; the launcher gives those the row split.
  constexpr bool kSdPByRole = T::kSdPByRole;
  static_assert(!kSdPByRole || (T::kSplitD && !Softcap && !Dense && !Dropout && !Segments),
                "S^T / dP^T by role: the plain head-dim split only");
  constexpr int kPieceFrag = T::kdQFrag / T::kdQRounds;
  float* const stage = ss.dq.data() + wg * T::kdQStageFloats;
  auto dq_piece_offset = [&](int r, int i) {
    return dq_frag_offset<T>(tidx, i) - wg * T::kdQWGFloats - r * T::kdQStageFloats;
  };
  float dq_held[kDeferLastPiece ? kPieceFrag : 1];
  float* held_dst = nullptr;  // dq_accum destination of dq_held
  // Stage the held piece and reduce-add it (the previous piece's read must be complete). Called
  // under loop-uniform conditions and with no wgmma in flight: a branch the compiler cannot prove
  // uniform while wgmmas are in flight makes it serialize every wgmma of the kernel (C7518).
  auto flush_held = [&]() {
    if constexpr (kDeferLastPiece) {
      wg_wait_bulk_reads(tidx, kBwdBarDQ + wg);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kPieceFrag; i += 4)
        *reinterpret_cast<float4*>(stage + dq_piece_offset(T::kdQRounds - 1, i + (T::kdQRounds - 1) * kPieceFrag)) =
            make_float4(dq_held[i], dq_held[i + 1], dq_held[i + 2], dq_held[i + 3]);
      fence_async_smem();
      named_sync(128, kBwdBarDQ + wg);
      if (tidx % 128 == 0) {
        bulk_reduce_add_f32(held_dst, stage, T::kdQStageFloats * sizeof(float));
        tma_store_arrive();
      }
    }
  };
  BwdStepTimeline tl;
  tl.init(kp.timeline, wg, blockIdx.x == 0 && tidx % 128 == 0);
  BwdTileTimeline ttl;
  ttl.init(kp.timeline, tile_timeline_offset(wg), blockIdx.x == 0 && tidx % 128 == 0);
  int loaded = 0;
  // kAsyncDS: steps run so far by this CTA; step c's dS goes to buffer c % 2 (use c / 2).
  int ds_count = 0;
  // kDenseTma: this WG's bias / mask stage, and the steps it has run (the stage's phase).
  uint8_t const* const dense_stage = bwd_dense_stage<T>(ss, wg);
  int dense_count = 0;
  // dQ = dS K (or dQ^T = K^T dS^T) over the block's keys from dS buffer dbuf, this
  // WG's head_dim half; then the fragment goes to the WG's writer warp (below). The accumulator
  // is declared where it is used: a live range spanning the step loop costs 32 registers.
  auto dq_gemm = [&](int dbuf, auto& tdQrdQ) {
    Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data() + dbuf * T::kdSSize), typename T::SmemLayoutdS{});
    if constexpr (T::kdQTransposed) wg_gemm<true, -1>(mma_dq, tdQrK, wg_dq.partition_fragment_B(sdS), tdQrdQ);
    else wg_gemm<true, -1>(mma_dq, wg_dq.partition_fragment_A(sdS), tdQrK, tdQrdQ);
  };
  auto dq_handoff = [&](auto const& tdQrdQ, bool first_of_tile) {
    // The writer has read the previous fragment (a step ago: normally no wait). kdKVInDQStage: the
    // tile's first handoff follows the previous epilogue, which synced already (tile start).
    if (!T::kdKVInDQStage || !first_of_tile) named_sync(kBwdDQHandoffThreads, kBwdBarDQEmpty + wg);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < T::kdQFrag; i += 4)
      *reinterpret_cast<float4*>(stage + dq_piece_offset(0, i)) = make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
    fence_async_smem();
    named_arrive(kBwdDQHandoffThreads, kBwdBarDQFull + wg);
  };
  for (int r = 0;; ++r) {
    BwdTile const w = bwd_round_tile<T, Segments, Dynamic, SplitTail>(kp, ss, r);
    if (w.done) break;
    ttl.mark(kBTileStart);
    ttl.set(kBTileSteps, w.n_iters);
    int const n_block = w.t.m_block, h_kv = w.t.h, b = w.t.b;
    SeqMask msk = make_seq_mask(p, b);
    if constexpr (T::kUnboundedOnly) {  // no causal / window bound: only the lengths mask (constants free registers)
      msk.offset = 0;
      msk.left = -1;
      msk.right = -1;
    }
    int const n_iters = w.n_iters;
    int const key0_wg = n_block * kBlockN + (T::kSplitD ? 0 : wg * 64);  // this WG's keys
    // Row blocks [full_lo, full_hi) of rows see all of this WG's keys: no element-wise mask.
    int full_lo, full_hi;
    msk.full_rows(key0_wg, key0_wg + 64, &full_lo, &full_hi);
    int32_t const* q_seg = nullptr;  // Segments: this batch's ids
    int32_t const* kv_seg = nullptr;
    if constexpr (Segments) {  // and the rows every key of the WG sees by segment
      narrow_full_to_segment(p, p.seqlen_k, b, key0_wg / kSegChunkRows, full_lo, full_hi);
      q_seg = p.q_segment_ids + b * p.q_seg_batch_stride;
      kv_seg = p.kv_segment_ids + b * p.kv_seg_batch_stride;
    }
    clear(tdVrdV);
    if constexpr (!T::kdKVByRole) clear(tdKrdK);
    if (n_iters > 0) {
      ss.barrier_kv.wait(loaded & 1);
      ttl.mark(kBTileKVReady);
      if constexpr (T::kdKVInDQStage) {  // the previous epilogue's dK / dV stores have read the dQ staging buffer
        wg_wait_bulk_reads(tidx, kBwdBarEpilogue + wg);
      }
      // kAsyncDS: WG 1 starts the tile once WG 0 has formed its first P / dS.
      if constexpr (T::kAsyncDS) {
        if (wg == 1) named_sync(T::kMmaThreads, kBwdBarDS);
      }
      // The head-dim split step's tail, once dV and dK are issued: dQ = dS K (this WG's head_dim
      // half, dS from buffer buf), the Q / dO stages released, then the dQ partial -> smem
      // (fragment order) -> bulk reduce-add into dq_accum in kdQRounds pieces per WG (rows past
      // seqlen_q add zeros: P is 0 there).
      auto dq_step_tail = [&](int buf, auto hq, int m) {
        Tensor tdQrdQ = partition_fragment_C(mma_dq, typename T::ShapedQ{});
        dq_gemm(buf, tdQrdQ);
        // dV, the last reader of this dO stage, is done (kdKVByRole: this WG's dV or dK, the last
        // reader of dO or Q, so both stages go now).
        warpgroup_wait<T::kdKVByRole ? 1 : 2>();
        pipe_do.consumer_release(rd_do);
        ++rd_do;
        if constexpr (T::kdKVByRole) {
          pipe_q.consumer_release(rd);
          ++rd;
        }
        warpgroup_wait<0>();
        tl.mark(kBwdDQDone);
        if constexpr (!T::kdKVByRole) {
          pipe_q.consumer_release(rd);
          ++rd;
        }
        int const row0 = m * kBlockM;
        float* acc = dq_block_ptr(kp, b, hq, row0, wg);
        int* sem = dq_counter_ptr(kp, b, hq, row0);
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < T::kdQRounds; ++r) {
          if (kDeferLastPiece && r == T::kdQRounds - 1) {
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < kPieceFrag; ++i) dq_held[i] = tdQrdQ(r * kPieceFrag + i);
            held_dst = acc + r * T::kdQStageFloats;
            break;
          }
          if (r > 0 || kDeferLastPiece) {  // the previous piece's reduce must have read the staging buffer
            wg_wait_bulk_reads(tidx, kBwdBarDQ + wg);
          }
          CUTLASS_PRAGMA_UNROLL
          for (int i = r * kPieceFrag; i < (r + 1) * kPieceFrag; i += 4)
            *reinterpret_cast<float4*>(stage + dq_piece_offset(r, i)) = make_float4(tdQrdQ(i), tdQrdQ(i + 1), tdQrdQ(i + 2), tdQrdQ(i + 3));
          fence_async_smem();
          named_sync(128, kBwdBarDQ + wg);
          if (tidx % 128 == 0) {
            if constexpr (Deterministic) {
              if (r == 0) dq_wait_turn(sem, dq_turn_of<T>(msk, m, n_block));
            }
            bulk_reduce_add_f32(acc + r * T::kdQStageFloats, stage, T::kdQStageFloats * sizeof(float));
            tma_store_arrive();
          }
        }
        if constexpr (Deterministic) {
          if (tidx % 128 == 0) {
            asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the adds are done, not just read
            __threadfence();
            atomicAdd(sem, 1);
          }
        }
      };
      // One head-dim split step with S^T / dP^T by role: WG 0 computes S^T and P^T for all kBlockM
      // rows, WG 1 dP^T; P^T (16-bit) goes to smem for WG 1, which forms dS^T from it. Then
      // kdKVByRole: dV on WG 0 and dK on WG 1 from registers, else both split by head_dim from
      // smem; dQ split by head_dim. Two CTA-wide syncs per step (P stored; dS stored). Branches
      // on wg hold no wgmma in flight (each arm waits for its own).
      // (A generic lambda: its body is instantiated only where kSdPByRole calls it.)
      auto step_by_role = [&](auto hq, int m, int it) {
        int const row0 = m * kBlockM;
        int const buf = it & 1;
        typename T::TiledMmaSdPRole mma_role;
        auto wg_role = mma_role.get_slice(0);
        auto thr_role = mma_role.get_thread_slice(tidx % 128);
        Tensor acc = partition_fragment_C(mma_role, Shape<_64, Int<kBlockM>>{});  // S^T (WG 0) or dP^T (WG 1)
        Tensor acc_rc = make_tensor(acc.data(), acc_rowcol(acc.layout()));
        Tensor cR = thr_role.partition_C(make_identity_tensor(Shape<_64, Int<kBlockM>>{}));  // (key, row)
        Tensor cR_rc = make_tensor(cR.data(), acc_rowcol(cR.layout()));
        constexpr int kRC = decltype(size<1>(cR_rc))::value;  // rows owned by this thread
        constexpr int kRK = decltype(size<0>(cR_rc))::value;  // keys owned by this thread
        Tensor sPt = make_tensor(make_smem_ptr(ss.p.data() + buf * T::kdSSize), typename T::SmemLayoutdSt{});
        Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data() + buf * T::kdSSize), typename T::SmemLayoutdSt{});
        // The same buffers for the per-thread stmatrix / ldmatrix copies (utils.h).
        Tensor sPt_copy = smem_tensor_for_copy<typename T::SmemLayoutdSt>(ss.p.data() + buf * T::kdSSize);
        Tensor sdSt_copy = smem_tensor_for_copy<typename T::SmemLayoutdSt>(ss.ds.data() + buf * T::kdSSize);
        tl.mark(kBwdStart);
        if (wg == 0) {
          bwd_consumer_wait(pipe_q, rd);
          tl.mark(kBwdLanded);
          wg_gemm<true, -1>(mma_role, wg_role.partition_fragment_A(sK), wg_role.partition_fragment_B(sQ)(_, _, _, rd.index()), acc);
          warpgroup_wait<0>();
        } else {
          bwd_consumer_wait(pipe_do, rd_do);
          tl.mark(kBwdLanded);
          wg_gemm<true, -1>(mma_role, wg_role.partition_fragment_A(sV), wg_role.partition_fragment_B(sdO)(_, _, _, rd_do.index()), acc);
          warpgroup_wait<0>();
        }
        tl.mark(kBwdIssued);
        auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_role);
        auto r2s_thr = r2s.get_thread_slice(tidx % 128);
        Tensor x16 = make_tensor<Element>(acc.layout());  // P^T (WG 0) or dS^T (WG 1), 16-bit
        if (wg == 0) {
          // P^T = exp2(S^T * scale_log2 - lse2), element-wise mask only on boundary steps.
          float const* s_lse = ss.lse[rd.index()];
          auto p_tile = [&](auto masked) {
            TileMask tm{};  // (no segment ids here: static_assert above)
            if constexpr (decltype(masked)::value)
              tm = bwd_tile_mask(msk, row0, int64_t(n_block) * kBlockN, cR_rc);
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kRC; ++j) {
              float const lse2 = s_lse[int(get<1>(cR_rc(0, j)))];
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < kRK; ++i) {
                float pr = exp2_at<T::kPolyEvery, decltype(masked)::value>(j * kRK + i, acc_rc(i, j) * scale_log2 - lse2);
                if constexpr (decltype(masked)::value) {
                  if (!bwd_visible<bool(JF_BWD_TILE_MASK)>(msk, tm, row0, int64_t(n_block) * kBlockN, cR_rc, i, j)) pr = 0.f;
                }
                acc_rc(i, j) = pr;
              }
            }
          };
          if (full_lo <= row0 && row0 + kBlockM <= full_hi) p_tile(cute::false_type{}); else p_tile(cute::true_type{});
          convert_out(acc, x16);
          cute::copy(r2s, r2s_thr.retile_S(x16), r2s_thr.partition_D(sPt_copy));
        }
        if constexpr (kDeferLastPiece) {
          if (it > 0) flush_held();  // the previous step's last dQ piece (no wgmma in flight here)
        } else {
          if (tidx % 128 == 0) tma_store_wait<0>();
        }
        fence_async_smem();
        named_sync(T::kMmaThreads, kBwdBarDS);  // P^T stored, dP^T formed
        tl.mark(kBwdPdS);
        if (wg == 1) {
          bwd_consumer_wait(pipe_q, rd);  // (dK's B operand, a step ahead: no wait in practice)
          // dS^T = P^T (dP^T - D), with P^T read back in dP^T's fragment order.
          Tensor p16 = make_tensor<Element>(acc.layout());
          auto s2r = make_tiled_copy_C(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_role);
          auto s2r_thr = s2r.get_thread_slice(tidx % 128);
          cute::copy(s2r, s2r_thr.partition_S(sPt_copy), s2r_thr.retile_D(p16));
          Tensor p_rc = make_tensor(p16.data(), acc_rowcol(p16.layout()));
          float const* s_dsum = ss.dsum[rd_do.index()];
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kRC; ++j) {
            float const d = s_dsum[int(get<1>(cR_rc(0, j)))];
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < kRK; ++i) acc_rc(i, j) = float(p_rc(i, j)) * (acc_rc(i, j) - d);
          }
          convert_out(acc, x16);
          cute::copy(r2s, r2s_thr.retile_S(x16), r2s_thr.partition_D(sdSt_copy));
          fence_async_smem();
        } else {
          bwd_consumer_wait(pipe_do, rd_do);  // (dV's B operand; WG 1 waited for it before dP^T)
        }
        if constexpr (T::kdKVByRole) {
          // WG 0: dV += P^T dO, WG 1: dK += dS^T Q, A from registers. One call on operands chosen
          // by wg (the same layouts), not two branches: a branch left with a wgmma in flight
          // would serialize the kernel's wgmmas (C7518). WG 0's dV runs while WG 1 forms dS^T.
          Tensor tXrB = tdVrdO(_, _, _, rd_do.index());
          Tensor tKrB = tdKrQ(_, _, _, rd.index());
          Tensor tRoleB = make_tensor(wg == 0 ? tXrB.data() : tKrB.data(), tXrB.layout());
          wg_gemm<false, -1>(mma_dkv, make_tensor(x16.data(), acc_to_Aregs(x16.layout())), tRoleB, tdVrdV);
          named_sync(T::kMmaThreads, kBwdBarDS);  // dS^T stored
          tl.mark(kBwdShared);
        } else {
          wg_gemm<false, -1>(mma_dkv, wg_dkv.partition_fragment_A(sPt), tdVrdO(_, _, _, rd_do.index()), tdVrdV);
          named_sync(T::kMmaThreads, kBwdBarDS);  // dS^T stored
          tl.mark(kBwdShared);
          wg_gemm<false, -1>(mma_dkv, wg_dkv.partition_fragment_A(sdSt), tdKrQ(_, _, _, rd.index()), tdKrdK);
        }
        dq_step_tail(buf, hq, m);
      };
      BwdStep st = w.first_step();
      CUTLASS_PRAGMA_NO_UNROLL
      for (int it = 0; it < n_iters; ++it, w.next_step(st)) {
        int const hq = st.hq, m = st.m;
        if constexpr (kSdPByRole) {
          step_by_role(hq, m, it);
          tl.mark(kBwdEnd);
          tl.end_step();
          continue;
        }
        int const row0 = m * kBlockM;
        int const buf = T::kAsyncDS ? ds_count & 1 : it & 1;
        Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
        tl.mark(kBwdStart);
        DenseBwd dense;
        if constexpr (Dense) {  // this warp's 16 keys x the WG's rows into L1, under the Q wait and GEMMs
          dense = make_dense_bwd(p, b, hq);  // (here no wgmma is in flight: its branches cannot serialize them)
          if constexpr (!T::kDenseTma) {
            int const warp_key0 = (int(get<0>(cS_rc(0, 0))) / 16) * 16;
            dense_bwd_prefetch(dense, int64_t(n_block) * kBlockN + warp_key0,
                               row0 + (T::kSplitD ? wg * (kBlockM / 2) : 0), T::kSplitD ? kBlockM / 2 : kBlockM);
          }
        }
        bwd_consumer_wait(pipe_q, rd);
        if constexpr (T::kDenseTma) {  // (issued a step ago: normally no wait)
          ss.dense_full[wg].wait(dense_count & 1);
          asm volatile("" ::: "memory");  // the stage's reads stay after the wait
        }
        wg_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, rd.index()), tSrS);
        bwd_consumer_wait(pipe_do, rd_do);
        tl.mark(kBwdLanded);
        wg_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, rd_do.index()), tdPrdP);
        tl.mark(kBwdIssued);
        Tensor s_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
        Tensor dp_rc = make_tensor(tdPrdP.data(), acc_rowcol(tdPrdP.layout()));
        // (Dense kernels reading tiles from smem test the interval rule on boundary tiles only too.)
        bool const full = (!Dense || T::kDenseTma) && full_lo <= row0 && row0 + kBlockM <= full_hi;
        float const* s_lse = ss.lse[rd.index()];
        float const* s_dsum = ss.dsum[rd_do.index()];
        // P^T = exp2(logit * scale_log2 - lse2); element-wise mask only on boundary tiles (the
        // masked variant is a separate loop so the full-tile loop has no branches).
        // tile: the step's DenseTileRead (kDenseTma kernels), else unused.
        constexpr bool kTileMask = JF_BWD_TILE_MASK && !T::kUnboundedOnly;
        auto prob = [&](auto masked, TileMask const& tm, float x, float lse2, int i, int j, auto const& tile) {
          float arg = x * scale_log2 - lse2;
          bool dense_visible = true;
          if constexpr (T::kDenseTma) {
            arg = tile.logit(arg, cS_rc, i, j, dense_visible);
          } else if constexpr (Dense) {
            arg = dense_bwd_logit(dense, arg, row0 + int(get<1>(cS_rc(i, j))),
                                  int64_t(n_block) * kBlockN + int(get<0>(cS_rc(i, j))), dense_visible);
          }
          // Full tiles (lse2 finite) may put part of the exp2s on the FMA pipe.
          float pr = exp2_at<T::kPolyEvery, decltype(masked)::value>(j * kRowsK + i, arg);
          if constexpr (decltype(masked)::value) {
            if (!bwd_visible<kTileMask>(msk, tm, row0, int64_t(n_block) * kBlockN, cS_rc, i, j) || !dense_visible) pr = 0.f;
            if constexpr (Segments) {  // (indices clamped: rows / keys past the ends are masked above)
              int64_t const key = n_block * kBlockN + int(get<0>(cS_rc(i, j)));
              int64_t const row = row0 + int(get<1>(cS_rc(i, j)));
              if (__ldg(q_seg + min(row, int64_t(p.seqlen_q - 1))) != __ldg(kv_seg + min(key, int64_t(p.seqlen_k - 1))))
                pr = 0.f;
            }
          } else if constexpr (Dense) {
            if (!dense_visible) pr = 0.f;
          }
          return pr;
        };
        if constexpr (Softcap) {
          // dS needs tanh' of the logit, so P and dS are formed together once both GEMMs land.
          warpgroup_wait<0>();
          auto p_and_ds = [&](auto masked) {
            TileMask tm{};
            if constexpr (decltype(masked)::value && kTileMask)
              tm = bwd_tile_mask(msk, row0, int64_t(n_block) * kBlockN, cS_rc);
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kCols; ++j) {
              float const lse2 = s_lse[int(get<1>(cS_rc(0, j)))], d = s_dsum[int(get<1>(cS_rc(0, j)))];
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < kRowsK; ++i) {
                float const t = tanhf(s_rc(i, j) * kp.softcap_mult);
                float const pr = prob(masked, tm, t, lse2, i, j, Int<0>{});
                s_rc(i, j) = pr;
                dp_rc(i, j) = pr * (dp_rc(i, j) - d) * (1.f - t * t);
              }
            }
          };
          if (full) p_and_ds(cute::false_type{}); else p_and_ds(cute::true_type{});
        } else {
          // P^T (in place of S^T) while dP^T is still in flight.
          warpgroup_wait<1>();
          auto p_only = [&](auto masked, auto const& tile) {
            TileMask tm{};
            if constexpr (decltype(masked)::value && kTileMask)
              tm = bwd_tile_mask(msk, row0, int64_t(n_block) * kBlockN, cS_rc);
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kCols; ++j) {
              float const lse2 = s_lse[int(get<1>(cS_rc(0, j)))];
              CUTLASS_PRAGMA_UNROLL
              for (int i = 0; i < kRowsK; ++i) s_rc(i, j) = prob(masked, tm, s_rc(i, j), lse2, i, j, tile);
            }
          };
          auto p_all = [&](auto const& tile) {
            if (full) p_only(cute::false_type{}, tile); else p_only(cute::true_type{}, tile);
          };
          if constexpr (T::kDenseTma) {  // one loop per bias dtype (no per-element dtype test)
            auto with_kind = [&](auto kind) {
              p_all(DenseTileRead<decltype(kind)::value, kBlockM>(dense_stage, kp.dense, cS_rc, 64 * wg));
            };
            using K = DenseKind;
            switch (dense_kind_of(p.bias != nullptr, p.bias_dtype)) {
              case K::kMask: with_kind(std::integral_constant<K, K::kMask>{}); break;
              case K::kBiasF32: with_kind(std::integral_constant<K, K::kBiasF32>{}); break;
              case K::kBiasBF16: with_kind(std::integral_constant<K, K::kBiasBF16>{}); break;
              case K::kBiasF16: with_kind(std::integral_constant<K, K::kBiasF16>{}); break;
            }
            asm volatile("" ::: "memory");  // the stage's reads stay before the release
            ss.dense_empty[wg].arrive();
            ++dense_count;
          } else {
            p_all(Int<0>{});
          }
          // Dropout's keep bits, still under the dP GEMM: dS = P o (Z o dP / (1 - rate) - D) with
          // the undropped P, then P o Z for dV (whose 1 / (1 - rate) comes in the epilogue).
          constexpr int kKeepWords = (kRowsK * kCols + 31) / 32;
          uint32_t keep[kKeepWords];
          if constexpr (Dropout)
            dropout_keep_bits_t(make_head_dropout(p, b, hq), cS_rc, int64_t(n_block) * kBlockN, row0, keep);
          warpgroup_wait<0>();
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kCols; ++j) {
            float const d = s_dsum[int(get<1>(cS_rc(0, j)))];
            CUTLASS_PRAGMA_UNROLL
            for (int i = 0; i < kRowsK; ++i) {
              if constexpr (Dropout) {
                bool const kept = keep[(i * kCols + j) / 32] >> ((i * kCols + j) % 32) & 1u;
                dp_rc(i, j) = s_rc(i, j) * ((kept ? dp_rc(i, j) * p.dropout_scale : 0.f) - d);
                if (!kept) s_rc(i, j) = 0.f;
              } else {
                dp_rc(i, j) = s_rc(i, j) * (dp_rc(i, j) - d);
              }
            }
          }
          if constexpr (Dense) dense_bwd_dbias(dense, dp_rc, cS_rc, int64_t(n_block) * kBlockN, row0);
        }
        tl.mark(kBwdPdS);
        Tensor tPr16 = make_tensor<Element>(tSrS.layout());
        Tensor tdSr16 = make_tensor<Element>(tSrS.layout());
        convert_out(tSrS, tPr16);
        convert_out(tdPrdP, tdSr16);
        // 16-bit accumulators -> smem (keys, rows) view by stmatrix: four 8x8 tiles (a key's 8
        // adjacent query rows each) per instruction, 4 stores per thread instead of 16.
        auto store_tile16 = [&](Element* base, auto const& frag16) {
          Tensor st = smem_tensor_for_copy<typename T::SmemLayoutdSt>(base);
          auto r2s = make_tiled_copy_C(Copy_Atom<typename T::StoreAtomdS, Element>{}, mma_sdp);
          auto thr = r2s.get_thread_slice(tidx);
          cute::copy(r2s, thr.retile_S(frag16), thr.partition_D(st));
        };
        if constexpr (!T::kSplitD) {
          // dV issued; dS shared; then dQ and dK issued, and the dQ fragment is handed to this
          // WG's writer warp while dK runs (the tensor pipe stays busy through the handoff,
          // NOTES.md v19).
          Tensor tPrA = make_tensor(tPr16.data(), acc_to_Aregs(tPr16.layout()));
          Tensor tdSrA = make_tensor(tdSr16.data(), acc_to_Aregs(tdSr16.layout()));
          if constexpr (T::kAsyncDS) {
            if (wg == 0 && it == 0) named_arrive(T::kMmaThreads, kBwdBarDS);  // WG 1 may start the tile
          }
          wg_gemm<false, -1>(mma_dkv, tPrA, tdVrdO(_, _, _, rd_do.index()), tdVrdV);
          // dS^T -> smem (as dS, keys contiguous) for dQ = dS K over all keys of the block.
          if constexpr (T::kAsyncDS) ss.ds_empty[buf].wait(((ds_count >> 1) & 1) ^ 1);  // dQ of step c - 2 read it
          store_tile16(ss.ds.data() + buf * T::kdSSize, tdSr16);
          fence_async_smem();
          if constexpr (T::kAsyncDS) {
            ss.ds_full[buf].arrive();
            tl.mark(kBwdShared);
            // The previous step's dQ (the other WG stored its half of that dS long ago), then dK;
            // the fragment goes to the writer while dK runs. One branch holds the dQ accumulator's
            // whole live range.
            if (it > 0) {
              ss.ds_full[buf ^ 1].wait(((ds_count - 1) >> 1) & 1);
              Tensor tdQrdQ = partition_fragment_C(mma_dq, typename T::ShapedQ{});
              dq_gemm(buf ^ 1, tdQrdQ);
              wg_gemm<false, -1>(mma_dkv, tdSrA, tdKrQ(_, _, _, rd.index()), tdKrdK);
              warpgroup_wait<1>();  // dV (the last reader of this dO stage) and the previous dQ are done
              pipe_do.consumer_release(rd_do);
              ss.ds_empty[buf ^ 1].arrive();
              tl.mark(kBwdDQDone);
              dq_handoff(tdQrdQ, it == 1);
            } else {
              wg_gemm<false, -1>(mma_dkv, tdSrA, tdKrQ(_, _, _, rd.index()), tdKrdK);
              warpgroup_wait<1>();  // dV is done
              pipe_do.consumer_release(rd_do);
              tl.mark(kBwdDQDone);
            }
            ++rd_do;
          } else {
            named_sync(T::kMmaThreads, kBwdBarDS);
            tl.mark(kBwdShared);
            Tensor tdQrdQ = partition_fragment_C(mma_dq, typename T::ShapedQ{});
            dq_gemm(buf, tdQrdQ);
            wg_gemm<false, -1>(mma_dkv, tdSrA, tdKrQ(_, _, _, rd.index()), tdKrdK);
            warpgroup_wait<1>();  // dV (the last reader of this dO stage) and dQ are done
            pipe_do.consumer_release(rd_do);
            ++rd_do;
            tl.mark(kBwdDQDone);
            dq_handoff(tdQrdQ, it == 0);
          }
          warpgroup_wait<0>();  // dK, the last reader of this Q stage
          pipe_q.consumer_release(rd);
          ++rd;
          ++ds_count;
        } else {
          // Each WG holds P^T / dS^T for half the rows: both halves meet in smem, then every
          // WG reads all rows for its head_dim half of dV and dK.
          store_tile16(ss.p.data() + buf * T::kdSSize, tPr16);
          store_tile16(ss.ds.data() + buf * T::kdSSize, tdSr16);
          if constexpr (kDeferLastPiece) {
            if (it > 0) flush_held();  // the previous step's last dQ piece (no wgmma in flight here)
          } else {
            if (tidx % 128 == 0) tma_store_wait<0>();  // as above
          }
          fence_async_smem();
          named_sync(T::kMmaThreads, kBwdBarDS);
          Tensor sPt = make_tensor(make_smem_ptr(ss.p.data() + buf * T::kdSSize), typename T::SmemLayoutdSt{});
          Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data() + buf * T::kdSSize), typename T::SmemLayoutdSt{});
          wg_gemm<false, -1>(mma_dkv, wg_dkv.partition_fragment_A(sPt), tdVrdO(_, _, _, rd_do.index()), tdVrdV);
          wg_gemm<false, -1>(mma_dkv, wg_dkv.partition_fragment_A(sdSt), tdKrQ(_, _, _, rd.index()), tdKrdK);
          tl.mark(kBwdShared);
          dq_step_tail(buf, hq, m);
        }
        tl.mark(kBwdEnd);
        tl.end_step();
      }
      if (kDeferLastPiece) flush_held();
      if constexpr (T::kAsyncDS) {  // the tile's last dQ
        int const last = (ds_count - 1) & 1;
        ss.ds_full[last].wait(((ds_count - 1) >> 1) & 1);
        Tensor tdQrdQ = partition_fragment_C(mma_dq, typename T::ShapedQ{});
        dq_gemm(last, tdQrdQ);
        warpgroup_wait<0>();
        ss.ds_empty[last].arrive();
        dq_handoff(tdQrdQ, n_iters == 1);
      }
      ss.barrier_kv_empty.arrive();  // the last dQ GEMM (the last reader of K / V) has completed
      ++loaded;
      ttl.mark(kBTileLoopEnd);
    }
    // Epilogue: dK = scale * dS^T Q, dV; keys past seqlen_k (and columns past head_dim) are dropped.
    // This WG's 64 keys x kdKVCols: dV then dK through its smem buffer, one TMA store each (the
    // per-element stores were ~6% of the stall samples at H=128 4k causal, NOTES.md v27).
    // A piece of a split tile: its partial sums meet the tile's other pieces' in the split
    // workspace, and only the WG that completes the tile stores (every barrier below is kept).
    bool store_kv = true;
    if constexpr (SplitTail) {
      if (w.slot >= 0) {
        if constexpr (T::kdKVByRole) store_kv = bwd_piece_combine(kp, w.slot, n_iters, wg, tidx, tdVrdV, nullptr);
        else store_kv = bwd_piece_combine(kp, w.slot, n_iters, wg, tidx, tdVrdV, tdKrdK);
      }
    }
    if constexpr (Dropout) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdVrdV); ++i) tdVrdV(i) *= p.dropout_scale;
    }
    auto const frag = partition_fragment_C(typename T::TiledMmadKVWG{}, Shape<_64, Int<T::kdKVCols>>{}).layout();
    // Tile (key_tile, col_tile) of 64 keys x kdKVCols of dK or dV in global memory (TMA view).
    auto gtile = [&](auto const& tma, int key_tile, int col_tile) {
      Tensor mX = tma.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.heads_kv, p.batch))(_, _, h_kv, b);
      return local_tile(mX, Shape<_64, Int<T::kdKVCols>>{}, make_coord(key_tile, col_tile));
    };
    if constexpr (T::kdKVByRole) {
      // WG 0 holds all of dV, WG 1 all of dK (64 keys x head_dim): out through the WG's P / dS
      // buffer in two head_dim halves. A half is the first / second 64 values of the thread's
      // fragment (the m64n256 C fragment's column groups are its slowest mode): TiledMmadKVWG's.
      float const mult = wg == 1 ? p.scale : 1.f;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdVrdV); ++i) tdVrdV(i) *= mult;
      Tensor rX = make_tensor_like<Element>(tdVrdV);
      convert_out(tdVrdV, rX);
      named_sync(T::kMmaThreads, kBwdBarDS);  // both WGs' last GEMMs read P / dS
      Element* const buf = wg == 0 ? ss.p.data() : ss.ds.data();
      static_assert(2 * decltype(size(frag))::value == decltype(size(rX))::value, "two halves per WG");
      auto const& tma = wg == 0 ? kp.tma_dv : kp.tma_dk;
      if (store_kv) {
        if constexpr (JF_BWD_EPI_ONE_ROUND) {
          // Half 1 goes to the WG's dQ staging buffer (16 KB, free once the last dQ pieces' bulk
          // reads are done), so both halves share one wait, one barrier and one bulk group.
          Element* const buf1 = reinterpret_cast<Element*>(stage);
          wg_wait_bulk_reads(tidx, kBwdBarEpilogue + wg);
          wg_stage_tile<typename T::TiledMmadKVWG, typename T::SmemLayoutdKV>(make_tensor(rX.data(), frag), buf, tidx);
          wg_stage_tile<typename T::TiledMmadKVWG, typename T::SmemLayoutdKV>(make_tensor(rX.data() + size(frag), frag), buf1, tidx);
          fence_async_smem();
          named_sync(128, kBwdBarEpilogue + wg);
          if (tidx % 128 == 0) {
            issue_tma_store<typename T::SmemLayoutdKV>(buf, tma, gtile(tma, n_block, 0));
            issue_tma_store<typename T::SmemLayoutdKV>(buf1, tma, gtile(tma, n_block, 1));
            cute::tma_store_arrive();
          }
        } else {
          CUTLASS_PRAGMA_UNROLL
          for (int half = 0; half < 2; ++half) {
            wg_tma_store<typename T::TiledMmadKVWG, typename T::SmemLayoutdKV>(
                make_tensor(rX.data() + half * size(frag), frag), buf, tma, [&] { return gtile(tma, n_block, half); },
                kBwdBarEpilogue + wg, tidx);
          }
        }
      }
      if (tidx % 128 == 0) cute::tma_store_wait<0>();  // the next tile's first step writes P / dS here
      named_sync(T::kMmaThreads, kBwdBarDS);
      ttl.mark(kBTileStored);
      ttl.end_tile();
      continue;
    }
    Tensor rdV = make_tensor_like<Element>(tdVrdV);
    convert_out(tdVrdV, rdV);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= p.scale;
    Tensor rdK = make_tensor_like<Element>(tdKrdK);
    convert_out(tdKrdK, rdK);
    if constexpr (T::kSplitD) named_sync(T::kMmaThreads, kBwdBarDS);  // both WGs' last GEMMs read P / dS
    if constexpr (T::kdKVInDQStage) {  // the writer's last reduce of this tile has read the dQ staging buffer
      if (n_iters > 0) named_sync(kBwdDQHandoffThreads, kBwdBarDQEmpty + wg);
    }
    Element* const buf = T::kSplitD        ? (wg == 0 ? ss.p.data() : ss.ds.data())
                         : T::kdKVInDQStage ? reinterpret_cast<Element*>(stage)
                                            : ss.dkv.data() + wg * cute::cosize_v<typename T::SmemLayoutdKV>;
    // This WG's tile: its own 64 keys (key split) or its head_dim half (head-dim split).
    auto own_tile = [&](auto const& tma) {
      return gtile(tma, n_block * (kBlockN / 64) + (T::kSplitD ? 0 : wg), T::kSplitD ? wg : 0);
    };
    if (store_kv) {
      wg_tma_store<typename T::TiledMmadKVWG, typename T::SmemLayoutdKV>(
          make_tensor(rdV.data(), frag), buf, kp.tma_dv, [&] { return own_tile(kp.tma_dv); }, kBwdBarEpilogue + wg, tidx);
      wg_tma_store<typename T::TiledMmadKVWG, typename T::SmemLayoutdKV>(
          make_tensor(rdK.data(), frag), buf, kp.tma_dk, [&] { return own_tile(kp.tma_dk); }, kBwdBarEpilogue + wg, tidx);
    }
    if constexpr (T::kSplitD) {
      // The next tile's first step writes P / dS here: the stores must have read them.
      if (tidx % 128 == 0) cute::tma_store_wait<0>();
      named_sync(T::kMmaThreads, kBwdBarDS);
    }
    ttl.mark(kBTileStored);
    ttl.end_tile();
  }
  wg_bulk_drain(tidx);  // the last dK / dV store (and, head-dim split, dQ reduce-add)
}

// Row statistics into the padded [batch, heads_q, seqlen_q_rounded] workspaces, and zeros
// into dq_accum: dsum = rowsum(dO * O) (fp32), lse_log2 = lse * log2(e). Padded rows and rows
// with no visible key get dsum = 0 and lse_log2 = +inf, so the main kernel's P is 0 there.
// One CTA per (64-row block, q head, batch), flattened with the row block fastest: its share
// of dq_accum is one contiguous 64 * kHeadDim float run (coalesced float4 zeros), of dsum /
// lse_log2 a contiguous 64-float run. Each thread issues all its O / dO loads (kHeadDim / 8
// threads per row, 16 bytes each) before the zero stores and the arithmetic. (Before v75 a CTA
// held 256 / kG (b, t, h) rows, one per head, and took 70 us against FA3's 64 at H=128 1k.)
// m_blocks: 64-row blocks per (b, h), covering seqlen_q rounded up to kBlockM (what the main
// kernel reads); their zeroed rows stay inside the workspace (seqlen_q_rounded % 64 == 0).
// tile_counter: the dynamic schedule's counter, zeroed here (one stream operation fewer than a
// memset before the main kernel), or nullptr. split_zero: the split tail's slots in use
// (split_vec4s 16-byte words), and ready_zero: the early conversion's counters (ready_ints),
// zeroed here too.
constexpr int kRowStatsRows = 64, kRowStatsThreads = 256;

template <class T>
__global__ void __launch_bounds__(kRowStatsThreads) flash_bwd_row_stats_kernel_sm90(const FlashBwdParams p, int m_blocks, int* tile_counter,
                                                                                      int4* split_zero, int split_vec4s,
                                                                                      int* ready_zero, int ready_ints) {
  using Element = typename T::Element;
  using Vec = cutlass::Array<Element, 8>;
  constexpr int kG = T::kHeadDim / 8;  // threads per row
  static_assert(32 % kG == 0 && kRowStatsThreads % kG == 0);
  constexpr int kRowsPerPass = kRowStatsThreads / kG;
  constexpr int kPasses = kRowStatsRows / kRowsPerPass;
  static_assert(kPasses * kRowsPerPass == kRowStatsRows);
  // Last CTA first (v76): the main kernel's tile orders start at (b, h) = 0, row block 0, so the
  // CTAs that finish here last leave those planes' zeroed dq_accum, dsum / lse_log2 and dO in L2
  // for its first tiles (and the first ones read the O the forward wrote last).
  int const j = int(gridDim.x) - 1 - int(blockIdx.x);
  int const m = j % m_blocks, bh = j / m_blocks;  // bh = b * heads_q + h
  int const h = bh % p.heads_q, b = bh / p.heads_q;
  int const tid = int(threadIdx.x), lane = tid % kG, r0 = tid / kG;
  if (tile_counter != nullptr && j == 0 && tid == 0) *tile_counter = 0;
  for (int64_t i = int64_t(blockIdx.x) * kRowStatsThreads + tid; i < split_vec4s; i += int64_t(gridDim.x) * kRowStatsThreads)
    split_zero[i] = make_int4(0, 0, 0, 0);
  for (int i = int(blockIdx.x) * kRowStatsThreads + tid; i < ready_ints; i += int(gridDim.x) * kRowStatsThreads)
    ready_zero[i] = 0;
  int const t0 = m * kRowStatsRows;
  bool const cols_ok = lane * 8 < p.head_dim;
  Vec ov[kPasses], dv[kPasses];
  float lse[kPasses];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kPasses; ++i) {
    int const t = t0 + r0 + i * kRowsPerPass;
    ov[i].clear();
    dv[i].clear();
    lse[i] = -INFINITY;
    if (t < p.seqlen_q) {
      if (cols_ok) {
        ov[i] = *reinterpret_cast<Vec const*>(static_cast<Element const*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride +
                                              h * p.o_head_stride + lane * 8);
        dv[i] = *reinterpret_cast<Vec const*>(static_cast<Element const*>(p.dout) + b * p.do_batch_stride +
                                              t * p.do_row_stride + h * p.do_head_stride + lane * 8);
      }
      if (lane == 0) lse[i] = p.lse[int64_t(bh) * p.seqlen_q + t];
    }
  }
  int64_t const out0 = row_stats_offset(p, b, h) + t0;
  // dq_accum rows are kHeadDim floats (checked at launch).
  float4* acc = reinterpret_cast<float4*>(p.dq_accum + out0 * T::kHeadDim);
  CUTLASS_PRAGMA_UNROLL
  for (int c = tid; c < kRowStatsRows * T::kHeadDim / 4; c += kRowStatsThreads) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p.deterministic && tid == 0) p.dq_semaphore[int64_t(bh) * (p.seqlen_q_rounded / 64) + m] = 0;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kPasses; ++i) {
    float s = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 8; ++e) s += float(ov[i][e]) * float(dv[i][e]);
    CUTLASS_PRAGMA_UNROLL
    for (int off = kG / 2; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
    if (lane == 0) {
      int const r = r0 + i * kRowsPerPass;
      p.dsum[out0 + r] = s;
      p.lse_log2[out0 + r] = lse[i] == -INFINITY ? INFINITY : lse[i] * 1.44269504088896340736f;
    }
  }
}

// Early conversion (ready != nullptr; launch_bwd, NOTES.md v83): this kernel is a programmatic
// dependent of the last main-kernel launch and runs beside it. A CTA waits until its (batch, kv
// head)'s dq_ready count reaches ready_target (every step of every key-block tile of the head,
// counted by both writer warps), then converts. Bounded (~0.3-1 s): past the bound it waits for
// the main launch to complete instead and marks the head ready for its other CTAs (slower, never
// wrong: a very long main launch, or a count that never completes). The last CTA also waits for
// that launch, so this kernel (and what follows it in the stream) completes after it.
__forceinline__ __device__ void wait_dq_ready(int* ready, int target) {
  int v;
  for (int spin = 0; spin < (1 << 20); ++spin) {
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(ready) : "memory");
    if (v >= target) return;
    __nanosleep(256);
  }
  pdl_wait();
  atomicMax(ready, target);
}

// dq = scale * dq_accum in the input dtype. One CTA per (row block, q head, batch): thread t
// reads back the fragment consumer thread t reduced (dq_frag_offset, coalesced float4), scatters
// it as 16-bit values into a row-major smem tile, then the tile goes out as 16-byte row chunks.
template <class T>
__global__ void flash_bwd_convert_dq_kernel_sm90(const FlashBwdParams p, int64_t acc_rows, int64_t acc_cols,
                                                 int* ready, int ready_target) {
  using Element = typename T::Element;
  constexpr int kRowStride = T::kHeadDim + 8;  // padded: the scatter spreads over banks
  __shared__ alignas(16) Element tile[T::kBlockM * kRowStride];
  // Last block first (v76): the main kernel's tile orders end at the last (b, h) planes (causal:
  // with the shortest key blocks, which reach only the last row blocks), so these dq_accum rows
  // are the ones still in L2. Early conversion: first block first, the order in which the main
  // kernel's static schedule completes the heads.
  int const m = ready ? int(blockIdx.x) : int(gridDim.x - 1 - blockIdx.x);
  int const h = ready ? int(blockIdx.y) : int(gridDim.y - 1 - blockIdx.y);
  int const b = ready ? int(blockIdx.z) : int(gridDim.z - 1 - blockIdx.z);
  int const t = threadIdx.x;
  if (ready != nullptr) {
    if (t == 0) wait_dq_ready(ready + int64_t(b) * p.heads_kv + h / (p.heads_q / p.heads_kv), ready_target);
    __syncthreads();
  }
  typename T::TiledMmadQ mma_dq;
  // (row, column) of each fragment value; kdQTransposed fragments are (column, row).
  Tensor c = mma_dq.get_thread_slice(t).partition_C(make_identity_tensor(typename T::ShapedQ{}));
  auto row_of = [&](int i) { return int(get<T::kdQTransposed ? 1 : 0>(c(i))); };
  auto col_of = [&](int i) { return int(get<T::kdQTransposed ? 0 : 1>(c(i))); };
  float const* acc = p.dq_accum + ((int64_t(b) * p.heads_q + h) * acc_rows + int64_t(m) * T::kBlockM) * acc_cols;
  cutlass::NumericArrayConverter<Element, float, 2> cvt;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < T::kdQFrag; i += 4) {
    float4 const a = __ldcg(reinterpret_cast<float4 const*>(acc + dq_frag_offset<T>(t, i)));  // L2 (early conversion)
    float const v[4] = {a.x, a.y, a.z, a.w};
    CUTLASS_PRAGMA_UNROLL
    for (int e = 0; e < 4; e += 2) {  // accumulator pairs (i, i+1): adjacent columns of one row (or transposed, rows)
      cutlass::Array<float, 2> x;
      x[0] = v[e] * p.scale; x[1] = v[e + 1] * p.scale;
      cutlass::Array<Element, 2> const y = cvt(x);
      if constexpr (T::kdQTransposed) {
        tile[row_of(i + e) * kRowStride + col_of(i + e)] = y[0];
        tile[row_of(i + e + 1) * kRowStride + col_of(i + e + 1)] = y[1];
      } else {
        *reinterpret_cast<cutlass::Array<Element, 2>*>(tile + row_of(i + e) * kRowStride + col_of(i + e)) = y;
      }
    }
  }
  __syncthreads();
  Element* dq = static_cast<Element*>(p.dq) + b * p.dq_batch_stride + h * p.dq_head_stride;
  constexpr int kChunks = T::kHeadDim / 8;
  for (int k = t; k < T::kBlockM * kChunks; k += blockDim.x) {
    int const r = k / kChunks, c8 = (k % kChunks) * 8;
    int64_t const row = int64_t(m) * T::kBlockM + r;
    if (row < p.seqlen_q && c8 < p.head_dim)
      *reinterpret_cast<uint4*>(dq + row * p.dq_row_stride + c8) = *reinterpret_cast<uint4 const*>(tile + r * kRowStride + c8);
  }
  if (ready != nullptr && blockIdx.x == gridDim.x - 1 && blockIdx.y == gridDim.y - 1 && blockIdx.z == gridDim.z - 1)
    pdl_wait();
}

}  // namespace jax_flash::sm90
