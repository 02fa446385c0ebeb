// sm90 (Hopper) FlashAttention backward: FlashAttention-3 style, one CTA per key block.
//   warpgroup 0   : producer; one thread loads K, V once (TMA) and streams Q / dO blocks of
//                   kBlockM query rows through a kStages mbarrier ring (TMA).
//   warpgroups 1-2: consumers; WG w owns keys [64w, 64w+64) of the block:
//       S^T  = K Q^T, dP^T = V dO^T           (wgmma SS, 64 keys x 64 rows per WG)
//       P^T  = exp2(S^T*scale*log2e - lse*log2e), dS^T = P^T (dP^T - D) [* softcap grad]
//       dV  += P^T dO, dK += dS^T Q           (wgmma RS: P^T / dS^T straight from registers)
//       dS^T -> smem (double buffer), named barrier, dQ = dS K (wgmma SS, hdim split over WGs)
//       dQ atomically added (fp32, float2 red) into dq_accum.
//   dK / dV live in registers for the whole CTA (all q heads of a GQA group are looped here,
//   so no atomics for dK / dV).
// Preprocess (D = rowsum(dO*O)) and postprocess (dq = scale*dq_accum) kernels are below.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "../common/mask.h"
#include "traits.h"
#include "utils.h"

namespace jax_flash::sm90 {

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, class Element_>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per mainloop step
  static constexpr int kBlockN = kBlockN_;  // keys per CTA
  static constexpr int kStages = kStages_;
  static constexpr int kMmaWGs = kBlockN / 64;
  static constexpr int kMmaThreads = kMmaWGs * 128;
  static constexpr int kThreads = kMmaThreads + 128;
  static_assert(kMmaWGs == 2 && kBlockM == 64);
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;

  // S^T / dP^T: (keys, rows), reduction over head_dim. WGs split the keys.
  using TileShapeSdP = Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>;
  // dK / dV: (keys, head_dim), reduction over rows. WGs split the keys.
  using TileShapedKV = Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>;
  // dQ: (rows, head_dim), reduction over keys; per-atom tile, WGs split head_dim.
  using TileShapedQAtom = Shape<Int<kBlockM>, Int<kHeadDim / 2>, Int<kBlockN>>;
  using TiledMmaSdP = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileShapeSdP>(),
                                              Layout<Shape<_2, _1, _1>>{}));
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapedKV, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_2, _1, _1>>{}));
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, TileShapedQAtom, GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, _2, _1>>{}));

  // Q / dO: (rows, head_dim, stage), head_dim contiguous. The "t" views are the transposes
  // (head_dim, rows, stage) of the same memory, read as MN-major B operands.
  using SmemAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{},
                                 Stride<Int<kBlockM>, _1, Int<kBlockM * kHeadDim>>{})));
  // K / V: (keys, head_dim); Kt = (head_dim, keys) view.
  using SmemAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Stride<Int<kBlockN>, _1>{})));
  // dS: (rows, keys), keys contiguous (K-major A of dQ = dS K); dSt = (keys, rows) view for
  // the register -> smem store of the dS^T accumulator.
  using SmemAtomdS = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element, Int<kBlockM>, Int<kBlockN>>());
  using SmemLayoutdS = decltype(tile_to_shape(SmemAtomdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutdSt = decltype(composition(
      SmemLayoutdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Stride<Int<kBlockM>, _1>{})));

  using ShapeT = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideT = Stride<int64_t, _1, int64_t, int64_t>;
  using TMA_Q = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideT{}),
                                       take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TMA_K = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), ShapeT{}, StrideT{}),
                                       SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesK = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  static constexpr int kdSSize = cute::cosize_v<SmemLayoutdS>;
  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> dout;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> v;
    cute::array_aligned<Element, 2 * kdSSize, 1024> ds;  // double buffer
    alignas(16) cutlass::arch::ClusterTransactionBarrier barrier_kv;
    alignas(16) typename Pipeline::SharedStorage pipe_q;
    alignas(16) typename Pipeline::SharedStorage pipe_do;
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage);
};

