// The one seam between the XLA FFI handlers and every attention kernel (CPU, sm80, sm90).
// Handlers fill it from buffers and attributes; kernels read nothing else. Plain data only,
// so the same struct is passed by value to CUDA kernels.
//
// Tensor layouts (all row-major, last dimension contiguous):
//   q, o, do, dq : [batch, seqlen_q, heads_q,  head_dim]
//   k, v, dk, dv : [batch, seqlen_k, heads_kv, head_dim]
//   lse          : [batch, heads_q, seqlen_q]   (float32)
//   dsum, lse_log2 (backward workspaces): [batch, heads_q, seqlen_q_rounded] (float32)
//   optional: q/kv segment ids int32 [batch, seqlen]; bias / mask / dbias broadcastable to
//   [batch, heads_q, seqlen_q, seqlen_k] through their strides (see the end of FlashFwdParams);
//   dropout keys uint32 [batch, heads_q, 4]
// Strides are in elements and 64-bit so that batch*seqlen*heads*head_dim may pass 2^31.
#pragma once

#include <cfloat>
#include <cstdint>

#if defined(__CUDACC__)
#define JF_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JF_HOST_DEVICE inline
#endif

namespace jax_flash {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct FlashFwdParams {
  // --- inputs ---
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* q_lens = nullptr;   // [batch] valid query rows per batch; nullptr = seqlen_q
  const int32_t* kv_lens = nullptr;  // [batch] valid key rows per batch;   nullptr = seqlen_k
  // --- outputs ---
  void* o = nullptr;
  float* lse = nullptr;  // natural-log logsumexp of the scaled (softcapped) logits; -inf on empty rows

  // --- sizes ---
  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int heads_q = 0;
  int heads_kv = 0;  // heads_q % heads_kv == 0; q head h reads kv head h / (heads_q / heads_kv)
  int head_dim = 0;
  DType dtype = DType::kFloat32;  // of q, k, v, o (and do, dq, dk, dv in the backward)

  // --- strides (elements) ---
  int64_t q_batch_stride = 0, q_row_stride = 0, q_head_stride = 0;
  int64_t k_batch_stride = 0, k_row_stride = 0, k_head_stride = 0;
  int64_t v_batch_stride = 0, v_row_stride = 0, v_head_stride = 0;
  int64_t o_batch_stride = 0, o_row_stride = 0, o_head_stride = 0;

  // --- the attention function ---
  float scale = 1.f;    // logits = scale * q.k
  float softcap = 0.f;  // > 0: logits -> softcap * tanh(logits / softcap), before masking
  // Visibility of key j to query i (see mask.h): with d = i + q_offset_b - j,
  // visible iff j < kv_len_b, i < q_len_b, d <= window_left (if >= 0), -d <= window_right
  // (if >= 0). Causal is window_right = 0 and is folded in by the handler.
  int window_left = -1;   // -1 = unbounded
  int window_right = -1;  // -1 = unbounded
  bool causal = false;    // informational (already folded into window_right); kernels may specialise on it
  int64_t q_offset = 0;   // position of query row 0 relative to key row 0
  bool bottom_right = false;  // add (kv_len_b - q_len_b) to q_offset per batch (KV-cache alignment)

  // --- optional element-wise inputs, appended last; nullptr = off. Read by the CPU backend and
  // the sm80 kernels (their kExtras variants). The sm90 forward takes all of them (dropout alone),
  // the sm90 backward segment ids, bias / mask or dropout, one kind at a time (hopper_fwd_takes_extras,
  // hopper_bwd_takes_extras); the CUDA handlers route the other calls with any of them to sm80. ---
  // Packed sequences: key j is visible to query i only if their segment ids are equal.
  const int32_t* q_segment_ids = nullptr;   // [batch, seqlen_q]
  const int32_t* kv_segment_ids = nullptr;  // [batch, seqlen_k]; set iff q_segment_ids is
  int64_t q_seg_batch_stride = 0, kv_seg_batch_stride = 0;
  // Additive bias on the (softcapped) logits, logically [batch, heads_q, seqlen_q, seqlen_k];
  // a stride of 0 broadcasts that axis (the buffer is never expanded).
  const void* bias = nullptr;
  DType bias_dtype = DType::kFloat32;
  int64_t bias_batch_stride = 0, bias_head_stride = 0, bias_row_stride = 0, bias_col_stride = 0;
  // Boolean mask (one byte per element, nonzero = may attend), broadcast like the bias.
  const uint8_t* mask = nullptr;
  int64_t mask_batch_stride = 0, mask_head_stride = 0, mask_row_stride = 0, mask_col_stride = 0;

