// Host side of one instantiation: builds the TMA descriptors (cuTensorMapEncodeTiled via
// cudaGetDriverEntryPoint inside CuTe; no libcuda link), sizes the grid and launches.
// No allocation and no synchronisation, so it can be captured in a CUDA graph.
#pragma once

#include <cuda_runtime.h>

#include "kernel.h"
#include "support.h"

namespace jax_flash::sm90 {

// Tile configuration per head dim (see NOTES.md for why).
template <int kHeadDim>
struct TileConfig;
// PersistentCausalMaxS: without a tile counter, causal / right-bounded problems with at most
// this many keys run persistent (static snake order); longer ones one CTA per tile (hardware
// dispatch, chunked longest-first order). Measured at S = 1k causal (NOTES.md v13): persistent
// is +13% at H = 64 (cheap tiles: hiding the prologue matters), -7% / -17% at 128 / 256.
// SoftmaxChains: independent max / sum chains per row (8: H=64 +1-3%, H=256 +1-3%; H=128 -2%
// with 8, NOTES.md v16).
// PolyEvery: every PolyEvery-th exp2 of a row on the FMA pipe (exp2_fma), 0 = all on the MUFU
// (H=64: 1 in 8 +4-6% at S >= 4k, 1 in 4 +3-4%, 1 in 2 -5%; H=128 -2% with 1 in 4, NOTES.md v17).
// DynamicCausalMaxS: causal / right-bounded problems with at most this many keys run the
// dynamic persistent schedule when the caller gives a tile counter (scheduler.h), taking
// precedence over PersistentCausalMaxS. Since a CTA claims its next tile near the end of the
// current one (v39), it beats one CTA per tile at every length at H=128 / 256 (S=1k-16k:
// H=128 +4% / +3% / +0.5%, H=256 +5% / +1% / +0.4%; H=64 beyond 4k keys, where it runs
// 128-row tiles: 16k +1.3%, session 12).
// ChunkMB: K + V bytes per longest-first chunk of heads (heads_per_l2_chunk). H=256 with 32 MB:
// +3-8% at S=1k / 4k over 8 MB, whose chunks held fewer tiles than there are SMs (2 heads x 32
// query blocks at 4k); H=128 lost 1% with 32 MB (NOTES.md v39).
// SchedArrive (FwdTraits::kSchedArrive): where a WG lets the other issue its GEMMs. H=64: after
// its row max, +3% at S >= 4k non-causal, +1% at 1k causal (after half its exp2s the same; after
// its whole softmax -12% to -18%, NOTES.md v30). JF_FWD_ARRIVE64 overrides it for experiments.
// ShortCausalM / ShortCausalN / ShortCausalMaxS: causal / right-bounded problems with at most
// ShortCausalMaxS keys take ShortCausalM x ShortCausalN tiles instead (0 = never). H=64 with
// 64-row tiles (one consumer WG, two CTAs per SM): causal 1k +7%, 4k +1.5%, but non-causal 16k
// -10% (NOTES.md v36). But under sustained load (back to back at the power cap) the 64-row tiles,
// reading K / V from L2 twice as often per FLOP, lose: 128-row tiles +3.5% at 1k causal and +5.7%
// at 4k, against -3.6% / -1.4% in short bursts (v81). H=64 keeps them up to 1k keys only (the 1k
// burst figure; from 2k on sustained throughput decides). Measured and dropped: H=128 on 64 x 64
// tiles (-2% at 1k causal, v37); H=64's 64-row tiles for every problem with a 3-stage ring
// (neutral, v38); H=64 192-row tiles (three consumer WGs at 160 registers, as FA3: 52-80 B of
// spills, -29% to -36% non-causal, v42).
// LongN / LongMinS: problems without a right bound (non-causal) and at least LongMinS keys, and
// no segment ids, take M x LongN tiles instead (0 = never): fewer steps per tile, each with its
// fixed cost. H=64 with 192 keys (harness, session 17, two passes, non-causal 1k / 4k / 16k):
// 396 / 453 / 459 -> 367 / 473 / 509 TFLOP/s (-7%, +4.4%, +11%); 160 keys lost everywhere (348 /
// 435 / 443). Its segment-id kernels spilled 16-196 B, hence not with segment ids.
// JF_FWD_LONGN64 / JF_FWD_LONGMINS64 / JF_FWD_SHORTCAUSALMAXS64 override H=64's for experiments.
// LazyMax (FwdTraits::kLazyMax, v64): FA4's lazy row max (threshold 2^8) with the O rescale
// skipped when no row's max moved. Harness bf16, same run, two passes: H=128 4k non-causal +6%,
// 1k causal +4.6%, 16k non-causal +7-10%; H=256 4k / 16k non-causal +7.5% / +9%, 1k / 4k causal
// +4% / +6%; H=64 -4% / -5% at 4k / 16k non-causal, -1% causal (its O rows are short and its step
// is softmax-bound: the vote and the compare cost more than the multiplies), so H=64 keeps the
// exact rescale. JF_FWD_LAZY64 overrides H=64's for experiments.
// JF_FWD_POLY128 / JF_FWD_ARRIVE128 override H=128's PolyEvery / SchedArrive for experiments
// (to retune them with v64's lazy rescale, which shortens the step's critical path).
#ifndef JF_FWD_POLY128
#define JF_FWD_POLY128 0
#endif
#ifndef JF_FWD_ARRIVE128
#define JF_FWD_ARRIVE128 0
#endif
#ifndef JF_FWD_LAZY64
#define JF_FWD_LAZY64 0
#endif
#ifndef JF_FWD_ARRIVE64
#define JF_FWD_ARRIVE64 1
#endif
#ifndef JF_FWD_SHORTCAUSALMAXS64
#define JF_FWD_SHORTCAUSALMAXS64 1024
#endif
#ifndef JF_FWD_LONGN64
#define JF_FWD_LONGN64 192
#endif
#ifndef JF_FWD_LONGMINS64
#define JF_FWD_LONGMINS64 4096
#endif
template <> struct TileConfig<64> { static constexpr int M = 128, N = 128, Stages = 2, PersistentCausalMaxS = 2048, DynamicCausalMaxS = 1 << 30, ChunkMB = 8, SoftmaxChains = 8, PolyEvery = 8, ShortCausalM = 64, ShortCausalN = 128, ShortCausalMaxS = JF_FWD_SHORTCAUSALMAXS64, LongN = JF_FWD_LONGN64, LongMinS = JF_FWD_LONGMINS64, LazyMax = JF_FWD_LAZY64; static constexpr int SchedArrive = JF_FWD_ARRIVE64; };
template <> struct TileConfig<128> { static constexpr int M = 128, N = 128, Stages = 2, PersistentCausalMaxS = 0, DynamicCausalMaxS = 1 << 30, ChunkMB = 8, SoftmaxChains = 1, PolyEvery = JF_FWD_POLY128, ShortCausalM = 0, ShortCausalN = 0, ShortCausalMaxS = 0, LongN = 0, LongMinS = 0, LazyMax = 8; static constexpr int SchedArrive = JF_FWD_ARRIVE128; };
template <> struct TileConfig<256> { static constexpr int M = 128, N = 64, Stages = 2, PersistentCausalMaxS = 0, DynamicCausalMaxS = 1 << 30, ChunkMB = 32, SoftmaxChains = 8, PolyEvery = 0, ShortCausalM = 0, ShortCausalN = 0, ShortCausalMaxS = 0, LongN = 0, LongMinS = 0, LazyMax = 8; static constexpr int SchedArrive = 0; };

// The traits of head dim kHeadDim's kernel on kBlockM x kBlockN tiles: every other setting from
// its TileConfig, so a new setting is passed through in one place.
template <int kHeadDim, int kBlockM, int kBlockN, class Element, bool kDenseTma = false>
using ConfigTraits =
    FwdTraits<kHeadDim, kBlockM, kBlockN, TileConfig<kHeadDim>::Stages, Element, TileConfig<kHeadDim>::SoftmaxChains,
              TileConfig<kHeadDim>::PolyEvery, TileConfig<kHeadDim>::SchedArrive, TileConfig<kHeadDim>::LazyMax, kDenseTma>;

template <class Traits, bool Softcap, bool Segments, bool Dense = false, bool Dropout = false>
cudaError_t launch_fwd(const FlashFwdParams& p, cudaStream_t stream) {
  using T = Traits;
  using Element = typename T::Element;
  KernelParams<T> kp;
  kp.p = p;
  auto mQ = tma_operand<Element>(p.q, p.seqlen_q, p.head_dim, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto mK = tma_operand<Element>(p.k, p.seqlen_k, p.head_dim, p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto mV = tma_operand<Element>(p.v, p.seqlen_k, p.head_dim, p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  auto mVt = make_tensor(mV.data(), select<1, 0, 2, 3>(mV.layout()));  // (head_dim, keys, heads, batch)
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, mQ, typename T::SmemLayoutQ{}, Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}, _1{});
  kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, mK, take<0, 2>(typename T::SmemLayoutK{}), Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, _1{});
  kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, mVt, take<0, 2>(typename T::SmemLayoutVt{}), Shape<Int<T::kHeadDim>, Int<T::kBlockN>>{}, _1{});
  auto mO = tma_operand<Element>(p.o, p.seqlen_q, p.head_dim, p.heads_q, p.batch, p.o_row_stride, p.o_head_stride, p.o_batch_stride);
  kp.tma_o = make_tma_copy(SM90_TMA_STORE{}, mO, typename T::SmemLayoutO{}, Shape<_64, Int<T::kOCols>>{}, _1{});
  float const log2e = 1.44269504088896340736f;
  kp.scale_log2 = Softcap ? p.softcap * log2e : p.scale * log2e;
  kp.softcap_mult = Softcap ? p.scale / p.softcap : 0.f;
  kp.timeline = fwd_timeline_buffer();
  if constexpr (T::kDenseTma) {
    cudaError_t const e = make_dense_tma<T::kBlockM>(p, &kp.dense);
    if (e != cudaSuccess) return e;
  }
  int const m_blocks = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  int64_t tiles = int64_t(m_blocks) * p.heads_q * p.batch;
  if (tiles <= 0) return cudaSuccess;
  if (tiles > 0x7fffffff) return cudaErrorNotSupported;
  bool const longest_first = p.window_right >= 0;  // causal / right-bounded: the last query block is longest
  // A q head's share of K + V in L2 (the q heads of a GQA group read the same K/V).
  int64_t const kv_bytes = int64_t(p.seqlen_k) * p.head_dim * 2 * int64_t(sizeof(Element)) * p.heads_kv / p.heads_q;
  int sms = 0;
  cudaError_t err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  // Persistent (one CTA per SM, static snake order) hides per-tile prologue/epilogue, which
  // matters when tiles are short. Causal tiles vary a lot in length: there the hardware's
  // dynamic CTA dispatch (one CTA per tile, longest first) balances better (NOTES.md v2, v13).
  // With a tile counter (p.tile_counter), short causal problems run persistent with the dynamic
  // schedule (scheduler.h): the balance of dynamic dispatch and the overlap of persistence.
  bool const dynamic = longest_first && p.tile_counter != nullptr &&
                       p.seqlen_k <= TileConfig<T::kHeadDim>::DynamicCausalMaxS;
  bool const persistent = dynamic || !longest_first || p.seqlen_k <= TileConfig<T::kHeadDim>::PersistentCausalMaxS;
  // Longest-first in chunks of heads only when tiles are taken in index order: the static snake
  // order balances only a globally sorted tile list (chunked, S=1k causal lost 6-20%, NOTES.md v11).
  int const num_bh = p.heads_q * p.batch;
  kp.sched = make_tile_schedule(m_blocks, num_bh, p.heads_q,
                                persistent && !dynamic ? num_bh : heads_per_l2_chunk(kv_bytes, TileConfig<T::kHeadDim>::ChunkMB),
                                int(tiles), longest_first ? TileOrder::kLastBlockLongest : TileOrder::kByHead);
  kp.tile_counter = dynamic ? p.tile_counter : nullptr;
  if (dynamic) {
    err = cudaMemsetAsync(p.tile_counter, 0, sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
  }
  int64_t const slots = int64_t(sms) * T::kCtasPerSm;  // CTAs resident at once
  int grid = int(persistent && tiles > slots ? slots : tiles);
  auto kernel = &flash_fwd_kernel<T, Softcap, Segments, Dense, Dropout>;
  constexpr int smem = T::kSmemBytes;
  // Cheap and idempotent; keeps the launch free of any one-time global state.
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  if constexpr (T::kCtasPerSm > 1) {  // all of the unified L1 as smem, so kCtasPerSm CTAs fit
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    if (err != cudaSuccess) return err;
  }
  kernel<<<dim3(unsigned(grid)), dim3(T::kThreads), smem, stream>>>(kp);
  return cudaGetLastError();
}

template <int kHeadDim, int kBlockM, int kBlockN, class Element>
cudaError_t run_fwd_tiles(const FlashFwdParams& p, cudaStream_t stream) {
  using T = ConfigTraits<kHeadDim, kBlockM, kBlockN, Element>;
  if (p.q_segment_ids) {
    if (p.softcap > 0.f) return launch_fwd<T, true, true>(p, stream);
    return launch_fwd<T, false, true>(p, stream);
  }
  if (p.softcap > 0.f) return launch_fwd<T, true, false>(p, stream);
  return launch_fwd<T, false, false>(p, stream);
}

template <int kHeadDim, class Element>
cudaError_t run_fwd_hdim(const FlashFwdParams& p, cudaStream_t stream) {
  using C = TileConfig<kHeadDim>;
  if (p.dropout_keys) {
    // Dropout: the default tiles, without the other optional inputs (hopper_fwd_takes_extras
    // sends those mixes to the portable forward).
    if (p.bias || p.mask || p.q_segment_ids) return cudaErrorNotSupported;
    using T = ConfigTraits<kHeadDim, C::M, C::N, Element>;
    if (p.softcap > 0.f) return launch_fwd<T, true, false, false, true>(p, stream);
    return launch_fwd<T, false, false, false, true>(p, stream);
  }
  if (p.bias || p.mask) {
    // Bias / mask (segment ids with them: checked at run time). Where TMA can copy them, the
    // producer stages each key block's bias / mask tiles in smem (dense_tma.h; 64-key blocks,
    // H <= 128: at H = 256 the tiles do not fit beside Q, K / V and O).
    if constexpr (kHeadDim <= 128) {
      if (dense_tiles_by_tma(p)) {
        using T = ConfigTraits<kHeadDim, C::M, kDenseTmaKeys, Element, true>;
        if (p.softcap > 0.f) return launch_fwd<T, true, false, true>(p, stream);
        return launch_fwd<T, false, false, true>(p, stream);
      }
    }
    // Otherwise the Dense kernels load a key block's words a block ahead (dense.h), which fits
    // the consumers' registers with 64-key blocks at H >= 128.
    using T = ConfigTraits<kHeadDim, C::M, kHeadDim >= 128 ? 64 : C::N, Element>;
    if (p.softcap > 0.f) return launch_fwd<T, true, false, true>(p, stream);
    return launch_fwd<T, false, false, true>(p, stream);
  }
  if constexpr (C::ShortCausalM > 0) {
    if (p.window_right >= 0 && p.seqlen_k <= C::ShortCausalMaxS)
      return run_fwd_tiles<kHeadDim, C::ShortCausalM, C::ShortCausalN, Element>(p, stream);
  }
  if constexpr (C::LongN > 0) {
    if (p.window_right < 0 && p.seqlen_k >= C::LongMinS && !p.q_segment_ids) {
      using T = ConfigTraits<kHeadDim, C::M, C::LongN, Element>;
      if (p.softcap > 0.f) return launch_fwd<T, true, false>(p, stream);
      return launch_fwd<T, false, false>(p, stream);
    }
  }
  return run_fwd_tiles<kHeadDim, C::M, C::N, Element>(p, stream);
}

}  // namespace jax_flash::sm90

// Explicit instantiation entry points, one per .cu file.
namespace jax_flash {
template <int kHeadDim, DType kDType>
cudaError_t flash_fwd_sm90_hdim(const FlashFwdParams& p, cudaStream_t stream);
}
