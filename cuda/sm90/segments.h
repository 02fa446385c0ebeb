// Packed sequences (segment ids) in the sm90 kernels. A pre-pass gives each 64-row chunk of one
// side (queries in the forward, keys in the backward) two ranges on the other side: `visible`,
// the indices whose segment id lies within the chunk's id range (a superset of what any of its
// rows sees: only blocks meeting it are loaded), and `full`, the indices every row of the chunk
// sees by the segment rule (set only when the chunk has one id and the other side's indices
// with that id are contiguous: blocks inside it skip the element test). Packed sequences have
// sorted ids, so a chunk's blocks are its diagonal band; unsorted ids stay correct (every block
// is tested element by element) and only lose the skipping.
#pragma once

#include <cuda_runtime.h>

#include "../common/flash_params.h"
#include "../common/mask.h"
#include "utils.h"

namespace jax_flash::sm90 {

constexpr int kSegChunkRows = 64;

struct SegRange {
  int visible_lo, visible_hi, full_lo, full_hi;  // [lo, hi) on the other side; empty when hi <= lo
};

// One side's ids against the other's: the forward's chunks are query rows (ranges of keys),
// the backward's are keys (ranges of query rows).
struct SegSides {
  int32_t const* own;  // this side's ids, [batch, own_len]
  int64_t own_batch_stride;
  int own_len;
  int32_t const* other;
  int64_t other_batch_stride;
  int other_len;
  int4* ranges;  // [batch][seg_chunks(own_len)]
};
inline SegSides query_chunk_sides(FlashFwdParams const& p) {  // the forward's
  return {p.q_segment_ids, p.q_seg_batch_stride, p.seqlen_q, p.kv_segment_ids, p.kv_seg_batch_stride, p.seqlen_k,
          reinterpret_cast<int4*>(p.tile_counter + 4)};
}
inline SegSides key_chunk_sides(FlashFwdParams const& p) {  // the backward's
  return {p.kv_segment_ids, p.kv_seg_batch_stride, p.seqlen_k, p.q_segment_ids, p.q_seg_batch_stride, p.seqlen_q,
          reinterpret_cast<int4*>(p.tile_counter + 4)};
}

// After the tile counter in the workspace (workspace_ints, flash_params.h).
__forceinline__ __device__ SegRange load_seg_range(FlashFwdParams const& p, int own_len, int b, int chunk) {
  int4 const r = reinterpret_cast<int4 const*>(p.tile_counter + 4)[int64_t(b) * seg_chunks(own_len) + chunk];
  return {r.x, r.y, r.z, r.w};
}

// One CTA per (chunk, batch): the chunk's id range [lo, hi], then one pass over the other side.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) segment_ranges_kernel(SegSides s) {
  __shared__ int lo_s, hi_s, first, last, count;
  int const chunk = blockIdx.x, b = blockIdx.y;
  int const r0 = chunk * kSegChunkRows;
  int const r1 = min(r0 + kSegChunkRows, s.own_len);
  int32_t const* own = s.own + b * s.own_batch_stride;
  int32_t const* other = s.other + b * s.other_batch_stride;
  if (threadIdx.x == 0) {
    lo_s = INT_MAX, hi_s = INT_MIN, first = INT_MAX, last = -1, count = 0;
  }
  __syncthreads();
  if (r0 + int(threadIdx.x) < r1) {
    int const id = own[r0 + threadIdx.x];
    atomicMin(&lo_s, id);
    atomicMax(&hi_s, id);
  }
  __syncthreads();
  int const lo = lo_s, hi = hi_s;
  int my_first = INT_MAX, my_last = -1, my_count = 0;
  for (int j = threadIdx.x; j < s.other_len; j += kThreads) {
    int const id = other[j];
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
    s.ranges[int64_t(b) * gridDim.x + chunk] = r;
  }
}

inline cudaError_t compute_segment_ranges(SegSides const& s, int batch, cudaStream_t stream) {
  constexpr int kThreads = 256;
  static_assert(kThreads >= kSegChunkRows, "one thread per chunk row");
  segment_ranges_kernel<kThreads><<<dim3(unsigned(seg_chunks(s.own_len)), unsigned(batch)), kThreads, 0, stream>>>(s);
  return cudaGetLastError();
}

// [full_lo, full_hi) narrowed to the other side's indices that every row of one side's chunk
// sees by segment (a chunk past own_len, as the padding rows of a tile: none).
__forceinline__ __device__ void narrow_full_to_segment(FlashFwdParams const& p, int own_len, int b, int chunk,
                                                       int& full_lo, int& full_hi) {
  SegRange const r = chunk < int(seg_chunks(own_len)) ? load_seg_range(p, own_len, b, chunk) : SegRange{0, 0, 0, 0};
  full_lo = max(full_lo, r.full_lo);
  full_hi = min(full_hi, r.full_hi);
}

// The union [lo, hi) of the visible ranges of one side's chunks [c0, c0 + n) (those that
// exist); hi <= lo: none.
__forceinline__ __device__ void visible_union(FlashFwdParams const& p, int own_len, int b, int c0, int n, int& lo,
                                              int& hi) {
  lo = INT_MAX, hi = 0;
  int const chunks = int(seg_chunks(own_len));
  for (int c = c0; c < c0 + n && c < chunks; ++c) {
    SegRange const r = load_seg_range(p, own_len, b, c);
    if (r.visible_hi > r.visible_lo) lo = min(lo, r.visible_lo), hi = max(hi, r.visible_hi);
  }
}

// Block range [first, end) (blocks of kBlock) narrowed to the indices [lo, hi); empty when
// hi <= lo.
template <int kBlock>
__forceinline__ __device__ void narrow_blocks(int lo, int hi, int& first, int& end) {
  if (hi <= lo) {
    first = end = 0;
    return;
  }
  first = max(first, lo / kBlock);
  end = max(first, min(end, (hi + kBlock - 1) / kBlock));
}

// Forward: a tile's key blocks [n_min, n_max), narrowed to its query chunks' visible keys.
template <int kBlockM, int kBlockN>
__forceinline__ __device__ void narrow_to_segments(FlashFwdParams const& p, int b, int m_block, int& n_min,
                                                   int& n_max) {
  static_assert(kBlockM % kSegChunkRows == 0, "tiles are whole chunks");
  int lo, hi;
  visible_union(p, p.seqlen_q, b, m_block * (kBlockM / kSegChunkRows), kBlockM / kSegChunkRows, lo, hi);
  narrow_blocks<kBlockN>(lo, hi, n_min, n_max);
}

// Backward: a key block's query row blocks [m_min, m_min + nm), narrowed to its key chunks'
// visible rows.
template <int kBlockM, int kBlockN>
__forceinline__ __device__ void narrow_rows_to_segments(FlashFwdParams const& p, int b, int n_block, int& m_min,
                                                        int& nm) {
  static_assert(kBlockN % kSegChunkRows == 0, "key blocks are whole chunks");
  int lo, hi, m_end = m_min + nm;
  visible_union(p, p.seqlen_k, b, n_block * (kBlockN / kSegChunkRows), kBlockN / kSegChunkRows, lo, hi);
  narrow_blocks<kBlockM>(lo, hi, m_min, m_end);
  nm = m_end - m_min;
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
