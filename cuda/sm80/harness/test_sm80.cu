// Standalone correctness + speed harness for the SM80 FlashAttention kernels.
//   test_sm80            full case grid, then the benchmark shapes
//   test_sm80 --small    a few tiny cases (for compute-sanitizer)
//   test_sm80 --bench    benchmark only
// Correctness rule (as FlashAttention's tests): max|ours - ref64| <= 2 * max|naive - ref64| + atol,
// where naive computes the same function in the input dtype (rounding every matmul output
// and P) and ref64 in float64. Exit code != 0 on any failure.
// Optional inputs: segment ids (sorted = packed, or unsorted), an additive bias (float32 or the
// input dtype; full or broadcast over any axes, with dbias checked by the same rule) and a
// boolean mask (broadcast; some rows fully masked), combined with causal / GQA / lengths.
// Dropout: the host reference drops with common/philox.h's HeadDropout (the CPU backend's
// code), so a kernel that keeps a different element set fails the rule by a wide margin.
//   test_sm80 --extras   only the optional-input cases
//   test_sm80 --dropout  only the dropout cases (then benchmarks with and without dropout)
//   test_sm80 --even     only the block-aligned cases (T % 128 == 0, S % 64 == 0, no lengths, no
//                        padded head dim): the forward's predicate-free kEven variant at H = 256
//                        (FwdTraits::kLean); at H = 64 / 128 the default kernel on aligned shapes
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include <thread>
#include <atomic>

#include "../../common/mask.h"
#include "../../common/philox.h"
#include "../flash_sm80.h"

#include "../../common/harness_util.h"

using namespace jax_flash;

static bool g_bf16 = true;  // the dtype of the case being run
static uint16_t f2h(float f) { return from_f(f, g_bf16); }
static float h2f(uint16_t u) { return to_f(u, g_bf16); }
static double rnd(double x) { return std::isinf(x) ? x : double(h2f(f2h(float(x)))); }

struct Case {
  bool bf16 = true;
  int B = 1, T = 1, S = 1, Nq = 2, Nkv = 2, H = 64;
  bool causal = false, br = false;
  int wl = -1, wr = -1;
  float softcap = 0.f;
  bool lens = false;
  bool det = false;
  int seg = 0;         // segment ids: 0 none, 1 sorted (packed sequences), 2 unsorted
  int bias = -1;       // -1 none, else a bitmask of the bias's full axes (1 batch, 2 heads, 4 rows, 8 keys)
  bool bias_f32 = true;  // bias dtype: float32, or the input dtype
  int mask = -1;       // -1 none, else the mask's full axes, as for the bias
  float drop = 0.f;    // dropout rate; 0 = off
  bool drop_bcast = false;  // one mask for every (batch, head): counter coordinates (0, 0)
  std::string name() const {
    char buf[300], ex[120] = "";
    auto axes = [](int a) {
      static char t[5];
      t[0] = a & 1 ? 'B' : '1'; t[1] = a & 2 ? 'N' : '1'; t[2] = a & 4 ? 'T' : '1'; t[3] = a & 8 ? 'S' : '1'; t[4] = 0;
      return std::string(t);
    };
    std::string e;
    if (seg) e += seg == 1 ? " seg" : " seg-unsorted";
    if (bias >= 0) e += " bias[" + axes(bias) + (bias_f32 ? "]f32" : "]");
    if (mask >= 0) e += " mask[" + axes(mask) + "]";
    if (drop > 0) e += " dropout" + std::to_string(drop).substr(0, 4) + (drop_bcast ? "-bcast" : "");
    snprintf(ex, sizeof ex, "%s", e.c_str());
    snprintf(buf, sizeof buf, "%s H%-3d T%-4d S%-4d B%d N%d/%d%s%s%s%s%s%s", bf16 ? "bf16" : "fp16", H, T, S, B, Nq, Nkv,
             causal ? (br ? " causal-br" : " causal") : "", (wl >= 0 || (wr >= 0 && !causal)) ? " window" : "",
             softcap > 0 ? " softcap" : "", lens ? " lens" : "", det ? " det" : "", ex);
    return buf;
  }
};

// A [B, N, T, S]-broadcast buffer (bias, mask, dbias): each axis full or 1 (stride 0).
struct Bcast {
  int64_t dims[4] = {1, 1, 1, 1}, st[4] = {0, 0, 0, 0};
  size_t n = 1;
  Bcast() = default;
  Bcast(int axes, int B, int N, int T, int S) {
    const int64_t full[4] = {B, N, T, S};
    for (int a = 0; a < 4; ++a) dims[a] = (axes >> a) & 1 ? full[a] : 1;
    int64_t stride = 1;
    for (int a = 3; a >= 0; --a) { st[a] = dims[a] == 1 ? 0 : stride; stride *= dims[a]; }
    n = size_t(stride);
  }
  size_t at(int b, int h, int i, int j) const { return size_t(b * st[0] + h * st[1] + i * st[2] + j * st[3]); }
};

// The optional inputs of a case, on the host (the reference reads these).
struct Extras {
  std::vector<int32_t> qseg, kvseg;   // [B, T], [B, S]
  std::vector<double> bias;           // values as the kernel reads them (rounded if 16-bit)
  std::vector<uint16_t> bias16;       // the bias in the input dtype (bias_f32 = false)
  std::vector<float> bias32;
  std::vector<uint8_t> mask;
  Bcast bshape, mshape;
  std::vector<uint32_t> dkeys;        // dropout key table [B, Nq, 4] (FlashFwdParams::dropout_keys)
};

struct Result { std::vector<double> o, lse, dq, dk, dv, dbias; };

