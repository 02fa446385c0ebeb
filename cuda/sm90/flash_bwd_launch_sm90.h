// Host side of one sm90 backward instantiation: zero dq_accum, row statistics (D, lse*log2e),
// the main kernel (TMA descriptors built here), dq = scale*dq_accum. No allocation, no host sync.
#pragma once

#include <cuda_runtime.h>

#include "flash_bwd_kernel_sm90.h"
#include "support.h"

namespace jax_flash::sm90 {

template <int kHeadDim>
struct BwdTileConfig;
// PolyEvery: every n-th exp2 of P on the FMA pipe (NOTES.md v20: H=64 1 in 4 +5%, H=128 1 in 8
// +1-2%; v43: without the lockstep the H=128 WGs no longer form P at the same time, and all-MUFU
// is 0-3% faster there); the macros override it for experiments.
#ifndef JF_BWD_POLY64
#define JF_BWD_POLY64 4
#endif
#ifndef JF_BWD_POLY128
#define JF_BWD_POLY128 0
#endif
// DynamicCausalMaxS: causal / right-bounded problems with at most this many keys run persistent
// on the dynamic schedule (bwd_next_tile; v41: S = 1k / 4k / 16k causal, H=64 +7% / +1% / -2%,
// H=128 +4.5% / +0.5% / -2.6% to +4.6% over three passes, H=256 +2% each); longer ones one CTA
// per tile. H=128 takes every length since session 15 (after v43 / v44, 16k causal, three
// same-run passes: 585 / 584 / 612 -> 653 / 592 / 640 TFLOP/s, +5.5% on the mean).
// JF_BWD_DYNAMIC=0 builds without the dynamic instantiation (A/B against it);
// JF_BWD_DYN_MAXS64 / JF_BWD_DYN_MAXS128 override DynamicCausalMaxS (experiments: 16k causal
// after v43 / v44, whose per-tile timing differs from v41's).
#ifndef JF_BWD_DYNAMIC
#define JF_BWD_DYNAMIC 1
#endif
// Split tail (NOTES.md v82, v82b): a persistent static launch whose tiles leave a part-empty last
// round runs that round as a second launch that deals its steps out to every CTA
// (flash_bwd_kernel<..., SplitTail = true>). JF_BWD_SPLIT_TAIL=0 builds without it (A/B).
// Since v84 only the head-dim split kernel (H=256) runs it; the key split runs the early dQ
// conversion (below) instead.
// JF_BWD_SPLIT_MIN_STEPS: tiles of fewer steps keep the part-empty round, where the second
// launch's fixed cost (kernel boundary, the pieces' prologue and reduce-adds) outweighs it
// (H=128, H100 harness: 13 steps -2.7%, 52 steps +0.9%, 205 steps +1.1%).
#ifndef JF_BWD_SPLIT_TAIL
#define JF_BWD_SPLIT_TAIL 1
#endif
#ifndef JF_BWD_SPLIT_MIN_STEPS
#define JF_BWD_SPLIT_MIN_STEPS 32
#endif
// Early dQ conversion (NOTES.md v83): on persistent static launches without a causal / window
// bound or lengths (every key-block tile runs every step of its head), the dQ conversion runs as
// a programmatic dependent of the main launch: it converts each (batch, kv head)'s rows as soon as
// the writers' counts say the head's reduce-adds have landed, on the SMs that the part-empty last
// round leaves idle, instead of after the main kernel. JF_BWD_EARLY_DQ=0 builds without it (A/B).
#ifndef JF_BWD_EARLY_DQ
#define JF_BWD_EARLY_DQ 1
#endif
#ifndef JF_BWD_DYN_MAXS64
#define JF_BWD_DYN_MAXS64 4096
#endif
#ifndef JF_BWD_DYN_MAXS128
#define JF_BWD_DYN_MAXS128 (1 << 30)
#endif
// UnboundedM: query rows per step of the plain launches without a causal / window bound (no
// softcap, bias / mask, dropout, segment ids or deterministic mode); M for the rest.
template <> struct BwdTileConfig<64> { static constexpr int M = 128, N = 128, Stages = 2, PolyEvery = JF_BWD_POLY64, DynamicCausalMaxS = JF_BWD_DYN_MAXS64, UnboundedM = M; static constexpr bool SdPByRole = false; };
// Three Q / dO stages at H=128, the dK / dV epilogue in the dQ staging buffer (v44: +1-2% at 1k,
// +0-1.5% at 4k, same run); JF_BWD_STAGES128=2 restores two stages and a separate epilogue buffer.
#ifndef JF_BWD_STAGES128
#define JF_BWD_STAGES128 3
#endif
// Unbounded launches: 80-row steps (FA3's non-causal H=128 tile; dQ transposed, two stages for
// smem), each step's fixed cost over 25% more rows (NOTES.md v65). JF_BWD_M80=0: 64 rows (A/B).
#ifndef JF_BWD_M80
#define JF_BWD_M80 1
#endif
template <> struct BwdTileConfig<128> { static constexpr int M = 64, N = 128, Stages = JF_BWD_STAGES128, PolyEvery = JF_BWD_POLY128, DynamicCausalMaxS = JF_BWD_DYN_MAXS128, UnboundedM = JF_BWD_M80 ? 80 : 64; static constexpr bool SdPByRole = false; };
// 64 keys per CTA: the WGs split head_dim (BwdTraits::kSplitD). SdPByRole: plain launches (no
// softcap, deterministic mode, segment ids, bias / mask or dropout) take the S^T / dP^T-by-role
// instantiation (NOTES.md v57b, v69, v70). JF_BWD_SDP_BY_ROLE=0 turns it off (A/B).
#ifndef JF_BWD_SDP_BY_ROLE
#define JF_BWD_SDP_BY_ROLE 1
#endif
// Causal / windowed launches take it too from JF_BWD_ROLE_BOUNDED_MINS keys up (v70: with v69's
// dV / dK by role it wins at every length, harness causal 1k / 4k / 16k +0% / +4% / +3-15%; before
// v69 it lost 4% at 1k, where WG 0 masks all rows of a boundary step while WG 1 waits).
#ifndef JF_BWD_ROLE_BOUNDED_MINS
#define JF_BWD_ROLE_BOUNDED_MINS 0
#endif
template <> struct BwdTileConfig<256> { static constexpr int M = 64, N = 64, Stages = 2, PolyEvery = 0, DynamicCausalMaxS = 1 << 30, RoleBoundedMinS = JF_BWD_ROLE_BOUNDED_MINS, UnboundedM = M; static constexpr bool SdPByRole = JF_BWD_SDP_BY_ROLE; };

template <class Traits, bool Softcap, bool Deterministic, bool Segments = false, bool Dense = false,
          bool Dropout = false>
cudaError_t launch_bwd(const FlashBwdParams& p, cudaStream_t stream) {
  using T = Traits;
  using Element = typename T::Element;
  BwdKernelParams<T> kp;
  kp.p = p;
  kp.timeline = bwd_timeline_buffer();
  kp.acc_rows = p.seqlen_q_rounded > 0 ? p.seqlen_q_rounded : dq_accum_rows(p.seqlen_q);
  kp.acc_cols = p.head_dim_rounded > 0 ? p.head_dim_rounded : dq_accum_cols(p.head_dim);
  // dq_accum: whole kBlockM-row blocks of kBlockM * head_dim floats (fragment order) from each
  // (b, h)'s row 0; the row statistics are read in kBlockM-row, 16-byte aligned pieces; the
  // turn counters count 64-row blocks. dq_accum_rows leaves room for the last block (80-row
  // tiles too). The fragment order needs rows of exactly kHeadDim floats (head dims 129..192
  // have 192: those take the portable backward).
  int const stats_rows = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM * T::kBlockM;
  if (kp.acc_rows < stats_rows || kp.acc_rows % 64 || kp.acc_cols != T::kHeadDim || p.seqlen_q_rounded != kp.acc_rows)
    return cudaErrorNotSupported;
  int const n_blocks = (p.seqlen_k + T::kBlockN - 1) / T::kBlockN;

  bool const longest_first = p.window_right >= 0;
  // The dynamic schedule's tile counter: the caller's, or else the first dQ turn counter
  // (dq_semaphore, [batch, heads_q, acc_rows / 64]), which only the deterministic mode (never
  // dynamic) uses otherwise.
  bool const has_turn_counter = int64_t(p.batch) * p.heads_q * (kp.acc_rows / 64) > 0;
  int* const counter = p.tile_counter ? p.tile_counter : has_turn_counter ? p.dq_semaphore : nullptr;
  bool const dynamic = JF_BWD_DYNAMIC && !Deterministic && longest_first && counter != nullptr &&
                       p.seqlen_k <= BwdTileConfig<T::kHeadDim>::DynamicCausalMaxS;
  auto mQ = tma_operand<Element>(p.q, p.seqlen_q, p.head_dim, p.heads_q, p.batch, p.q_row_stride, p.q_head_stride, p.q_batch_stride);
  auto mdO = tma_operand<Element>(p.dout, p.seqlen_q, p.head_dim, p.heads_q, p.batch, p.do_row_stride, p.do_head_stride,
                                  p.do_batch_stride);
  auto mK = tma_operand<Element>(p.k, p.seqlen_k, p.head_dim, p.heads_kv, p.batch, p.k_row_stride, p.k_head_stride, p.k_batch_stride);
  auto mV = tma_operand<Element>(p.v, p.seqlen_k, p.head_dim, p.heads_kv, p.batch, p.v_row_stride, p.v_head_stride, p.v_batch_stride);
  auto tileQ = Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{};
  auto tileK = Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{};
  kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, mQ, take<0, 2>(typename T::SmemLayoutQ{}), tileQ, _1{});
  kp.tma_do = make_tma_copy(SM90_TMA_LOAD{}, mdO, take<0, 2>(typename T::SmemLayoutQ{}), tileQ, _1{});
  kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, mK, typename T::SmemLayoutK{}, tileK, _1{});
  kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, mV, typename T::SmemLayoutK{}, tileK, _1{});
  auto mdK = tma_operand<Element>(p.dk, p.seqlen_k, p.head_dim, p.heads_kv, p.batch, p.dk_row_stride, p.dk_head_stride,
                                  p.dk_batch_stride);
  auto mdV = tma_operand<Element>(p.dv, p.seqlen_k, p.head_dim, p.heads_kv, p.batch, p.dv_row_stride, p.dv_head_stride,
                                  p.dv_batch_stride);
  auto tiledKV = Shape<_64, Int<T::kdKVCols>>{};
  kp.tma_dk = make_tma_copy(SM90_TMA_STORE{}, mdK, typename T::SmemLayoutdKV{}, tiledKV, _1{});
  kp.tma_dv = make_tma_copy(SM90_TMA_STORE{}, mdV, typename T::SmemLayoutdKV{}, tiledKV, _1{});
  float const log2e = 1.44269504088896340736f;
  kp.scale_log2 = Softcap ? p.softcap * log2e : p.scale * log2e;
  kp.softcap_mult = Softcap ? p.scale / p.softcap : 0.f;
  kp.dense = DenseTmaDescs{};
  if constexpr (T::kDenseTma) {  // the WGs' bias / mask tiles (compact stages: room for a float32 bias)
    cudaError_t const e = make_dense_tma<T::kBlockM>(p, &kp.dense, true);
    if (e != cudaSuccess) return e;
  }

  // Causal / right-bounded masks: the first key blocks (the longest) first, over chunks of
  // heads, so the longest tiles do not start last. Otherwise a head's key blocks stay adjacent
  // (Q/dO in L2). Persistent (one CTA per SM, snake order) overlaps a tile's dK/dV stores with
  // the next tile's loads (+1-2% at S=1k). Causal / right-bounded problems run persistent on
  // the dynamic schedule (a CTA claims its next tile near the end of the current one, v41);
  // in a static order they lost to one CTA per tile, whose hardware dispatch balances tiles of
  // different lengths (v6).
  int64_t const tiles = int64_t(n_blocks) * p.heads_kv * p.batch;
  if (tiles > 0x7fffffff) return cudaErrorNotSupported;
  // A kv head's Q + dO (all q heads of its group) in L2.
  int64_t const qdo_bytes = int64_t(p.seqlen_q) * p.head_dim * 2 * int64_t(sizeof(Element)) * (p.heads_q / p.heads_kv);
  kp.sched = make_tile_schedule(n_blocks, p.heads_kv * p.batch, p.heads_kv, heads_per_l2_chunk(qdo_bytes), int(tiles),
                                longest_first ? TileOrder::kFirstBlockLongest : TileOrder::kByHead);
  int sms = 0;
  cudaError_t err = sm_count(&sms);
  if (err != cudaSuccess) return err;
  // Deterministic: a CTA waits for the lower key blocks' dQ turns, so those must have been
  // launched already: one CTA per tile, in tile order.
  bool const persistent = dynamic || (!longest_first && !p.deterministic);
  int const grid = int(persistent && tiles > sms ? sms : tiles);
  kp.tile_counter = dynamic ? counter : nullptr;  // zeroed by the row statistics kernel
  // Split tail (bwd_static_tile): a persistent static launch whose tiles leave a last round of
  // rest < grid tiles runs the whole rounds, then a second launch (the SplitTail instantiation)
  // with the rest cut into pieces over every CTA. Only where each tile has the same steps (no
  // causal / window bound, no lengths) and the caller's workspace has the slots. A launch of its
  // own, because the pieces' code costs the main loop registers (one kernel for both: 4-5% slower,
  // NOTES.md v82). (Instantiated only for the traits that run unbounded launches.) Head-dim split
  // only (H=256): the key split runs the early dQ conversion there instead, which fills the same
  // idle round better (v84, NOTES.md).
  using C = BwdTileConfig<T::kHeadDim>;
  constexpr bool kSplitKernel = JF_BWD_SPLIT_TAIL && T::kSplitD && !Deterministic && !Segments && !Dense && !Dropout &&
                                (Softcap ? T::kBlockM == C::M && !T::kSdPByRole
                                         : T::kBlockM == C::UnboundedM && T::kSdPByRole == C::SdPByRole);
  // Uniform launches: every tile has the same steps (no causal / window bound, no lengths).
  bool const uniform = p.window_left < 0 && p.window_right < 0 && p.q_lens == nullptr && p.kv_lens == nullptr;
  int64_t const tile_units = int64_t((p.seqlen_q + T::kBlockM - 1) / T::kBlockM) * (p.heads_q / p.heads_kv);
  // Early dQ conversion: the counters are the first batch * heads_kv dQ turn counters, unused
  // without the deterministic mode and the dynamic schedule. Key split only: its writer warps
  // issue every reduce-add (the head-dim split's consumers do their own).
  kp.dq_ready = nullptr;
  int ready_target = 0;
  {
    int64_t const target = int64_t(T::kMmaWGs) * n_blocks * tile_units;  // one count per writer warp
    if (JF_BWD_EARLY_DQ && !Deterministic && !Segments && !Dense && !Dropout && !T::kSplitD && persistent && !dynamic &&
        uniform && has_turn_counter && p.dq_semaphore != nullptr && target <= 0x7fffffff) {
      kp.dq_ready = p.dq_semaphore;
      ready_target = int(target);
    }
  }
  int split_vec4s = 0;
  if constexpr (kSplitKernel) {
    int64_t const rest = grid > 0 ? tiles % grid : 0;
    if (persistent && !dynamic && !p.deterministic && uniform && tiles > grid && rest > 0 &&
        tile_units >= JF_BWD_SPLIT_MIN_STEPS &&
        p.tile_counter != nullptr && p.q_segment_ids == nullptr &&
        rest <= bwd_split_slots(p.batch, p.heads_kv, p.seqlen_k) && rest * tile_units <= 0x7fffffff) {
      kp.split.tile0 = int(tiles - rest);
      kp.split.deal = make_split_deal(rest, int(tile_units), grid);
      kp.split.by_rows = FastDiv(int(tile_units / (p.heads_q / p.heads_kv)));
      kp.split.slots = p.tile_counter + 4;
      split_vec4s = int(rest * kBwdSplitSlotInts / 4);
    }
  }
  {  // row statistics + zeroed dq_accum (and the dynamic schedule's counter), one CTA per 64-row block
    int const m_blocks = (stats_rows + kRowStatsRows - 1) / kRowStatsRows;
    int64_t const ctas = int64_t(m_blocks) * p.heads_q * p.batch;
    if (ctas > 0x7fffffff) return cudaErrorNotSupported;
    if (ctas > 0) {
      flash_bwd_row_stats_kernel_sm90<T><<<unsigned(ctas), kRowStatsThreads, 0, stream>>>(
          p, m_blocks, dynamic ? counter : nullptr, reinterpret_cast<int4*>(kp.split.slots), split_vec4s, kp.dq_ready,
          kp.dq_ready ? p.batch * p.heads_kv : 0);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  }

  auto kernel = &flash_bwd_kernel<T, Softcap, Deterministic, false, Segments, Dense, Dropout>;
  if constexpr (JF_BWD_DYNAMIC && !Deterministic && !T::kUnboundedOnly) {
    if (dynamic) kernel = &flash_bwd_kernel<T, Softcap, false, true, Segments, Dense, Dropout>;
  }
  constexpr int smem = T::kSmemBytes;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  BwdKernelParams<T> kp_main = kp;
  if (split_vec4s > 0) kp_main.sched.num_tiles = kp.split.tile0;  // the whole rounds only
  kernel<<<dim3(unsigned(grid)), dim3(T::kThreads), smem, stream>>>(kp_main);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if constexpr (kSplitKernel) {
    if (split_vec4s > 0) {
      auto const tail = &flash_bwd_kernel<T, Softcap, false, false, false, false, false, true>;
      err = cudaFuncSetAttribute(tail, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
      if (err != cudaSuccess) return err;
      tail<<<dim3(unsigned(grid)), dim3(T::kThreads), smem, stream>>>(kp);
      err = cudaGetLastError();
      if (err != cudaSuccess) return err;
    }
  }

  int const m_blocks = (p.seqlen_q + T::kBlockM - 1) / T::kBlockM;
  dim3 const convert_grid(unsigned(m_blocks), unsigned(p.heads_q), unsigned(p.batch));
  if (kp.dq_ready != nullptr)
    return launch_dependent(&flash_bwd_convert_dq_kernel_sm90<T>, convert_grid, dim3(T::kMmaThreads), 0, stream, p,
                            kp.acc_rows, kp.acc_cols, kp.dq_ready, ready_target);
  flash_bwd_convert_dq_kernel_sm90<T><<<convert_grid, T::kMmaThreads, 0, stream>>>(p, kp.acc_rows, kp.acc_cols, nullptr, 0);
  return cudaGetLastError();
}

template <int kHeadDim, class Element>
cudaError_t run_bwd_hdim(const FlashBwdParams& p, cudaStream_t stream) {
  using C = BwdTileConfig<kHeadDim>;
  using T = BwdTraits<kHeadDim, C::M, C::N, C::Stages, Element, C::PolyEvery>;
  // Deterministic is a separate instantiation: its turn-taking stays out of the default kernel.
  // Dropout: its own instantiation, alone (no bias / mask / segment ids, softcap or the
  // deterministic mode: the dispatcher sends those mixes to the portable kernels).
  if (p.dropout_keys) {
    if (p.bias || p.mask || p.q_segment_ids || p.softcap > 0.f || p.deterministic) return cudaErrorNotSupported;
    return launch_bwd<T, false, false, false, false, true>(p, stream);
  }
  // Segment ids: their own instantiation, without softcap or the deterministic mode (the
  // dispatcher sends those to the portable kernels).
  if (p.q_segment_ids) return launch_bwd<T, false, false, true>(p, stream);
  // Bias / mask (dense_bwd.h): their own instantiation too, on the same terms. At H=128 their tiles
  // come by TMA where the layout allows it and a WG's tile fits its stage (two Q / dO stages, to
  // make room; NOTES.md v53).
  if (p.bias || p.mask) {
    if constexpr (kHeadDim == 128) {
      if (dense_bwd_tiles_by_tma(p)) {
        using TD = BwdTraits<kHeadDim, C::M, C::N, 2, Element, C::PolyEvery, true>;
        return launch_bwd<TD, false, false, false, true>(p, stream);
      }
    }
    return launch_bwd<T, false, false, false, true>(p, stream);
  }
  if (p.deterministic) return p.softcap > 0.f ? launch_bwd<T, true, true>(p, stream) : launch_bwd<T, false, true>(p, stream);
  if (p.softcap > 0.f) return launch_bwd<T, true, false>(p, stream);
  if constexpr (C::SdPByRole) {
    // No causal / window bound: masked steps only at ragged ends (lengths, seqlens not a multiple
    // of 64). Bounded: by role from C::RoleBoundedMinS keys (v70).
    if ((p.window_left < 0 && p.window_right < 0) || p.seqlen_k >= C::RoleBoundedMinS) {
      using TR = BwdTraits<kHeadDim, C::M, C::N, C::Stages, Element, C::PolyEvery, false, true>;
      return launch_bwd<TR, false, false>(p, stream);
    }
  }
  if constexpr (C::UnboundedM != C::M) {
    if (p.window_left < 0 && p.window_right < 0) {
      using TU = BwdTraits<kHeadDim, C::UnboundedM, C::N, 2, Element, C::PolyEvery>;
      return launch_bwd<TU, false, false>(p, stream);
    }
  }
  return launch_bwd<T, false, false>(p, stream);
}

}  // namespace jax_flash::sm90

namespace jax_flash {
template <int kHeadDim, DType kDType>
cudaError_t flash_bwd_sm90_hdim(const FlashBwdParams& p, cudaStream_t stream);
}
