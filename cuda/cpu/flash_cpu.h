// The CPU backend: tiled online-softmax FlashAttention, float32 arithmetic, O(T + S)
// memory per head (no T x S matrix), parallel over (batch, head) tasks.
#pragma once

#include "../common/flash_params.h"

namespace jax_flash::cpu {

// Rows of queries and keys per tile. Small enough that a tile of Q, K^T, V and the score
// block stay in L2 for head dims up to 256 (~400 KB at H=256). Each K^T / V tile is converted
// once per kBlockQ query rows: 64 rows instead of 32 gave forward -6% at H=64 and -10% at
// H=256 (session 10), 128 instead of 64 -3% / -6% (fwd+bwd -2%), 256 a further -2% forward
// without a backward gain (session 11, benchmarks/cpu-2026-11-29.md); 128 keys gained nothing.
constexpr int kBlockQ = 128;
constexpr int kBlockK = 64;

void flash_fwd(const FlashFwdParams& p);
// Writes dq, dk, dv; uses p.dsum as workspace (p.dq_accum is unused on the CPU).
void flash_bwd(const FlashBwdParams& p);

}  // namespace jax_flash::cpu
