// CPU backward (FlashAttention-2 order): one task per (batch, kv head) owns dK/dV of that
// head and dQ of every q head in its GQA group, so no two threads write the same output.
// For each key block, dK/dV accumulate in float32 while the task walks the query blocks
// that can see it, recomputing P = exp(S - lse) from the saved logsumexp.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../common/mask.h"
#include "flash_cpu.h"
#include "parallel.h"
#include "tile.h"

namespace jax_flash::cpu {

void flash_bwd(const FlashBwdParams& p) {
  const int H = p.head_dim;
  const int64_t group = p.group();
  const int64_t T = p.seqlen_q;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  parallel_for(int64_t(p.batch) * p.heads_kv, [&](int64_t task) {
    const int b = int(task / p.heads_kv);
    const int hk = int(task % p.heads_kv);
    const SeqMask mask = make_seq_mask(p, b);
    const int64_t k_off = b * p.k_batch_stride + hk * p.k_head_stride;
    const int64_t v_off = b * p.v_batch_stride + hk * p.v_head_stride;
    const int64_t dk_off = b * p.dk_batch_stride + hk * p.dk_head_stride;
    const int64_t dv_off = b * p.dv_batch_stride + hk * p.dv_head_stride;

    std::vector<float> row(H), row2(H);
    // Preprocess: D_i = rowsum(dO * O) for every q head of the group (into p.dsum).
    for (int64_t g = 0; g < group; ++g) {
      const int h = int(hk * group + g);
      float* dsum = p.dsum + row_stats_offset(p, b, h);
      for (int64_t i = 0; i < T; ++i) {
        load_row(p.o, p.dtype, b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride, H, row.data());
        load_row(p.dout, p.dtype, b * p.do_batch_stride + h * p.do_head_stride + i * p.do_row_stride, H,
                 row2.data());
        float acc = 0.f;
        for (int d = 0; d < H; ++d) acc += row[d] * row2[d];
        dsum[i] = acc;
      }
    }

    std::vector<float> dq(group * T * H, 0.f);  // float32 dQ of the group's q heads
    std::vector<float> kf(kBlockK * H), kt(H * kBlockK), vt(H * kBlockK);
    std::vector<float> qf(kBlockQ * H), dof(kBlockQ * H);
    std::vector<float> s(kBlockQ * kBlockK), dp(kBlockQ * kBlockK);
    std::vector<float> dk(kBlockK * H), dv(kBlockK * H);

    for (int64_t k0 = 0; k0 < p.seqlen_k; k0 += kBlockK) {
      const int nk = int(std::min<int64_t>(kBlockK, p.seqlen_k - k0));
      std::fill(dk.begin(), dk.end(), 0.f);
      std::fill(dv.begin(), dv.end(), 0.f);
      int64_t rlo, rhi;
      mask.row_range(k0, k0 + nk, &rlo, &rhi);
      if (rhi > rlo) {
        load_tile(p.k, p.dtype, k_off, p.k_row_stride, k0, nk, H, kf.data(), H);
        for (int j = 0; j < nk; ++j)
          for (int d = 0; d < H; ++d) kt[d * kBlockK + j] = kf[j * H + d];
        load_tile_t(p.v, p.dtype, v_off, p.v_row_stride, k0, nk, H, row.data(), vt.data(), kBlockK);
      }
      for (int64_t g = 0; g < group && rhi > rlo; ++g) {
        const int h = int(hk * group + g);
        const int64_t q_off = b * p.q_batch_stride + h * p.q_head_stride;
        const int64_t do_off = b * p.do_batch_stride + h * p.do_head_stride;
        const float* lse = p.lse + (int64_t(b) * p.heads_q + h) * T;
        const float* dsum = p.dsum + row_stats_offset(p, b, h);
        float* dq_h = dq.data() + g * T * H;
        for (int64_t r0 = rlo; r0 < rhi; r0 += kBlockQ) {
          const int nr = int(std::min<int64_t>(kBlockQ, rhi - r0));
          load_tile(p.q, p.dtype, q_off, p.q_row_stride, r0, nr, H, qf.data(), H);
          load_tile(p.dout, p.dtype, do_off, p.do_row_stride, r0, nr, H, dof.data(), H);
          gemm_nt_into(nr, nk, H, qf.data(), H, kt.data(), kBlockK, s.data(), kBlockK);
          gemm_nt_into(nr, nk, H, dof.data(), H, vt.data(), kBlockK, dp.data(), kBlockK);
          const bool full = mask.tile_full(r0, r0 + nr, k0, k0 + nk);
          for (int i = 0; i < nr; ++i) {
            float* si = s.data() + i * kBlockK;  // becomes P
            float* dpi = dp.data() + i * kBlockK;  // becomes dS (w.r.t. the scaled raw logit)
            const float li = lse[r0 + i];
            const float di = dsum[r0 + i];
            for (int j = 0; j < nk; ++j) {
              const float capped = apply_softcap(si[j] * p.scale, p.softcap);
              const bool vis = li != kNegInf && (full || mask.visible(r0 + i, k0 + j));
              const float pij = vis ? std::exp(capped - li) : 0.f;
              si[j] = pij;
              dpi[j] = pij * (dpi[j] - di) * softcap_grad(capped, p.softcap);
            }
          }
          gemm_tn_acc(nr, nk, H, 1.f, s.data(), kBlockK, dof.data(), H, dv.data(), H);
          gemm_tn_acc(nr, nk, H, p.scale, dp.data(), kBlockK, qf.data(), H, dk.data(), H);
          gemm_acc(nr, nk, H, p.scale, dp.data(), kBlockK, kf.data(), H, dq_h + r0 * H, H);
        }
      }
      for (int j = 0; j < nk; ++j) {
        store_row(p.dk, p.dtype, dk_off + (k0 + j) * p.dk_row_stride, H, dk.data() + j * H);
        store_row(p.dv, p.dtype, dv_off + (k0 + j) * p.dv_row_stride, H, dv.data() + j * H);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const int h = int(hk * group + g);
      const int64_t dq_off = b * p.dq_batch_stride + h * p.dq_head_stride;
      for (int64_t i = 0; i < T; ++i)
        store_row(p.dq, p.dtype, dq_off + i * p.dq_row_stride, H, dq.data() + (g * T + i) * H);
    }
  });
}

}  // namespace jax_flash::cpu
