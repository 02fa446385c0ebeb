// Writes the normalised O tile (input dtype) and the LSE rows of one consumer warpgroup.
#pragma once

#include "mainloop.h"
#include "softmax.h"
#include "traits.h"
#include "utils.h"

namespace jax_flash::sm90 {

// Per-WG named barrier of the smem epilogue (after the GEMM-issue ring's ids 1..kMmaWGs).
template <class Traits>
constexpr int kBarEpilogue = 1 + Traits::kMmaWGs;

template <class Traits, class TO, int kRows>
__forceinline__ __device__ void store_o_lse(KernelParams<Traits> const& kp, typename Traits::SharedStorage& ss, TO& tOrO,
                                            float const (&inv)[kRows], float const (&lse)[kRows], int m_block, int h,
                                            int b, int tidx, int wg) {
  using T = Traits;
  using Element = typename T::Element;
  FlashFwdParams const& p = kp.p;
  typename T::TiledMmaPV mma_pv;
  auto thr = mma_pv.get_thread_slice(tidx);
  Tensor cO = thr.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}));
  Tensor o_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  Tensor c_rc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  rescale_rows(o_rc, inv);
  Tensor rO = make_tensor_like<Element>(tOrO);
  convert_out(tOrO, rO);

  int const m0 = m_block * T::kBlockM;
  static_assert(kBarEpilogue<T> + T::kMmaWGs <= kBarQEmpty, "named barrier ids overlap");
  Tensor sO = make_tensor(make_smem_ptr(ss.o.data() + wg * cute::cosize_v<typename T::SmemLayoutO>), typename T::SmemLayoutO{});
  auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, typename T::TiledMmaOWG{});
  auto thr_r2s = r2s.get_thread_slice(tidx % 128);
  auto const frag_layout = partition_fragment_C(typename T::TiledMmaOWG{}, Shape<_64, Int<T::kOCols>>{}).layout();
  constexpr int kFragSize = decltype(cute::size(frag_layout))::value;
  bool const issuer = tidx % 128 == 0;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < T::kORounds; ++r) {
    // The buffer's previous store (a tile ago, or round r - 1's) must have been read.
    if (issuer) tma_store_wait<0>();
    named_sync(128, kBarEpilogue<T> + wg);
    Tensor rO_r = make_tensor(rO.data() + r * kFragSize, frag_layout);
    cute::copy(r2s, thr_r2s.retile_S(rO_r), thr_r2s.partition_D(sO));
    fence_async_smem();
    named_sync(128, kBarEpilogue<T> + wg);
    if (issuer) {
      Tensor mO = kp.tma_o.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads_q, p.batch))(_, _, h, b);
      Tensor gO = local_tile(mO, Shape<_64, Int<T::kOCols>>{}, make_coord(m_block * T::kMmaWGs + wg, r));
      auto c = kp.tma_o.get_slice(_0{});
      copy(kp.tma_o, group_modes<0, 3>(c.partition_S(sO)), group_modes<0, 3>(c.partition_D(gO)));
      tma_store_arrive();
    }
  }
  if (p.lse != nullptr && (tidx % 4) == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int row = m0 + get<0>(c_rc(r, 0));
      if (row < p.seqlen_q) p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + row] = lse[r];
    }
  }
}

// Before the CTA exits: the WG's last O store has completed (its smem must stay valid until read).
template <class Traits>
__forceinline__ __device__ void store_o_tail(int tidx) {
  if (tidx % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

}  // namespace jax_flash::sm90
