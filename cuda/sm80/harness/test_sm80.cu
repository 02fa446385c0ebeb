// Standalone correctness + speed harness for the SM80 FlashAttention kernels.
//   test_sm80            full case grid, then the benchmark shapes
//   test_sm80 --small    a few tiny cases (for compute-sanitizer)
//   test_sm80 --bench    benchmark only
// Correctness rule (as FlashAttention's tests): max|ours - ref64| <= 2 * max|naive - ref64| + atol,
// where naive computes the same function in the input dtype (rounding every matmul output
// and P) and ref64 in float64. Exit code != 0 on any failure.
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
  std::string name() const {
    char buf[200];
    snprintf(buf, sizeof buf, "%s H%-3d T%-4d S%-4d B%d N%d/%d%s%s%s%s%s%s", bf16 ? "bf16" : "fp16", H, T, S, B, Nq, Nkv,
             causal ? (br ? " causal-br" : " causal") : "", (wl >= 0 || (wr >= 0 && !causal)) ? " window" : "",
             softcap > 0 ? " softcap" : "", lens ? " lens" : "", det ? " det" : "", "");
    return buf;
  }
};

struct Result { std::vector<double> o, lse, dq, dk, dv; };

// Reference in float64 (lowp=false) or emulating the input dtype (lowp=true).
static void reference(const Case& c, const FlashFwdParams& p, const std::vector<double>& q, const std::vector<double>& k,
                      const std::vector<double>& v, const std::vector<double>& dO, bool lowp, Result& R) {
  auto r = [&](double x) { return lowp ? rnd(x) : x; };
  const int B = c.B, T = c.T, S = c.S, Nq = c.Nq, Nkv = c.Nkv, H = c.H, G = Nq / Nkv;
  const double scale = p.scale;
  R.o.assign(size_t(B) * T * Nq * H, 0); R.lse.assign(size_t(B) * Nq * T, -INFINITY);
  R.dq.assign(R.o.size(), 0); R.dk.assign(size_t(B) * S * Nkv * H, 0); R.dv.assign(R.dk.size(), 0);
  std::vector<double> P(size_t(B) * Nq * T * S, 0), dS(P.size(), 0);
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
        s[j] = m.visible(i, j) ? x : -INFINITY;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      for (int j = 0; j < S; ++j) sum += (s[j] == -INFINITY) ? 0 : std::exp(s[j] - mx);
      double* Prow = &P[(size_t(bh) * T + i) * S];
      if (sum > 0) {
        R.lse[size_t(bh) * T + i] = mx + std::log(sum);
        for (int j = 0; j < S; ++j) Prow[j] = s[j] == -INFINITY ? 0 : r(std::exp(s[j] - mx) / sum);
      }
      double D = 0;
      for (int d = 0; d < H; ++d) {
        double acc = 0;
        for (int j = 0; j < S; ++j) acc += Prow[j] * v[ki(b, j, hk) + d];
        R.o[qi(b, i, h) + d] = r(acc);
        D += r(acc) * dO[qi(b, i, h) + d];
      }
      double* dSrow = &dS[(size_t(bh) * T + i) * S];
      for (int j = 0; j < S; ++j) {
        if (Prow[j] == 0) continue;
        double dp = 0;
        for (int d = 0; d < H; ++d) dp += dO[qi(b, i, h) + d] * v[ki(b, j, hk) + d];
        double ds = r(Prow[j] * (r(dp) - D));
        if (c.softcap > 0) ds = r(ds * (1 - t[j] * t[j]));
        dSrow[j] = ds;
      }
      for (int d = 0; d < H; ++d) {
        double acc = 0;
        for (int j = 0; j < S; ++j) acc += dSrow[j] * k[ki(b, j, hk) + d];
        R.dq[qi(b, i, h) + d] = r(acc * scale);
      }
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
}

struct Dev {
  void *q, *k, *v, *o, *dO, *dq, *dk, *dv;
  float *lse, *dsum, *dqacc;
  int *qlens, *kvlens;
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
  // Poison outputs and workspaces so unwritten elements show up.
  CK(cudaMemset(d.o, 0xff, nq * 2)); CK(cudaMemset(d.dq, 0xff, nq * 2)); CK(cudaMemset(d.dk, 0xff, nk * 2));
  CK(cudaMemset(d.dv, 0xff, nk * 2)); CK(cudaMemset(d.lse, 0xff, nl * 4)); CK(cudaMemset(d.dqacc, 0xff, nacc * 4));

  FlashBwdParams p; fill_params(c, d, p);
  CK(flash_fwd_sm80(p, 0));
  CK(cudaDeviceSynchronize());
  CK(flash_bwd_sm80(p, 0));
  CK(cudaDeviceSynchronize());
  std::vector<float> o = d2h16(d.o, nq), dq = d2h16(d.dq, nq), dk = d2h16(d.dk, nk), dv = d2h16(d.dv, nk);
  std::vector<float> lse(nl); CK(cudaMemcpy(lse.data(), d.lse, nl * 4, cudaMemcpyDeviceToHost));
  bool det_ok = true;
  if (c.det) {
    CK(flash_bwd_sm80(p, 0)); CK(cudaDeviceSynchronize());
    std::vector<float> dq2 = d2h16(d.dq, nq), dk2 = d2h16(d.dk, nk), dv2 = d2h16(d.dv, nk);
    det_ok = !memcmp(dq.data(), dq2.data(), nq * 4) && !memcmp(dk.data(), dk2.data(), nk * 4) && !memcmp(dv.data(), dv2.data(), nk * 4);
  }

