// FlashAttention-2 backward for SM80+.
//   1. flash_bwd_dsum_kernel: dsum = rowsum(dO * O) (fp32).
//   2. flash_bwd_dkdv_kernel: one CTA = kBlockN keys of one (batch, kv head); loops over the
//      q heads of its GQA group and over the query blocks that can see these keys, keeping
//      dK/dV in registers (so GQA sums need no extra workspace), and adds each block's dQ
//      contribution into the fp32 dq_accum workspace.
//   3. flash_bwd_convert_dq_kernel: dq = scale * dq_accum in the input dtype.
// Optional inputs (extras_sm80.h), as in the forward, in the kExtras instantiation only (it
// tests softcap at runtime; runtime-flagged extras code made ptxas spill in the default
// hdim-128 kernel): segment ids skip tiles of disjoint segments, the boolean mask is applied
// element-wise, the bias enters P = exp(logit + bias - lse), and dS (before the softcap chain
// rule) is summed into the float32 dbias (zeroed by the launcher) over the bias's broadcast axes.
// Dropout (Z = keep / (1 - rate), the forward's keep bits recomputed from the same Philox
// counters): dS = P o (Z o dP - D), with D = rowsum(dO o O) of the dropped O as always, and
// dV = (P o Z)^T dO. The tile's keep bits are computed once and applied twice: to dP (with the
// scale) before dS, and to P (without) before its 16-bit copy for the dV MMA; dV's 1 / (1 - rate)
// is applied once in the epilogue, so P o keep stays in [0, 1] in 16 bits for any rate.
#pragma once

#include "../common/flash_params.h"
#include "../common/mask.h"
#include "../common/red_add.h"
#include "extras_sm80.h"
#include "kernel_traits_sm80.h"
#include "softmax_sm80.h"
#include "utils_sm80.h"

