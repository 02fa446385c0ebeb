// Host side of timeline.h, for the harnesses' --timeline: reads back the recorded marks and
// prints, per step of each consumer warpgroup of CTA 0, the cycles between consecutive marks.
#pragma once

#include <cstring>
#include <vector>

#include "../common/harness_util.h"
#include "timeline.h"

namespace jax_flash::sm90 {

constexpr size_t kTimelineBytes = 2 * kTimelineSteps * kTimelineMarks * sizeof(uint32_t);

// intervals: the names of the kTimelineMarks - 1 spans between consecutive marks.
inline void print_timeline(uint32_t const* dbuf, char const* title, char const* const (&intervals)[kTimelineMarks - 1]) {
  std::vector<uint32_t> t(kTimelineBytes / sizeof(uint32_t));
  CK(cudaMemcpy(t.data(), dbuf, kTimelineBytes, cudaMemcpyDeviceToHost));
  printf("%s (cycles; start offsets relative to WG0 step 0)\n  wg step |  start |", title);
  for (char const* name : intervals) printf(" %s |", name);
  printf(" step\n");
  uint32_t const t0 = t[0];
  for (int wg = 0; wg < 2; ++wg)
    for (int i = 0; i < kTimelineSteps; ++i) {
      uint32_t const* m = &t[(wg * kTimelineSteps + i) * kTimelineMarks];
      uint32_t const* n = m + kTimelineMarks;
      if (m[0] == 0 && m[kTimelineMarks - 1] == 0) break;
      bool const has_next = i + 1 < kTimelineSteps && !(n[0] == 0 && n[kTimelineMarks - 1] == 0);
      printf("  %2d %4d | %6d |", wg, i, int(m[0] - t0));
      for (int k = 0; k + 1 < kTimelineMarks; ++k) printf(" %*u |", int(strlen(intervals[k])), m[k + 1] - m[k]);
      printf(" %5d\n", has_next ? int(n[0] - m[0]) : -1);
    }
}

}  // namespace jax_flash::sm90