template <class Traits>
struct BwdKernelParams {
  FlashBwdParams p;
  typename Traits::TMA_Q tma_q;
  typename Traits::TMA_Q tma_do;
  typename Traits::TMA_K tma_k;
  typename Traits::TMA_K tma_v;
  float scale_log2;    // multiplier of the raw (or tanh) logit in the exp2 domain
  float softcap_mult;  // scale / softcap (tanh argument), softcap variant only
  int64_t acc_rows, acc_cols;
};

constexpr int kBwdBarDS = 7;

template <class Pipe, class State>
__forceinline__ __device__ void bwd_consumer_wait(Pipe& pipe, State& st) {
  auto tok = pipe.consumer_try_wait(st);
  pipe.consumer_wait(st, tok);
}  // named barrier: both consumer WGs wrote their dS^T half

template <class Traits, bool Softcap>
__global__ void __launch_bounds__(Traits::kThreads, 1) flash_bwd_kernel(__grid_constant__ const BwdKernelParams<Traits> kp) {
  using T = Traits;
  using Element = typename T::Element;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kHeadDim = T::kHeadDim;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);
  FlashBwdParams const& p = kp.p;

  int const n_block = blockIdx.x, h_kv = blockIdx.y, b = blockIdx.z;
  int const warp_group = __shfl_sync(0xffffffff, int(threadIdx.x) / 128, 0);
  int const warp_in_wg = __shfl_sync(0xffffffff, (int(threadIdx.x) / 32) % 4, 0);

  if (threadIdx.x == 0) ss.barrier_kv.init(1);
  typename T::Pipeline::Params pp;
  pp.role = warp_group == 0 ? T::Pipeline::ThreadCategory::Producer : T::Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = T::kMmaThreads;
  pp.transaction_bytes = T::kBytesQ;
  typename T::Pipeline pipe_q(ss.pipe_q, pp, Shape<_1, _1, _1>{});
  typename T::Pipeline pipe_do(ss.pipe_do, pp, Shape<_1, _1, _1>{});
  __syncthreads();

  SeqMask const msk = make_seq_mask(p, b);
  int64_t r_lo, r_hi;
  msk.row_range(int64_t(n_block) * kBlockN, int64_t(n_block + 1) * kBlockN, &r_lo, &r_hi);
  int const m_min = r_hi > r_lo ? int(r_lo / kBlockM) : 0;
  int const m_max = r_hi > r_lo ? int((r_hi + kBlockM - 1) / kBlockM) : 0;
  int const nm = m_max - m_min;
  int const group = p.heads_q / p.heads_kv;
  int const n_iters = nm * group;

  if (warp_group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (warp_in_wg == 0 && n_iters > 0 && threadIdx.x == 0) {
      Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
      Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQ{});
      Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
      Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
      Tensor mQ = kp.tma_q.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads_q, p.batch));
      Tensor mdO = kp.tma_do.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads_q, p.batch));
      Tensor mK = kp.tma_k.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.heads_kv, p.batch))(_, _, h_kv, b);
      Tensor mV = kp.tma_v.get_tma_tensor(make_shape(p.seqlen_k, p.head_dim, p.heads_kv, p.batch))(_, _, h_kv, b);
      Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
      Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, _0{}));
      auto cq = kp.tma_q.get_slice(_0{});
      auto cdo = kp.tma_do.get_slice(_0{});
      auto ck = kp.tma_k.get_slice(_0{});
      auto cv = kp.tma_v.get_slice(_0{});
      Tensor tQs = group_modes<0, 3>(cq.partition_D(sQ));    // (TMA, stage)
      Tensor tdOs = group_modes<0, 3>(cdo.partition_D(sdO));
      using BarrierT = cutlass::arch::ClusterTransactionBarrier::ValueType;
      ss.barrier_kv.arrive_and_expect_tx(2 * T::kBytesK);
      copy(kp.tma_k.with(reinterpret_cast<BarrierT&>(ss.barrier_kv), 0, TMA::CacheHintSm90::EVICT_FIRST),
           ck.partition_S(gK), ck.partition_D(sK));
      copy(kp.tma_v.with(reinterpret_cast<BarrierT&>(ss.barrier_kv), 0, TMA::CacheHintSm90::EVICT_FIRST),
           cv.partition_S(gV), cv.partition_D(sV));
      auto wr = cutlass::make_producer_start_state<typename T::Pipeline>();
      for (int it = 0; it < n_iters; ++it) {
        int const hq = h_kv * group + it / nm;
        int const m = m_min + it % nm;
        Tensor gQ = local_tile(mQ(_, _, hq, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
        Tensor gdO = local_tile(mdO(_, _, hq, b), Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, _0{}));
        pipe_q.producer_acquire(wr);
        copy(kp.tma_q.with(*pipe_q.producer_get_barrier(wr), 0, TMA::CacheHintSm90::EVICT_LAST),
             group_modes<0, 3>(cq.partition_S(gQ)), tQs(_, wr.index()));
        pipe_do.producer_acquire(wr);
        copy(kp.tma_do.with(*pipe_do.producer_get_barrier(wr), 0, TMA::CacheHintSm90::EVICT_LAST),
             group_modes<0, 3>(cdo.partition_S(gdO)), tdOs(_, wr.index()));
        ++wr;
      }
      pipe_q.producer_tail(wr);
      pipe_do.producer_tail(wr);
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  int const tidx = int(threadIdx.x) - 128;
  int const wg = tidx / 128;
  typename T::TiledMmaSdP mma_sdp;
  typename T::TiledMmadKV mma_dkv;
  typename T::TiledMmadQ mma_dq;
  Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(tdVrdV);
  clear(tdKrdK);

  if (n_iters > 0) {
    Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(ss.dout.data()), typename T::SmemLayoutQt{});
    Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemLayoutKt{});

    auto wg_sdp = mma_sdp.get_slice(wg * 128);
    Tensor tSrK = wg_sdp.partition_fragment_A(sK);     // (MMA, MMA_M, MMA_K)
    Tensor tSrQ = wg_sdp.partition_fragment_B(sQ);     // (MMA, MMA_N, MMA_K, stage)
    Tensor tdPrV = wg_sdp.partition_fragment_A(sV);
    Tensor tdPrdO = wg_sdp.partition_fragment_B(sdO);
    auto wg_dkv = mma_dkv.get_slice(wg * 128);
    Tensor tdVrdO = wg_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stage)
    Tensor tdKrQ = wg_dkv.partition_fragment_B(sQt);
    auto wg_dq = mma_dq.get_slice(wg * 128);
    Tensor tdQrK = wg_dq.partition_fragment_B(sKt);

    auto thr_sdp = mma_sdp.get_thread_slice(tidx);
    Tensor cS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));  // (key, row)
    Tensor cS_rc = make_tensor(cS.data(), acc_rowcol(cS.layout()));
    auto thr_dq = mma_dq.get_thread_slice(tidx);
    Tensor cdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));  // (row, d)

    float const log2e = 1.44269504088896340736f;
    float const scale_log2 = kp.scale_log2;
    int const key0_wg = n_block * kBlockN + wg * 64;
    constexpr int kCols = decltype(size<1>(cS_rc))::value;  // query rows owned by this thread
    constexpr int kRowsK = decltype(size<0>(cS_rc))::value;  // keys owned by this thread

    ss.barrier_kv.wait(0);
    typename T::PipelineState rd;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int it = 0; it < n_iters; ++it) {
      int const hq = h_kv * group + it / nm;
      int const m = m_min + it % nm;
      int const row0 = m * kBlockM;
      int const buf = it & 1;
      // lse (log2 domain; empty rows -> +inf so P = 0) and D for the rows of this thread.
      float lse2[kCols], dsum[kCols];
      {
        float const* lse_p = p.lse + (int64_t(b) * p.heads_q + hq) * p.seqlen_q;
        float const* d_p = p.dsum + (int64_t(b) * p.heads_q + hq) * p.seqlen_q;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kCols; ++j) {
          int const r = row0 + int(get<1>(cS_rc(0, j)));
          float l = r < p.seqlen_q ? __ldg(lse_p + r) : -INFINITY;
          lse2[j] = l == -INFINITY ? INFINITY : l * log2e;
          dsum[j] = r < p.seqlen_q ? __ldg(d_p + r) : 0.f;
        }
      }
      Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockN>, Int<kBlockM>>{});
      bwd_consumer_wait(pipe_q, rd);
      wg_gemm<true, -1>(mma_sdp, tSrK, tSrQ(_, _, _, rd.index()), tSrS);
      bwd_consumer_wait(pipe_do, rd);
      wg_gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, rd.index()), tdPrdP);
      warpgroup_wait<0>();
      Tensor s_rc = make_tensor(tSrS.data(), acc_rowcol(tSrS.layout()));
      Tensor dp_rc = make_tensor(tdPrdP.data(), acc_rowcol(tdPrdP.layout()));
      bool const full = msk.tile_full(row0, row0 + kBlockM, key0_wg, key0_wg + 64);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRowsK; ++i) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kCols; ++j) {
          float x = s_rc(i, j);
          float grad = 1.f;
          if constexpr (Softcap) {
            float t = tanhf(x * kp.softcap_mult);
            x = t;
            grad = 1.f - t * t;
          }
          float pr = ex2(x * scale_log2 - lse2[j]);
          if (!full) {
            int64_t const key = n_block * kBlockN + int(get<0>(cS_rc(i, j)));
            int64_t const row = row0 + int(get<1>(cS_rc(i, j)));
            if (!msk.visible(row, key)) pr = 0.f;
          }
          s_rc(i, j) = pr;
          dp_rc(i, j) = pr * (dp_rc(i, j) - dsum[j]) * grad;
        }
      }
      Tensor tPr16 = make_tensor<Element>(tSrS.layout());
      Tensor tdSr16 = make_tensor<Element>(tSrS.layout());
      convert_out(tSrS, tPr16);
      convert_out(tdPrdP, tdSr16);
      Tensor tPrA = make_tensor(tPr16.data(), acc_to_Aregs(tPr16.layout()));
      Tensor tdSrA = make_tensor(tdSr16.data(), acc_to_Aregs(tdSr16.layout()));
      wg_gemm<false, -1>(mma_dkv, tPrA, tdVrdO(_, _, _, rd.index()), tdVrdV);
      wg_gemm<false, -1>(mma_dkv, tdSrA, tdKrQ(_, _, _, rd.index()), tdKrdK);
      // dS^T -> smem (as dS, keys contiguous) for dQ = dS K over all keys of the block.
      {
        Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data() + buf * T::kdSSize), typename T::SmemLayoutdSt{});
        Tensor tdSs = thr_sdp.partition_C(sdSt);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(tdSr16); ++i) tdSs(i) = tdSr16(i);
      }
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(T::kMmaThreads, kBwdBarDS);
      Tensor sdS = make_tensor(make_smem_ptr(ss.ds.data() + buf * T::kdSSize), typename T::SmemLayoutdS{});
      Tensor tdQrdS = wg_dq.partition_fragment_A(sdS);
      Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      wg_gemm<true, -1>(mma_dq, tdQrdS, tdQrK, tdQrdQ);
      warpgroup_wait<0>();
      pipe_q.consumer_release(rd);
      pipe_do.consumer_release(rd);
      ++rd;
      // dQ partial -> dq_accum (fp32 vector reductions, fire and forget).
      float* acc = p.dq_accum + ((int64_t(b) * p.heads_q + hq) * kp.acc_rows + row0) * kp.acc_cols;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(tdQrdQ); i += 2) {
        int const r = int(get<0>(cdQ(i))), c = int(get<1>(cdQ(i)));
        if (row0 + r < p.seqlen_q)
          atomicAdd(reinterpret_cast<float2*>(acc + int64_t(r) * kp.acc_cols + c), make_float2(tdQrdQ(i), tdQrdQ(i + 1)));
      }
    }
  }

  // Epilogue: dK = scale * dS^T Q, dV; keys past seqlen_k are dropped.
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  Tensor cdKV = thr_dkv.partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  cutlass::NumericArrayConverter<Element, float, 2> cvt;
  Element* dk = static_cast<Element*>(p.dk) + int64_t(b) * p.dk_batch_stride + int64_t(h_kv) * p.dk_head_stride;
  Element* dv = static_cast<Element*>(p.dv) + int64_t(b) * p.dv_batch_stride + int64_t(h_kv) * p.dv_head_stride;
  float const scale = p.scale;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tdKrdK); i += 2) {
    int const key = n_block * kBlockN + int(get<0>(cdKV(i)));
    int const c = int(get<1>(cdKV(i)));
    if (key < p.seqlen_k) {
      cutlass::Array<float, 2> a;
      a[0] = tdKrdK(i) * scale; a[1] = tdKrdK(i + 1) * scale;
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dk + key * p.dk_row_stride + c) = cvt(a);
      a[0] = tdVrdV(i); a[1] = tdVrdV(i + 1);
      *reinterpret_cast<cutlass::Array<Element, 2>*>(dv + key * p.dv_row_stride + c) = cvt(a);
    }
  }
}

