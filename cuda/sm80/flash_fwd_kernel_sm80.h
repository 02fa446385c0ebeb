// FlashAttention-2 forward for SM80+ (mma.sync m16n8k16, ldmatrix, cp.async).
// One CTA = kBlockM query rows of one (batch, q head). Key blocks are visited from the last
// visible one down to the first, so the causal/length boundary tiles (which need
// element-wise masking) come first and every later tile runs the unmasked path.
// Optional inputs (extras_sm80.h), in the kExtras instantiation only: segment ids classify
// each tile (disjoint segments: the tile's MMAs and softmax are skipped); the boolean mask is
// applied on every tile; the bias turns the logits into natural-log units (s * scale + bias) on
// every tile; dropout zeroes the dropped probabilities of every tile after they entered the row
// sums (lse and the normaliser are those of the undropped softmax), in the 16-bit P of the
// P V MMA (zeroing commutes with the rounding; the float32 tile is dead by then, which saves
// registers), and 1 / (1 - rate) is folded into the final 1 / l, as the CPU backend does.
// A compile-time variant, unlike the backward: the forward without extras uses
// 248-254 registers, and runtime-flagged extras code made ptxas spill in it. The kExtras
// variant is only instantiated with kSoftcap = false and tests softcap at runtime, so the
// extras add one kernel per instantiation file, not two.
#pragma once

#include "../common/flash_params.h"
#include "../common/mask.h"
#include "extras_sm80.h"
#include "kernel_traits_sm80.h"
#include "softmax_sm80.h"
#include "utils_sm80.h"

