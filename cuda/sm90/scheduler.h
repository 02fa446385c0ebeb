// Maps a linear tile index to (m_block, head, batch). Persistent CTAs take tiles
// blockIdx.x, blockIdx.x + gridDim.x, ... so ordering the index space is the schedule.
#pragma once

#include <cstdint>

#include "../common/mask.h"

namespace jax_flash::sm90 {

struct TileCoord {
  int m_block, h, b;
};

// The tile index space: (block, head, batch), blocks being query blocks (forward) or key
// blocks (backward). kByHead keeps the blocks of one head adjacent, so the CTAs running at
// once share that head's K/V (Q/dO) in L2. Under causal / right-bounded masks the work per
// block varies, and the longest blocks go first so the tail of the grid is short tiles; the
// longest block is the last one (forward) or the first one (backward). Longest-first runs over
// chunks of heads_per_chunk heads: over all heads at once, each running CTA would read a
// different head and miss in L2 (the S=1k causal case, NOTES.md).
enum class TileOrder : int { kByHead, kLastBlockLongest, kFirstBlockLongest };

struct TileSchedule {
  int num_blocks;       // blocks per head
  int num_bh;           // batch * heads
  int heads;            // heads per batch (h = bh % heads)
  int heads_per_chunk;  // longest-first orders only
  int num_tiles;        // num_blocks * num_bh
  TileOrder order;
};

// Heads per longest-first chunk: about chunk_mb MB of per-head operands (K/V forward, Q/dO
// backward) per chunk, so the ~2 chunks in flight stay inside the 50 MB L2.
inline int heads_per_l2_chunk(int64_t bytes_per_head, int chunk_mb = 8) {
  int64_t const chunk_bytes = int64_t(chunk_mb) << 20;
  int64_t const h = bytes_per_head > 0 ? chunk_bytes / bytes_per_head : chunk_bytes;
  return int(h < 1 ? 1 : (h > (1 << 20) ? (1 << 20) : h));
}

__forceinline__ __device__ TileCoord get_tile(int linear, TileSchedule const& s) {
  TileCoord t;
  int bh;
  if (s.order == TileOrder::kByHead) {
    t.m_block = linear % s.num_blocks;
    bh = linear / s.num_blocks;
  } else {
    int const chunk_tiles = s.heads_per_chunk * s.num_blocks;
    int const bh0 = linear / chunk_tiles * s.heads_per_chunk, in = linear % chunk_tiles;
    int const nh = min(s.heads_per_chunk, s.num_bh - bh0);  // the last chunk may be short
    int const rank = in / nh;                               // 0 = longest
    bh = bh0 + in % nh;
    t.m_block = s.order == TileOrder::kLastBlockLongest ? s.num_blocks - 1 - rank : rank;
  }
  t.h = bh % s.heads;
  t.b = bh / s.heads;
  return t;
}

// Tile of round r for this CTA. Rounds alternate direction (snake) so that, with tiles sorted
// longest-first, every persistent CTA gets a similar total amount of work. With
// gridDim.x == number of tiles (non-persistent launch) this is just blockIdx.x.
__forceinline__ __device__ int snake_tile(int r) {
  int const g = int(gridDim.x), i = int(blockIdx.x);
  return r * g + ((r & 1) ? g - 1 - i : i);
}

// Dynamic persistent schedule (forward): grid = min(CTA slots, tiles), CTA i starts with tile i,
// and each CTA's producer takes its next tile from a global counter (zeroed before the launch)
// once it has issued the current tile's last loads, then hands it to the consumers through smem
// (named barriers kBarTileFull / kBarTileEmpty, mainloop.h). Tiles come off the counter in index order
// (longest first under causal masks) as CTAs near the end of their work, so the balance is that
// of the hardware's CTA dispatch, and the persistent CTA still overlaps a tile's epilogue with
// the next tile's loads.

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
