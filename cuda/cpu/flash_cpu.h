// The CPU backend: tiled online-softmax FlashAttention, float32 arithmetic, O(T + S)
// memory per head (no T x S matrix), parallel over (batch, head) tasks.
#pragma once

#include "../common/flash_params.h"

namespace jax_flash::cpu {

// Rows of queries and keys per tile. Small enough that a tile of Q, K^T, V and the score
// block stay in L1/L2 for head dims up to 256.
constexpr int kBlockQ = 32;
constexpr int kBlockK = 64;

void flash_fwd(const FlashFwdParams& p);
// Writes dq, dk, dv; uses p.dsum as workspace (p.dq_accum is unused on the CPU).
void flash_bwd(const FlashBwdParams& p);

}  // namespace jax_flash::cpu
