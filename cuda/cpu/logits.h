// The logits of one (batch, head) on the CPU: scale, softcap, bias and every mask rule, in
// one place for the forward, the backward and the dbias pass.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../common/mask.h"
#include "cpu_dtype.h"

namespace jax_flash::cpu {

struct HeadLogits {
  float scale, softcap;
  SeqMask seq;
  ElemMask elem;
  BiasView bias;  // bias.ptr == nullptr: no bias

  HeadLogits(const FlashFwdParams& p, int b, int h)
      : scale(p.scale),
        softcap(p.softcap),
        seq(make_seq_mask(p, b)),
        elem(make_elem_mask(p, b, h)),
        bias(make_bias_view(p, b, h)) {}

  TileKind classify(int64_t r0, int64_t r1, int64_t k0, int64_t k1) const {
    return classify_tile(elem, seq.tile_full(r0, r1, k0, k1), r0, r1, k0, k1);
  }

  // Raw q.k of row i, keys [k0, k0 + nk), in place -> logits (-inf where not visible).
  // capped (or nullptr): receives the softcapped scaled logit before the bias, for
  // softcap_grad; written only when softcap is on (without it the gradient factor is 1).
  // bias_buf: nk floats of scratch.
  void row(float* s, int64_t i, int64_t k0, int nk, TileKind kind, float* capped, float* bias_buf) const {
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    if (softcap > 0.f) {
      for (int j = 0; j < nk; ++j) s[j] = apply_softcap(s[j] * scale, softcap);
      if (capped) std::copy(s, s + nk, capped);
    } else {
      for (int j = 0; j < nk; ++j) s[j] *= scale;
    }
    if (bias.ptr) {
      if (bias.col_stride == 1) {
        load_row(bias.ptr, bias.dtype, i * bias.row_stride + k0, nk, bias_buf);
        for (int j = 0; j < nk; ++j) s[j] += bias_buf[j];
      } else {  // broadcast over keys (stride 0)
        const float one = bias.at(i, k0);
        for (int j = 0; j < nk; ++j) s[j] += one;
      }
    }
    if (kind == TileKind::kFull) return;
    const ElemMask::Row er = elem.row(i);
    for (int j = 0; j < nk; ++j)
      if (!seq.visible(i, k0 + j) || !er.visible(k0 + j)) s[j] = kNegInf;
  }
};

}  // namespace jax_flash::cpu