// Reference in float64 (lowp=false) or emulating the input dtype (lowp=true).
static void reference(const Case& c, const FlashFwdParams& p, const Extras& X, const std::vector<double>& q,
                      const std::vector<double>& k, const std::vector<double>& v, const std::vector<double>& dO, bool lowp,
                      Result& R) {
  auto r = [&](double x) { return lowp ? rnd(x) : x; };
  const int B = c.B, T = c.T, S = c.S, Nq = c.Nq, Nkv = c.Nkv, H = c.H, G = Nq / Nkv;
  const double scale = p.scale;
  R.o.assign(size_t(B) * T * Nq * H, 0); R.lse.assign(size_t(B) * Nq * T, -INFINITY);
  R.dq.assign(R.o.size(), 0); R.dk.assign(size_t(B) * S * Nkv * H, 0); R.dv.assign(R.dk.size(), 0);
  std::vector<double> P(size_t(B) * Nq * T * S, 0), dS(P.size(), 0), dSb(c.bias >= 0 ? P.size() : 0, 0);
  auto qi = [&](int b, int t, int h) { return (size_t(b) * T + t) * Nq * H + size_t(h) * H; };
  auto ki = [&](int b, int s, int h) { return (size_t(b) * S + s) * Nkv * H + size_t(h) * H; };
  parallel_for(B * Nq * T, [&](int idx) {
      const int bh = idx / T, i = idx % T;
      const int b = bh / Nq, h = bh % Nq, hk = h / G;
      SeqMask m = make_seq_mask(p, b);
      std::vector<double> s(S), t(S);
      double mx = -INFINITY;
      for (int j = 0; j < S; ++j) {
        double acc = 0;
        for (int d = 0; d < H; ++d) acc += r(q[qi(b, i, h) + d] * scale) * k[ki(b, j, hk) + d];
        double x = r(acc);
        if (!lowp) { acc = 0; for (int d = 0; d < H; ++d) acc += q[qi(b, i, h) + d] * k[ki(b, j, hk) + d]; x = acc * scale; }
        if (c.softcap > 0) { t[j] = std::tanh(x / c.softcap); x = r(c.softcap * t[j]); }
        if (c.bias >= 0) x = r(x + X.bias[X.bshape.at(b, h, i, j)]);
        bool vis = m.visible(i, j);
        if (c.seg) vis = vis && X.qseg[size_t(b) * T + i] == X.kvseg[size_t(b) * S + j];
        if (c.mask >= 0) vis = vis && X.mask[X.mshape.at(b, h, i, j)] != 0;
        s[j] = vis ? x : -INFINITY;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (int j = 0; j < S; ++j) sum += (s[j] == -INFINITY) ? 0 : std::exp(s[j] - mx);
      double* Prow = &P[(size_t(bh) * T + i) * S];
      if (sum > 0) {
        R.lse[size_t(bh) * T + i] = mx + std::log(sum);
        for (int j = 0; j < S; ++j) Prow[j] = s[j] == -INFINITY ? 0 : r(std::exp(s[j] - mx) / sum);
      }
      // Dropout: z = 1 / (1 - rate) where kept, 0 where dropped (the shared HeadDropout).
      std::vector<double> z(S, 1.0);
      if (c.drop > 0) {
        std::vector<float> keep(S, 1.f);
        make_head_dropout(p, b, h).apply_row(keep.data(), i, 0, S, 1.f);
        for (int j = 0; j < S; ++j) z[j] = keep[j] * (1.0 / (1.0 - double(c.drop)));
      }
      std::vector<double> pz(S);  // P o Z: what meets V and dO
      for (int j = 0; j < S; ++j) pz[j] = c.drop > 0 ? r(Prow[j] * z[j]) : Prow[j];
      double D = 0;
      for (int d = 0; d < H; ++d) {
        double acc = 0;
        for (int j = 0; j < S; ++j) acc += pz[j] * v[ki(b, j, hk) + d];
        R.o[qi(b, i, h) + d] = r(acc);
        D += r(acc) * dO[qi(b, i, h) + d];
      }
      double* dSrow = &dS[(size_t(bh) * T + i) * S];
      for (int j = 0; j < S; ++j) {
        if (Prow[j] == 0) continue;
        double dp = 0;
        for (int d = 0; d < H; ++d) dp += dO[qi(b, i, h) + d] * v[ki(b, j, hk) + d];
        double ds = r(Prow[j] * (r(dp) * z[j] - D));
        if (c.bias >= 0) dSb[(size_t(bh) * T + i) * S + j] = ds;
        if (c.softcap > 0) ds = r(ds * (1 - t[j] * t[j]));
        dSrow[j] = ds;
      }
      for (int d = 0; d < H; ++d) {
        double acc = 0;
        for (int j = 0; j < S; ++j) acc += dSrow[j] * k[ki(b, j, hk) + d];
        R.dq[qi(b, i, h) + d] = r(acc * scale);
      }
      for (int j = 0; j < S; ++j) Prow[j] = pz[j];  // dV = (P o Z)^T dO
    });
  parallel_for(B * Nkv * S, [&](int idx) {
      const int bk = idx / S, j = idx % S;
      const int b = bk / Nkv, hk = bk % Nkv;
      for (int d = 0; d < H; ++d) {
        double ak = 0, av = 0;
        for (int g = 0; g < G; ++g) {
          const int h = hk * G + g;
          for (int i = 0; i < T; ++i) {
            const size_t pi = ((size_t(b) * Nq + h) * T + i) * S + j;
            ak += dS[pi] * q[qi(b, i, h) + d];
            av += P[pi] * dO[qi(b, i, h) + d];
          }
        }
        R.dk[ki(b, j, hk) + d] = r(ak * scale);
        R.dv[ki(b, j, hk) + d] = r(av);
      }
    });
  if (c.bias >= 0) {  // dbias: dS before the softcap chain rule, summed over the broadcast axes
    R.dbias.assign(X.bshape.n, 0);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < Nq; ++h)
        for (int i = 0; i < T; ++i)
          for (int j = 0; j < S; ++j) R.dbias[X.bshape.at(b, h, i, j)] += dSb[((size_t(b) * Nq + h) * T + i) * S + j];
  }
}

