// CPU forward: for each (batch, q head) and each block of query rows, stream over the
// visible key blocks keeping a running max, running sum and float32 accumulator
// (online softmax). Memory is O(kBlockQ * (kBlockK + head_dim)) per thread.
// Dropout zeroes elements of exp(S - m) after they entered the running sum (lse and the
// normaliser are those of the undropped softmax); the 1 / (1 - rate) scale is folded into
// the final 1 / l.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../common/philox.h"
#include "flash_cpu.h"
#include "logits.h"
#include "parallel.h"
#include "tile.h"

namespace jax_flash::cpu {

void flash_fwd(const FlashFwdParams& p) {
  const int H = p.head_dim;
  const int64_t group = p.group();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  parallel_for(int64_t(p.batch) * p.heads_q, [&](int64_t task) {
    const int b = int(task / p.heads_q);
    const int h = int(task % p.heads_q);
    const int hk = int(h / group);
    const HeadLogits logits(p, b, h);
    const bool dropout = p.dropout_keys != nullptr;
    const HeadDropout drop = dropout ? make_head_dropout(p, b, h) : HeadDropout{};
    const int64_t q_off = b * p.q_batch_stride + h * p.q_head_stride;
    const int64_t k_off = b * p.k_batch_stride + hk * p.k_head_stride;
    const int64_t v_off = b * p.v_batch_stride + hk * p.v_head_stride;
    const int64_t o_off = b * p.o_batch_stride + h * p.o_head_stride;
    float* lse = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q;

    std::vector<float> qf(kBlockQ * H), kt(H * kBlockK), vf(kBlockK * H), row(H);
    std::vector<float> s(kBlockQ * kBlockK), acc(kBlockQ * H), bias_buf(kBlockK);
    float m[kBlockQ], l[kBlockQ];

    for (int64_t r0 = 0; r0 < p.seqlen_q; r0 += kBlockQ) {
      const int nr = int(std::min<int64_t>(kBlockQ, p.seqlen_q - r0));
      int64_t klo, khi;
      logits.seq.key_range(r0, r0 + nr, &klo, &khi);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m, m + kBlockQ, kNegInf);
      std::fill(l, l + kBlockQ, 0.f);
      if (khi > klo) load_tile(p.q, p.dtype, q_off, p.q_row_stride, r0, nr, H, qf.data(), H);

      for (int64_t k0 = klo; k0 < khi; k0 += kBlockK) {
        const int nk = int(std::min<int64_t>(kBlockK, khi - k0));
        const TileKind kind = logits.classify(r0, r0 + nr, k0, k0 + nk);
        if (kind == TileKind::kSkip) continue;
        load_tile_t(p.k, p.dtype, k_off, p.k_row_stride, k0, nk, H, row.data(), kt.data(), kBlockK);
        load_tile(p.v, p.dtype, v_off, p.v_row_stride, k0, nk, H, vf.data(), H);
        gemm_nt_into(nr, nk, H, qf.data(), H, kt.data(), kBlockK, s.data(), kBlockK);
        for (int i = 0; i < nr; ++i) {
          float* si = s.data() + i * kBlockK;
          logits.row(si, r0 + i, k0, nk, kind, nullptr, bias_buf.data());
          const float mx = row_max(si, nk, m[i]);
          if (mx == kNegInf) {  // nothing visible in this row yet, or only NaN logits
            if (any_nan(si, nk)) l[i] = std::numeric_limits<float>::quiet_NaN();  // sticks: out NaN
            continue;
          }
          const float alpha = std::exp(m[i] - mx);  // exp(-inf) = 0 on the first visible block
          l[i] = l[i] * alpha + exp_shifted_sum(si, nk, mx);
          m[i] = mx;
          if (dropout) drop.apply_row(si, r0 + i, k0, nk, 1.f);
          float* ai = acc.data() + i * H;
          if (alpha != 1.f)
            for (int d = 0; d < H; ++d) ai[d] *= alpha;
        }
        // Rows whose max is still -inf hold exp(-inf - -inf) garbage: zero them first.
        for (int i = 0; i < nr; ++i)
          if (m[i] == kNegInf) std::fill(s.data() + i * kBlockK, s.data() + i * kBlockK + nk, 0.f);
        gemm_acc(nr, nk, H, 1.f, s.data(), kBlockK, vf.data(), H, acc.data(), H);
      }

      for (int i = 0; i < nr; ++i) {
        float* ai = acc.data() + i * H;
        // l is 0 only for a row with no visible key; NaN (a NaN input) falls through to NaN.
        if (l[i] != 0.f) {
          const float inv = (dropout ? p.dropout_scale : 1.f) / l[i];
          for (int d = 0; d < H; ++d) ai[d] *= inv;
          lse[r0 + i] = m[i] + std::log(l[i]);
        } else {  // empty row: out 0, lse -inf
          std::fill(ai, ai + H, 0.f);
          lse[r0 + i] = kNegInf;
        }
        store_row(p.o, p.dtype, o_off + (r0 + i) * p.o_row_stride, H, ai);
      }
    }
  });
}

}  // namespace jax_flash::cpu
