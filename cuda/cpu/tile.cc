// The CPU passes' tile products. Loops are ordered so the innermost one runs over contiguous
// memory without a reduction, which compilers vectorise without reassociating floating point.
// On x86-64 each is built twice, for AVX2+FMA (x86-64-v3) and for the baseline, and the
// loader picks one per machine (GCC/Clang function multiversioning), so one build stays
// portable and still uses the wide vectors where they exist.
#include "tile.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define JF_CPU_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define JF_CPU_MULTIVERSION
#endif

namespace jax_flash::cpu {

// c[i][j] = sum_d a[i][d] * bt[d][j];  a: [m][lda], bt: [k][ldb] (b transposed), c: [m][ldc].
JF_CPU_MULTIVERSION void gemm_nt_into(int m, int n, int k, const float* __restrict__ a, int lda,
                                      const float* __restrict__ bt, int ldb, float* __restrict__ c, int ldc) {
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
JF_CPU_MULTIVERSION void gemm_acc(int m, int n, int k, float alpha, const float* __restrict__ p, int ldp,
                                  const float* __restrict__ b, int ldb, float* __restrict__ c, int ldc) {
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
JF_CPU_MULTIVERSION void gemm_tn_acc(int m, int n, int k, float alpha, const float* __restrict__ p, int ldp,
                                     const float* __restrict__ b, int ldb, float* __restrict__ c, int ldc) {
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

}  // namespace jax_flash::cpu