struct Dev {
  void *q, *k, *v, *o, *dO, *dq, *dk, *dv;
  float *lse, *dsum, *dqacc;
  int *qlens, *kvlens;
  int32_t *qseg = nullptr, *kvseg = nullptr;
  void* bias = nullptr;
  uint8_t* mask = nullptr;
  float* dbias = nullptr;
  uint32_t* dkeys = nullptr;
};

static void fill_params(const Case& c, const Dev& d, FlashBwdParams& p) {
  p = FlashBwdParams{};
  p.q = d.q; p.k = d.k; p.v = d.v; p.o = d.o; p.lse = d.lse;
  p.q_lens = c.lens ? d.qlens : nullptr; p.kv_lens = c.lens ? d.kvlens : nullptr;
  p.batch = c.B; p.seqlen_q = c.T; p.seqlen_k = c.S; p.heads_q = c.Nq; p.heads_kv = c.Nkv; p.head_dim = c.H;
  p.dtype = c.bf16 ? DType::kBFloat16 : DType::kFloat16;
  const int64_t H = c.H;
  p.q_row_stride = c.Nq * H; p.q_head_stride = H; p.q_batch_stride = int64_t(c.T) * c.Nq * H;
  p.k_row_stride = c.Nkv * H; p.k_head_stride = H; p.k_batch_stride = int64_t(c.S) * c.Nkv * H;
  p.v_row_stride = p.k_row_stride; p.v_head_stride = H; p.v_batch_stride = p.k_batch_stride;
  p.o_row_stride = p.q_row_stride; p.o_head_stride = H; p.o_batch_stride = p.q_batch_stride;
  p.scale = 1.f / std::sqrt(float(c.H));
  p.softcap = c.softcap;
  p.window_left = c.wl; p.window_right = c.causal ? 0 : c.wr; p.causal = c.causal;
  p.bottom_right = c.br;
  p.dout = d.dO; p.do_row_stride = p.q_row_stride; p.do_head_stride = H; p.do_batch_stride = p.q_batch_stride;
  p.dq = d.dq; p.dk = d.dk; p.dv = d.dv;
  p.dq_row_stride = p.q_row_stride; p.dq_head_stride = H; p.dq_batch_stride = p.q_batch_stride;
  p.dk_row_stride = p.k_row_stride; p.dk_head_stride = H; p.dk_batch_stride = p.k_batch_stride;
  p.dv_row_stride = p.k_row_stride; p.dv_head_stride = H; p.dv_batch_stride = p.k_batch_stride;
  p.dsum = d.dsum; p.dq_accum = d.dqacc;
  p.seqlen_q_rounded = int(dq_accum_rows(c.T)); p.head_dim_rounded = int(dq_accum_cols(c.H));
  p.deterministic = c.det;
  if (c.seg) {
    p.q_segment_ids = d.qseg; p.kv_segment_ids = d.kvseg; p.q_seg_batch_stride = c.T; p.kv_seg_batch_stride = c.S;
  }
  if (c.bias >= 0) {
    const Bcast bs(c.bias, c.B, c.Nq, c.T, c.S);
    p.bias = d.bias;
    p.bias_dtype = c.bias_f32 ? DType::kFloat32 : p.dtype;
    p.bias_batch_stride = bs.st[0]; p.bias_head_stride = bs.st[1]; p.bias_row_stride = bs.st[2]; p.bias_col_stride = bs.st[3];
    p.dbias = d.dbias;
    p.dbias_batch_stride = bs.st[0]; p.dbias_head_stride = bs.st[1]; p.dbias_row_stride = bs.st[2]; p.dbias_col_stride = bs.st[3];
  }
  if (c.mask >= 0) {
    const Bcast ms(c.mask, c.B, c.Nq, c.T, c.S);
    p.mask = d.mask;
    p.mask_batch_stride = ms.st[0]; p.mask_head_stride = ms.st[1]; p.mask_row_stride = ms.st[2]; p.mask_col_stride = ms.st[3];
  }
  if (c.drop > 0) {  // as fill_extra_params (cuda/ffi/ffi_params.h)
    p.dropout_keys = d.dkeys;
    p.dropout_batch_stride = int64_t(c.Nq) * 4; p.dropout_head_stride = 4;
    p.dropout_rate = c.drop;
    p.dropout_threshold = dropout_threshold(c.drop);
    p.dropout_scale = float(1.0 / (1.0 - double(c.drop)));
  }
}

// The FFI handler's part of a backward call: dbias zeroed (the kernels add into it), then the kernels.
static cudaError_t run_bwd(const FlashBwdParams& p) {
  if (p.dbias) {
    const cudaError_t e = cudaMemsetAsync(p.dbias, 0, sizeof(float) * dbias_elements(p), 0);
    if (e != cudaSuccess) return e;
  }
  return flash_bwd_sm80(p, 0);
}

