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
  static_assert(kBarEpilogue<T> + T::kMmaWGs <= kBarQEmpty<T>, "named barrier ids overlap");
  auto const frag_layout = partition_fragment_C(typename T::TiledMmaOWG{}, Shape<_64, Int<T::kOCols>>{}).layout();
  constexpr int kFragSize = decltype(cute::size(frag_layout))::value;
  CUTLASS_PRAGMA_UNROLL
  for (int r = 0; r < T::kORounds; ++r) {
    wg_tma_store<typename T::TiledMmaOWG, typename T::SmemLayoutO>(
        make_tensor(rO.data() + r * kFragSize, frag_layout), ss.o.data() + wg * cute::cosize_v<typename T::SmemLayoutO>,
        kp.tma_o,
        [&] {
          Tensor mO = kp.tma_o.get_tma_tensor(make_shape(p.seqlen_q, p.head_dim, p.heads_q, p.batch))(_, _, h, b);
          return local_tile(mO, Shape<_64, Int<T::kOCols>>{}, make_coord(m_block * T::kMmaWGs + wg, r));
        },
        kBarEpilogue<T> + wg, tidx);
  }
  if (p.lse != nullptr && (tidx % 4) == 0) {
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      int row = m0 + get<0>(c_rc(r, 0));
      if (row < p.seqlen_q) p.lse[(int64_t(b) * p.heads_q + h) * p.seqlen_q + row] = lse[r];
    }
  }
}

}  // namespace jax_flash::sm90
