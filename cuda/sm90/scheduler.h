// Maps a linear tile index to (m_block, head, batch). Persistent CTAs take tiles
// blockIdx.x, blockIdx.x + gridDim.x, ... so ordering the index space is the schedule.
#pragma once

#include <cstdint>

#include "../common/mask.h"

namespace jax_flash::sm90 {

struct TileCoord {
  int m_block, h, b;
};

// Causal / right-windowed work shrinks with the row block: hand out the longest (last) row
// blocks of every head first so the tail of the grid is made of short tiles. Otherwise keep
// the row blocks of one head adjacent so they share K/V in L2.
__forceinline__ __device__ TileCoord get_tile(int linear, int num_m_blocks, int num_bh, int heads_q, bool longest_first) {
  TileCoord t;
  int bh;
  if (longest_first) {
    t.m_block = num_m_blocks - 1 - linear / num_bh;
    bh = linear % num_bh;
  } else {
    t.m_block = linear % num_m_blocks;
    bh = linear / num_m_blocks;
  }
  t.h = bh % heads_q;
  t.b = bh / heads_q;
  return t;
}

// Tile of round r for this CTA. Rounds alternate direction (snake) so that, with tiles sorted
// longest-first, every persistent CTA gets a similar total amount of work. With
// gridDim.x == number of tiles (non-persistent launch) this is just blockIdx.x.
__forceinline__ __device__ int snake_tile(int r) {
  int const g = int(gridDim.x), i = int(blockIdx.x);
  return r * g + ((r & 1) ? g - 1 - i : i);
}

// Key blocks [n_min, n_max) that rows [m0, m0 + kBlockM) can see (empty when n_max <= n_min).
template <int kBlockM, int kBlockN>
__forceinline__ __device__ void key_block_range(SeqMask const& m, int m_block, int& n_min, int& n_max) {
  int64_t lo, hi;
  m.key_range(int64_t(m_block) * kBlockM, int64_t(m_block + 1) * kBlockM, &lo, &hi);
  if (hi <= lo) { n_min = 0; n_max = 0; return; }
  n_min = int(lo / kBlockN);
  n_max = int((hi + kBlockN - 1) / kBlockN);
}

}  // namespace jax_flash::sm90