// The dropout key table of a call: one random 64-bit seed, coordinates (b, h) or (0, 0).
static std::vector<uint32_t> dropout_keys(const Case& c, std::mt19937& rng) {
  std::vector<uint32_t> t(size_t(c.B) * c.Nq * 4);
  const uint32_t lo = rng(), hi = rng();
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.Nq; ++h) {
      uint32_t* e = &t[(size_t(b) * c.Nq + h) * 4];
      e[0] = lo; e[1] = hi; e[2] = c.drop_bcast ? 0 : b; e[3] = c.drop_bcast ? 0 : h;
    }
  return t;
}

static std::vector<float> d2h16(void* dptr, size_t n) {
  std::vector<uint16_t> h(n); CK(cudaMemcpy(h.data(), dptr, n * 2, cudaMemcpyDeviceToHost));
  std::vector<float> f(n); for (size_t i = 0; i < n; ++i) f[i] = h2f(h[i]); return f;
}

struct Cmp { double ours, naive, tol, maxref; bool ok; };
static Cmp compare(const std::vector<float>& got, const std::vector<double>& ref, const std::vector<double>& naive) {
  Cmp c{0, 0, 0, 0, true};
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) { c.ok = false; c.ours = INFINITY; }
    else c.ours = std::max(c.ours, std::fabs(got[i] - ref[i]));
    c.naive = std::max(c.naive, std::fabs(naive[i] - ref[i]));
    c.maxref = std::max(c.maxref, std::fabs(ref[i]));
  }
  c.tol = 2 * c.naive + 2e-4 * std::max(1.0, c.maxref) + 1e-5;
  if (!(c.ours <= c.tol)) c.ok = false;
  return c;
}

