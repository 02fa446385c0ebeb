// Producer (TMA loads of Q and a kStages K/V ring) and consumer (wgmma + online softmax)
// halves of the forward mainloop.
#pragma once

#include "../common/dropout_frag.h"
#include "dense.h"
#include "segments.h"
#include "softmax.h"
#include "traits.h"

namespace jax_flash::sm90 {

// Runs on one elected thread of the producer warpgroup.
template <class Traits, class DensePipe>
__forceinline__ __device__ void producer_load(KernelParams<Traits> const& kp, typename Traits::SharedStorage& ss,
                                              typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                              DensePipe& pipe_dense, typename Traits::PipelineState& wr, int m_block, int h, int b,
                                              int n_min, int n_max, ProducerTimeline& ptl) {
  using T = Traits;
  FlashFwdParams const& p = kp.p;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutVt{});
  int h_kv = h / int(p.heads_q / p.heads_kv);

  Tensor mQ = kp.tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads_q, p.batch))(_, _, h, b);
  Tensor mK = kp.tma_k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.heads_kv, p.batch))(_, _, h_kv, b);
  Tensor mVt = kp.tma_v.get_tma_tensor(make_shape(p.head_dim, p.seqlen_k, p.heads_kv, p.batch))(_, _, h_kv, b);
  Tensor gQ = local_tile(mQ, Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}, make_coord(m_block, _0{}));
  Tensor gK = local_tile(mK, Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, make_coord(_, _0{}));   // (N, D, n)
  Tensor gVt = local_tile(mVt, Shape<Int<T::kHeadDim>, Int<T::kBlockN>>{}, make_coord(_0{}, _));  // (D, N, n)

  auto cq = kp.tma_q.get_slice(_0{});
  auto ck = kp.tma_k.get_slice(_0{});
  auto cv = kp.tma_v.get_slice(_0{});
  Tensor tQg = group_modes<0, 3>(cq.partition_S(gQ));
  Tensor tQs = group_modes<0, 3>(cq.partition_D(sQ));
  Tensor tKg = group_modes<0, 3>(ck.partition_S(gK));   // (TMA, n)
  Tensor tKs = group_modes<0, 3>(ck.partition_D(sK));   // (TMA, stage)
  Tensor tVg = group_modes<0, 3>(cv.partition_S(gVt));
  Tensor tVs = group_modes<0, 3>(cv.partition_D(sVt));

  using BarrierT = cutlass::arch::ClusterTransactionBarrier::ValueType;
  // K of the first block goes out before Q's completion matters; Q and K[first] overlap.
  ss.barrier_q.arrive_and_expect_tx(T::kBytesQ);
  copy(kp.tma_q.with(reinterpret_cast<BarrierT&>(ss.barrier_q), 0, TMA::CacheHintSm90::EVICT_FIRST), tQg, tQs);
  // Iterate key blocks from the last one down: the (masked) diagonal block comes first,
  // matching the consumer order.
  for (int n = n_max - 1; n >= n_min; --n) {
    pipe_k.producer_acquire(wr);
    copy(kp.tma_k.with(*pipe_k.producer_get_barrier(wr), 0, TMA::CacheHintSm90::EVICT_LAST), tKg(_, n), tKs(_, wr.index()));
    if constexpr (T::kDenseTma) {  // used with S(n), so right after K(n)
      pipe_dense.producer_acquire(wr);
      issue_dense_tma<T::kBlockM>(kp.dense, pipe_dense.producer_get_barrier(wr),
                                  ss.dense.tiles.data() + wr.index() * DenseTmaStage<T::kBlockM>::kBytes,
                                  n * T::kBlockN, m_block * T::kBlockM, h, b);
    }
    pipe_v.producer_acquire(wr);
    copy(kp.tma_v.with(*pipe_v.producer_get_barrier(wr), 0, TMA::CacheHintSm90::EVICT_LAST), tVg(_, n), tVs(_, wr.index()));
    if (n == n_max - 1) ptl.mark(kProdFirstKV);
    ++wr;
  }
}

