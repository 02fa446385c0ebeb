// The CPU backend: tiled online-softmax FlashAttention, float32 arithmetic, O(T + S)
// memory per head (no T x S matrix), parallel over (batch, head) tasks.
#pragma once

#include "../common/flash_params.h"

namespace jax_flash::cpu {

// Rows of queries and keys per tile. Small enough that a tile of Q, K^T, V and the score
// block stay in L2 for head dims up to 256. 64 query rows: each K^T / V tile serves twice the
// rows of 32 (forward -6% at H=64, -10% at H=256; 128 keys gained nothing; session 10).
constexpr int kBlockQ = 64;
constexpr int kBlockK = 64;

void flash_fwd(const FlashFwdParams& p);
// Writes dq, dk, dv; uses p.dsum as workspace (p.dq_accum is unused on the CPU).
void flash_bwd(const FlashBwdParams& p);

}  // namespace jax_flash::cpu