namespace jax_flash {
namespace sm80 {

template <typename Element>
__global__ void flash_bwd_dsum_kernel(const FlashBwdParams p) {
  // One warp per (batch, head, row).
  const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int64_t total = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  if (warp >= total) return;
  const int i = int(warp % p.seqlen_q);
  const int h = int((warp / p.seqlen_q) % p.heads_q);
  const int b = int(warp / (int64_t(p.seqlen_q) * p.heads_q));
  const Element* o = reinterpret_cast<const Element*>(p.o) + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
  const Element* d = reinterpret_cast<const Element*>(p.dout) + b * p.do_batch_stride + i * p.do_row_stride + h * p.do_head_stride;
  float acc = 0.f;
  for (int c = lane; c < p.head_dim; c += 32) acc += float(o[c]) * float(d[c]);
  CUTE_UNROLL
  for (int s = 16; s > 0; s /= 2) acc += __shfl_xor_sync(0xffffffff, acc, s);
  if (lane == 0) p.dsum[row_stats_offset(p, b, h) + i] = acc;
}

template <typename Element>
__global__ void flash_bwd_convert_dq_kernel(const FlashBwdParams p, int64_t acc_rows, int64_t acc_cols) {
  const int64_t total = int64_t(p.batch) * p.heads_q * p.seqlen_q * p.head_dim;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int c = int(idx % p.head_dim);
    int64_t t = idx / p.head_dim;
    const int i = int(t % p.seqlen_q);
    t /= p.seqlen_q;
    const int h = int(t % p.heads_q);
    const int b = int(t / p.heads_q);
    const float v = p.dq_accum[((int64_t(b) * p.heads_q + h) * acc_rows + i) * acc_cols + c] * p.scale;
    reinterpret_cast<Element*>(p.dq)[b * p.dq_batch_stride + i * p.dq_row_stride + h * p.dq_head_stride + c] = Element(v);
  }
}

// dQ reductions (common/red_add.h): red_add_f32x2 takes dq_accum[c], dq_accum[c + 1] (c even:
// 8-byte aligned; hd % 8 == 0, so both columns are in range or neither is; acc_cols is even:
// dq_accum_cols rounds to 64).
// sm_90: 16-byte dQ reductions after a lane-pair exchange (half the reduction instructions of
// the 8-byte ones, 2 shuffles per 4 values; fewer spills too: hd128 sm_90 4 / 4 B vs 36 / 60 B).
// -DJF_SM80_DQ_RED_V4=0 selects the 8-byte reductions (session 12 A/B: harness/bin/test_sm80_new_v2).
#ifndef JF_SM80_DQ_RED_V4
#define JF_SM80_DQ_RED_V4 1
#endif
template <typename T>
__device__ __forceinline__ auto offset_tensor(T const& t, int off) {
  return make_tensor(t.data() + off, t.layout());
}

// Issue the Q / dO loads of flattened iteration `it` (q head g, query block m) into smem buffer `buf`.
template <typename Kt, typename GCopy, typename GThr, typename SQ, typename SdO, typename CQ>
__device__ __forceinline__ void load_q_do_tile(const FlashBwdParams& p, const SeqMask& mask, GCopy const& gcopy,
                                               GThr const& gthr, SQ const& tQsQ, SdO const& tdOsdO, CQ const& tQcQ,
                                               int it, int buf, int n_m, int m_min, int h_kv, int group, int b) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kHeadDim = Kt::kHeadDim;
  const int g = it / n_m;
  const int m = m_min + it % n_m;
  const int h = h_kv * group + g;
  const Element* q_ptr = reinterpret_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const Element* do_ptr = reinterpret_cast<const Element*>(p.dout) + b * p.do_batch_stride + h * p.do_head_stride;
  Tensor gQ = local_tile(make_tensor(make_gmem_ptr(q_ptr), make_shape(p.seqlen_q, Int<kHeadDim>{}), make_stride(p.q_row_stride, _1{})),
                         Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, 0));
  Tensor gdO = local_tile(make_tensor(make_gmem_ptr(do_ptr), make_shape(p.seqlen_q, Int<kHeadDim>{}), make_stride(p.do_row_stride, _1{})),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m, 0));
  Tensor tQgQ = gthr.partition_S(gQ);
  Tensor tdOgdO = gthr.partition_S(gdO);
  Tensor dQs = offset_tensor(tQsQ, buf * kBlockM * kHeadDim);
  Tensor ddOs = offset_tensor(tdOsdO, buf * kBlockM * kHeadDim);
  copy_pred(gcopy, tQgQ, dQs, tQcQ, mask.q_len - m * kBlockM, p.head_dim);
  copy_pred(gcopy, tdOgdO, ddOs, tQcQ, mask.q_len - m * kBlockM, p.head_dim);
}

// Every kernel, not only kExtras, maps lse = -inf to +inf, so the per-element select on P goes
// (session 49, H100 harness A/B: +0-1% at H=128; NOTES.md). JF_SM80_BWD_LSE_INF_ALWAYS=0 builds
// the select back (A/B).
#ifndef JF_SM80_BWD_LSE_INF_ALWAYS
#define JF_SM80_BWD_LSE_INF_ALWAYS 1
#endif