static bool run_case(const Case& c, std::mt19937& rng) {
  g_bf16 = c.bf16;
  const size_t nq = size_t(c.B) * c.T * c.Nq * c.H, nk = size_t(c.B) * c.S * c.Nkv * c.H;
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> hq(nq), hk(nk), hv(nk), hdo(nq);
  std::vector<double> q(nq), k(nk), v(nk), dO(nq);
  for (size_t i = 0; i < nq; ++i) { hq[i] = f2h(nd(rng)); q[i] = h2f(hq[i]); hdo[i] = f2h(nd(rng)); dO[i] = h2f(hdo[i]); }
  for (size_t i = 0; i < nk; ++i) { hk[i] = f2h(nd(rng)); k[i] = h2f(hk[i]); hv[i] = f2h(nd(rng)); v[i] = h2f(hv[i]); }
  std::vector<int> qlens(c.B), kvlens(c.B);
  for (int b = 0; b < c.B; ++b) { qlens[b] = std::max(0, c.T - 3 * b - (b == 1 ? c.T / 3 : 0)); kvlens[b] = std::max(1, c.S - 5 * b - (b == 0 ? c.S / 4 : 0)); }
  if (c.B > 2) qlens[2] = 0;  // an entirely empty sequence
  // Optional inputs.
  Extras X;
  if (c.seg) {
    X.qseg.resize(size_t(c.B) * c.T); X.kvseg.resize(size_t(c.B) * c.S);
    std::uniform_int_distribution<int> ud(0, 2);
    for (int b = 0; b < c.B; ++b) {
      // Sorted: 3 + b segments splitting both sequences at the same fractions (packed cross-attention).
      const int nseg = 3 + b;
      for (int i = 0; i < c.T; ++i) X.qseg[size_t(b) * c.T + i] = c.seg == 1 ? int(int64_t(i) * nseg / c.T) : ud(rng);
      for (int j = 0; j < c.S; ++j) X.kvseg[size_t(b) * c.S + j] = c.seg == 1 ? int(int64_t(j) * nseg / c.S) : ud(rng);
    }
  }
  if (c.bias >= 0) {
    X.bshape = Bcast(c.bias, c.B, c.Nq, c.T, c.S);
    X.bias.resize(X.bshape.n); X.bias32.resize(X.bshape.n); X.bias16.resize(X.bshape.n);
    for (size_t i = 0; i < X.bshape.n; ++i) {
      const float x = 1.5f * nd(rng);
      X.bias16[i] = f2h(x);
      X.bias32[i] = x;
      X.bias[i] = c.bias_f32 ? double(x) : double(h2f(X.bias16[i]));
    }
  }
  if (c.mask >= 0) {
    X.mshape = Bcast(c.mask, c.B, c.Nq, c.T, c.S);
    X.mask.resize(X.mshape.n);
    std::uniform_real_distribution<float> uf(0.f, 1.f);
    for (size_t i = 0; i < X.mshape.n; ++i) X.mask[i] = uf(rng) < 0.75f;
    if (c.mask & 4)  // rows 5, 18, 31, ... see no key at all (where rows are not broadcast)
      for (int b = 0; b < int(X.mshape.dims[0]); ++b)
        for (int h = 0; h < int(X.mshape.dims[1]); ++h)
          for (int i = 5; i < c.T; i += 13)
            for (int j = 0; j < int(X.mshape.dims[3]); ++j) X.mask[X.mshape.at(b, h, i, j)] = 0;
  }
  Dev d;
  CK(cudaMalloc(&d.q, nq * 2)); CK(cudaMalloc(&d.k, nk * 2)); CK(cudaMalloc(&d.v, nk * 2)); CK(cudaMalloc(&d.o, nq * 2));
  CK(cudaMalloc(&d.dO, nq * 2)); CK(cudaMalloc(&d.dq, nq * 2)); CK(cudaMalloc(&d.dk, nk * 2)); CK(cudaMalloc(&d.dv, nk * 2));
  const size_t nl = size_t(c.B) * c.Nq * c.T;
  CK(cudaMalloc(&d.lse, nl * 4)); CK(cudaMalloc(&d.dsum, size_t(c.B) * c.Nq * dq_accum_rows(c.T) * 4));
  const size_t nacc = size_t(c.B) * c.Nq * dq_accum_rows(c.T) * dq_accum_cols(c.H);
  CK(cudaMalloc(&d.dqacc, nacc * 4)); CK(cudaMalloc(&d.qlens, c.B * 4)); CK(cudaMalloc(&d.kvlens, c.B * 4));
  CK(cudaMemcpy(d.q, hq.data(), nq * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(d.k, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.v, hv.data(), nk * 2, cudaMemcpyHostToDevice)); CK(cudaMemcpy(d.dO, hdo.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.qlens, qlens.data(), c.B * 4, cudaMemcpyHostToDevice)); CK(cudaMemcpy(d.kvlens, kvlens.data(), c.B * 4, cudaMemcpyHostToDevice));
  if (c.seg) {
    CK(cudaMalloc(&d.qseg, X.qseg.size() * 4)); CK(cudaMalloc(&d.kvseg, X.kvseg.size() * 4));
    CK(cudaMemcpy(d.qseg, X.qseg.data(), X.qseg.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d.kvseg, X.kvseg.data(), X.kvseg.size() * 4, cudaMemcpyHostToDevice));
  }
  if (c.bias >= 0) {
    const size_t nb = X.bshape.n;
    CK(cudaMalloc(&d.bias, nb * (c.bias_f32 ? 4 : 2)));
    if (c.bias_f32) CK(cudaMemcpy(d.bias, X.bias32.data(), nb * 4, cudaMemcpyHostToDevice));
    else CK(cudaMemcpy(d.bias, X.bias16.data(), nb * 2, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&d.dbias, nb * 4));
    CK(cudaMemset(d.dbias, 0xff, nb * 4));  // poisoned: run_bwd must zero it
  }
  if (c.mask >= 0) {
    CK(cudaMalloc(&d.mask, X.mshape.n));
    CK(cudaMemcpy(d.mask, X.mask.data(), X.mshape.n, cudaMemcpyHostToDevice));
  }
  if (c.drop > 0) {
    X.dkeys = dropout_keys(c, rng);
    CK(cudaMalloc(&d.dkeys, X.dkeys.size() * 4));
    CK(cudaMemcpy(d.dkeys, X.dkeys.data(), X.dkeys.size() * 4, cudaMemcpyHostToDevice));
  }
  // Poison outputs and workspaces so unwritten elements show up.
  CK(cudaMemset(d.o, 0xff, nq * 2)); CK(cudaMemset(d.dq, 0xff, nq * 2)); CK(cudaMemset(d.dk, 0xff, nk * 2));
  CK(cudaMemset(d.dv, 0xff, nk * 2)); CK(cudaMemset(d.lse, 0xff, nl * 4)); CK(cudaMemset(d.dqacc, 0xff, nacc * 4));

  FlashBwdParams p; fill_params(c, d, p);
  CK(flash_fwd_sm80(p, 0));
  CK(cudaDeviceSynchronize());
  CK(run_bwd(p));
  CK(cudaDeviceSynchronize());
  std::vector<float> o = d2h16(d.o, nq), dq = d2h16(d.dq, nq), dk = d2h16(d.dk, nk), dv = d2h16(d.dv, nk);
  std::vector<float> lse(nl); CK(cudaMemcpy(lse.data(), d.lse, nl * 4, cudaMemcpyDeviceToHost));
  std::vector<float> dbias(c.bias >= 0 ? X.bshape.n : 0);
  if (c.bias >= 0) CK(cudaMemcpy(dbias.data(), d.dbias, dbias.size() * 4, cudaMemcpyDeviceToHost));
  bool det_ok = true;
  if (c.det) {
    CK(run_bwd(p)); CK(cudaDeviceSynchronize());
    std::vector<float> dq2 = d2h16(d.dq, nq), dk2 = d2h16(d.dk, nk), dv2 = d2h16(d.dv, nk);
    det_ok = !memcmp(dq.data(), dq2.data(), nq * 4) && !memcmp(dk.data(), dk2.data(), nk * 4) && !memcmp(dv.data(), dv2.data(), nk * 4);
    if (c.bias >= 0) {
      std::vector<float> db2(dbias.size());
      CK(cudaMemcpy(db2.data(), d.dbias, db2.size() * 4, cudaMemcpyDeviceToHost));
      det_ok = det_ok && !memcmp(dbias.data(), db2.data(), db2.size() * 4);
    }
  }

  // Host copies of the lengths for the reference mask.
  FlashFwdParams hp = p; hp.q_lens = c.lens ? qlens.data() : nullptr; hp.kv_lens = c.lens ? kvlens.data() : nullptr;
  hp.dropout_keys = c.drop > 0 ? X.dkeys.data() : nullptr;
  Result ref, naive;
  reference(c, hp, X, q, k, v, dO, false, ref);
  reference(c, hp, X, q, k, v, dO, true, naive);
  Cmp co = compare(o, ref.o, naive.o), cq = compare(dq, ref.dq, naive.dq), ck = compare(dk, ref.dk, naive.dk), cv = compare(dv, ref.dv, naive.dv);
  Cmp cb{0, 0, 0, 0, true};
  if (c.bias >= 0) cb = compare(dbias, ref.dbias, naive.dbias);
  double lse_err = 0; bool lse_ok = true;
  for (size_t i = 0; i < nl; ++i) {
    if (std::isinf(ref.lse[i])) { if (!(std::isinf(lse[i]) && lse[i] < 0)) lse_ok = false; }
    else if (!std::isfinite(lse[i])) lse_ok = false;
    else lse_err = std::max(lse_err, std::fabs(lse[i] - ref.lse[i]));
  }
  if (lse_err > 2e-3) lse_ok = false;
  const bool ok = co.ok && cq.ok && ck.ok && cv.ok && cb.ok && lse_ok && det_ok;
  char dbs[64] = "";
  if (c.bias >= 0) snprintf(dbs, sizeof dbs, "  dbias %.1e/%.1e", cb.ours, cb.tol);
  printf("%-4s %-58s o %.1e/%.1e  lse %.1e  dq %.1e/%.1e  dk %.1e/%.1e  dv %.1e/%.1e%s%s\n", ok ? "PASS" : "FAIL", c.name().c_str(),
         co.ours, co.tol, lse_err, cq.ours, cq.tol, ck.ours, ck.tol, cv.ours, cv.tol, dbs, c.det ? (det_ok ? " bit-equal" : " NOT-BIT-EQUAL") : "");
  fflush(stdout);
  cudaFree(d.q); cudaFree(d.k); cudaFree(d.v); cudaFree(d.o); cudaFree(d.dO); cudaFree(d.dq); cudaFree(d.dk); cudaFree(d.dv);
  cudaFree(d.lse); cudaFree(d.dsum); cudaFree(d.dqacc); cudaFree(d.qlens); cudaFree(d.kvlens);
  cudaFree(d.qseg); cudaFree(d.kvseg); cudaFree(d.bias); cudaFree(d.mask); cudaFree(d.dbias); cudaFree(d.dkeys);
  return ok;
}

static void bench(int B, int T, int N, int H, bool causal, bool bf16, float drop = 0.f) {
  Case c; c.bf16 = bf16; c.B = B; c.T = T; c.S = T; c.Nq = N; c.Nkv = N; c.H = H; c.causal = causal; c.drop = drop;
  const size_t n = size_t(B) * T * N * H, nl = size_t(B) * N * T;
  Dev d;
  CK(cudaMalloc(&d.q, n * 2)); CK(cudaMalloc(&d.k, n * 2)); CK(cudaMalloc(&d.v, n * 2)); CK(cudaMalloc(&d.o, n * 2));
  CK(cudaMalloc(&d.dO, n * 2)); CK(cudaMalloc(&d.dq, n * 2)); CK(cudaMalloc(&d.dk, n * 2)); CK(cudaMalloc(&d.dv, n * 2));
  CK(cudaMalloc(&d.lse, nl * 4)); CK(cudaMalloc(&d.dsum, size_t(B) * N * dq_accum_rows(T) * 4));
  CK(cudaMalloc(&d.dqacc, size_t(B) * N * dq_accum_rows(T) * dq_accum_cols(H) * 4));
  g_bf16 = bf16;
  std::vector<uint16_t> h(n); std::mt19937 rng(1); std::normal_distribution<float> nd(0.f, 1.f);
  for (auto* ptr : {d.q, d.k, d.v, d.dO}) { for (auto& x : h) x = f2h(nd(rng)); CK(cudaMemcpy(ptr, h.data(), n * 2, cudaMemcpyHostToDevice)); }
  d.qlens = d.kvlens = nullptr;
  if (drop > 0) {
    const std::vector<uint32_t> keys = dropout_keys(c, rng);
    CK(cudaMalloc(&d.dkeys, keys.size() * 4));
    CK(cudaMemcpy(d.dkeys, keys.data(), keys.size() * 4, cudaMemcpyHostToDevice));
  }
  FlashBwdParams p; fill_params(c, d, p);
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  auto time_it = [&](auto fn) {
    for (int i = 0; i < 3; ++i) CK(fn());
    std::vector<float> ts;
    for (int i = 0; i < 10; ++i) {
      CK(cudaEventRecord(e0)); CK(fn()); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
      float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end()); return ts[ts.size() / 2];
  };
  const double flops = 4.0 * B * N * double(T) * T * H * (causal ? 0.5 : 1.0);
  float tf = time_it([&] { return flash_fwd_sm80(p, 0); });
  float tb = time_it([&] { return run_bwd(p); });
  p.deterministic = true;
  float td = time_it([&] { return run_bwd(p); });
  printf("bench %s B%-2d T=S=%-5d N%-2d H%d %-7s%s fwd %7.3f ms %6.1f TFLOP/s | bwd %7.3f ms %6.1f TFLOP/s | bwd-det %7.3f ms %6.1f TFLOP/s\n",
         bf16 ? "bf16" : "fp16", B, T, N, H, causal ? "causal" : "full", drop > 0 ? " dropout" : "", tf, flops / tf / 1e9, tb,
         2.5 * flops / tb / 1e9, td, 2.5 * flops / td / 1e9);
  fflush(stdout);
  cudaFree(d.q); cudaFree(d.k); cudaFree(d.v); cudaFree(d.o); cudaFree(d.dO); cudaFree(d.dq); cudaFree(d.dk); cudaFree(d.dv);
  cudaFree(d.lse); cudaFree(d.dsum); cudaFree(d.dqacc); cudaFree(d.dkeys);
}

int main(int argc, char** argv) {
  bool small = false, bench_only = false, extras_only = false, dropout_only = false, even_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--small")) small = true;
    if (!strcmp(argv[i], "--bench")) bench_only = true;
    if (!strcmp(argv[i], "--extras")) extras_only = true;
    if (!strcmp(argv[i], "--dropout")) dropout_only = true;
    if (!strcmp(argv[i], "--even")) even_only = true;
  }
  std::vector<Case> cases;
  auto add = [&](Case c) { cases.push_back(c); };
  // Segment ids, bias (+ dbias) and mask, with causal / GQA / lengths / window / softcap.
  auto add_extras = [&](bool bf, int H) {
    const int kFull = 15, kB = 1, kN = 2, kT = 4, kS = 8;
    Case c; c.bf16 = bf; c.H = H; c.B = 2; c.T = 300; c.S = 300; c.Nq = 4; c.Nkv = 2;
    c.seg = 1; c.causal = true; add(c);                                            // packed self-attention
    c = Case(); c.bf16 = bf; c.H = H; c.B = 3; c.T = 97; c.S = 230; c.seg = 2; c.lens = true; c.wl = 60; c.wr = 20; add(c);
    c = Case(); c.bf16 = bf; c.H = H; c.B = 2; c.T = 200; c.S = 333; c.Nq = 4; c.Nkv = 2; c.causal = true;
    c.bias = kFull; add(c);                                                          // full bias, f32
    c.bias_f32 = false; c.bias = kN | kT | kS; c.causal = false; add(c);             // over batch, input dtype
    c = Case(); c.bf16 = bf; c.H = H; c.B = 3; c.T = 130; c.S = 257; c.Nq = 2; c.Nkv = 1; c.lens = true;
    c.causal = true; c.br = true; c.bias = kB | kS; add(c);                          // key-padding style [B, 1, 1, S]
    c = Case(); c.bf16 = bf; c.H = H; c.B = 2; c.T = 150; c.S = 170; c.bias = kB | kN | kT; add(c);  // over keys
    c.bias = kT; c.softcap = 10.f; add(c);                                           // [1, 1, T, 1] + softcap
    c.bias = 0; c.softcap = 0.f; c.causal = true; add(c);                            // scalar [1, 1, 1, 1]
    c = Case(); c.bf16 = bf; c.H = H; c.B = 2; c.T = 211; c.S = 190; c.Nq = 4; c.Nkv = 1; c.causal = true;
    c.mask = kB | kT | kS; add(c);                                                   // [B, 1, T, S], empty rows
    c.mask = kB | kN | kS; c.causal = false; c.lens = true; add(c);                  // [B, N, 1, S]
    c = Case(); c.bf16 = bf; c.H = H; c.B = 3; c.T = 257; c.S = 300; c.Nq = 4; c.Nkv = 2; c.lens = true;
    c.causal = true; c.seg = 1; c.mask = kT | kS; c.bias = kN | kT | kS; c.bias_f32 = false; c.softcap = 20.f; add(c);  // all
    c = Case(); c.bf16 = bf; c.H = H; c.B = 2; c.T = 300; c.S = 400; c.Nq = 4; c.Nkv = 2; c.causal = true; c.det = true;
    c.bias = kFull; c.mask = kT | kS; add(c);                                        // deterministic with a full bias
  };
  // Dropout, alone and with causal / GQA / lengths / window / softcap / broadcast masks / the
  // other optional inputs (dbias under dropout); odd lengths leave partial 4-column groups.
  auto add_dropout = [&](bool bf, int H) {
    Case c; c.bf16 = bf; c.H = H; c.B = 2; c.T = 300; c.S = 300; c.Nq = 4; c.Nkv = 2; c.causal = true; c.drop = 0.3f;
    add(c);                                                                          // causal, GQA 2:1
    c = Case(); c.bf16 = bf; c.H = H; c.T = 97; c.S = 230; c.drop = 0.5f; add(c);   // T != S, odd
    c = Case(); c.bf16 = bf; c.H = H; c.B = 3; c.T = 257; c.S = 190; c.Nq = 4; c.Nkv = 1; c.lens = true; c.causal = true;
    c.br = true; c.drop = 0.7f; add(c);                                              // lengths, GQA 4:1, bottom-right
    c = Case(); c.bf16 = bf; c.H = H; c.B = 2; c.T = 129; c.S = 333; c.Nq = 3; c.Nkv = 3; c.wl = 50; c.wr = 10;
    c.softcap = 20.f; c.drop = 0.2f; c.drop_bcast = true; add(c);                    // window, softcap, one mask
    c = Case(); c.bf16 = bf; c.H = H; c.B = 2; c.T = 200; c.S = 211; c.Nq = 4; c.Nkv = 2; c.causal = true; c.seg = 1;
    c.mask = 4 | 8; c.bias = 2 | 4 | 8; c.bias_f32 = false; c.drop = 0.25f; add(c);  // with every other extra
    c = Case(); c.bf16 = bf; c.H = H; c.B = 2; c.T = 300; c.S = 400; c.Nq = 4; c.Nkv = 2; c.causal = true; c.det = true;
    c.drop = 0.4f; add(c);                                                           // deterministic: bit-equal
  };
  // Block-aligned shapes (the forward's kEven variant: no load/store predicates), with causal
  // (both alignments), GQA, window, softcap and the deterministic backward.
  auto add_even = [&](bool bf, int H) {
    Case c; c.bf16 = bf; c.H = H; c.T = 256; c.S = 512; c.Nq = 4; c.Nkv = 2; c.causal = true; c.br = true; add(c);
    c = Case(); c.bf16 = bf; c.H = H; c.T = 512; c.S = 256; c.causal = true; c.softcap = 20.f; add(c);
    c = Case(); c.bf16 = bf; c.H = H; c.T = 384; c.S = 640; c.wl = 100; c.wr = 30; add(c);
    c = Case(); c.bf16 = bf; c.H = H; c.B = 2; c.T = 256; c.S = 256; c.Nq = 4; c.Nkv = 1; c.causal = true; c.det = true; add(c);
    c = Case(); c.bf16 = bf; c.H = H; c.T = 128; c.S = 192; add(c);
  };
  if (small) {
    Case c; c.H = 64; c.T = 97; c.S = 130; add(c);
    c.causal = true; c.br = true; c.lens = true; c.B = 3; c.Nq = 4; c.Nkv = 1; add(c);
    c = Case(); c.H = 80; c.T = 7; c.S = 200; c.wl = 20; c.wr = 5; c.softcap = 30.f; c.det = true; add(c);
    c = Case(); c.H = 128; c.T = 130; c.S = 70; c.bf16 = false; c.causal = true; add(c);
    c = Case(); c.H = 64; c.B = 2; c.T = 97; c.S = 130; c.Nq = 4; c.Nkv = 2; c.causal = true; c.lens = true; c.seg = 1;
    c.bias = 1 | 4 | 8; c.mask = 8; add(c);
    c = Case(); c.H = 128; c.B = 2; c.T = 97; c.S = 130; c.Nq = 4; c.Nkv = 2; c.causal = true; c.drop = 0.3f; add(c);
  } else if (dropout_only) {
    for (int bf = 1; bf >= 0; --bf)
      for (int H : {64, 128}) add_dropout(bf, H);
    add_dropout(true, 256);
    add_dropout(true, 80);  // padded onto the 128 kernel
  } else if (even_only) {
    for (int bf = 1; bf >= 0; --bf)
      for (int H : {64, 128}) add_even(bf, H);
    add_even(true, 256);
  } else if (extras_only) {
    for (int bf = 1; bf >= 0; --bf)
      for (int H : {64, 128}) add_extras(bf, H);
    add_extras(true, 256);
  } else if (!bench_only) {
    const int TS[][2] = {{1, 7}, {7, 1}, {97, 128}, {128, 97}, {1000, 97}, {97, 1000}};
    for (int bf = 1; bf >= 0; --bf)
      for (int H : {32, 64, 80, 128, 256})
        for (auto ts : TS) {
          if (!bf && H == 256) continue;  // fp16 x 256 not in the harness build
          Case c; c.bf16 = bf; c.H = H; c.T = ts[0]; c.S = ts[1];
          add(c);
          c.causal = true; add(c);
        }
    for (int bf = 1; bf >= 0; --bf)
      for (int H : {64, 128, 256}) {
        if (!bf && H == 256) continue;
        Case c; c.bf16 = bf; c.H = H; c.T = 300; c.S = 1000;
        c.Nq = 4; c.Nkv = 1; add(c);                                   // GQA 4:1
        c.causal = true; c.br = true; add(c);                          // GQA + causal bottom-right
        c = Case(); c.bf16 = bf; c.H = H; c.T = 1000; c.S = 300; c.causal = true; c.br = true; add(c);
        c = Case(); c.bf16 = bf; c.H = H; c.T = 500; c.S = 700; c.wl = 100; c.wr = 30; add(c);   // window
        c.wr = -1; add(c);                                               // left-only window
        c = Case(); c.bf16 = bf; c.H = H; c.T = 200; c.S = 333; c.softcap = 20.f; c.causal = true; add(c);
        c = Case(); c.bf16 = bf; c.H = H; c.B = 3; c.T = 257; c.S = 190; c.lens = true; add(c);    // q/kv lengths (b=2 empty)
        c.causal = true; c.br = true; c.Nq = 4; c.Nkv = 1; c.softcap = 15.f; add(c);               // everything
        c = Case(); c.bf16 = bf; c.H = H; c.T = 400; c.S = 650; c.Nq = 4; c.Nkv = 2; c.causal = true; c.det = true; add(c);
        c.lens = true; c.B = 2; c.wl = 64; c.wr = 8; c.causal = false; add(c);
      }
    { Case c; c.H = 128; c.T = 1000; c.S = 4096; c.causal = true; c.br = true; add(c); }
    { Case c; c.H = 128; c.T = 4096; c.S = 128; add(c); }
    { Case c; c.H = 128; c.T = 4096; c.S = 1000; c.Nq = 4; c.Nkv = 1; c.causal = true; c.det = true; add(c); }
    for (int bf = 1; bf >= 0; --bf)
      for (int H : {64, 128}) add_even(bf, H);
    add_even(true, 256);
    for (int bf = 1; bf >= 0; --bf)
      for (int H : {64, 128}) add_extras(bf, H);
    add_extras(true, 256);
    for (int bf = 1; bf >= 0; --bf)
      for (int H : {64, 128}) add_dropout(bf, H);
    add_dropout(true, 256);
  }
  int fails = 0;
  std::mt19937 rng(1234);
  for (auto& c : cases) fails += !run_case(c, rng);
  if (dropout_only) {  // the cost of dropout (the kExtras kernels + one Philox call per 4 elements)
    bench(4, 4096, 16, 128, false, true);
    bench(4, 4096, 16, 128, false, true, 0.1f);
    bench(4, 4096, 16, 128, true, true);
    bench(4, 4096, 16, 128, true, true, 0.1f);
    bench(8, 2048, 32, 64, false, true, 0.1f);
  }
  if (!small && !extras_only && !dropout_only && !even_only) {
    bench(4, 4096, 16, 128, false, true);
    bench(4, 4096, 16, 128, true, true);
    bench(2, 8192, 16, 128, false, true);
    bench(2, 8192, 16, 128, true, true);
    bench(4, 4096, 16, 128, false, false);
    bench(8, 2048, 32, 64, false, true);
    bench(4, 4096, 8, 256, false, true);
  }
  printf("SUMMARY: %d / %zu cases failed (%s)\n", fails, cases.size(), fails ? "FAIL" : "PASS");
  return fails ? 1 : 0;
}