namespace jax_flash {
namespace sm80 {

// kEven (launcher: no extras, no q/kv lengths, seqlen_q % kBlockM == 0, seqlen_k % kBlockN == 0,
// head_dim == kHeadDim): every Q/K/V/O tile is entirely in range, so the global<->shared copies,
// the O store and the lse store carry no predicates.
template <typename Kt, bool kSoftcap, bool kExtras, bool kEven = false>
__global__ void __launch_bounds__(Kt::kNThreads) flash_fwd_kernel(const FlashFwdParams p) {
  static_assert(!(kSoftcap && kExtras), "the kExtras variant handles softcap at runtime");
  static_assert(!(kEven && kExtras), "kEven is for the default variants only");
  static_assert(!kEven || Kt::kEvenVariant, "kEven is built for FwdTraits::kEvenVariant configurations only");
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kBlockN = Kt::kBlockN;
  constexpr int kHeadDim = Kt::kHeadDim;
  extern __shared__ __align__(128) char smem_raw[];

  const int m_block = gridDim.x - 1 - blockIdx.x;  // heavy (causal) row blocks first
  const int h = blockIdx.y;
  const int b = blockIdx.z;
  const int tid = threadIdx.x;
  const int h_kv = h / (p.heads_q / p.heads_kv);
  const SeqMask mask = make_seq_mask(p, b);
  const int row0 = m_block * kBlockM;

  int64_t key_lo, key_hi;
  mask.key_range(row0, row0 + kBlockM, &key_lo, &key_hi);

  Element* o_ptr = reinterpret_cast<Element*>(p.o) + b * p.o_batch_stride + h * p.o_head_stride;
  float* lse_ptr = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q;

  if (key_hi <= key_lo) {
    // No row of this block sees any key: out = 0, lse = -inf.
    const int rows = min(kBlockM, p.seqlen_q - row0);
    for (int i = tid; i < rows * p.head_dim; i += Kt::kNThreads) {
      const int r = i / p.head_dim, c = i % p.head_dim;
      o_ptr[int64_t(row0 + r) * p.o_row_stride + c] = Element(0.f);
    }
    for (int r = tid; r < rows; r += Kt::kNThreads) lse_ptr[row0 + r] = -INFINITY;
    return;
  }
  const int n_min = int(key_lo / kBlockN);
  const int n_max = int((key_hi + kBlockN - 1) / kBlockN);

  const Element* q_ptr = reinterpret_cast<const Element*>(p.q) + b * p.q_batch_stride + h * p.q_head_stride;
  const Element* k_ptr = reinterpret_cast<const Element*>(p.k) + b * p.k_batch_stride + h_kv * p.k_head_stride;
  const Element* v_ptr = reinterpret_cast<const Element*>(p.v) + b * p.v_batch_stride + h_kv * p.v_head_stride;

  Tensor mQ = make_tensor(make_gmem_ptr(q_ptr), make_shape(p.seqlen_q, Int<kHeadDim>{}), make_stride(p.q_row_stride, _1{}));
  Tensor mK = make_tensor(make_gmem_ptr(k_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}), make_stride(p.k_row_stride, _1{}));
  Tensor mV = make_tensor(make_gmem_ptr(v_ptr), make_shape(p.seqlen_k, Int<kHeadDim>{}), make_stride(p.v_row_stride, _1{}));
  Tensor mO = make_tensor(make_gmem_ptr(o_ptr), make_shape(p.seqlen_q, Int<kHeadDim>{}), make_stride(p.o_row_stride, _1{}));
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, nblk)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));

  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem_raw)), typename Kt::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Kt::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Kt::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Kt::SmemLayoutVt{});
  Tensor sVtNoSwz = make_tensor(sV.data(), typename Kt::SmemLayoutVtNoSwizzle{});
  Tensor sO = make_tensor(sQ.data(), typename Kt::SmemLayoutO{});

  typename Kt::GmemTiledCopy gcopy;
  auto gthr = gcopy.get_thread_slice(tid);
  Tensor tQgQ = gthr.partition_S(gQ);
  Tensor tQsQ = gthr.partition_D(sQ);
  Tensor tKgK = gthr.partition_S(gK);
  Tensor tKsK = gthr.partition_D(sK);
  Tensor tVgV = gthr.partition_S(gV);
  Tensor tVsV = gthr.partition_D(sV);
  Tensor tQcQ = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKcK = gthr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));

  typename Kt::TiledMma mma;
  auto thr_mma = mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwz);
  Tensor acc_o = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});

  auto s2r_q = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, mma);
  auto s2r_q_thr = s2r_q.get_thread_slice(tid);
  Tensor tSsQ = s2r_q_thr.partition_S(sQ);
  auto s2r_k = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, mma);
  auto s2r_k_thr = s2r_k.get_thread_slice(tid);
  Tensor tSsK = s2r_k_thr.partition_S(sK);
  auto s2r_v = make_tiled_copy_B(typename Kt::SmemCopyAtomT{}, mma);
  auto s2r_v_thr = s2r_v.get_thread_slice(tid);
  Tensor tOsVt = s2r_v_thr.partition_S(sVt);

  // Tile coordinates of every accumulator element, as (rows, cols).
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), rowcol_layout(tScS.layout()));

  // Loads beyond the valid lengths are zero-filled (lengths, not padded seqlens: padding may
  // hold garbage that 0 * x would turn into NaN).
  const int q_rows = mask.q_len - row0;
  const int hd = p.head_dim;
  copy_tile<kEven>(gcopy, tQgQ, tQsQ, tQcQ, q_rows, hd);
  int n = n_max - 1;
  copy_tile<kEven>(gcopy, tKgK(_, _, _, n), tKsK, tKcK, mask.kv_len - n * kBlockN, hd);
  cute::cp_async_fence();

  clear(acc_o);
  Tensor acc_o_rc = make_tensor(acc_o.data(), rowcol_layout(acc_o.layout()));
  constexpr int kRows = decltype(size<0>(acc_o_rc))::value;
  OnlineSoftmax<kRows> softmax;
  softmax.init();

  // softcap: s = tanh(qk * scale / cap), logit = cap * s. Otherwise s = qk, logit = scale * s.
  const bool softcap_on = kSoftcap || (kExtras && p.softcap > 0.f);  // compile-time unless kExtras
  const float scale_nat = softcap_on ? p.softcap : p.scale;
  const float scale_log2 = scale_nat * kLog2e;
  const float pre_tanh = softcap_on ? p.scale / p.softcap : 1.f;
  // With a bias the logits are converted to natural-log units before the softmax.
  const bool has_bias = kExtras && p.bias != nullptr;
  const bool dropout_on = kExtras && p.dropout_keys != nullptr;

  // Kt::kLean: masking state hoisted out of the key loop (no 64-bit SeqMask arithmetic per
  // tile): the key range whose tiles are fully visible to every row of the block, and each
  // thread row's visible keys [key_lo, key_hi) (empty for rows past q_len), clamped to
  // [0, kv_len].
  int full_lo = 0, full_hi = 0;
  int row_key_lo[kRows], row_key_hi[kRows];
  if constexpr (Kt::kLean) {
    mask.full_keys(row0, int64_t(row0) + kBlockM, &full_lo, &full_hi);
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int64_t r = row0 + get<0>(tScS_rc(mi, 0));
      const bool in = r < mask.q_len;
      row_key_lo[mi] = in ? int(min(mask.key_lo(r), int64_t(mask.kv_len))) : mask.kv_len;
      row_key_hi[mi] = in ? int(mask.key_hi(r)) : 0;
    }
  }

  // No lambdas here: nvcc would outline them and pass the accumulators through local memory.
  for (; n >= n_min; --n) {
    Tensor acc_s = partition_fragment_C(mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    cute::cp_async_wait<0>();
    __syncthreads();  // K[n] landed; every warp is done reading V[n+1]
    copy_tile<kEven>(gcopy, tVgV(_, _, _, n), tVsV, tKcK, mask.kv_len - n * kBlockN, hd);
    cute::cp_async_fence();

    const int col0 = n * kBlockN;
    // Only boundary tiles pay for element-wise masking.
    bool const full_tile = Kt::kLean ? full_lo <= col0 && col0 + kBlockN <= full_hi
                                     : mask.tile_full(row0, row0 + kBlockM, col0, int64_t(col0) + kBlockN);
    TileKind kind = full_tile ? TileKind::kFull : TileKind::kPartial;
    if (kExtras && (p.q_segment_ids != nullptr || p.mask != nullptr)) {
      int32_t qseg_lo = 0, qseg_hi = 0, kseg_lo = 0, kseg_hi = 0;
      if (p.q_segment_ids) {
        warp_id_range(p.q_segment_ids + b * p.q_seg_batch_stride, row0, min(row0 + kBlockM, mask.q_len), qseg_lo,
                      qseg_hi);
        warp_id_range(p.kv_segment_ids + b * p.kv_seg_batch_stride, col0, min(col0 + kBlockN, mask.kv_len), kseg_lo,
                      kseg_hi);
      }
      kind = classify_ranges(kind == TileKind::kFull, p.mask != nullptr, p.q_segment_ids != nullptr, qseg_lo, qseg_hi,
                             kseg_lo, kseg_hi);
    }
    Tensor s_rc = make_tensor(acc_s.data(), rowcol_layout(acc_s.layout()));
    // A skipped tile (no shared segment) adds nothing: exp of -inf everywhere.
    if (!kExtras || kind != TileKind::kSkip) {
      gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, mma, s2r_q, s2r_k, s2r_q_thr, s2r_k_thr);
      if (softcap_on) {
        CUTE_UNROLL
        for (int i = 0; i < size(acc_s); ++i) acc_s(i) = tanh_accurate(acc_s(i) * pre_tanh);
      }
      if (has_bias)
        add_bias(s_rc, tScS_rc, make_bias_view(p, b, h), row0, col0, p.seqlen_q - row0, p.seqlen_k - col0, scale_nat);
      if (kind == TileKind::kPartial) {
        if (kExtras && (p.q_segment_ids != nullptr || p.mask != nullptr))
          apply_mask_elem(s_rc, tScS_rc, mask, make_elem_mask(p, b, h), row0, col0);
        else if constexpr (Kt::kLean)
          apply_mask_rows(s_rc, tScS_rc, row_key_lo, row_key_hi, col0);
        else
          apply_mask(s_rc, tScS_rc, mask, row0, col0);
      }
    }

    cute::cp_async_wait<0>();
    __syncthreads();  // V[n] landed; every warp is done reading K[n]
    if (n > n_min) {
      copy_tile<kEven>(gcopy, tKgK(_, _, _, n - 1), tKsK, tKcK, mask.kv_len - (n - 1) * kBlockN, hd);
      cute::cp_async_fence();
    }
    if (!kExtras || kind != TileKind::kSkip) {
      // The first tile's rescale is a harmless multiply of zeros (corr = 0).
      softmax.update(s_rc, acc_o_rc, has_bias ? kLog2e : scale_log2);

      Tensor rP = convert_type<Element>(acc_s);
      if (dropout_on) {  // on the 16-bit P: acc_s is dead by now (fewer live registers)
        Tensor rP_rc = make_tensor(rP.data(), rowcol_layout(rP.layout()));
        apply_dropout(rP_rc, tScS_rc, make_head_dropout(p, b, h), row0, col0);
      }
      Tensor tOrP = make_tensor(rP.data(), acc_to_a_layout(rP.layout()));
      gemm_rs(acc_o, tOrP, tOrVt, tOsVt, mma, s2r_v, s2r_v_thr);
    }
  }

  float lse[kRows];
  softmax.finalize(acc_o_rc, has_bias ? 1.f : scale_nat, lse, dropout_on ? p.dropout_scale : 1.f);

  // Epilogue: registers -> smem (reusing Q) -> 16-byte global stores.
  Tensor rO = convert_type<Element>(acc_o);
  auto r2s = make_tiled_copy_C(typename Kt::SmemCopyAtomC{}, mma);
  auto r2s_thr = r2s.get_thread_slice(tid);
  Tensor taccOrO = r2s_thr.retile_S(rO);
  Tensor taccOsO = r2s_thr.partition_D(sO);
  __syncthreads();  // all warps done with sQ
  copy(r2s, taccOrO, taccOsO);

  Tensor tOcO_acc = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tOcO_rc = make_tensor(tOcO_acc.data(), rowcol_layout(tOcO_acc.layout()));
  if (get<1>(tOcO_rc(0, 0)) == 0) {
    CUTE_UNROLL
    for (int mi = 0; mi < kRows; ++mi) {
      const int r = row0 + get<0>(tOcO_rc(mi, 0));
      if (kEven || r < p.seqlen_q) lse_ptr[r] = lse[mi];
    }
  }
  __syncthreads();
  typename Kt::GmemTiledStore gstore;
  auto gst_thr = gstore.get_thread_slice(tid);
  Tensor tOsO = gst_thr.partition_S(sO);
  Tensor tOgO = gst_thr.partition_D(gO);
  Tensor tOcO = gst_thr.partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  if constexpr (kEven) {
    copy(gstore, tOsO, tOgO);
  } else {
    store_pred(gstore, tOsO, tOgO, tOcO, p.seqlen_q - row0, hd);
  }
}

}  // namespace sm80
}  // namespace jax_flash
