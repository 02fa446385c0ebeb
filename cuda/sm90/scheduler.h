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

// x / d for a divisor fixed at launch and 0 <= x < 2^31: a multiply-high and a shift (Granlund and
// Montgomery's round-up method) instead of the ~20 dependent instructions of a division by a
// run-time int. Built on the host.
struct FastDiv {
  uint32_t d = 1, mul = 0, shift = 0;
  FastDiv() = default;
  explicit FastDiv(int divisor) : d(uint32_t(divisor < 1 ? 1 : divisor)) {
    if (d == 1) return;
    uint32_t l = 0;  // ceil(log2(d))
    while ((uint64_t(1) << l) < d) ++l;
    mul = uint32_t(((uint64_t(1) << (31 + l)) + d - 1) / d);
    shift = l - 1;
  }
  JF_HOST_DEVICE int div(int x) const {
#ifdef __CUDA_ARCH__
    return d == 1 ? x : int(__umulhi(uint32_t(x), mul) >> shift);
#else
    return d == 1 ? x : int((uint64_t(uint32_t(x)) * mul >> 32) >> shift);
#endif
  }
};

struct TileSchedule {
  int num_blocks;       // blocks per head
  int num_bh;           // batch * heads
  int heads;            // heads per batch (h = bh % heads)
  int heads_per_chunk;  // longest-first orders only
  int num_tiles;        // num_blocks * num_bh
  TileOrder order;
  // The divisions of get_tile, by num_blocks, heads, heads_per_chunk and heads_per_chunk *
  // num_blocks (tile setup sits between a tile's hand-off and its first GEMM, NOTES.md v59).
  FastDiv by_blocks, by_heads, by_chunk_heads, by_chunk_tiles;
};

inline TileSchedule make_tile_schedule(int num_blocks, int num_bh, int heads, int heads_per_chunk, int num_tiles,
                                       TileOrder order) {
  if (heads_per_chunk > num_bh) heads_per_chunk = num_bh;  // the same order; keeps chunk tiles <= num_tiles
  TileSchedule s;
  s.num_blocks = num_blocks;
  s.num_bh = num_bh;
  s.heads = heads;
  s.heads_per_chunk = heads_per_chunk;
  s.num_tiles = num_tiles;
  s.order = order;
  s.by_blocks = FastDiv(num_blocks);
  s.by_heads = FastDiv(heads);
  s.by_chunk_heads = FastDiv(heads_per_chunk);
  s.by_chunk_tiles = FastDiv(heads_per_chunk * num_blocks);  // <= num_tiles < 2^31
  return s;
}

// Heads per longest-first chunk: about chunk_mb MB of per-head operands (K/V forward, Q/dO
// backward) per chunk, so the ~2 chunks in flight stay inside the 50 MB L2.
inline int heads_per_l2_chunk(int64_t bytes_per_head, int chunk_mb = 8) {
  int64_t const chunk_bytes = int64_t(chunk_mb) << 20;
  int64_t const h = bytes_per_head > 0 ? chunk_bytes / bytes_per_head : chunk_bytes;
  return int(h < 1 ? 1 : (h > (1 << 20) ? (1 << 20) : h));
}

JF_HOST_DEVICE TileCoord get_tile(int linear, TileSchedule const& s) {
  TileCoord t;
  int bh;
  if (s.order == TileOrder::kByHead) {
    bh = s.by_blocks.div(linear);
    t.m_block = linear - bh * s.num_blocks;
  } else {
    int const chunk = s.by_chunk_tiles.div(linear);
    int const bh0 = chunk * s.heads_per_chunk, in = linear - chunk * (s.heads_per_chunk * s.num_blocks);
    int const nh = s.num_bh - bh0 < s.heads_per_chunk ? s.num_bh - bh0 : s.heads_per_chunk;  // the last chunk may be short
    int const rank = nh == s.heads_per_chunk ? s.by_chunk_heads.div(in) : in / nh;  // 0 = longest
    bh = bh0 + (in - rank * nh);
    t.m_block = s.order == TileOrder::kLastBlockLongest ? s.num_blocks - 1 - rank : rank;
  }
  t.b = s.by_heads.div(bh);
  t.h = bh - t.b * s.heads;
  return t;
}

// The split tail's deal (sm90 backward, NOTES.md v82): the steps of the tail's tiles, tile_units
// each, numbered tile-major, go out to the CTAs as contiguous ranges: CTA c takes per_cta of them,
// one more if c < extra, from c * per_cta + min(c, extra) on (per_cta, extra: the total's quotient
// and remainder by the CTAs). A range covers at most two tiles when it holds no more steps than a
// tile, so a CTA runs piece k = 0, 1: steps [s0, s1) of the tail's tile `tile` (none: s1 <= s0).
struct SplitDeal {
  int per_cta, extra, tile_units;
  FastDiv by_tile_units;
};
struct SplitPiece {
  int tile, s0, s1;
};
inline SplitDeal make_split_deal(int64_t tiles, int tile_units, int ctas) {
  int64_t const units = tiles * tile_units;  // < 2^31 (launch_bwd checks)
  return {int(units / ctas), int(units % ctas), tile_units, FastDiv(tile_units)};
}
JF_HOST_DEVICE SplitPiece split_piece(SplitDeal const& d, int cta, int k) {
  int const u0 = cta * d.per_cta + (cta < d.extra ? cta : d.extra);
  int const u1 = u0 + d.per_cta + (cta < d.extra ? 1 : 0);
  int const j = d.by_tile_units.div(u0) + k;
  int const s0 = u0 - j * d.tile_units, s1 = u1 - j * d.tile_units;
  return {j, s0 > 0 ? s0 : 0, s1 < d.tile_units ? s1 : d.tile_units};
}

// Tile of round r for this CTA. Rounds alternate direction (snake) so that, with tiles sorted
// longest-first, every persistent CTA gets a similar total amount of work. With
// gridDim.x == number of tiles (non-persistent launch) this is just blockIdx.x.
#ifdef __CUDACC__
__forceinline__ __device__ int snake_tile(int r) {
  int const g = int(gridDim.x), i = int(blockIdx.x);
  return r * g + ((r & 1) ? g - 1 - i : i);
}
#endif

// Dynamic persistent schedule (forward): grid = min(CTA slots, tiles), CTA i starts with tile i,
// and each CTA's producer takes its next tile from a global counter (zeroed before the launch)
// once it has issued the current tile's last loads, then hands it to the consumers through smem
// (named barriers kBarTileFull / kBarTileEmpty, mainloop.h). Tiles come off the counter in index order
// (longest first under causal masks) as CTAs near the end of their work, so the balance is that
// of the hardware's CTA dispatch, and the persistent CTA still overlaps a tile's epilogue with
// the next tile's loads.

// Key blocks [n_min, n_max) that rows [m0, m0 + kBlockM) can see (empty when n_max <= n_min).
template <int kBlockM, int kBlockN>
JF_HOST_DEVICE void key_block_range(SeqMask const& m, int m_block, int& n_min, int& n_max) {
  int64_t lo, hi;
  m.key_range(int64_t(m_block) * kBlockM, int64_t(m_block + 1) * kBlockM, &lo, &hi);
  if (hi <= lo) { n_min = 0; n_max = 0; return; }
  n_min = int(lo / kBlockN);
  n_max = int((hi + kBlockN - 1) / kBlockN);
}

}  // namespace jax_flash::sm90
