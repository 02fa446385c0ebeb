// Host side of timeline.h, for the harnesses' --timeline: reads back the recorded marks and
// prints, per step of each consumer warpgroup of CTA 0, the cycles between consecutive marks.
#pragma once

#include <cstring>
#include <vector>

#include "../common/harness_util.h"
#include "timeline.h"

namespace jax_flash::sm90 {

constexpr size_t kTimelineBytes =
    (kProducerTimelineOffset + kTileTimelineTiles * kProdMarks) * sizeof(uint32_t);

// The whole timeline buffer, copied to the host.
inline std::vector<uint32_t> read_timeline(uint32_t const* dbuf) {
  std::vector<uint32_t> t(kTimelineBytes / sizeof(uint32_t));
  CK(cudaMemcpy(t.data(), dbuf, kTimelineBytes, cudaMemcpyDeviceToHost));
  return t;
}

// intervals: the names of the N spans between consecutive marks 0..N (N < kTimelineMarks).
template <int N>
inline void print_timeline(uint32_t const* dbuf, char const* title, char const* const (&intervals)[N]) {
  static_assert(N < kTimelineMarks);
  std::vector<uint32_t> const t = read_timeline(dbuf);
  printf("%s (cycles; start offsets relative to WG0 step 0)\n  wg step |  start |", title);
  for (char const* name : intervals) printf(" %s |", name);
  printf(" step\n");
  uint32_t const t0 = t[0];
  for (int wg = 0; wg < 2; ++wg)
    for (int i = 0; i < kTimelineSteps; ++i) {
      uint32_t const* m = &t[(wg * kTimelineSteps + i) * kTimelineMarks];
      uint32_t const* n = m + kTimelineMarks;
      if (m[0] == 0 && m[N] == 0) break;
      bool const has_next = i + 1 < kTimelineSteps && !(n[0] == 0 && n[N] == 0);
      printf("  %2d %4d | %6d |", wg, i, int(m[0] - t0));
      for (int k = 0; k < N; ++k) printf(" %*u |", int(strlen(intervals[k])), m[k + 1] - m[k]);
      printf(" %5d\n", has_next ? int(n[0] - m[0]) : -1);
    }
}

// Forward only: per tile of each consumer WG of CTA 0, the cycles between the TileMark marks,
// then the mean over the recorded tiles (the spans a tile spends outside its steady-state steps).
inline void print_tile_timeline(uint32_t const* dbuf, char const* title) {
  std::vector<uint32_t> const t = read_timeline(dbuf);
  uint32_t const* base = t.data() + tile_timeline_offset(0);
  printf("%s, per tile (cycles)\n  wg tile |  start | wait Q | first S | steps loop | epilogue | handoff | blocks | loop/block\n", title);
  uint32_t const t0 = base[0];
  for (int wg = 0; wg < 2; ++wg) {
    double sum[6] = {0, 0, 0, 0, 0, 0};
    int n = 0;
    for (int i = 0; i < kTileTimelineTiles; ++i) {
      uint32_t const* m = base + (wg * kTileTimelineTiles + i) * kTileMarks;
      if (m[kTileStart] == 0 && m[kTileHandoff] == 0) break;
      uint32_t d[5];
      for (int k = 0; k < 5; ++k) d[k] = m[k + 1] - m[k];
      int const blocks = int(m[kTileSteps]);
      if (i < 12) printf("  %2d %4d | %6d | %6u | %7u | %10u | %8u | %7u | %6d | %8.0f\n", wg, i, int(m[0] - t0), d[0], d[1], d[2],
                         d[3], d[4], blocks, blocks > 1 ? double(d[2]) / (blocks - 1) : 0.0);
      for (int k = 0; k < 5; ++k) sum[k] += d[k];
      sum[5] += blocks;
      ++n;
    }
    if (n)
      printf("  %2d mean over %d tiles: wait Q %.0f, first S %.0f, loop %.0f, epilogue %.0f, handoff %.0f, blocks %.1f\n", wg, n,
             sum[0] / n, sum[1] / n, sum[2] / n, sum[3] / n, sum[4] / n, sum[5] / n);
  }
  // The producer's marks of the same tiles, relative to WG 0's tile start (negative = before it).
  uint32_t const* prod = t.data() + kProducerTimelineOffset;
  printf("  producer vs WG0 tile start (cycles) | round top | Q issued | first K+V issued | all issued | Q landed\n");
  double psum[5] = {0, 0, 0, 0, 0};
  int pn = 0;
  for (int i = 0; i < kTileTimelineTiles; ++i) {
    uint32_t const* m = base + i * kTileMarks;
    uint32_t const* pm = prod + i * kProdMarks;
    if ((m[kTileStart] == 0 && m[kTileHandoff] == 0) || pm[kProdTop] == 0) break;
    int d[5];
    for (int k = 0; k < kProdMarks; ++k) d[k] = int(pm[k] - m[kTileStart]);
    d[4] = int(m[kTileQReady] - m[kTileStart]);
    if (i < 12) printf("  tile %4d | %9d | %8d | %16d | %10d | %8d\n", i, d[0], d[1], d[2], d[3], d[4]);
    if (i > 0)  // the first tile has no previous tile to overlap
      for (int k = 0; k < 5; ++k) psum[k] += d[k];
    pn += i > 0;
  }
  if (pn)
    printf("  mean over tiles 1..%d: round top %.0f, Q issued %.0f, first K+V %.0f, all issued %.0f, Q landed %.0f\n", pn,
           psum[0] / pn, psum[1] / pn, psum[2] / pn, psum[3] / pn, psum[4] / pn);
}

// Backward only: per tile of each consumer WG of CTA 0, the cycles from the tile known to K / V
// landed, the steps, the epilogue, and on to the next tile; then the producer's K / V issue
// against the consumers' release. Means skip tile 0 (no previous tile to overlap).
inline void print_bwd_tile_timeline(uint32_t const* dbuf, char const* title) {
  std::vector<uint32_t> const t = read_timeline(dbuf);
  uint32_t const* c0 = t.data() + tile_timeline_offset(0);
  uint32_t const* prod = t.data() + kProducerTimelineOffset;
  printf("%s, per tile (cycles)\n  wg tile |   start | wait K/V | steps loop | per step | epilogue | to next | steps\n", title);
  auto rec = [&](int wg, int i) { return t.data() + tile_timeline_offset(wg) + i * kTileMarks; };
  auto valid = [&](uint32_t const* m) { return m[kBTileStart] != 0 && m[kBTileStored] != 0; };
  uint32_t const t0 = c0[kBTileStart];
  for (int wg = 0; wg < 2; ++wg) {
    double sum[4] = {0, 0, 0, 0}, steps = 0;
    int n = 0;
    for (int i = 0; i < kTileTimelineTiles && valid(rec(wg, i)); ++i) {
      uint32_t const* m = rec(wg, i);
      bool const has_next = i + 1 < kTileTimelineTiles && valid(rec(wg, i + 1));
      int const n_steps = int(m[kBTileSteps]);
      uint32_t const kv = m[kBTileKVReady] - m[kBTileStart], loop = m[kBTileLoopEnd] - m[kBTileKVReady];
      uint32_t const epi = m[kBTileStored] - m[kBTileLoopEnd];
      int const next = has_next ? int(rec(wg, i + 1)[kBTileStart] - m[kBTileStored]) : -1;
      if (i < 10)
        printf("  %2d %4d | %7d | %8u | %10u | %8.0f | %8u | %7d | %5d\n", wg, i, int(m[kBTileStart] - t0), kv, loop,
               n_steps ? double(loop) / n_steps : 0.0, epi, next, n_steps);
      // Every launch of a bench loop rewrites records 0.. of its own tiles: where a later launch ran
      // fewer tiles on CTA 0 (dynamic schedule), record i + 1 can be an earlier launch's (negative
      // span): such tiles stay out of the means, as do tiles without steps (their K/V and loop
      // marks are the previous tile's).
      if (i > 0 && has_next && next >= 0 && n_steps > 0) {
        sum[0] += kv, sum[1] += loop, sum[2] += epi, sum[3] += next, steps += n_steps;
        ++n;
      }
    }
    if (n)
      printf("  %2d mean over %d tiles: wait K/V %.0f, loop %.0f (%.0f per step, %.1f steps), epilogue %.0f, to next %.0f\n", wg,
             n, sum[0] / n, sum[1] / n, steps ? sum[1] / steps : 0.0, steps / n, sum[2] / n, sum[3] / n);
  }
  // The producer, relative to the tile's WG 0 start; K / V free relative to the previous tile's
  // later WG loop end (the release).
  printf("  producer vs WG0 tile start | round top | K/V free | K/V issued | first Q issued | K/V free - release\n");
  double ps[5] = {0, 0, 0, 0, 0};
  int pn = 0;
  for (int i = 1; i < kTileTimelineTiles && valid(rec(0, i)) && valid(rec(1, i)); ++i) {
    uint32_t const* pm = prod + i * kProdMarks;
    if (pm[kBProdTop] == 0) break;
    uint32_t const s0 = rec(0, i)[kBTileStart];
    uint32_t const rel = int(rec(0, i - 1)[kBTileLoopEnd] - rec(1, i - 1)[kBTileLoopEnd]) > 0 ? rec(0, i - 1)[kBTileLoopEnd]
                                                                                                : rec(1, i - 1)[kBTileLoopEnd];
    int const d[5] = {int(pm[kBProdTop] - s0), int(pm[kBProdKVFree] - s0), int(pm[kBProdKVIssued] - s0),
                      int(pm[kBProdQIssued] - s0), int(pm[kBProdKVFree] - rel)};
    if (i < 10) printf("  tile %4d | %9d | %8d | %10d | %14d | %18d\n", i, d[0], d[1], d[2], d[3], d[4]);
    if (d[4] < 0) continue;  // record i - 1 from another launch (see above)
    for (int k = 0; k < 5; ++k) ps[k] += d[k];
    ++pn;
  }
  if (pn)
    printf("  mean over %d tiles: round top %.0f, K/V free %.0f, K/V issued %.0f, first Q issued %.0f, free - release %.0f\n", pn,
           ps[0] / pn, ps[1] / pn, ps[2] / pn, ps[3] / pn, ps[4] / pn);
}

}  // namespace jax_flash::sm90
