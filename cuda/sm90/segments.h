// Packed sequences (segment ids) in the sm90 forward. A pre-pass gives each 64-row chunk of
// queries two key ranges: `visible`, the keys whose segment id lies within the chunk's id range
// (a superset of the keys any of its rows sees: only key blocks meeting it are loaded), and
// `full`, the keys every row of the chunk sees by the segment rule (set only when the chunk has
// one id and the keys with that id are contiguous: blocks inside it skip the element test).
// Packed sequences have sorted ids, so a chunk's blocks are its diagonal band; unsorted ids
// stay correct (every block is tested element by element) and only lose the skipping.
#pragma once

#include <cuda_runtime.h>

#include "../common/flash_params.h"
#include "utils.h"

namespace jax_flash::sm90 {

constexpr int kSegChunkRows = 64;

struct SegRange {
  int visible_lo, visible_hi, full_lo, full_hi;  // key indices, [lo, hi); empty when hi <= lo
};

// After the tile counter in the forward's workspace (fwd_workspace_ints, flash_params.h).
__forceinline__ __device__ __host__ int4* seg_ranges(FlashFwdParams const& p) {
  return reinterpret_cast<int4*>(p.tile_counter + 4);
}

__forceinline__ __device__ SegRange load_seg_range(FlashFwdParams const& p, int b, int chunk) {
  int4 const r = seg_ranges(p)[int64_t(b) * seg_chunks(p.seqlen_q) + chunk];
  return {r.x, r.y, r.z, r.w};
}

// One CTA per (chunk, batch): the chunk's id range [qlo, qhi], then one pass over the keys.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) segment_ranges_kernel(FlashFwdParams p) {
  __shared__ int qlo, qhi, first, last, count;
  int const chunk = blockIdx.x, b = blockIdx.y;
  int const r0 = chunk * kSegChunkRows;
  int const r1 = min(r0 + kSegChunkRows, p.seqlen_q);
  int32_t const* q_seg = p.q_segment_ids + b * p.q_seg_batch_stride;
  int32_t const* kv_seg = p.kv_segment_ids + b * p.kv_seg_batch_stride;
  if (threadIdx.x == 0) {
    qlo = INT_MAX, qhi = INT_MIN, first = INT_MAX, last = -1, count = 0;
  }
  __syncthreads();
  if (r0 + int(threadIdx.x) < r1) {
    int const id = q_seg[r0 + threadIdx.x];
    atomicMin(&qlo, id);
    atomicMax(&qhi, id);
  }
  __syncthreads();
  int const lo = qlo, hi = qhi;
  int my_first = INT_MAX, my_last = -1, my_count = 0;
  for (int j = threadIdx.x; j < p.seqlen_k; j += kThreads) {
    int const id = kv_seg[j];
    if (lo <= id && id <= hi) {
      my_first = min(my_first, j);
      my_last = max(my_last, j);
      ++my_count;
    }
  }
  if (my_count) {
    atomicMin(&first, my_first);
    atomicMax(&last, my_last);
    atomicAdd(&count, my_count);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int4 r = make_int4(0, 0, 0, 0);
    if (count > 0) {
      r.x = first, r.y = last + 1;
      if (lo == hi && count == last + 1 - first) r.z = first, r.w = last + 1;
    }
    seg_ranges(p)[int64_t(b) * gridDim.x + chunk] = r;
  }
}

inline cudaError_t compute_segment_ranges(FlashFwdParams const& p, cudaStream_t stream) {
  constexpr int kThreads = 256;
  static_assert(kThreads >= kSegChunkRows, "one thread per chunk row");
  segment_ranges_kernel<kThreads><<<dim3(unsigned(seg_chunks(p.seqlen_q)), unsigned(p.batch)), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// Narrows a tile's key blocks [n_min, n_max) to those meeting its chunks' visible ranges.
template <int kBlockM, int kBlockN>
__forceinline__ __device__ void narrow_to_segments(FlashFwdParams const& p, int b, int m_block, int& n_min,
                                                   int& n_max) {
  static_assert(kBlockM % kSegChunkRows == 0, "tiles are whole chunks");
  int lo = INT_MAX, hi = 0;
  int const c0 = m_block * (kBlockM / kSegChunkRows);
  int const chunks = int(seg_chunks(p.seqlen_q));
  for (int c = c0; c < c0 + kBlockM / kSegChunkRows && c < chunks; ++c) {
    SegRange const r = load_seg_range(p, b, c);
    if (r.visible_hi > r.visible_lo) lo = min(lo, r.visible_lo), hi = max(hi, r.visible_hi);
  }
  if (hi <= lo) {
    n_min = n_max = 0;
    return;
  }
  n_min = max(n_min, lo / kBlockN);
  n_max = min(n_max, (hi + kBlockN - 1) / kBlockN);
  if (n_max < n_min) n_max = n_min;
}

// The segment rule for one thread's two accumulator rows: the key ids and the rows' ids.
struct SegRows {
  int32_t const* kv_seg = nullptr;  // this batch's key ids
  int seqlen_k = 0;
  int id[2] = {0, 0};  // the ids of the thread's two accumulator rows
};

// -inf where a key's segment differs from its row's. s / c: (rows, cols) views of the S
// accumulator and its coordinates; n0: the tile's first key. Columns are the thread's base
// column plus compile-time offsets, as in mask_tile (no hoisted column registers).
template <class TS, class TC>
__forceinline__ __device__ void mask_tile_segments(TS& s, TC const& c, SegRows const& seg, int n0) {
  static_assert(decltype(size<0>(s))::value == 2, "two rows per thread");
  int const col0 = n0 + int(get<1>(c(0, 0)));
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<1>(s); ++k) {
    int const dj = int(get<1>(c.layout()(0, k))) - int(get<1>(c.layout()(0, 0)));
    int const j = min(col0 + dj, seg.seqlen_k - 1);  // keys past seqlen_k are masked already
    int const id = __ldg(seg.kv_seg + j);
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 2; ++r)
      if (id != seg.id[r]) s(r, k) = -INFINITY;
  }
}

}  // namespace jax_flash::sm90