template <typename Kt, bool kSoftcap, bool kExtras>
__global__ void __launch_bounds__(Kt::kNThreads) flash_bwd_dkdv_kernel(const FlashBwdParams p, int n_block_offset,
                                                                        int64_t acc_rows, int64_t acc_cols) {
  static_assert(!(kSoftcap && kExtras), "the kExtras variant handles softcap at runtime");
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kBlockN = Kt::kBlockN;
  constexpr int kHeadDim = Kt::kHeadDim;
  constexpr int kQElems = kBlockM * kHeadDim;
  extern __shared__ __align__(128) char smem_raw[];

  const int n_block = blockIdx.x + n_block_offset;
  const int h_kv = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int group = p.heads_q / p.heads_kv;
  const int hd = p.head_dim;
  const SeqMask mask = make_seq_mask(p, b);
  const int col0 = n_block * kBlockN;

  int64_t row_lo, row_hi;
  mask.row_range(col0, col0 + kBlockN, &row_lo, &row_hi);
  const int m_min = int(row_lo / kBlockM);
  const int m_max = row_hi > row_lo ? int((row_hi + kBlockM - 1) / kBlockM) : m_min;
  const int n_m = m_max - m_min;
  const int total_iters = n_m * group;

  // --- shared memory ---
  Element* smem = reinterpret_cast<Element*>(smem_raw);
  Tensor sQ = make_tensor(make_smem_ptr(smem), typename Kt::SmemLayoutQ{});            // buffer 0
  Tensor sQt = make_tensor(sQ.data(), typename Kt::SmemLayoutQt{});
  Tensor sQtNoSwz = make_tensor(sQ.data(), typename Kt::SmemLayoutQtNoSwizzle{});
  Tensor sdO = make_tensor(sQ.data() + 2 * kQElems, typename Kt::SmemLayoutQ{});       // buffer 0
  Tensor sdOt = make_tensor(sdO.data(), typename Kt::SmemLayoutQt{});
  Tensor sdOtNoSwz = make_tensor(sdO.data(), typename Kt::SmemLayoutQtNoSwizzle{});
  Tensor sK = make_tensor(sQ.data() + 4 * kQElems, typename Kt::SmemLayoutKV{});
  Tensor sKt = make_tensor(sK.data(), typename Kt::SmemLayoutKt{});
  Tensor sKtNoSwz = make_tensor(sK.data(), typename Kt::SmemLayoutKtNoSwizzle{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Kt::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + size(sV), typename Kt::SmemLayoutPdS{});
  Tensor sPt = make_tensor(sP.data(), typename Kt::SmemLayoutPdSt{});
  Tensor sPtNoSwz = make_tensor(sP.data(), typename Kt::SmemLayoutPdStNoSwizzle{});
  Tensor sdS = make_tensor(sP.data() + size(sP), typename Kt::SmemLayoutPdS{});
  Tensor sdSt = make_tensor(sdS.data(), typename Kt::SmemLayoutPdSt{});
  Tensor sdStNoSwz = make_tensor(sdS.data(), typename Kt::SmemLayoutPdStNoSwizzle{});

  // --- K, V tiles of this CTA ---
  const Element* k_ptr = reinterpret_cast<const Element*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride;
  const Element* v_ptr = reinterpret_cast<const Element*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride;
  Tensor gK = local_tile(make_tensor(make_gmem_ptr(k_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}), make_stride(p.k_row_stride, _1{})),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gV = local_tile(make_tensor(make_gmem_ptr(v_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}), make_stride(p.v_row_stride, _1{})),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));

  typename Kt::GmemTiledCopy gcopy;
  auto gthr = gcopy.get_thread_slice(tid);
  Tensor tKcK = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tQcQ = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  {
    Tensor tKgK = gthr.partition_S(gK);
    Tensor tKsK = gthr.partition_D(sK);
    Tensor tVgV = gthr.partition_S(gV);
    Tensor tVsV = gthr.partition_D(sV);
    copy_pred(gcopy, tKgK, tKsK, tKcK, mask.kv_len - col0, hd);
    copy_pred(gcopy, tVgV, tVsV, tKcK, mask.kv_len - col0, hd);
  }
  Tensor tQsQ = gthr.partition_D(sQ);
  Tensor tdOsdO = gthr.partition_D(sdO);

  if (total_iters > 0) load_q_do_tile<Kt>(p, mask, gcopy, gthr, tQsQ, tdOsdO, tQcQ, 0, 0, n_m, m_min, h_kv, group, b);
  cute::cp_async_fence();

  // --- MMA partitions ---
  typename Kt::TiledMmaSdP mma_sdp;
  auto thr_sdp = mma_sdp.get_thread_slice(tid);
  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  auto s2r_a_sdp = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, mma_sdp);
  auto s2r_a_sdp_thr = s2r_a_sdp.get_thread_slice(tid);
  auto s2r_b_sdp = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, mma_sdp);
  auto s2r_b_sdp_thr = s2r_b_sdp.get_thread_slice(tid);
  Tensor tSsQ = s2r_a_sdp_thr.partition_S(sQ);
  Tensor tdPsdO = s2r_a_sdp_thr.partition_S(sdO);
  Tensor tSsK = s2r_b_sdp_thr.partition_S(sK);
  Tensor tdPsV = s2r_b_sdp_thr.partition_S(sV);

  typename Kt::TiledMmadKV mma_dkv;
  auto thr_dkv = mma_dkv.get_thread_slice(tid);
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtNoSwz);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOtNoSwz);
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdStNoSwz);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtNoSwz);
  auto s2r_a_dkv = make_tiled_copy_A(typename Kt::SmemCopyAtomT{}, mma_dkv);
  auto s2r_a_dkv_thr = s2r_a_dkv.get_thread_slice(tid);
  auto s2r_b_dkv = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, mma_dkv);
  auto s2r_b_dkv_thr = s2r_b_dkv.get_thread_slice(tid);
  Tensor tdVsPt = s2r_a_dkv_thr.partition_S(sPt);
  Tensor tdKsdSt = s2r_a_dkv_thr.partition_S(sdSt);
  Tensor tdVsdOt = s2r_b_dkv_thr.partition_S(sdOt);
  Tensor tdKsQt = s2r_b_dkv_thr.partition_S(sQt);

  typename Kt::TiledMmadQ mma_dq;
  auto thr_dq = mma_dq.get_thread_slice(tid);
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKtNoSwz);
  auto s2r_a_dq = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, mma_dq);
  auto s2r_a_dq_thr = s2r_a_dq.get_thread_slice(tid);
  auto s2r_b_dq = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, mma_dq);
  auto s2r_b_dq_thr = s2r_b_dq.get_thread_slice(tid);
  Tensor tdQsdS = s2r_a_dq_thr.partition_S(sdS);
  Tensor tdQsKt = s2r_b_dq_thr.partition_S(sKt);
  Tensor tdQcdQ = thr_dq.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));

  auto r2s_pds = make_tiled_copy_C(typename Kt::SmemCopyAtomC{}, mma_sdp);
  auto r2s_pds_thr = r2s_pds.get_thread_slice(tid);
  Tensor tPsP = r2s_pds_thr.partition_D(sP);
  Tensor tdSsdS = r2s_pds_thr.partition_D(sdS);

  Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), rowcol_layout(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tScS_rc))::value;

  const bool softcap_on = kSoftcap || (kExtras && p.softcap > 0.f);  // compile-time unless kExtras
  const float scale_nat = softcap_on ? p.softcap : p.scale;
  const float scale_log2 = scale_nat * kLog2e;
  const float pre_tanh = softcap_on ? p.scale / p.softcap : 1.f;
  // Segment ids / boolean mask (uniform flag). The segment-id range of this CTA's keys is fixed.
  const bool elem_on = kExtras && (p.q_segment_ids != nullptr || p.mask != nullptr);
  const bool dropout_on = kExtras && p.dropout_keys != nullptr;
  int32_t kseg_lo = 0, kseg_hi = 0;
  if (kExtras && p.q_segment_ids)
    warp_id_range(p.kv_segment_ids + b * p.kv_seg_batch_stride, col0, min(col0 + kBlockN, mask.kv_len), kseg_lo, kseg_hi);

  // Plain loop (no lambda: nvcc would outline it and spill dK/dV to local memory).
  for (int it = 0; it < total_iters; ++it) {
    const int buf = it & 1;
    const int g = it / n_m;
    const int m = m_min + it % n_m;
    const int h = h_kv * group + g;
    const int row0 = m * kBlockM;
    TileKind kind = mask.tile_full(int64_t(row0), int64_t(row0) + kBlockM, col0, int64_t(col0) + kBlockN)
                        ? TileKind::kFull
                        : TileKind::kPartial;
    if (elem_on) {
      int32_t qseg_lo = 0, qseg_hi = 0;
      if (kExtras && p.q_segment_ids)
        warp_id_range(p.q_segment_ids + b * p.q_seg_batch_stride, row0, min(row0 + kBlockM, mask.q_len), qseg_lo,
                      qseg_hi);
      kind = classify_ranges(kind == TileKind::kFull, p.mask != nullptr, p.q_segment_ids != nullptr, qseg_lo, qseg_hi,
                             kseg_lo, kseg_hi);
    }

    // Row statistics from the forward / preprocess (rows past seqlen_q are all-masked). With
    // extras (or JF_SM80_BWD_LSE_INF_ALWAYS), rows with no visible key (lse = -inf) get +inf here,
    // so P = exp2(x - inf) = 0 for any x: a masked logit (where -inf + inf would be NaN) or a
    // finite logit meeting a -inf bias. Otherwise such rows only occur in masked tiles, where
    // every logit is -inf and the select below forces P to 0.
    float lse_l2[kRows], dsum_r[kRows];
    const float* lse_ptr = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q;
    const float* dsum_ptr = p.dsum + row_stats_offset(p, b, h);
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int r = row0 + get<0>(tScS_rc(mi, 0));
      const float l = r < p.seqlen_q ? lse_ptr[r] : 0.f;
      lse_l2[mi] = (JF_SM80_BWD_LSE_INF_ALWAYS || kExtras) && l == -INFINITY ? INFINITY : l * kLog2e;
      dsum_r[mi] = r < p.seqlen_q ? dsum_ptr[r] : 0.f;
    }

    cute::cp_async_wait<0>();
    __syncthreads();  // Q/dO[it] (and K/V) landed; all warps done with buffer buf^1, sP, sdS
    if (it + 1 < total_iters) load_q_do_tile<Kt>(p, mask, gcopy, gthr, tQsQ, tdOsdO, tQcQ, it + 1, buf ^ 1, n_m, m_min, h_kv, group, b);
    cute::cp_async_fence();
    // A skipped tile (no shared segment) has P = dS = 0: nothing to add anywhere.
    if (kExtras && kind == TileKind::kSkip) continue;

    const int off = buf * kQElems;
    Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    clear(acc_dp);
    gemm_ss(acc_s, tSrQ, tSrK, offset_tensor(tSsQ, off), tSsK, mma_sdp, s2r_a_sdp, s2r_b_sdp, s2r_a_sdp_thr, s2r_b_sdp_thr);
    gemm_ss(acc_dp, tdPrdO, tdPrV, offset_tensor(tdPsdO, off), tdPsV, mma_sdp, s2r_a_sdp, s2r_b_sdp, s2r_a_sdp_thr, s2r_b_sdp_thr);

    Tensor s_rc = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
    Tensor dp_rc = make_tensor(acc_dp.data(), rowcol_layout(acc_dp.layout()));
    if (softcap_on) {
      CUTE_UNROLL
      for (int i = 0; i < size(acc_s); ++i) acc_s(i) = tanh_accurate(acc_s(i) * pre_tanh);
    }
    // Masked logits become -inf -> P = 0 -> dS = 0 (kept exactly 0, also on rows with nothing
    // visible, whose lse_l2 is +inf).
    if (kind == TileKind::kPartial) {
      if (elem_on) apply_mask_elem(s_rc, tScS_rc, mask, make_elem_mask(p, b, h), row0, col0);
      else apply_mask(s_rc, tScS_rc, mask, row0, col0);
    }
    // Dropout: dP -> Z o dP (dS below then is P o (Z o dP - D)); the q head's own key table entry.
    // The tile's keep bits fit one register: row mi's at bit mi * kCols.
    constexpr int kCols = decltype(size<1>(s_rc))::value;
    static_assert(kRows * kCols <= 32, "one bit per element of the thread's tile");
    uint32_t keep = 0;
    if (dropout_on) {
      const HeadDropout drop = make_head_dropout(p, b, h);
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        const uint32_t row_bits = dropout_keep_row(drop, tScS_rc, mi, row0, col0);
        drop_row(dp_rc, mi, row_bits, p.dropout_scale);
        keep |= row_bits << (mi * kCols);
      }
    }
    if (!kExtras || p.bias == nullptr) {
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) {
        CUTE_UNROLL
        for (int ni = 0; ni < size<1>(s_rc); ++ni) {
          const float t = s_rc(mi, ni);
          float pv = fast_exp2(fmaf(t, scale_log2, -lse_l2[mi]));
          if (!JF_SM80_BWD_LSE_INF_ALWAYS) pv = t == -INFINITY ? 0.f : pv;
          float ds = pv * (dp_rc(mi, ni) - dsum_r[mi]);
          // softcap: a masked t (-inf) would make the factor -inf and 0 * -inf NaN.
          if (softcap_on) ds = t == -INFINITY ? 0.f : ds * (1.f - t * t);
          s_rc(mi, ni) = pv;
          dp_rc(mi, ni) = ds;
        }
      }
    } else {
      // logit = scale_nat * t + bias; dbias = dS before the softcap chain rule.
      DbiasTile<kRows, decltype(size<1>(s_rc))::value> dbias(p, b, h);
      bias_probs_grads(s_rc, dp_rc, tScS_rc, make_bias_view(p, b, h), dbias, row0, col0, p.seqlen_q - row0,
                       p.seqlen_k - col0, scale_log2, lse_l2, dsum_r, softcap_on);
    }
    if (dropout_on) {  // P -> P o keep for dV (its 1 / (1 - rate) comes in the epilogue)
      CUTE_UNROLL
      for (int mi = 0; mi < kRows; ++mi) drop_row(s_rc, mi, keep >> (mi * kCols));
    }
    Tensor rP = convert_type<Element>(acc_s);
    Tensor rdS = convert_type<Element>(acc_dp);
    copy(r2s_pds, r2s_pds_thr.retile_S(rP), tPsP);
    copy(r2s_pds, r2s_pds_thr.retile_S(rdS), tdSsdS);
    __syncthreads();  // P, dS visible to all warps

    gemm_ss(acc_dv, tdVrPt, tdVrdOt, tdVsPt, offset_tensor(tdVsdOt, off), mma_dkv, s2r_a_dkv, s2r_b_dkv, s2r_a_dkv_thr, s2r_b_dkv_thr);
    gemm_ss(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, offset_tensor(tdKsQt, off), mma_dkv, s2r_a_dkv, s2r_b_dkv, s2r_a_dkv_thr, s2r_b_dkv_thr);

    Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_dq);
    gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, mma_dq, s2r_a_dq, s2r_b_dq, s2r_a_dq_thr, s2r_b_dq_thr);
    float* dq_acc = p.dq_accum + ((int64_t(b) * p.heads_q + h) * acc_rows + row0) * acc_cols;
    // Column pairs (c, c + 1) of one row sit in adjacent registers: vector reductions on sm_90
    // (8-byte: half the L2 sector operations of scalar adds; 16-byte below). When the workspace's
    // padding covers the whole tile (acc_rows >= row0 + kBlockM, acc_cols >= kHeadDim: always
    // for hd 32..256 with the default rounding) the stores need no predicates: the padding rows
    // and columns only ever receive exact zeros (masked rows have dS = 0, padded K columns are
    // zero-filled) and are never read back.
    Tensor dq_rc = make_tensor(acc_dq.data(), rowcol_layout(acc_dq.layout()));
    Tensor dqc_rc = make_tensor(tdQcdQ.data(), rowcol_layout(tdQcdQ.layout()));
    const bool dq_unpred = acc_cols >= kHeadDim && acc_rows >= int64_t(row0) + kBlockM;
