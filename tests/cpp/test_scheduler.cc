// The sm90 tile schedule's index arithmetic (cuda/sm90/scheduler.h), built and run on the host by
// tests/test_mask_cpp.py: FastDiv against integer division, and get_tile against the schedule's
// definition (a bijection from tile indices to (block, head, batch), longest blocks first by
// chunks of heads) written with plain division, and the backward split tail's deal (split_piece:
// every step of the tail's tiles in exactly one piece, at most two pieces per CTA).
#include <cstdint>
#include <cstdio>
#include <random>
#include <vector>

#include "sm90/scheduler.h"

using namespace jax_flash::sm90;

// The definition: chunks of heads_per_chunk (batch * head) rows, inside a chunk rank-major
// (every head's rank-0 block, then rank 1, ...), rank 0 = the longest block.
static TileCoord reference_tile(int linear, int num_blocks, int num_bh, int heads, int hpc, TileOrder order) {
  TileCoord t;
  int bh;
  if (order == TileOrder::kByHead) {
    t.m_block = linear % num_blocks;
    bh = linear / num_blocks;
  } else {
    int const chunk_tiles = hpc * num_blocks;
    int const bh0 = linear / chunk_tiles * hpc, in = linear % chunk_tiles;
    int const nh = num_bh - bh0 < hpc ? num_bh - bh0 : hpc;
    int const rank = in / nh;
    bh = bh0 + in % nh;
    t.m_block = order == TileOrder::kLastBlockLongest ? num_blocks - 1 - rank : rank;
  }
  t.h = bh % heads;
  t.b = bh / heads;
  return t;
}

int main() {
  std::mt19937 g(7);
  long mismatches = 0, checks = 0;
  // FastDiv: every divisor below 4096 and random ones up to 2^31 - 1, dividends in [0, 2^31).
  for (int i = 0; i < 300000; ++i) {
    int const d = i < 4096 ? i + 1 : (i & 1 ? int(g() & 0x7fffffff) | 1 : 1 + int(g() % 1000000));
    FastDiv const f(d);
    for (int x : {0, d - 1, d, 2147483647, int(g() & 0x7fffffff), int(g() % (uint32_t(d) * 3u + 1u) & 0x7fffffff)}) {
      ++checks;
      if (f.div(x) != x / d) ++mismatches;
    }
  }
  // get_tile: every tile index of random schedules (heads_per_chunk beyond num_bh included).
  for (int i = 0; i < 3000; ++i) {
    int const nb = 1 + int(g() % 70), heads = 1 + int(g() % 24), batch = 1 + int(g() % 9), num_bh = heads * batch;
    int const hpc = 1 + int(g() % (num_bh + 4));
    TileOrder const order = TileOrder(g() % 3);
    TileSchedule const s = make_tile_schedule(nb, num_bh, heads, hpc, nb * num_bh, order);
    std::vector<char> seen(size_t(nb) * num_bh, 0);
    for (int lin = 0; lin < nb * num_bh; ++lin) {
      TileCoord const a = get_tile(lin, s), r = reference_tile(lin, nb, num_bh, heads, hpc, order);
      ++checks;
      bool const in_range = a.m_block >= 0 && a.m_block < nb && a.h >= 0 && a.h < heads && a.b >= 0 && a.b < batch;
      if (!in_range || a.m_block != r.m_block || a.h != r.h || a.b != r.b) { ++mismatches; continue; }
      char& c = seen[(size_t(a.b) * heads + a.h) * nb + a.m_block];
      if (c++) ++mismatches;  // two indices, one tile
    }
  }
  // split_piece: a tail of fewer tiles than CTAs (launch_bwd's condition), every step covered once.
  for (int i = 0; i < 20000; ++i) {
    int const ctas = 1 + int(g() % 264), tiles = 1 + int(g() % ctas), tu = 2 + int(g() % (i & 1 ? 40 : 400));
    if (tiles >= ctas) continue;
    SplitDeal const d = make_split_deal(tiles, tu, ctas);
    std::vector<int> covered(size_t(tiles) * tu, 0);
    for (int c = 0; c < ctas; ++c)
      for (int k = 0; k < 3; ++k) {
        SplitPiece const pc = split_piece(d, c, k);
        if (pc.s1 <= pc.s0) continue;
        ++checks;
        if (k == 2 || pc.tile < 0 || pc.tile >= tiles || pc.s0 < 0 || pc.s1 > tu) { ++mismatches; continue; }
        for (int s = pc.s0; s < pc.s1; ++s) covered[size_t(pc.tile) * tu + s]++;
      }
    for (int v : covered) mismatches += v != 1;
  }
  std::printf("%ld checks, %ld mismatches\n", checks, mismatches);
  return mismatches != 0;
}
