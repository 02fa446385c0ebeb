// Diagnostic, off by default: clock() marks at the sync points of every consumer step, to see
// where a step's time goes (softmax vs. waits for the other warpgroup or for data). Forward:
// compiled in only with -DJF_FWD_TIMELINE (harness: EXTRA_FLAGS=-DJF_FWD_TIMELINE
// cuda/sm90/build_harness.sh fwd, then test_sm90 --timeline ...). Backward: -DJF_BWD_TIMELINE
// (build_harness.sh bwd, then test_bwd_sm90 --timeline ...; BwdMark names its marks). Without
// the macro every call below is empty and the kernel params' timeline stays nullptr.
#pragma once

#include <cstdint>

namespace jax_flash::sm90 {

constexpr int kTimelineSteps = 128;  // steps recorded per consumer warpgroup
constexpr int kTimelineMarks = 7;    // room per step: StepTimelineT::Mark (forward, 6), BwdMark (backward, 7)
// Host side: a device buffer of 2 * kTimelineSteps * kTimelineMarks uint32, or nullptr.
// Thread 0 of each consumer warpgroup of CTA 0 writes [wg][step][mark] of its first
// kTimelineSteps steps, counted across its tiles (each launch writes from step 0 again).
#ifdef JF_FWD_TIMELINE
extern uint32_t* g_fwd_timeline;
inline uint32_t* fwd_timeline_buffer() { return g_fwd_timeline; }
#else
inline uint32_t* fwd_timeline_buffer() { return nullptr; }
#endif
#ifdef JF_BWD_TIMELINE
extern uint32_t* g_bwd_timeline;
inline uint32_t* bwd_timeline_buffer() { return g_bwd_timeline; }
#else
inline uint32_t* bwd_timeline_buffer() { return nullptr; }
#endif

// Backward step marks: step start, the step's operands landed (by role: Q for WG 0, dO for WG 1;
// key split: Q, then S^T issued, then dO), S^T / dP^T issued (by role: complete), P and dS formed,
// dS shared (after the WG barrier; dV issued before it, and dK too in the head-dim split), the dQ
// GEMM complete (key split: dK still running; head-dim split: every GEMM), step end (key split:
// dQ handed to the writer warp and dK complete; head-dim split: dQ reduce issued).
enum BwdMark { kBwdStart, kBwdLanded, kBwdIssued, kBwdPdS, kBwdShared, kBwdDQDone, kBwdEnd };
static_assert(kBwdEnd < kTimelineMarks);

// kEnabled = false: every call is empty and the members are never touched (same SASS as no
// timeline at all).
template <bool kEnabled>
struct StepTimelineT {
  // Forward marks: step start, QK^T issued (after the ping-pong barrier), both GEMMs issued,
  // S ready, softmax done, step end (PV done, P converted, O rescaled).
  enum Mark { kStart, kIssueQK, kIssued, kSReady, kSoftmax, kEnd };
  uint32_t* out = nullptr;
  uint32_t t[kTimelineMarks];
  int step = 0;
  __device__ void init(uint32_t* buf, int wg, bool on) {
    if constexpr (kEnabled) {
      out = buf && on ? buf + wg * kTimelineSteps * kTimelineMarks : nullptr;
      step = 0;
      for (int i = 0; i < kTimelineMarks; ++i) t[i] = 0;  // (the forward uses 6 of the 7)
    }
  }
  // Every thread reads the clock (no divergent branch between wgmma issue and wait); only the
  // recording thread stores, once per step, after the step's GEMMs have completed.
  __device__ void mark(int m) {
    if constexpr (kEnabled) t[m] = uint32_t(clock());
  }
  __device__ void end_step() {
    if constexpr (kEnabled) {
      if (out && step < kTimelineSteps)
        for (int i = 0; i < kTimelineMarks; ++i) out[step * kTimelineMarks + i] = t[i];
      ++step;
    }
  }
};
// Forward, per tile (same builds): kMarks values per tile of one recorder of CTA 0, stored for
// the first kTileTimelineTiles tiles at buf[offset + tile * kMarks + mark] (clock() marks or set()).
constexpr int kTileTimelineTiles = 64;
template <bool kEnabled, int kMarks>
struct TileRecordT {
  uint32_t* out = nullptr;
  uint32_t t[kMarks];
  int tile = 0;
  __device__ void init(uint32_t* buf, int offset, bool on) {
    if constexpr (kEnabled) {
      out = buf && on ? buf + offset : nullptr;
      for (int i = 0; i < kMarks; ++i) t[i] = 0;  // a mark another lane takes stays 0 here
    }
  }
  __device__ void mark(int m) {
    if constexpr (kEnabled) t[m] = uint32_t(clock());
  }
  __device__ void set(int m, int v) {
    if constexpr (kEnabled) t[m] = uint32_t(v);
  }
  __device__ void end_tile() {
    if constexpr (kEnabled) {
      if (out && tile < kTileTimelineTiles)
        for (int i = 0; i < kMarks; ++i) out[tile * kMarks + i] = t[i];
      ++tile;
    }
  }
};
// A consumer WG, between its tiles' steps: tile known, Q landed, first S ready, last PV done,
// O stored, next tile handed over; then the tile's key-block count. After the step region of
// the buffer, [wg][tile][mark].
constexpr int kTileMarks = 7;
enum TileMark { kTileStart, kTileQReady, kTileFirstS, kTileLoopEnd, kTileStored, kTileHandoff, kTileSteps };
constexpr int tile_timeline_offset(int wg) { return 2 * kTimelineSteps * kTimelineMarks + wg * kTileTimelineTiles * kTileMarks; }
// The producer: when it starts the round, when it may overwrite Q (after the Q-empty barrier:
// Q's load goes out), when the tile's first K and V are issued, when all its loads are issued.
// Same clock as the consumers' marks (one SM). After the consumers' region, [tile][mark].
constexpr int kProdMarks = 4;
enum ProdMark { kProdTop, kProdQIssue, kProdFirstKV, kProdAllIssued };
constexpr int kProducerTimelineOffset = tile_timeline_offset(2);
// Where a forward tile's kTileStart mark sits (diagnostic builds): 0 at the top of the tile loop,
// 1 after the tile's coordinates and key-block range, 2 right before the Q wait ("wait Q" then
// times the wait alone; NOTES.md v59).
#ifndef JF_FWD_TL_START
#define JF_FWD_TL_START 0
#endif
#ifdef JF_FWD_TIMELINE
using StepTimeline = StepTimelineT<true>;
using TileTimeline = TileRecordT<true, kTileMarks>;
using ProducerTimeline = TileRecordT<true, kProdMarks>;
#else
using StepTimeline = StepTimelineT<false>;
using TileTimeline = TileRecordT<false, kTileMarks>;
using ProducerTimeline = TileRecordT<false, kProdMarks>;
#endif
// Backward, per tile (same regions as the forward's tile records): a consumer WG's tile known,
// K / V landed, steps done (K / V released), dK / dV stored (the next tile may write the epilogue
// buffers), then the tile's step count; the producer's round top, K / V free (previous tile's
// consumers released them), K / V issued, first Q / dO issued.
enum BwdTileMark { kBTileStart, kBTileKVReady, kBTileLoopEnd, kBTileStored, kBTileSteps, kBTileMarks };
enum BwdProdMark { kBProdTop, kBProdKVFree, kBProdKVIssued, kBProdQIssued, kBProdMarks };
static_assert(kBTileMarks <= kTileMarks && kBProdMarks <= kProdMarks, "backward tile records fit the forward's regions");
#ifdef JF_BWD_TIMELINE
using BwdStepTimeline = StepTimelineT<true>;
using BwdTileTimeline = TileRecordT<true, kTileMarks>;
using BwdProducerTimeline = TileRecordT<true, kProdMarks>;
#else
using BwdStepTimeline = StepTimelineT<false>;
using BwdTileTimeline = TileRecordT<false, kTileMarks>;
using BwdProducerTimeline = TileRecordT<false, kProdMarks>;
#endif

}  // namespace jax_flash::sm90