#if JF_SM80_DQ_RED_V4 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    // 16-byte reductions: rows mi = 2 i, 2 i + 1 of the row-col view are rows r and r + 8 (the
    // m16n8 accumulator), and lanes l, l ^ 1 hold columns (c, c + 1), (c + 2, c + 3) of both.
    // One exchange of two floats gives the even lane row r, columns c..c + 3, and the odd lane
    // row r + 8, columns c - 2..c + 1 (4-column groups: hd % 8 == 0, so a group is in range or not).
    const bool odd = threadIdx.x & 1;
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(dq_rc); mi += 2) {
      const int r = get<0>(dqc_rc(mi, 0)) + (odd ? 8 : 0);  // row mi + 1 is row mi + 8
      float* dq_row = dq_acc + int64_t(r) * acc_cols;
      const bool row_ok = dq_unpred || row0 + r < p.seqlen_q;
      CUTE_UNROLL
      for (int nj = 0; nj < size<1>(dq_rc); nj += 2) {
        const float a0 = dq_rc(mi, nj), a1 = dq_rc(mi, nj + 1);
        const float b0 = dq_rc(mi + 1, nj), b1 = dq_rc(mi + 1, nj + 1);
        const float x0 = __shfl_xor_sync(0xffffffffu, odd ? a0 : b0, 1);
        const float x1 = __shfl_xor_sync(0xffffffffu, odd ? a1 : b1, 1);
        const int c = get<1>(dqc_rc(0, nj)) - (odd ? 2 : 0);
        if (dq_unpred || (row_ok && c < hd))
          red_add_f32x4(dq_row + c, odd ? x0 : a0, odd ? x1 : a1, odd ? b0 : x0, odd ? b1 : x1);
      }
    }
