// Writes the normalised O tile (input dtype) and the LSE rows of one consumer warpgroup.
#pragma once

#include "softmax.h"
#include "traits.h"

namespace jax_flash::sm90 {

template <class Traits, class TO, int kRows>
__forceinline__ __device__ void store_o_lse(FlashFwdParams const& p, TO& tOrO, float const (&inv)[kRows],
                                            float const (&lse)[kRows], int m_block, int h, int b, int tidx) {
  using T = Traits;
  using Element = typename T::Element;
  typename T::TiledMmaPV mma_pv;
  auto thr = mma_pv.get_thread_slice(tidx);
  Tensor cO = thr.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}));
  Tensor o_rc = make_tensor(tOrO.data(), acc_rowcol(tOrO.layout()));
  Tensor c_rc = make_tensor(cO.data(), acc_rowcol(cO.layout()));
  rescale_rows(o_rc, inv);
  Tensor rO = make_tensor_like<Element>(tOrO);
  convert_out(tOrO, rO);

  int const m0 = m_block * T::kBlockM;
  Element* o = static_cast<Element*>(p.o) + int64_t(b) * p.o_batch_stride + int64_t(h) * p.o_head_stride;
  // Accumulator element pairs (2k, 2k+1) are adjacent columns of one row: 32-bit stores.
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size(rO); k += 2) {
    int row = m0 + get<0>(cO(k));
    int col = get<1>(cO(k));
    if (row < p.seqlen_q && col < p.head_dim) {  // padded head dims: columns past head_dim stay unwritten
      *reinterpret_cast<uint32_t*>(o + int64_t(row) * p.o_row_stride + col) =
          *reinterpret_cast<uint32_t const*>(&rO(k));
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

}  // namespace jax_flash::sm90