  // Host copies of the lengths for the reference mask.
  FlashFwdParams hp = p; hp.q_lens = c.lens ? qlens.data() : nullptr; hp.kv_lens = c.lens ? kvlens.data() : nullptr;
  Result ref, naive;
  reference(c, hp, q, k, v, dO, false, ref);
  reference(c, hp, q, k, v, dO, true, naive);
  Cmp co = compare(o, ref.o, naive.o), cq = compare(dq, ref.dq, naive.dq), ck = compare(dk, ref.dk, naive.dk), cv = compare(dv, ref.dv, naive.dv);
  double lse_err = 0; bool lse_ok = true;
  for (size_t i = 0; i < nl; ++i) {
    if (std::isinf(ref.lse[i])) { if (!(std::isinf(lse[i]) && lse[i] < 0)) lse_ok = false; }
    else if (!std::isfinite(lse[i])) lse_ok = false;
    else lse_err = std::max(lse_err, std::fabs(lse[i] - ref.lse[i]));
  }
  if (lse_err > 2e-3) lse_ok = false;
  const bool ok = co.ok && cq.ok && ck.ok && cv.ok && lse_ok && det_ok;
  printf("%-4s %-58s o %.1e/%.1e  lse %.1e  dq %.1e/%.1e  dk %.1e/%.1e  dv %.1e/%.1e%s\n", ok ? "ok" : "FAIL", c.name().c_str(),
         co.ours, co.tol, lse_err, cq.ours, cq.tol, ck.ours, ck.tol, cv.ours, cv.tol, c.det ? (det_ok ? " bit-equal" : " NOT-BIT-EQUAL") : "");
  fflush(stdout);
  cudaFree(d.q); cudaFree(d.k); cudaFree(d.v); cudaFree(d.o); cudaFree(d.dO); cudaFree(d.dq); cudaFree(d.dk); cudaFree(d.dv);
  cudaFree(d.lse); cudaFree(d.dsum); cudaFree(d.dqacc); cudaFree(d.qlens); cudaFree(d.kvlens);
  return ok;
}

static void bench(int B, int T, int N, int H, bool causal, bool bf16) {
  Case c; c.bf16 = bf16; c.B = B; c.T = T; c.S = T; c.Nq = N; c.Nkv = N; c.H = H; c.causal = causal;
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
  float tb = time_it([&] { return flash_bwd_sm80(p, 0); });
  p.deterministic = true;
  float td = time_it([&] { return flash_bwd_sm80(p, 0); });
  printf("bench %s B%-2d T=S=%-5d N%-2d H%d %-7s fwd %7.3f ms %6.1f TFLOP/s | bwd %7.3f ms %6.1f TFLOP/s | bwd-det %7.3f ms %6.1f TFLOP/s\n",
         bf16 ? "bf16" : "fp16", B, T, N, H, causal ? "causal" : "full", tf, flops / tf / 1e9, tb, 2.5 * flops / tb / 1e9,
         td, 2.5 * flops / td / 1e9);
  fflush(stdout);
  cudaFree(d.q); cudaFree(d.k); cudaFree(d.v); cudaFree(d.o); cudaFree(d.dO); cudaFree(d.dq); cudaFree(d.dk); cudaFree(d.dv);
  cudaFree(d.lse); cudaFree(d.dsum); cudaFree(d.dqacc);
}

int main(int argc, char** argv) {
  bool small = false, bench_only = false;
  for (int i = 1; i < argc; ++i) { if (!strcmp(argv[i], "--small")) small = true; if (!strcmp(argv[i], "--bench")) bench_only = true; }
  std::vector<Case> cases;
  auto add = [&](Case c) { cases.push_back(c); };
  if (small) {
    Case c; c.H = 64; c.T = 97; c.S = 130; add(c);
    c.causal = true; c.br = true; c.lens = true; c.B = 3; c.Nq = 4; c.Nkv = 1; add(c);
    c = Case(); c.H = 80; c.T = 7; c.S = 200; c.wl = 20; c.wr = 5; c.softcap = 30.f; c.det = true; add(c);
    c = Case(); c.H = 128; c.T = 130; c.S = 70; c.bf16 = false; c.causal = true; add(c);
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
  }
  int fails = 0;
  std::mt19937 rng(1234);
  for (auto& c : cases) fails += !run_case(c, rng);
  if (!small) {
    bench(4, 4096, 16, 128, false, true);
    bench(4, 4096, 16, 128, true, true);
    bench(2, 8192, 16, 128, false, true);
    bench(2, 8192, 16, 128, true, true);
    bench(4, 4096, 16, 128, false, false);
    bench(8, 2048, 32, 64, false, true);
    bench(4, 4096, 8, 256, false, true);
  }
  printf("%d / %zu cases failed\n", fails, cases.size());
  return fails ? 1 : 0;
}
