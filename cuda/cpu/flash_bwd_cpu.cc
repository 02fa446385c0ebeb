// CPU backward (FlashAttention-2 order): one task per (batch, kv head) owns dK/dV of that
// head and dQ of every q head in its GQA group, so no two threads write the same output.
// For each key block, dK/dV accumulate in float32 while the task walks the query blocks
// that can see it, recomputing P = exp(S - lse) from the saved logsumexp.
//
// dbias (when a bias is given) is dS itself, summed over the bias's broadcast axes. When
// no two tasks share a dbias element the owning task adds into it directly; when the bias is
// broadcast across tasks (over batch, or over heads with several kv heads), a second pass
// owns dbias instead: one task per (dbias slice, key block) recomputes S and dP for every
// (batch, head) mapped onto it, in a fixed order. Both keep the CPU backend deterministic
// and neither allocates a per-(batch, head) dbias buffer.
//
// Dropout (Z = keep / (1 - rate) per element, O = (P o Z) V): dV = (P o Z)^T dO and
// dS = P o (dO V^T o Z - D) with D = rowsum(dO o O) of the dropped O, since
// rowsum(P o Z o dO V^T) = dO . O. The keep mask is recomputed from the same counters.
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

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Scratch for one thread's tiles.
struct BwdTiles {
  std::vector<float> kf, kt, vt, qf, dof, s, dp, capped, bias_buf, z, row;
  explicit BwdTiles(int H)
      : kf(kBlockK * H), kt(H * kBlockK), vt(H * kBlockK), qf(kBlockQ * H), dof(kBlockQ * H),
        s(kBlockQ * kBlockK), dp(kBlockQ * kBlockK), capped(kBlockK), bias_buf(kBlockK), z(kBlockK), row(H) {}

  // K (row-major and transposed) and V^T of keys [k0, k0 + nk) of kv head (b, hk).
  void load_kv(const FlashBwdParams& p, int b, int hk, int64_t k0, int nk) {
    const int H = p.head_dim;
    load_tile(p.k, p.dtype, b * p.k_batch_stride + hk * p.k_head_stride, p.k_row_stride, k0, nk, H, kf.data(), H);
    for (int j = 0; j < nk; ++j)
      for (int d = 0; d < H; ++d) kt[d * kBlockK + j] = kf[j * H + d];
    load_tile_t(p.v, p.dtype, b * p.v_batch_stride + hk * p.v_head_stride, p.v_row_stride, k0, nk, H, row.data(),
                vt.data(), kBlockK);
  }

  // Q and dO of rows [r0, r0 + nr) of q head (b, h), then s = Q K^T and dp = dO V^T.
  void scores(const FlashBwdParams& p, int b, int h, int64_t r0, int nr, int nk) {
    const int H = p.head_dim;
    load_tile(p.q, p.dtype, b * p.q_batch_stride + h * p.q_head_stride, p.q_row_stride, r0, nr, H, qf.data(), H);
    load_tile(p.dout, p.dtype, b * p.do_batch_stride + h * p.do_head_stride, p.do_row_stride, r0, nr, H,
              dof.data(), H);
    gemm_nt_into(nr, nk, H, qf.data(), H, kt.data(), kBlockK, s.data(), kBlockK);
    gemm_nt_into(nr, nk, H, dof.data(), H, vt.data(), kBlockK, dp.data(), kBlockK);
  }