#else
    CUTE_UNROLL
    for (int mi = 0; mi < size<0>(dq_rc); ++mi) {
      const int r = get<0>(dqc_rc(mi, 0));
      float* dq_row = dq_acc + int64_t(r) * acc_cols;
      const bool row_ok = dq_unpred || row0 + r < p.seqlen_q;
      CUTE_UNROLL
      for (int nj = 0; nj < size<1>(dq_rc); nj += 2) {
        const int c = get<1>(dqc_rc(0, nj));
        if (dq_unpred || (row_ok && c < hd)) red_add_f32x2(dq_row + c, dq_rc(mi, nj), dq_rc(mi, nj + 1));
      }
    }
#endif
  }

  // --- epilogue: dK = scale * sum dS^T Q, dV (times 1 / (1 - rate) under dropout);
  // registers -> smem (K/V tiles) -> global ---
  cute::cp_async_wait<0>();
  __syncthreads();
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); ++i) acc_dk(i) *= p.scale;
  if (dropout_on) {
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dv); ++i) acc_dv(i) *= p.dropout_scale;
  }
  Tensor rdK = convert_type<Element>(acc_dk);
  Tensor rdV = convert_type<Element>(acc_dv);
  auto r2s_dkv = make_tiled_copy_C(typename Kt::SmemCopyAtomC{}, mma_dkv);
  auto r2s_dkv_thr = r2s_dkv.get_thread_slice(tid);
  copy(r2s_dkv, r2s_dkv_thr.retile_S(rdK), r2s_dkv_thr.partition_D(sK));
  copy(r2s_dkv, r2s_dkv_thr.retile_S(rdV), r2s_dkv_thr.partition_D(sV));
  __syncthreads();

  Element* dk_ptr = reinterpret_cast<Element*>(p.dk) + b * p.dk_batch_stride + h_kv * p.dk_head_stride;
  Element* dv_ptr = reinterpret_cast<Element*>(p.dv) + b * p.dv_batch_stride + h_kv * p.dv_head_stride;
  Tensor gdK = local_tile(make_tensor(make_gmem_ptr(dk_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}), make_stride(p.dk_row_stride, _1{})),
                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  Tensor gdV = local_tile(make_tensor(make_gmem_ptr(dv_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}), make_stride(p.dv_row_stride, _1{})),
                          Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
  typename Kt::GmemTiledStore gstore;
  auto gst_thr = gstore.get_thread_slice(tid);
  Tensor tcKV = gst_thr.partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor tdKgdK = gst_thr.partition_D(gdK);
  Tensor tdVgdV = gst_thr.partition_D(gdV);
  store_pred(gstore, gst_thr.partition_S(sK), tdKgdK, tcKV, p.seqlen_k - col0, hd);
  store_pred(gstore, gst_thr.partition_S(sV), tdVgdV, tcKV, p.seqlen_k - col0, hd);
}

}  // namespace sm80
}  // namespace jax_flash
