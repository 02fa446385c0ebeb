// Turns XLA FFI buffers and attributes into the params struct. Shared by the CPU and
// CUDA handlers so both decode the call identically; knows nothing of tiling.
#pragma once

#include <cstdint>
#include <string>

#include "../common/flash_params.h"
#include "../common/philox.h"
#include "xla/ffi/api/ffi.h"

namespace jax_flash {

// The custom call's attributes, one struct for forward and backward (Python passes the
// same set to both, see jax_flash/_primitives.py).
struct FlashAttrs {
  float scale;         // logit scale
  float softcap;       // 0 = off
  int32_t window_left;   // -1 = unbounded
  int32_t window_right;  // -1 = unbounded; causal already folded in as 0
  bool causal;         // informational: lets kernels specialise
  int64_t q_offset;    // query row 0's key position
  bool bottom_right;   // add kv_len - q_len per batch to q_offset
  bool deterministic;  // backward: reproducible dQ accumulation (GPU)
  int32_t kernel;      // GPU kernel family: 0 auto, 1 portable (sm80), 2 hopper (sm90)
  double dropout_rate;  // in [0, 1); > 0 iff the dropout keys operand is given (double: the
                        // threshold round(rate * 2^32) is computed from Python's own value)
};

namespace ffi_detail {

inline ::xla::ffi::Error check_dtype(const ::xla::ffi::AnyBuffer& buf, DType* out, const char* name) {
  using ::xla::ffi::DataType;
  switch (buf.element_type()) {
    case DataType::F32: *out = DType::kFloat32; return ::xla::ffi::Error::Success();
    case DataType::BF16: *out = DType::kBFloat16; return ::xla::ffi::Error::Success();
    case DataType::F16: *out = DType::kFloat16; return ::xla::ffi::Error::Success();
    default:
      return ::xla::ffi::Error::InvalidArgument(std::string("jax_flash: unsupported dtype for ") + name);
  }
}

// Element strides of a contiguous [B, L, N, H] buffer.
inline void blnh_strides(const ::xla::ffi::AnyBuffer& buf, int64_t* batch, int64_t* row, int64_t* head) {
  auto d = buf.dimensions();
  *head = d[3];
  *row = d[2] * d[3];
  *batch = d[1] * d[2] * d[3];
}

}  // namespace ffi_detail

// Fills everything but the output pointers' meaning for the backward.
inline ::xla::ffi::Error fill_fwd_params(const ::xla::ffi::AnyBuffer& q, const ::xla::ffi::AnyBuffer& k,
                                         const ::xla::ffi::AnyBuffer& v, const ::xla::ffi::AnyBuffer& q_lens,
                                         const ::xla::ffi::AnyBuffer& kv_lens, const FlashAttrs& a,
                                         FlashFwdParams* p) {
  using ::xla::ffi::Error;
  if (q.dimensions().size() != 4 || k.dimensions().size() != 4 || v.dimensions().size() != 4)
    return Error::InvalidArgument("jax_flash: q, k, v must be rank 4 [B, L, N, H]");
  DType dt;
  if (auto e = ffi_detail::check_dtype(q, &dt, "q"); e.failure()) return e;
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return Error::InvalidArgument("jax_flash: q, k, v dtypes differ");
  auto qd = q.dimensions();
  auto kd = k.dimensions();
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->q_lens = q_lens.element_count() ? static_cast<const int32_t*>(q_lens.untyped_data()) : nullptr;
  p->kv_lens = kv_lens.element_count() ? static_cast<const int32_t*>(kv_lens.untyped_data()) : nullptr;
  p->batch = int(qd[0]);
  p->seqlen_q = int(qd[1]);
  p->heads_q = int(qd[2]);
  p->head_dim = int(qd[3]);
  p->seqlen_k = int(kd[1]);
  p->heads_kv = int(kd[2]);
  if (p->heads_kv <= 0 || p->heads_q % p->heads_kv != 0)
    return Error::InvalidArgument("jax_flash: heads_q must be a multiple of heads_kv");
  p->dtype = dt;
  ffi_detail::blnh_strides(q, &p->q_batch_stride, &p->q_row_stride, &p->q_head_stride);
  ffi_detail::blnh_strides(k, &p->k_batch_stride, &p->k_row_stride, &p->k_head_stride);
  ffi_detail::blnh_strides(v, &p->v_batch_stride, &p->v_row_stride, &p->v_head_stride);
  // o has q's shape.
  p->o_batch_stride = p->q_batch_stride;
  p->o_row_stride = p->q_row_stride;
  p->o_head_stride = p->q_head_stride;
  p->scale = a.scale;
  p->softcap = a.softcap;
  p->window_left = a.window_left;
  p->window_right = a.window_right;
  p->causal = a.causal;
  p->q_offset = a.q_offset;
  p->bottom_right = a.bottom_right;
  return Error::Success();
}

inline ::xla::ffi::Error fill_bwd_params(const ::xla::ffi::AnyBuffer& q, const ::xla::ffi::AnyBuffer& k,
                                         const ::xla::ffi::AnyBuffer& v, const ::xla::ffi::AnyBuffer& o,
                                         const ::xla::ffi::AnyBuffer& lse, const ::xla::ffi::AnyBuffer& dout,
                                         const ::xla::ffi::AnyBuffer& q_lens,
                                         const ::xla::ffi::AnyBuffer& kv_lens, const FlashAttrs& a,
                                         FlashBwdParams* p) {
  if (auto e = fill_fwd_params(q, k, v, q_lens, kv_lens, a, p); e.failure()) return e;
  p->o = const_cast<void*>(o.untyped_data());  // read-only in the backward
  p->lse = static_cast<float*>(const_cast<void*>(lse.untyped_data()));
  p->dout = dout.untyped_data();
  p->do_batch_stride = p->q_batch_stride;
  p->do_row_stride = p->q_row_stride;
  p->do_head_stride = p->q_head_stride;
  p->dq_batch_stride = p->q_batch_stride;
  p->dq_row_stride = p->q_row_stride;
  p->dq_head_stride = p->q_head_stride;
  p->dk_batch_stride = p->k_batch_stride;
  p->dk_row_stride = p->k_row_stride;
  p->dk_head_stride = p->k_head_stride;
  p->dv_batch_stride = p->v_batch_stride;
  p->dv_row_stride = p->v_row_stride;
  p->dv_head_stride = p->v_head_stride;
  p->seqlen_q_rounded = int(dq_accum_rows(p->seqlen_q));
  p->head_dim_rounded = int(dq_accum_cols(p->head_dim));
  p->deterministic = a.deterministic;
  return ::xla::ffi::Error::Success();
}

namespace ffi_detail {

// Strides of a [B', N', T', S'] buffer read as [batch, heads_q, seqlen_q, seqlen_k]: each dim is
// 1 (broadcast, stride 0) or the full size.
inline ::xla::ffi::Error broadcast_strides(const ::xla::ffi::AnyBuffer& buf, const FlashFwdParams& p, const char* name,
                                           int64_t* s) {
  auto d = buf.dimensions();
  const int64_t full[4] = {p.batch, p.heads_q, p.seqlen_q, p.seqlen_k};
  if (d.size() != 4)
    return ::xla::ffi::Error::InvalidArgument(std::string("jax_flash: ") + name + " must be rank 4");
  int64_t stride = 1;
  for (int a = 3; a >= 0; --a) {
    if (d[a] != 1 && d[a] != full[a])
      return ::xla::ffi::Error::InvalidArgument(std::string("jax_flash: ") + name +
                                                " dims must be 1 or [B, N, T, S]");
    s[a] = d[a] == 1 ? 0 : stride;
    stride *= d[a];
  }
  return ::xla::ffi::Error::Success();
}

}  // namespace ffi_detail

// The optional element-wise inputs (zero-size buffer = absent).
inline ::xla::ffi::Error fill_extra_params(const ::xla::ffi::AnyBuffer& q_seg, const ::xla::ffi::AnyBuffer& kv_seg,
                                           const ::xla::ffi::AnyBuffer& bias, const ::xla::ffi::AnyBuffer& mask,
                                           const ::xla::ffi::AnyBuffer& dropout_keys, const FlashAttrs& a,
                                           FlashFwdParams* p) {
  using ::xla::ffi::DataType;
  using ::xla::ffi::Error;
  if (q_seg.element_count() || kv_seg.element_count()) {
    auto qd = q_seg.dimensions();
    auto kd = kv_seg.dimensions();
    if (q_seg.element_type() != DataType::S32 || kv_seg.element_type() != DataType::S32 || qd.size() != 2 ||
        kd.size() != 2 || qd[0] != p->batch || qd[1] != p->seqlen_q || kd[0] != p->batch || kd[1] != p->seqlen_k)
      return Error::InvalidArgument("jax_flash: segment ids must be int32 [B, T] and [B, S]");
    p->q_segment_ids = static_cast<const int32_t*>(q_seg.untyped_data());
    p->kv_segment_ids = static_cast<const int32_t*>(kv_seg.untyped_data());
    p->q_seg_batch_stride = p->seqlen_q;
    p->kv_seg_batch_stride = p->seqlen_k;
  }
  if (bias.element_count()) {
    if (auto e = ffi_detail::check_dtype(bias, &p->bias_dtype, "bias"); e.failure()) return e;
    int64_t s[4];
    if (auto e = ffi_detail::broadcast_strides(bias, *p, "bias", s); e.failure()) return e;
    p->bias = bias.untyped_data();
    p->bias_batch_stride = s[0], p->bias_head_stride = s[1], p->bias_row_stride = s[2], p->bias_col_stride = s[3];
  }
  if (mask.element_count()) {
    if (mask.element_type() != DataType::PRED) return Error::InvalidArgument("jax_flash: mask must be bool");
    int64_t s[4];
    if (auto e = ffi_detail::broadcast_strides(mask, *p, "mask", s); e.failure()) return e;
    p->mask = static_cast<const uint8_t*>(mask.untyped_data());
    p->mask_batch_stride = s[0], p->mask_head_stride = s[1], p->mask_row_stride = s[2], p->mask_col_stride = s[3];
  }
  const bool rate_on = a.dropout_rate > 0.0;
  if (rate_on != (dropout_keys.element_count() != 0) || !(a.dropout_rate < 1.0))
    return Error::InvalidArgument("jax_flash: dropout_rate must be in [0, 1), and > 0 iff dropout keys are given");
  if (rate_on) {
    auto d = dropout_keys.dimensions();
    if (dropout_keys.element_type() != DataType::U32 || d.size() != 3 || d[0] != p->batch || d[1] != p->heads_q ||
        d[2] != 4)
      return Error::InvalidArgument("jax_flash: dropout keys must be uint32 [B, N, 4]");
    p->dropout_keys = static_cast<const uint32_t*>(dropout_keys.untyped_data());
    p->dropout_batch_stride = int64_t(p->heads_q) * 4;
    p->dropout_head_stride = 4;
    p->dropout_rate = float(a.dropout_rate);
    p->dropout_threshold = dropout_threshold(a.dropout_rate);
    p->dropout_scale = float(1.0 / (1.0 - a.dropout_rate));
  }
  return Error::Success();
}

// dbias: float32 with the bias's shape, or zero-size when there is no bias.
inline ::xla::ffi::Error fill_dbias_params(::xla::ffi::AnyBuffer dbias, FlashBwdParams* p) {
  if (!dbias.element_count()) return ::xla::ffi::Error::Success();
  if (!p->bias || dbias.element_type() != ::xla::ffi::DataType::F32)
    return ::xla::ffi::Error::InvalidArgument("jax_flash: dbias must be float32 and come with a bias");
  int64_t s[4];
  if (auto e = ffi_detail::broadcast_strides(dbias, *p, "dbias", s); e.failure()) return e;
  p->dbias = static_cast<float*>(dbias.untyped_data());
  p->dbias_batch_stride = s[0], p->dbias_head_stride = s[1], p->dbias_row_stride = s[2], p->dbias_col_stride = s[3];
  return ::xla::ffi::Error::Success();
}

}  // namespace jax_flash

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_flash::FlashAttrs,
                                      ::xla::ffi::StructMember<float>("scale"),
                                      ::xla::ffi::StructMember<float>("softcap"),
                                      ::xla::ffi::StructMember<int32_t>("window_left"),
                                      ::xla::ffi::StructMember<int32_t>("window_right"),
                                      ::xla::ffi::StructMember<bool>("causal"),
                                      ::xla::ffi::StructMember<int64_t>("q_offset"),
                                      ::xla::ffi::StructMember<bool>("bottom_right"),
                                      ::xla::ffi::StructMember<bool>("deterministic"),
                                      ::xla::ffi::StructMember<int32_t>("kernel"),
                                      ::xla::ffi::StructMember<double>("dropout_rate"));