// D = rowsum(dO * O) in fp32, one warp per (b, t, h) row.
template <class Element>
__global__ void flash_bwd_dot_do_o_kernel_sm90(const FlashBwdParams p) {
  int64_t const row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  int const lane = threadIdx.x % 32;
  int64_t const nrows = int64_t(p.batch) * p.seqlen_q * p.heads_q;
  if (row >= nrows) return;
  int const h = int(row % p.heads_q);
  int64_t const t = (row / p.heads_q) % p.seqlen_q;
  int const b = int(row / (int64_t(p.heads_q) * p.seqlen_q));
  auto const* o = static_cast<Element const*>(p.o) + b * p.o_batch_stride + t * p.o_row_stride + h * p.o_head_stride;
  auto const* d = static_cast<Element const*>(p.dout) + b * p.do_batch_stride + t * p.do_row_stride + h * p.do_head_stride;
  float s = 0.f;
  for (int c = lane * 2; c < p.head_dim; c += 64) {
    auto ov = *reinterpret_cast<cutlass::Array<Element, 2> const*>(o + c);
    auto dv = *reinterpret_cast<cutlass::Array<Element, 2> const*>(d + c);
    s += float(ov[0]) * float(dv[0]) + float(ov[1]) * float(dv[1]);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
  if (lane == 0) p.dsum[(int64_t(b) * p.heads_q + h) * p.seqlen_q + t] = s;
}

// dq = scale * dq_accum in the input dtype, two elements per thread.
template <class Element>
__global__ void flash_bwd_convert_dq_kernel_sm90(const FlashBwdParams p, int64_t acc_rows, int64_t acc_cols) {
  int const half = p.head_dim / 2;
  int64_t const n = int64_t(p.batch) * p.seqlen_q * p.heads_q * half;
  cutlass::NumericArrayConverter<Element, float, 2> cvt;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < n; idx += int64_t(gridDim.x) * blockDim.x) {
    int const c = int(idx % half) * 2;
    int64_t r = idx / half;
    int const h = int(r % p.heads_q);
    r /= p.heads_q;
    int64_t const t = r % p.seqlen_q;
    int const b = int(r / p.seqlen_q);
    float2 a = *reinterpret_cast<float2 const*>(p.dq_accum + ((int64_t(b) * p.heads_q + h) * acc_rows + t) * acc_cols + c);
    cutlass::Array<float, 2> v;
    v[0] = a.x * p.scale; v[1] = a.y * p.scale;
    *reinterpret_cast<cutlass::Array<Element, 2>*>(static_cast<Element*>(p.dq) + b * p.dq_batch_stride + t * p.dq_row_stride +
                                                   h * p.dq_head_stride + c) = cvt(v);
  }
}

}  // namespace jax_flash::sm90