  // s -> P (P o Z under dropout: what dV needs) and dp -> dS w.r.t. the scaled raw logit
  // q.k * scale (what dQ/dK need), for the tile scored above. dS w.r.t. the final logit (the
  // bias's gradient) is added into dbias (offset to this (batch, head)) when given.
  // drop: this (batch, head)'s dropout, or nullptr when off.
  void probs_and_grads(const FlashBwdParams& p, const HeadLogits& logits, const HeadDropout* drop, TileKind kind,
                       const float* lse, const float* dsum, int64_t r0, int nr, int64_t k0, int nk, float* dbias) {
    const bool softcap = p.softcap > 0.f;
    for (int i = 0; i < nr; ++i) {
      float* si = s.data() + i * kBlockK;    // becomes P (o Z)
      float* dpi = dp.data() + i * kBlockK;  // becomes dS
      const float li = lse[r0 + i];
      const float di = dsum[r0 + i];
      logits.row(si, r0 + i, k0, nk, kind, capped.data(), bias_buf.data());
      if (drop) {  // z = Z of this row: 1 / (1 - rate) where kept, 0 where dropped
        std::fill(z.begin(), z.begin() + nk, p.dropout_scale);
        drop->apply_row(z.data(), r0 + i, k0, nk, 1.f);
      }
      float* db = dbias ? dbias + (r0 + i) * p.dbias_row_stride + k0 * p.dbias_col_stride : nullptr;
      // P = exp(S - lse), 0 where masked; an empty row (lse = -inf) has P = 0 throughout.
      if (li == kNegInf) {
        std::fill(si, si + nk, 0.f);
      } else {
        exp_shifted_sum(si, nk, li);
      }
      if (!drop && !db && !softcap) {  // the common case, in a loop the compiler vectorises
        for (int j = 0; j < nk; ++j) dpi[j] = si[j] * (dpi[j] - di);
        continue;
      }
      for (int j = 0; j < nk; ++j) {
        const float pij = si[j];
        const float ds = pij * ((drop ? dpi[j] * z[j] : dpi[j]) - di);
        if (db) db[j * p.dbias_col_stride] += ds;
        si[j] = drop ? pij * z[j] : pij;
        dpi[j] = softcap ? ds * softcap_grad(capped[j], p.softcap) : ds;
      }
    }
  }
};

// D_i = rowsum(dO * O) of every row of q head (b, h), into p.dsum.
void row_dsum(const FlashBwdParams& p, int b, int h, float* o_row, float* do_row) {
  const int H = p.head_dim;
  float* dsum = p.dsum + row_stats_offset(p, b, h);
  for (int64_t i = 0; i < p.seqlen_q; ++i) {
    load_row(p.o, p.dtype, b * p.o_batch_stride + h * p.o_head_stride + i * p.o_row_stride, H, o_row);
    load_row(p.dout, p.dtype, b * p.do_batch_stride + h * p.do_head_stride + i * p.do_row_stride, H, do_row);
    float acc = 0.f;
    for (int d = 0; d < H; ++d) acc += o_row[d] * do_row[d];
    dsum[i] = acc;
  }
}

// The separate dbias pass (see the top of the file). A task owns dbias slice (bb, nb) and
// keys [k_begin, k_end): one key block, or all keys when the bias is broadcast over keys.
void dbias_pass(const FlashBwdParams& p) {
  const DbiasExtents ext(p);
  const bool over_keys = ext.cols == 1;  // broadcast over keys: a task sums all of them
  const int64_t key_blocks = over_keys ? 1 : (p.seqlen_k + kBlockK - 1) / kBlockK;
  const int64_t group = p.group();
  parallel_for(int64_t(ext.batch) * ext.heads * key_blocks, [&](int64_t task) {
    const int64_t kb = task % key_blocks;
    const int nb = int(task / key_blocks % ext.heads);
    const int bb = int(task / key_blocks / ext.heads);
    const int64_t k_begin = over_keys ? 0 : kb * kBlockK;
    const int64_t k_end = over_keys ? p.seqlen_k : std::min<int64_t>(k_begin + kBlockK, p.seqlen_k);
    BwdTiles t(p.head_dim);
    for (int b = ext.batch == 1 ? 0 : bb; b < (ext.batch == 1 ? p.batch : bb + 1); ++b) {
      for (int h = ext.heads == 1 ? 0 : nb; h < (ext.heads == 1 ? p.heads_q : nb + 1); ++h) {
        const HeadLogits logits(p, b, h);
        const HeadDropout drop = p.dropout_keys ? make_head_dropout(p, b, h) : HeadDropout{};
        const float* lse = p.lse + (int64_t(b) * p.heads_q + h) * p.seqlen_q;
        const float* dsum = p.dsum + row_stats_offset(p, b, h);
        float* dbias = p.dbias + dbias_offset(p, b, h);
        for (int64_t k0 = k_begin; k0 < k_end; k0 += kBlockK) {
          const int nk = int(std::min<int64_t>(kBlockK, k_end - k0));
          int64_t rlo, rhi;
          logits.seq.row_range(k0, k0 + nk, &rlo, &rhi);
          if (rhi <= rlo) continue;
          t.load_kv(p, b, int(h / group), k0, nk);
          for (int64_t r0 = rlo; r0 < rhi; r0 += kBlockQ) {
            const int nr = int(std::min<int64_t>(kBlockQ, rhi - r0));
            const TileKind kind = logits.classify(r0, r0 + nr, k0, k0 + nk);
            if (kind == TileKind::kSkip) continue;
            t.scores(p, b, h, r0, nr, nk);
            t.probs_and_grads(p, logits, p.dropout_keys ? &drop : nullptr, kind, lse, dsum, r0, nr, k0, nk, dbias);
          }
        }
      }
    }
  });
}

}  // namespace

