// Bias / mask tiles by TMA for the sm90 Dense forward (and backward, NOTES.md v53): the producer loads each key block's
// (kBlockM rows x 64 keys) bias and mask tiles into smem beside the K / V stage, and the
// consumers read their accumulator elements from there in pairs. This replaces one global load
// per element and thread (dense.h's words, at half-sector efficiency through L1) with one
// bulk copy per tile; the consumers keep no words in registers.
// Taken when the layout allows TMA: keys contiguous, 16-byte aligned rows, no
// broadcast over rows or keys (dense_tiles_by_tma, flash_params.h); other layouts keep the words
// path.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/cuda_host_adapter.hpp>

#include "../common/dtype.h"
#include "../common/flash_params.h"

namespace jax_flash::sm90 {

// Smem of one stage: the bias tile (room for float32), then the mask tile. Each tile is stored
// as TMA writes it: boxes of kBlockM rows x kTileInner bytes, 128-byte swizzle (64-byte for the
// 1-byte mask), so the consumers' pair reads are conflict-free (8 rows x 4 threads per warp).
constexpr int kDenseTmaKeys = 64;  // keys per block (the Dense kernels' kBlockN at H <= 128)
template <int kBlockM>
struct DenseTmaStage {
  static constexpr int kBiasBytes = kBlockM * kDenseTmaKeys * 4;
  static constexpr int kMaskBytes = kBlockM * kDenseTmaKeys;
  static constexpr int kBytes = kBiasBytes + kMaskBytes;
};

// Box inner extent in bytes for an element size: 128 (one swizzle span) for the 4- and 2-byte
// bias, 64 for the mask (its whole 64-key row).
__host__ __device__ constexpr int dense_box_bytes(int elem_bytes) { return elem_bytes == 1 ? 64 : 128; }

// Byte offset of (row, key) of a tile with elem_bytes-sized elements (TMA's swizzle: 16-byte
// chunk index XOR row bits, 128B: row % 8; 64B: (row / 2) % 4).
template <int kBlockM, int kElemBytes>
__forceinline__ __device__ int dense_tile_offset(int row, int key) {
  constexpr int kInner = dense_box_bytes(kElemBytes);
  int const kb = key * kElemBytes;
  int const box = kb / kInner, within = kb % kInner, chunk = within / 16;
  int const sw = kInner == 128 ? chunk ^ (row & 7) : chunk ^ ((row >> 1) & 3);
  return box * (kBlockM * kInner) + row * kInner + sw * 16 + within % 16;
}

// The descriptors and what the producer needs to issue a block's copies (kernel parameter).
struct DenseTmaDescs {
  CUtensorMap bias;  // (keys, rows, heads, batch) with broadcast heads / batch as extent 1
  CUtensorMap mask;
  uint32_t stage_tx_bytes;  // bytes a block's copies deliver (the stage barrier's transaction)
  int bias_elem_bytes;      // 4, 2, or 0 = no bias
  uint32_t mask_offset;     // of the mask tile in a stage (bytes)
  bool has_mask;
  bool bias_heads, bias_batch, mask_heads, mask_batch;  // whether that axis is indexed (not broadcast)
};

inline CUresult encode_dense_operand(CUtensorMap* desc, const void* base, CUtensorMapDataType type, int elem_bytes,
                                     const FlashFwdParams& p, int64_t batch_stride, int64_t head_stride,
                                     int64_t row_stride, int block_m) {
  int64_t const row_bytes = row_stride * elem_bytes;
  // A broadcast axis is one long (its coordinate is always 0); its stride only has to be valid.
  cuuint64_t dims[4] = {cuuint64_t(p.seqlen_k), cuuint64_t(p.seqlen_q), cuuint64_t(head_stride ? p.heads_q : 1),
                        cuuint64_t(batch_stride ? p.batch : 1)};
  cuuint64_t strides[3] = {cuuint64_t(row_bytes), cuuint64_t(head_stride ? head_stride * elem_bytes : row_bytes),
                           cuuint64_t(batch_stride ? batch_stride * elem_bytes : row_bytes)};
  cuuint32_t box[4] = {cuuint32_t(dense_box_bytes(elem_bytes) / elem_bytes), cuuint32_t(block_m), 1, 1};
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      desc, type, 4, const_cast<void*>(base), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      elem_bytes == 1 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);  // out-of-range rows / keys read as 0 (masked anyway)
}

// compact: the mask tile right after the bias tile of the call's dtype (the backward's 16 KB
// stages); else at DenseTmaStage::kBiasBytes (the forward's stages, room for a float32 bias).
template <int kBlockM>
cudaError_t make_dense_tma(const FlashFwdParams& p, DenseTmaDescs* d, bool compact = false) {
  *d = DenseTmaDescs{};
  d->mask_offset = compact ? kBlockM * kDenseTmaKeys * (p.bias ? bias_elem_bytes(p) : 0) : DenseTmaStage<kBlockM>::kBiasBytes;
  if (p.bias) {
    int const eb = bias_elem_bytes(p);
    CUtensorMapDataType const type = p.bias_dtype == DType::kFloat32    ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32
                                     : p.bias_dtype == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                        : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    if (encode_dense_operand(&d->bias, p.bias, type, eb, p, p.bias_batch_stride, p.bias_head_stride,
                             p.bias_row_stride, kBlockM) != CUDA_SUCCESS)
      return cudaErrorNotSupported;
    d->bias_elem_bytes = eb;
    d->bias_heads = p.bias_head_stride != 0;
    d->bias_batch = p.bias_batch_stride != 0;
    d->stage_tx_bytes += kBlockM * kDenseTmaKeys * eb;
  }
  if (p.mask) {
    if (encode_dense_operand(&d->mask, p.mask, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p, p.mask_batch_stride,
                             p.mask_head_stride, p.mask_row_stride, kBlockM) != CUDA_SUCCESS)
      return cudaErrorNotSupported;
    d->has_mask = true;
    d->mask_heads = p.mask_head_stride != 0;
    d->mask_batch = p.mask_batch_stride != 0;
    d->stage_tx_bytes += kBlockM * kDenseTmaKeys;
  }
  return cudaSuccess;
}

// Producer (one thread): the copies of key block n0 for query rows m0.. into one stage.
template <int kBlockM>
__forceinline__ __device__ void issue_dense_tma(DenseTmaDescs const& d, uint64_t* bar, uint8_t* stage, int n0, int m0,
                                                int h, int b) {
  constexpr uint64_t kEvictNormal = uint64_t(cute::TMA::CacheHintSm90::EVICT_NORMAL);
  if (d.bias_elem_bytes) {
    int const hc = d.bias_heads ? h : 0, bc = d.bias_batch ? b : 0;
    int const keys_per_box = dense_box_bytes(d.bias_elem_bytes) / d.bias_elem_bytes;
    for (int box = 0; box * keys_per_box < kDenseTmaKeys; ++box)
      cute::SM90_TMA_LOAD_4D::copy(&d.bias, bar, kEvictNormal, stage + box * kBlockM * 128, n0 + box * keys_per_box,
                                   m0, hc, bc);
  }
  if (d.has_mask)
    cute::SM90_TMA_LOAD_4D::copy(&d.mask, bar, kEvictNormal, stage + d.mask_offset, n0, m0, d.mask_heads ? h : 0,
                                 d.mask_batch ? b : 0);
}

}  // namespace jax_flash::sm90