  // --- attention dropout, appended last (philox.h has the RNG and the counter layout);
  // dropout_keys == nullptr = off, and the kernels then make no RNG call. Element (b, h, i, j)
  // of the softmax P is kept iff its Philox word >= dropout_threshold; kept values are scaled by
  // dropout_scale. lse stays that of the undropped softmax. ---
  // [batch, heads_q, 4] uint32 per (batch, q head): Philox key (seed lo, seed hi), then the
  // batch and head counter coordinates. A table rather than one seed, so a vmapped call keeps
  // each example's own key and coordinates after its axis is folded into batch or heads, and
  // coordinates 0 share one mask across batch / heads (Flax's broadcast_dropout).
  const uint32_t* dropout_keys = nullptr;
  int64_t dropout_batch_stride = 0, dropout_head_stride = 0;
  float dropout_rate = 0.f;        // informational; in [0, 1)
  uint32_t dropout_threshold = 0;  // round(rate * 2^32), see dropout_threshold()
  float dropout_scale = 1.f;       // 1 / (1 - rate)

  // --- workspace, appended last: one int32 of device memory the sm90 forward may use as its
  // tile counter (dynamic persistent schedule; zeroed by the launch on the stream). nullptr =
  // static schedule only. The sm90 backward's dynamic schedule uses it when given, else its
  // first dQ turn counter (the FFI passes one to the backward only with segment ids, in the
  // workspace of their ranges). ---
  // With segment ids it must hold workspace_ints(batch, seqlen_q, true) ints (the backward's:
  // seqlen_k): the sm90 kernels keep their chunk ranges after the counter (sm90/segments.h).
  int32_t* tile_counter = nullptr;

