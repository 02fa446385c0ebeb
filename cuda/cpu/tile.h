// Small dense tile products used by both CPU passes. Loops are ordered so the innermost
// one runs over contiguous memory without a reduction, which compilers vectorise without
// reassociating floating point.
#pragma once

#include <cstdint>

#include "cpu_dtype.h"

namespace jax_flash::cpu {

// c[i][j] = sum_d a[i][d] * bt[d][j];  a: [m][lda], bt: [k][ldb] (b transposed), c: [m][ldc].
inline void gemm_nt_into(int m, int n, int k, const float* a, int lda, const float* bt, int ldb,
                         float* c, int ldc) {
  for (int i = 0; i < m; ++i) {
    float* ci = c + int64_t(i) * ldc;
    for (int j = 0; j < n; ++j) ci[j] = 0.f;
    const float* ai = a + int64_t(i) * lda;
    for (int d = 0; d < k; ++d) {
      const float aid = ai[d];
      const float* b = bt + int64_t(d) * ldb;
      for (int j = 0; j < n; ++j) ci[j] += aid * b[j];
    }
  }
}

// c[i][d] += alpha * sum_j p[i][j] * b[j][d];  p: [m][ldp], b: [n][ldb], c: [m][ldc].
inline void gemm_acc(int m, int n, int k, float alpha, const float* p, int ldp, const float* b,
                     int ldb, float* c, int ldc) {
  for (int i = 0; i < m; ++i) {
    float* ci = c + int64_t(i) * ldc;
    const float* pi = p + int64_t(i) * ldp;
    for (int j = 0; j < n; ++j) {
      const float w = alpha * pi[j];
      if (w == 0.f) continue;
      const float* bj = b + int64_t(j) * ldb;
      for (int d = 0; d < k; ++d) ci[d] += w * bj[d];
    }
  }
}

// c[j][d] += alpha * sum_i p[i][j] * b[i][d]  (p transposed);  p: [m][ldp], b: [m][ldb], c: [n][ldc].
inline void gemm_tn_acc(int m, int n, int k, float alpha, const float* p, int ldp, const float* b,
                        int ldb, float* c, int ldc) {
  for (int i = 0; i < m; ++i) {
    const float* pi = p + int64_t(i) * ldp;
    const float* bi = b + int64_t(i) * ldb;
    for (int j = 0; j < n; ++j) {
      const float w = alpha * pi[j];
      if (w == 0.f) continue;
      float* cj = c + int64_t(j) * ldc;
      for (int d = 0; d < k; ++d) cj[d] += w * bi[d];
    }
  }
}

// Loads rows [r0, r0 + n) of one head into dst[n][ld] (float).
inline void load_tile(const void* base, DType dtype, int64_t head_offset, int64_t row_stride,
                      int64_t r0, int n, int dim, float* dst, int ld) {
  for (int r = 0; r < n; ++r)
    load_row(base, dtype, head_offset + (r0 + r) * row_stride, dim, dst + int64_t(r) * ld);
}

// Loads rows [r0, r0 + n) of one head transposed into dst[dim][ld].
inline void load_tile_t(const void* base, DType dtype, int64_t head_offset, int64_t row_stride,
                        int64_t r0, int n, int dim, float* row_buf, float* dst, int ld) {
  for (int r = 0; r < n; ++r) {
    load_row(base, dtype, head_offset + (r0 + r) * row_stride, dim, row_buf);
    for (int d = 0; d < dim; ++d) dst[int64_t(d) * ld + r] = row_buf[d];
  }
}

}  // namespace jax_flash::cpu