// Warpgroup ping-pong: a WG issues its GEMMs only after the previous WG has issued its own,
// so one WG's softmax runs under the other's tensor-core work.
template <int kMmaWGs>
__forceinline__ __device__ void sched_sync(int wg) {
  if constexpr (kMmaWGs > 1) cutlass::arch::NamedBarrier::sync(256, 1 + wg);
}
template <int kMmaWGs>
__forceinline__ __device__ void sched_arrive(int wg) {
  int next = wg + 1 == kMmaWGs ? 0 : wg + 1;
  if constexpr (kMmaWGs > 1) cutlass::arch::NamedBarrier::arrive(256, 1 + next);
}

// sQ is reused by the next tile: consumers arrive once their last QK^T has completed; the
// producer warp syncs before overwriting Q. Its id follows the GEMM-issue ring's and the
// epilogue's per-WG ids (5 with up to two consumer WGs).
template <class Traits>
constexpr int kBarQEmpty = 1 + 2 * Traits::kMmaWGs > 5 ? 1 + 2 * Traits::kMmaWGs : 5;
// The dynamic schedule's tile hand-off (scheduler.h): one "empty" barrier (every consumer has read
// the hand-off) and, per consumer WG, one "full" barrier (its id kBarTileFull + wg), so that a WG
// starts its next tile without waiting for the other WG's epilogue (NOTES.md v60). The WGs end a
// tile about half a step apart (the GEMM-issue ring), and a joint barrier made both start the next
// one together: both first S GEMMs at once, then both softmaxes with the tensor pipe idle.
// cutlass::arch::NamedBarrier ids are offset by CUTLASS's 8 reserved hardware barriers: ids 0..7
// only. The GEMM-issue ring, the epilogue and Q-empty take 1..5; "empty" takes the unused 0.
template <class Traits>
constexpr int kBarTileEmpty = 0;
template <class Traits>
constexpr int kBarTileFull = kBarQEmpty<Traits> + 1;
// The producer warp publishes a hand-off to every consumer WG.
template <class Traits>
__forceinline__ __device__ void tile_full_arrive() {
  CUTLASS_PRAGMA_UNROLL
  for (int w = 0; w < Traits::kMmaWGs; ++w) cutlass::arch::NamedBarrier::arrive(128 + 32, kBarTileFull<Traits> + w);
}
// Consumer WG wg waits for the hand-off.
template <class Traits>
__forceinline__ __device__ void tile_full_sync(int wg) {
  cutlass::arch::NamedBarrier::sync(128 + 32, kBarTileFull<Traits> + wg);
}
template <class Traits>
__forceinline__ __device__ void q_empty_arrive() {
  cutlass::arch::NamedBarrier::arrive(Traits::kMmaThreads + 32, kBarQEmpty<Traits>);
}
template <class Traits>
__forceinline__ __device__ void q_empty_sync() {
  cutlass::arch::NamedBarrier::sync(Traits::kMmaThreads + 32, kBarQEmpty<Traits>);
}

template <class Pipe, class State>
__forceinline__ __device__ void consumer_wait(Pipe& pipe, State& st) {
  auto tok = pipe.consumer_try_wait(st);
  pipe.consumer_wait(st, tok);
}