  int64_t group() const { return heads_q / heads_kv; }
};

struct FlashBwdParams : FlashFwdParams {
  // --- extra inputs (o and lse above are read, not written) ---
  const void* dout = nullptr;  // [batch, seqlen_q, heads_q, head_dim], strides as o
  int64_t do_batch_stride = 0, do_row_stride = 0, do_head_stride = 0;
  // --- outputs ---
  void* dq = nullptr;  // strides as q
  void* dk = nullptr;  // strides as k
  void* dv = nullptr;  // strides as v
  int64_t dq_batch_stride = 0, dq_row_stride = 0, dq_head_stride = 0;
  int64_t dk_batch_stride = 0, dk_row_stride = 0, dk_head_stride = 0;
  int64_t dv_batch_stride = 0, dv_row_stride = 0, dv_head_stride = 0;
  // --- workspace, handed in by the FFI as extra outputs (never allocated by kernels) ---
  float* dsum = nullptr;      // [batch, heads_q, seqlen_q_rounded]: rowsum(dO * O)
  float* lse_log2 = nullptr;  // GPU only: [batch, heads_q, seqlen_q_rounded]: lse * log2(e), +inf on
                              // empty and padded rows (P = 0 there); 16B-aligned rows for TMA (sm90)
  int* dq_semaphore = nullptr;  // GPU only: [batch, heads_q, seqlen_q_rounded / 64] dQ turn counters
                                // of the deterministic sm90 backward (zeroed by its preprocess)
  float* dq_accum = nullptr;  // GPU only: fp32 dQ accumulator, layout [batch, heads_q, seqlen_q_rounded, head_dim_rounded]
  int seqlen_q_rounded = 0;
  int head_dim_rounded = 0;
  bool deterministic = false;  // GPU: no order-dependent float atomics
  // --- optional output: float32 gradient of the bias, with the bias's own (broadcast) shape
  // and strides (a broadcast axis has stride 0 in bias_*_stride and is summed over here).
  // The kernels add into it: the caller zeroes it (the FFI handler, once per call). ---
  float* dbias = nullptr;
  int64_t dbias_batch_stride = 0, dbias_head_stride = 0, dbias_row_stride = 0, dbias_col_stride = 0;
};

// Whether a call has any optional input (segment ids, bias, mask, dropout): the sm80 kernels run
// such calls on their kExtras variants; kernel='hopper' refuses them (cuda_handlers.cc).
JF_HOST_DEVICE bool has_extras(const FlashFwdParams& p) {
  return p.q_segment_ids != nullptr || p.bias != nullptr || p.mask != nullptr || p.dropout_keys != nullptr;
}

// The sm90 forward runs every optional input; dropout only alone (its own kernels; with segment
// ids, a bias or a mask it runs on the portable forward). Segment ids need the workspace for
// their key ranges (tile_counter, sized by workspace_ints over seqlen_q); a bias needs 1 / scale finite
// without softcap (the kernel adds bias / scale to the unscaled logits: scale 0 would give NaN).
JF_HOST_DEVICE bool hopper_fwd_takes_extras(const FlashFwdParams& p) {
  float const inv_scale = 1.f / p.scale;
  bool const bias_ok = p.bias == nullptr || p.softcap > 0.f || (inv_scale <= FLT_MAX && inv_scale >= -FLT_MAX);
  bool const dropout_ok = p.dropout_keys == nullptr || (p.q_segment_ids == nullptr && p.bias == nullptr && p.mask == nullptr);
  return dropout_ok && bias_ok && (p.q_segment_ids == nullptr || p.tile_counter != nullptr);
}

// Bytes of one bias element: float32, or bfloat16 / float16.
JF_HOST_DEVICE int bias_elem_bytes(const FlashFwdParams& p) { return p.bias_dtype == DType::kFloat32 ? 4 : 2; }

// Whether one [B, N, T, S]-broadcast operand (strides in elements) can be copied tile by tile by
// TMA: keys contiguous, rows neither broadcast nor misaligned (16-byte multiples), 16-byte base.
JF_HOST_DEVICE bool dense_operand_tma_ok(const void* base, int elem_bytes, int64_t batch_stride, int64_t head_stride,
                                         int64_t row_stride, int64_t col_stride) {
  auto ok16 = [&](int64_t s) { return s >= 0 && (s * elem_bytes) % 16 == 0 && s * elem_bytes < (int64_t(1) << 40); };
  return (reinterpret_cast<uintptr_t>(base) & 15) == 0 && col_stride == 1 && row_stride > 0 && ok16(row_stride) &&
         ok16(head_stride) && ok16(batch_stride);
}

// The Hopper forward stages bias / mask tiles in smem by TMA (cuda/sm90/dense_tma.h) at head dims
// <= 128 when every one given allows it; otherwise its Dense kernels load them element-wise.
JF_HOST_DEVICE bool dense_tiles_by_tma(const FlashFwdParams& p) {
  if (p.head_dim > 128 || (p.bias == nullptr && p.mask == nullptr)) return false;
  return (p.bias == nullptr || dense_operand_tma_ok(p.bias, bias_elem_bytes(p), p.bias_batch_stride, p.bias_head_stride,
                                                    p.bias_row_stride, p.bias_col_stride)) &&
         (p.mask == nullptr ||
          dense_operand_tma_ok(p.mask, 1, p.mask_batch_stride, p.mask_head_stride, p.mask_row_stride, p.mask_col_stride));
}

// The Hopper backward stages bias / mask tiles in smem by TMA at head dims 72..128 (its 128
// instantiation) where the forward could and a consumer WG's tile (64 keys x 64 rows) fits the
// 16 KB stage: a float32 bias alone, a 16-bit bias with or without a mask, or a mask.
JF_HOST_DEVICE bool dense_bwd_tiles_by_tma(const FlashBwdParams& p) {
  return p.head_dim > 64 && p.head_dim <= 128 && dense_tiles_by_tma(p) &&
         !(p.bias != nullptr && p.mask != nullptr && p.bias_dtype == DType::kFloat32);
}

// kernel='auto' on Hopper: where the Hopper forward runs a call it takes. A bias at head dims
// <= 64 loaded element-wise stays on the portable forward, which is faster there (session 16,
// S=8192 f32 bias [1,1,T,S]: Hopper 0.60-0.69x the portable forward at H=64; 1.13-1.49x at H=128,
// 1.35x at 256; a mask 1.32-3.23x everywhere; cuda/sm90/NOTES.md v47b).
JF_HOST_DEVICE bool hopper_fwd_preferred(const FlashFwdParams& p) {
  return hopper_fwd_takes_extras(p) && (p.bias == nullptr || p.head_dim > 64 || dense_tiles_by_tma(p));
}

// The sm90 kernels' int32 workspace (tile_counter): the tile counter, and with segment ids,
// after it padded to 16 bytes, one {visible_lo, visible_hi, full_lo, full_hi} range per (batch,
// 64-long chunk of the side that owns the ranges: queries in the forward, whose ranges are of
// keys; keys in the backward, ranges of query rows). chunked_len: that side's length.
// Python mirrors this (jax_flash/_primitives.py: _workspace_ints).
JF_HOST_DEVICE int64_t seg_chunks(int chunked_len) { return (int64_t(chunked_len) + 63) / 64; }
inline int64_t workspace_ints(int batch, int chunked_len, bool segment_ids) {
  return segment_ids ? 4 + 4 * int64_t(batch) * seg_chunks(chunked_len) : 1;
}

// The sm90 backward's split tail (sm90/flash_bwd_kernel_sm90.h, bwd_static_tile): without segment
// ids, its int32 workspace (tile_counter) holds, after 4 ints (the dynamic schedule's counter,
// padding), bwd_split_slots slots of kBwdSplitSlotInts: two step counts (padded to 16 bytes),
// then two consumer warpgroups' 16384 floats of dK / dV partial sums. A workspace sized for fewer
// slots is not passed on (no split). Python mirrors this (jax_flash/_primitives.py:
// _bwd_workspace_ints).
constexpr int64_t kBwdSplitSlotInts = 4 + 2 * 16384;
inline int64_t bwd_split_slots(int batch, int heads_kv, int seqlen_k) {
  int64_t const tiles = int64_t(batch) * heads_kv * ((int64_t(seqlen_k) + 63) / 64);  // >= any kernel's tiles
  return tiles <= 64 ? 0 : (tiles < 160 ? tiles : 160);
}
inline int64_t bwd_workspace_ints(int batch, int heads_kv, int seqlen_k, bool segment_ids) {
  if (segment_ids) return workspace_ints(batch, seqlen_k, true);
  int64_t const slots = bwd_split_slots(batch, heads_kv, seqlen_k);
  return slots > 0 ? 4 + slots * kBwdSplitSlotInts : 1;
}

// The sm90 backward runs segment ids, or a bias and / or a mask (with dbias; sm90/dense_bwd.h),
// or dropout, each alone and without softcap or the deterministic mode; segment ids given their
// workspace (tile_counter, sized by workspace_ints over seqlen_k). The other mixes run on the sm80
// kernels.
JF_HOST_DEVICE bool hopper_bwd_takes_extras(const FlashBwdParams& p) {
  bool const dense = p.bias != nullptr || p.mask != nullptr;
  bool const seg = p.q_segment_ids != nullptr;
  bool const drop = p.dropout_keys != nullptr;
  if (int(dense) + int(seg) + int(drop) > 1) return false;
  if (!dense && !seg && !drop) return true;
  return !p.deterministic && !(p.softcap > 0.f) && (!seg || p.tile_counter != nullptr);
}

// Shape of the GPU dQ accumulator workspace, [batch, heads_q, rows, cols] float32.
// Python mirrors this (jax_flash/_primitives.py) to size the FFI output buffer.
// Rows: a multiple of 128 with room for whole 64-, 128- and 80-row blocks (the sm90 H=128
// non-causal backward steps over 80 rows).
inline int64_t dq_accum_rows(int seqlen_q) { return ((int64_t(seqlen_q) + 79) / 80 * 80 + 127) / 128 * 128; }
inline int64_t dq_accum_cols(int head_dim) { return (int64_t(head_dim) + 63) / 64 * 64; }

// Offset of row 0 of (b, h) in the per-row backward workspaces (dsum, lse_log2).
JF_HOST_DEVICE int64_t row_stats_offset(const FlashBwdParams& p, int b, int h) {
  return (int64_t(b) * p.heads_q + h) * p.seqlen_q_rounded;
}

}  // namespace jax_flash
