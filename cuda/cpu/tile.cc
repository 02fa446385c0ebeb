// The CPU passes' tile products. On x86-64 machines with AVX2 + FMA the bulk of each output
// (4 x 16 blocks) runs in a register-blocked intrinsics kernel (blocks_avx2, picked at run
// time); the edges, and other machines, run row loops ordered so the innermost one runs over
// contiguous memory without a reduction, which compilers vectorise without reassociating
// floating point. The row loops are built twice on x86-64, for AVX2+FMA (x86-64-v3) and for
// the baseline, and the loader picks one (GCC/Clang function multiversioning), so one build
// stays portable.
#include "tile.h"

#include <algorithm>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && defined(__linux__)
#define JF_CPU_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#define JF_CPU_AVX2_BLOCKS 1
#include <immintrin.h>
#else
#define JF_CPU_MULTIVERSION
#define JF_CPU_AVX2_BLOCKS 0
#endif

namespace jax_flash::cpu {

// c[i][j] = sum_d a[i][d] * bt[d][j];  a: [m][lda], bt: [k][ldb] (b transposed), c: [m][ldc].
JF_CPU_MULTIVERSION static void gemm_nt_into_rows(int m, int n, int k, const float* __restrict__ a, int lda,
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
JF_CPU_MULTIVERSION static void gemm_acc_rows(int m, int n, int k, float alpha, const float* __restrict__ p, int ldp,
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
JF_CPU_MULTIVERSION static void gemm_tn_acc_rows(int m, int n, int k, float alpha, const float* __restrict__ p, int ldp,
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

namespace {

#if JF_CPU_AVX2_BLOCKS
// The instruction sets the intrinsics kernels below need, read once per process.
struct CpuFeatures {
  bool avx2_fma, f16c;
};
CpuFeatures const& cpu_features() {
  static const CpuFeatures f = [] {
    __builtin_cpu_init();
    return CpuFeatures{__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
                       __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c")};
  }();
  return f;
}
bool have_avx2_fma() { return cpu_features().avx2_fma; }
bool have_f16c() { return cpu_features().f16c; }

// The row loops above load and store a row of c for every FMA (about one FMA per cycle). This
// kernel keeps a 4 x 16 block of c in eight AVX registers: c[r][col] (+)= sum_t alpha * A(r, t)
// * b[t][col] with A(r, t) = a[r * a_rs + t * a_ts], for rows [0, mb) and columns [0, nb)
// (multiples of 4 and 16). Same order over t and the same fused multiply-adds as the row
// loops' x86-64-v3 build, so the same results, except that zero weights are not skipped.
__attribute__((target("avx2,fma"))) void blocks_avx2(int mb, int nb, int kk, float alpha, const float* a,
                                                      int64_t a_rs, int64_t a_ts, const float* b, int64_t ldb,
                                                      float* c, int64_t ldc, bool zero) {
  for (int i = 0; i < mb; i += 4) {
    for (int j = 0; j < nb; j += 16) {
      __m256 acc[4][2];
      for (int r = 0; r < 4; ++r)
        for (int v = 0; v < 2; ++v)
          acc[r][v] = zero ? _mm256_setzero_ps() : _mm256_loadu_ps(c + (i + r) * ldc + j + 8 * v);
      const float* ai = a + i * a_rs;
      for (int t = 0; t < kk; ++t) {
        const __m256 b0 = _mm256_loadu_ps(b + t * ldb + j), b1 = _mm256_loadu_ps(b + t * ldb + j + 8);
        for (int r = 0; r < 4; ++r) {
          const __m256 w = _mm256_set1_ps(alpha * ai[r * a_rs + t * a_ts]);
          acc[r][0] = _mm256_fmadd_ps(w, b0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(w, b1, acc[r][1]);
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int v = 0; v < 2; ++v) _mm256_storeu_ps(c + (i + r) * ldc + j + 8 * v, acc[r][v]);
    }
  }
}

// float16 -> float32, 8 at a time (vcvtph2ps: exact for every half, subnormals included).
__attribute__((target("avx,f16c"))) int widen_fp16_f16c(const uint16_t* s, int n, float* d) {
  int i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  return i;
}
#else
bool have_avx2_fma() { return false; }
void blocks_avx2(int, int, int, float, const float*, int64_t, int64_t, const float*, int64_t, float*, int64_t, bool) {}
bool have_f16c() { return false; }
int widen_fp16_f16c(const uint16_t*, int, float*) { return 0; }
#endif

// The blocked part of an m x n output (rows < mb, columns < nb) when the machine has AVX2 + FMA;
// returns false (nothing done) otherwise, and the caller's row loops do all of it.
bool blocked(int m, int n, int& mb, int& nb) {
  mb = m - m % 4;
  nb = n - n % 16;
  return mb > 0 && nb > 0 && have_avx2_fma();
}

// exp(v), 0 below -87 (and for -inf), NaN for NaN (a NaN logit must reach the output, as in
// jax.nn); branch-free, so the loops calling it vectorise (tile.cc is built with
// -fno-trapping-math for that).
inline float exp_or_zero(float v) {
  bool const zero = !(v >= -87.f);  // NaN too, so the polynomial below runs on finite numbers
  float const c = zero ? -87.f : (v > 88.f ? 88.f : v);
  float const n2 = (c * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(c / ln 2)
  float const r = (c - n2 * 0.693359375f) + n2 * 2.12194440e-4f;          // c - n2 ln 2, in two parts
  float q = 1.9875691500e-4f;
  q = q * r + 1.3981999507e-3f;
  q = q * r + 8.3334519073e-3f;
  q = q * r + 4.1665795894e-2f;
  q = q * r + 1.6666665459e-1f;
  q = q * r + 5.0000001201e-1f;
  q = q * r * r + r + 1.f;
  int const bits = (int(n2) + 127) << 23;  // 2^n2, n2 in [-126, 127]
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof scale);
  float const e = zero ? 0.f : q * scale;
  return v == v ? e : v;
}
}  // namespace

JF_CPU_MULTIVERSION float exp_shifted_sum(float* __restrict__ x, int n, float shift) {
  constexpr int kLanes = 8;  // independent partial sums, so the reduction vectorises in order
  float part[kLanes] = {};
  int j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      float const e = exp_or_zero(x[j + l] - shift);
      x[j + l] = e;
      part[l] += e;
    }
  }
  for (; j < n; ++j) {
    float const e = exp_or_zero(x[j] - shift);
    x[j] = e;
    part[0] += e;
  }
  float sum = 0.f;
  for (int l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

void widen_fp16(const uint16_t* s, int n, float* d) {
  int i = have_f16c() ? widen_fp16_f16c(s, n, d) : 0;  // the bit-exact scalar routine for the rest
  for (; i < n; ++i) d[i] = fp16_to_float(s[i]);
}

bool any_nan(const float* x, int n) {
  for (int j = 0; j < n; ++j)
    if (x[j] != x[j]) return true;
  return false;
}

// Eight independent running maxima, so the loop vectorises (max is exact: any order gives the
// same result); std::max(m, x) keeps m when x is NaN, as maxps(x, m) does.
JF_CPU_MULTIVERSION float row_max(const float* __restrict__ x, int n, float init) {
  constexpr int kLanes = 8;
  float part[kLanes];
  for (int l = 0; l < kLanes; ++l) part[l] = init;
  int j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) part[l] = std::max(part[l], x[j + l]);
  for (; j < n; ++j) part[0] = std::max(part[0], x[j]);
  float m = part[0];
  for (int l = 1; l < kLanes; ++l) m = std::max(m, part[l]);
  return m;
}

void gemm_nt_into(int m, int n, int k, const float* a, int lda, const float* bt, int ldb, float* c, int ldc) {
  int mb, nb;
  if (!blocked(m, n, mb, nb)) return gemm_nt_into_rows(m, n, k, a, lda, bt, ldb, c, ldc);
  blocks_avx2(mb, nb, k, 1.f, a, lda, 1, bt, ldb, c, ldc, true);
  if (nb < n) gemm_nt_into_rows(mb, n - nb, k, a, lda, bt + nb, ldb, c + nb, ldc);
  if (mb < m) gemm_nt_into_rows(m - mb, n, k, a + int64_t(mb) * lda, lda, bt, ldb, c + int64_t(mb) * ldc, ldc);
}

void gemm_acc(int m, int n, int k, float alpha, const float* p, int ldp, const float* b, int ldb, float* c, int ldc) {
  int mb, kb;  // output: m rows x k columns
  if (!blocked(m, k, mb, kb)) return gemm_acc_rows(m, n, k, alpha, p, ldp, b, ldb, c, ldc);
  blocks_avx2(mb, kb, n, alpha, p, ldp, 1, b, ldb, c, ldc, false);
  if (kb < k) gemm_acc_rows(mb, n, k - kb, alpha, p, ldp, b + kb, ldb, c + kb, ldc);
  if (mb < m) gemm_acc_rows(m - mb, n, k, alpha, p + int64_t(mb) * ldp, ldp, b, ldb, c + int64_t(mb) * ldc, ldc);
}

void gemm_tn_acc(int m, int n, int k, float alpha, const float* p, int ldp, const float* b, int ldb, float* c, int ldc) {
  int nb, kb;  // output: n rows x k columns
  if (!blocked(n, k, nb, kb)) return gemm_tn_acc_rows(m, n, k, alpha, p, ldp, b, ldb, c, ldc);
  blocks_avx2(nb, kb, m, alpha, p, 1, ldp, b, ldb, c, ldc, false);
  if (kb < k) gemm_tn_acc_rows(m, nb, k - kb, alpha, p, ldp, b + kb, ldb, c + kb, ldc);
  if (nb < n) gemm_tn_acc_rows(m, n - nb, k, alpha, p + nb, ldp, b, ldb, c + int64_t(nb) * ldc, ldc);
}

}  // namespace jax_flash::cpu