void flash_bwd(const FlashBwdParams& p) {
  const int H = p.head_dim;
  const int64_t group = p.group();
  const int64_t T = p.seqlen_q;
  // dbias is a float32 sum: start from zero (only the bias's own, broadcast shape).
  const bool separate_dbias = p.dbias && dbias_shared_across_kv_heads(p);
  if (p.dbias) std::fill(p.dbias, p.dbias + dbias_elements(p), 0.f);

  parallel_for(int64_t(p.batch) * p.heads_kv, [&](int64_t task) {
    const int b = int(task / p.heads_kv);
    const int hk = int(task % p.heads_kv);
    const int64_t dk_off = b * p.dk_batch_stride + hk * p.dk_head_stride;
    const int64_t dv_off = b * p.dv_batch_stride + hk * p.dv_head_stride;
    BwdTiles t(H);
    std::vector<float> row2(H);
    for (int64_t g = 0; g < group; ++g) row_dsum(p, b, int(hk * group + g), t.row.data(), row2.data());

    std::vector<HeadLogits> logits;  // per q head of the group
    std::vector<HeadDropout> drops;  // per q head of the group; empty when dropout is off
    for (int64_t g = 0; g < group; ++g) {
      logits.emplace_back(p, b, int(hk * group + g));
      if (p.dropout_keys) drops.push_back(make_head_dropout(p, b, int(hk * group + g)));
    }
    const SeqMask& seq = logits[0].seq;  // the interval rule is per batch, shared by the group

    std::vector<float> dq(group * T * H, 0.f);  // float32 dQ of the group's q heads
    std::vector<float> dk(kBlockK * H), dv(kBlockK * H);

    for (int64_t k0 = 0; k0 < p.seqlen_k; k0 += kBlockK) {
      const int nk = int(std::min<int64_t>(kBlockK, p.seqlen_k - k0));
      std::fill(dk.begin(), dk.end(), 0.f);
      std::fill(dv.begin(), dv.end(), 0.f);
      int64_t rlo, rhi;
      seq.row_range(k0, k0 + nk, &rlo, &rhi);
      if (rhi > rlo) t.load_kv(p, b, hk, k0, nk);
      for (int64_t g = 0; g < group && rhi > rlo; ++g) {
        const int h = int(hk * group + g);
        const float* lse = p.lse + (int64_t(b) * p.heads_q + h) * T;
        const float* dsum = p.dsum + row_stats_offset(p, b, h);
        float* dbias = p.dbias && !separate_dbias ? p.dbias + dbias_offset(p, b, h) : nullptr;
        float* dq_h = dq.data() + g * T * H;
        for (int64_t r0 = rlo; r0 < rhi; r0 += kBlockQ) {
          const int nr = int(std::min<int64_t>(kBlockQ, rhi - r0));
          const TileKind kind = logits[g].classify(r0, r0 + nr, k0, k0 + nk);
          if (kind == TileKind::kSkip) continue;
          t.scores(p, b, h, r0, nr, nk);
          t.probs_and_grads(p, logits[g], drops.empty() ? nullptr : &drops[g], kind, lse, dsum, r0, nr, k0, nk, dbias);
          gemm_tn_acc(nr, nk, H, 1.f, t.s.data(), kBlockK, t.dof.data(), H, dv.data(), H);
          gemm_tn_acc(nr, nk, H, p.scale, t.dp.data(), kBlockK, t.qf.data(), H, dk.data(), H);
          gemm_acc(nr, nk, H, p.scale, t.dp.data(), kBlockK, t.kf.data(), H, dq_h + r0 * H, H);
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

  if (separate_dbias) dbias_pass(p);
}

}  // namespace jax_flash::cpu
