// The warp-specialised, persistent sm90 forward kernel: warpgroup 0 = TMA producer,
// warpgroups 1.. = wgmma consumers (64 query rows each).
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "epilogue.h"
#include "mainloop.h"
#include "scheduler.h"

namespace jax_flash::sm90 {

// A tile's key blocks [n_min, n_max): the interval rule's, narrowed to its query chunks'
// segments (Segments; Dense: when segment ids come with the bias / mask). The producer and the
// consumers walk exactly these.
template <class T, bool Segments, bool Dense>
__forceinline__ __device__ void tile_key_blocks(FlashFwdParams const& p, SeqMask const& msk, TileCoord const& tc,
                                                int& n_min, int& n_max) {
  key_block_range<T::kBlockM, T::kBlockN>(msk, tc.m_block, n_min, n_max);
  if (Segments || (Dense && p.q_segment_ids))
    narrow_to_segments<T::kBlockM, T::kBlockN>(p, tc.b, tc.m_block, n_min, n_max);
}

// Segments: packed sequences (segment ids, segments.h); an instantiation of its own, so the
// plain kernels' code is unchanged by it. Dense: bias and / or a boolean mask, and segment ids
// checked at run time (with Segments = false). Dropout: attention dropout (common/dropout_frag.h),
// an instantiation of its own without the other optional inputs.
template <class Traits, bool Softcap, bool Segments, bool Dense = false, bool Dropout = false>
__global__ void __launch_bounds__(Traits::kThreads, Traits::kCtasPerSm) flash_fwd_kernel(__grid_constant__ const KernelParams<Traits> kp) {
  using T = Traits;
  static_assert(kBarTileFull<T> + T::kMmaWGs <= 8, "named barrier ids run out (NamedBarrier ids are 0..7)");
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  FlashFwdParams const& p = kp.p;

  int const warp_group = __shfl_sync(0xffffffff, int(threadIdx.x) / 128, 0);
  int const warp_in_wg = __shfl_sync(0xffffffff, (int(threadIdx.x) / 32) % 4, 0);
  bool const dynamic = kp.tile_counter != nullptr;

  if (threadIdx.x == 0) {
    ss.barrier_q.init(1);
  }
  typename T::Pipeline::Params pp;
  pp.role = warp_group == 0 ? T::Pipeline::ThreadCategory::Producer : T::Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = T::kMmaThreads;
  pp.transaction_bytes = T::kBytesK;
  typename T::Pipeline pipe_k(ss.pipe_k, pp, Shape<_1, _1, _1>{});
  pp.transaction_bytes = T::kBytesV;
  typename T::Pipeline pipe_v(ss.pipe_v, pp, Shape<_1, _1, _1>{});
  // The bias / mask tiles of a key block (kDenseTma): their own stages, released after use.
  auto pipe_dense = [&] {
    if constexpr (T::kDenseTma) {
      pp.transaction_bytes = kp.dense.stage_tx_bytes;
      return typename T::Pipeline(ss.dense.pipe, pp, Shape<_1, _1, _1>{});
    } else {
      return NoDenseTma{};
    }
  }();
  __syncthreads();

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (warp_in_wg == 0) {
      bool const leader = cute::elect_one_sync();
      auto wr = cutlass::make_producer_start_state<typename T::Pipeline>();
      bool q_loaded = false;
      int tile = int(blockIdx.x);
      ProducerTimeline ptl;
      ptl.init(kp.timeline, kProducerTimelineOffset, blockIdx.x == 0 && threadIdx.x == 0);
      for (int r = 0;; ++r) {
        ptl.mark(kProdTop);
        int next = 0;
        if (dynamic) {
          if (tile >= kp.sched.num_tiles) break;
        } else {
          if (r * int(gridDim.x) >= kp.sched.num_tiles) break;
          tile = snake_tile(r);
        }
        if (tile < kp.sched.num_tiles) {
          TileCoord tc = get_tile(tile, kp.sched);
          SeqMask msk = make_seq_mask(p, tc.b);
          int n_min, n_max;
          tile_key_blocks<T, Segments, Dense>(p, msk, tc, n_min, n_max);
          if (n_max > n_min) {
            if (q_loaded) q_empty_sync<T>();
            ptl.mark(kProdQIssue);
            q_loaded = true;
            if (leader) producer_load<T>(kp, ss, pipe_k, pipe_v, pipe_dense, wr, tc.m_block, tc.h, tc.b, n_min, n_max, ptl);
            __syncwarp();
            ptl.mark(kProdAllIssued);
            ptl.end_tile();
          }
        }
        if (dynamic) {
          // Claim the next tile only now, with this tile's loads all issued (about two key
          // blocks before its end): a CTA takes work when it is about to run out, as hardware
          // dispatch does, so longest-first order keeps its balance. Claimed at the start of a
          // tile, the next tile went to the CTA that started last rather than the one finishing
          // first (NOTES.md v39). The atomic's latency hides under the tile's last blocks.
          if (threadIdx.x == 0) next = atomicAdd(kp.tile_counter, 1) + int(gridDim.x);
          // The consumers have read the previous hand-off before this one overwrites it.
          if (r > 0) cutlass::arch::NamedBarrier::sync(T::kMmaThreads + 32, kBarTileEmpty<T>);
          asm volatile("" ::: "memory");
          tile = __shfl_sync(0xffffffff, next, 0);
          if (threadIdx.x == 0) *reinterpret_cast<int volatile*>(&ss.next_tile) = tile;
          asm volatile("" ::: "memory");  // bar.* carry no memory clobber: keep the store before the arrive
          tile_full_arrive<T>();
        }
      }
      // Keep the CTA alive until the consumers have released every stage.
      if (leader) {
        pipe_k.producer_tail(wr);
        pipe_v.producer_tail(wr);
        if constexpr (T::kDenseTma) pipe_dense.producer_tail(wr);
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    int const tidx = int(threadIdx.x) - 128;
    int const wg = consumer_warpgroup();
    // The first warpgroup opens the GEMM-issue ring (once per CTA: every tile leaves exactly
    // one pending arrive for the next one).
    if (T::kMmaWGs > 1 && wg == 0) cutlass::arch::NamedBarrier::arrive(256, 1);
    typename T::PipelineState rd;
    int q_phase = 0;
    float const log2e = 1.44269504088896340736f;
    int tile = int(blockIdx.x);
    TileTimeline ttl;
    ttl.init(kp.timeline, tile_timeline_offset(wg), blockIdx.x == 0 && tidx % 128 == 0);
    for (int r = 0;; ++r) {
      if (JF_FWD_TL_START == 0) ttl.mark(kTileStart);
      if (dynamic) {
        if (tile >= kp.sched.num_tiles) break;
      } else {
        if (r * int(gridDim.x) >= kp.sched.num_tiles) break;
        tile = snake_tile(r);
        if (tile >= kp.sched.num_tiles) continue;
      }
      TileCoord tc = get_tile(tile, kp.sched);
      SeqMask msk = make_seq_mask(p, tc.b);
      int n_min, n_max;
      tile_key_blocks<T, Segments, Dense>(p, msk, tc, n_min, n_max);
      if (JF_FWD_TL_START == 1) ttl.mark(kTileStart);
      typename T::TiledMmaPV mma_pv;
      Tensor tOrO = partition_fragment_C(mma_pv, select<0, 1>(typename T::TileShapePV{}));
      OnlineSoftmax<2, T::kSoftmaxChains, T::kPolyEvery, T::kLazyMax> softmax;
      softmax.scale_log2 = Softcap ? p.softcap * log2e : p.scale * log2e;
      float inv[2], lse[2];
      if (n_max > n_min) {
        consumer_mma<T, Softcap, Segments, Dense, Dropout>(kp, ss, pipe_k, pipe_v, pipe_dense, rd, msk, tc.b, tc.h, tc.m_block, n_min, n_max, tOrO, softmax, tidx, q_phase, ttl);
        q_phase ^= 1;
        softmax.finalize(inv, lse);
        if constexpr (Dropout) inv[0] *= p.dropout_scale, inv[1] *= p.dropout_scale;  // kept P / (1 - rate)
      } else {
        clear(tOrO);
        inv[0] = inv[1] = 0.f;
        lse[0] = lse[1] = -INFINITY;
      }
      store_o_lse<T>(kp, ss, tOrO, inv, lse, tc.m_block, tc.h, tc.b, tidx, wg);
      ttl.mark(kTileStored);
      if (dynamic) {
        tile_full_sync<T>(wg);
        asm volatile("" ::: "memory");
        tile = *reinterpret_cast<int volatile*>(&ss.next_tile);
        asm volatile("" ::: "memory");
        // The last hand-off (no tile) has no producer waiting for it.
        if (tile < kp.sched.num_tiles) cutlass::arch::NamedBarrier::arrive(T::kMmaThreads + 32, kBarTileEmpty<T>);
      }
      ttl.mark(kTileHandoff);
      ttl.set(kTileSteps, n_max - n_min);
      ttl.end_tile();
    }
    wg_bulk_drain(tidx);  // the last O store has read its smem
  }
}

}  // namespace jax_flash::sm90
