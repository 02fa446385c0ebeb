// Small dense tile products used by both CPU passes (defined in tile.cc), and tile loads.
#pragma once

#include <cstdint>

#include "cpu_dtype.h"

namespace jax_flash::cpu {

// c[i][j] = sum_d a[i][d] * bt[d][j];  a: [m][lda], bt: [k][ldb] (b transposed), c: [m][ldc].
void gemm_nt_into(int m, int n, int k, const float* a, int lda, const float* bt, int ldb, float* c, int ldc);

// c[i][d] += alpha * sum_j p[i][j] * b[j][d];  p: [m][ldp], b: [n][ldb], c: [m][ldc].
void gemm_acc(int m, int n, int k, float alpha, const float* p, int ldp, const float* b, int ldb, float* c, int ldc);

// c[j][d] += alpha * sum_i p[i][j] * b[i][d]  (p transposed);  p: [m][ldp], b: [m][ldb], c: [n][ldc].
void gemm_tn_acc(int m, int n, int k, float alpha, const float* p, int ldp, const float* b, int ldb, float* c, int ldc);

// x[j] = exp(x[j] - shift), 0 where x[j] is -inf or the result would fall below ~1e-38 (a
// negligible term next to the row's exp(0) = 1); returns their sum. shift must be finite.
// Vectorised (Cody-Waite reduction, Cephes' degree-6 polynomial: within 2 ulp of std::exp).
float exp_shifted_sum(float* x, int n, float shift);
// max(init, x[0], ..., x[n - 1]) as std::max folds it (a NaN element is passed over).
float row_max(const float* x, int n, float init);
// Whether x[0..n) holds a NaN (row_max passes NaNs over: a row of NaN logits has max -inf).
bool any_nan(const float* x, int n);

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