// Consumer mainloop for one tile. Leaves the unnormalised O in tOrO; returns 1/rowsum and
// LSE per owned row. Dropout: each block's P is dropped after it entered the row sums (lse and
// the normaliser stay those of the undropped softmax; the kernel scales O by 1 / (1 - rate)),
// while the previous block's PV GEMM runs.
template <class Traits, bool Softcap, bool Segments, bool Dense, bool Dropout, class DensePipe, class TO, class Softmax>
__forceinline__ __device__ void consumer_mma(KernelParams<Traits> const& kp, typename Traits::SharedStorage& ss,
                                             typename Traits::Pipeline& pipe_k, typename Traits::Pipeline& pipe_v,
                                             DensePipe& pipe_dense, typename Traits::PipelineState& rd, SeqMask const& msk, int b, int h, int m_block,
                                             int n_min, int n_max, TO& tOrO, Softmax& softmax, int tidx, int q_phase,
                                             TileTimeline& ttl) {
  using T = Traits;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN;
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutVt{});
  int const wg = consumer_warpgroup();

  typename T::TiledMmaQK mma_qk;
  typename T::TiledMmaPV mma_pv;
  // Smem operand descriptors depend only on the warpgroup.
  auto wg_qk = mma_qk.get_slice(wg * 128);
  auto wg_pv = mma_pv.get_slice(wg * 128);
  Tensor tSrQ = wg_qk.partition_fragment_A(sQ);
  Tensor tSrK = wg_qk.partition_fragment_B(sK);
  Tensor tOrV = wg_pv.partition_fragment_B(sVt);

  auto thr_qk = mma_qk.get_thread_slice(tidx);
  Tensor cS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));

  int const m0 = m_block * kBlockM;
  int const wg_r0 = m0 + wg * 64;
  // Key blocks inside [full_k0, full_k1) are visible to all of this WG's rows: no element-wise mask.
  int full_k0, full_k1;
  msk.full_keys(wg_r0, wg_r0 + 64, &full_k0, &full_k1);
  // Packed sequences: blocks outside the keys every row of the WG sees by segment take the
  // element test too.
  SegRows seg;
  if constexpr (Segments) {
    FlashFwdParams const& p = kp.p;
    narrow_full_to_segment(p, p.seqlen_q, b, wg_r0 / kSegChunkRows, full_k0, full_k1);
    seg.kv_seg = p.kv_segment_ids + b * p.kv_seg_batch_stride;
    seg.seqlen_k = p.seqlen_k;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 2; ++i) {
      int const row = min(m0 + int(get<0>(cS_rc(i, 0))), p.seqlen_q - 1);  // rows past seqlen_q are not stored
      seg.id[i] = p.q_segment_ids[b * p.q_seg_batch_stride + row];
    }
  }
  // Bias / mask: every block takes the element path (a bias adds to every logit; no tile of a
  // mask is known full).
  DenseRows dense;
  DenseWords<T::kAccCols> dense_words;  // the next block's, loaded before its S GEMM is waited on
  if constexpr (Dense) {
    FlashFwdParams const& p = kp.p;
    full_k1 = full_k0;
    int rows[2];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 2; ++i) rows[i] = min(m0 + int(get<0>(cS_rc(i, 0))), p.seqlen_q - 1);
    dense = make_dense_rows(p, b, h, rows, Softcap);
  }
  constexpr int kRows = 2;
  float rescale[kRows];

  // hook(Int<1>) after the row max, hook(Int<2>) after half of the exp2s (OnlineSoftmax::step).
  // always_inline: left out of line (the Dense kernels' two calls are large), it would take the
  // accumulators by reference and put them in local memory.
  auto process = [&](auto& tSrS, int n_block, auto is_first, auto hook) __attribute__((always_inline)) {
    constexpr bool Is_first = decltype(is_first)::value;
    Tensor s_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
    if constexpr (Softcap) softcap_tile(tSrS, kp.softcap_mult);
    int n0 = n_block * kBlockN;
    // Only tiles that cross a mask boundary pay for element-wise masking.
    if (full_k0 <= n0 && n0 + kBlockN <= full_k1) {
      softmax.template step<Is_first, false>(s_rc, rescale, hook);
    } else {
      mask_tile(s_rc, cS_rc, msk, m0, n0);
      if constexpr (Segments) mask_tile_segments(s_rc, cS_rc, seg, n0);
      if constexpr (T::kDenseTma) {  // rd: this block's stage (K's)
        consumer_wait(pipe_dense, rd);
        apply_dense_smem_tile<kBlockM>(s_rc, cS_rc, dense,
                                       ss.dense.tiles.data() + rd.index() * DenseTmaStage<kBlockM>::kBytes, n0);
        pipe_dense.consumer_release(rd);
      } else if constexpr (Dense) {
        apply_dense_tile(s_rc, cS_rc, dense, dense_words, n0);
      }
      softmax.template step<Is_first, true>(s_rc, rescale, hook);
    }
    if constexpr (Dropout) apply_dropout(s_rc, cS_rc, make_head_dropout(kp.p, b, h), m0, n0);
  };

  Tensor tSrS0 = partition_fragment_C(mma_qk, select<0, 1>(typename T::TileShapeQK{}));
  Tensor tOrP = make_tensor<typename T::Element>(acc_to_Aregs(tSrS0.layout()));

  StepTimeline tl;
  tl.init(kp.timeline, wg, blockIdx.x == 0 && tidx % 128 == 0);
  int n_block = n_max - 1;
  if constexpr (Dense && !T::kDenseTma) load_dense_words(dense_words, cS_rc, dense, n_block * kBlockN);
  if (JF_FWD_TL_START == 2) ttl.mark(kTileStart);
  ss.barrier_q.wait(q_phase);
  ttl.mark(kTileQReady);
  {
    consumer_wait(pipe_k, rd);
    wg_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, rd.index()), tSrS0);
    warpgroup_wait<0>();
    ttl.mark(kTileFirstS);
    pipe_k.consumer_release(rd);
    if (n_block == n_min) q_empty_arrive<Traits>();
    process(tSrS0, n_block, cute::true_type{}, [](auto) {});
    convert_out(tSrS0, tOrP);
  }
  clear(tOrO);
  Tensor o_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));

  // The GEMM-issue ring passes to the next WG at point T::kSchedArrive of the step: 0 after the
  // GEMM issue, 1 / 2 inside the softmax (its hook), 3 after it.
  auto arrive_at = [&](auto at) {
    if constexpr (decltype(at)::value == T::kSchedArrive) sched_arrive<T::kMmaWGs>(wg);
  };
  // Steady state: S(n) = Q K(n)^T and O += P(n+1) V(n+1) are in flight together; softmax of
  // S(n) runs while the PV GEMM is still executing.
  CUTLASS_PRAGMA_NO_UNROLL
  for (--n_block; n_block >= n_min; --n_block) {
    typename T::PipelineState rd_v = rd;
    ++rd;
    Tensor tSrS = partition_fragment_C(mma_qk, select<0, 1>(typename T::TileShapeQK{}));
    tl.mark(StepTimeline::kStart);
    if constexpr (Dense && !T::kDenseTma) load_dense_words(dense_words, cS_rc, dense, n_block * kBlockN);
    consumer_wait(pipe_k, rd);
    sched_sync<T::kMmaWGs>(wg);
    tl.mark(StepTimeline::kIssueQK);
    wg_gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, rd.index()), tSrS);
    consumer_wait(pipe_v, rd_v);
    wg_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, rd_v.index()), tOrO);
    arrive_at(Int<0>{});
    tl.mark(StepTimeline::kIssued);
    warpgroup_wait<1>();
    tl.mark(StepTimeline::kSReady);
    pipe_k.consumer_release(rd);
    if (n_block == n_min) q_empty_arrive<Traits>();
    process(tSrS, n_block, cute::false_type{}, arrive_at);
    arrive_at(Int<3>{});
    tl.mark(StepTimeline::kSoftmax);
    warpgroup_wait<0>();
    pipe_v.consumer_release(rd_v);
    convert_out(tSrS, tOrP);
    rescale_rows<(T::kLazyMax > 0)>(o_rc, rescale);
    tl.mark(StepTimeline::kEnd);
    tl.end_step();
  }
  consumer_wait(pipe_v, rd);
  wg_gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, rd.index()), tOrO);
  warpgroup_wait<0>();
  ttl.mark(kTileLoopEnd);
  pipe_v.consumer_release(rd);
  ++rd;
}

}  // namespace jax_flash::sm90
