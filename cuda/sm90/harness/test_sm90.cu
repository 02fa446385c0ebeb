// Standalone correctness + speed harness for the sm90 forward (flash_fwd_sm90).
// Correctness: float64 CPU reference; ours must be within 2x the error of a naive
// same-dtype computation + a small absolute epsilon; empty rows must be exactly 0 / -inf.
// Speed: the benchmark grid (B*S = 16384, N*H = 2048, bf16; --fp16 for float16), median TFLOP/s.
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

#include "../../common/mask.h"
#include "../../common/harness_util.h"
#include "../flash_sm90.h"
#include "../timeline_print.h"

using namespace jax_flash;


struct Case {
  const char* name;
  int B, T, S, Nq, Nkv, H;
  bool bf16 = true;
  bool causal = false, bottom_right = false;
  int wl = -1, wr = -1;
  float softcap = 0.f;
  int64_t q_offset = 0;
  std::vector<int> q_lens, kv_lens;
  bool packed = false;  // q,k,v slices of one [B,T,3,N,H] tensor (T == S, Nq == Nkv)
};

// The forward's tile-counter workspace (dynamic schedule of causal problems); nullptr with
// --static-schedule, which keeps the static / one-CTA-per-tile launches for comparison.
static int32_t* g_tile_counter = nullptr;

// --sustained=SEC: the bench times about SEC seconds of back-to-back launches (at the board's
// power cap, as a training loop runs) instead of the median of short bursts.
static double g_sustained = 0;

static bool run_case(const Case& c, uint64_t seed) {
  const bool bf = c.bf16;
  FlashFwdParams p;
  p.batch = c.B; p.seqlen_q = c.T; p.seqlen_k = c.S; p.heads_q = c.Nq; p.heads_kv = c.Nkv; p.head_dim = c.H;
  p.dtype = bf ? DType::kBFloat16 : DType::kFloat16;
  p.scale = 1.f / std::sqrt(float(c.H));
  p.softcap = c.softcap;
  p.causal = c.causal;
  p.window_left = c.wl;
  p.window_right = c.causal ? 0 : c.wr;
  p.q_offset = c.q_offset;
  p.bottom_right = c.bottom_right;

  size_t nq = size_t(c.B) * c.T * c.Nq * c.H, nk = size_t(c.B) * c.S * c.Nkv * c.H;
  std::vector<uint16_t> hq, hk, hv, hqkv;
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const uint16_t *Q, *K, *V;
  if (c.packed) {
    hqkv.resize(size_t(c.B) * c.T * 3 * c.Nq * c.H);
    for (auto& x : hqkv) x = from_f(nd(g), bf);
    int64_t row = 3LL * c.Nq * c.H;
    p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = row * c.T;
    p.q_row_stride = p.k_row_stride = p.v_row_stride = row;
    p.q_head_stride = p.k_head_stride = p.v_head_stride = c.H;
    Q = hqkv.data(); K = Q + c.Nq * c.H; V = K + c.Nq * c.H;
  } else {
    hq.resize(nq); hk.resize(nk); hv.resize(nk);
    for (auto& x : hq) x = from_f(nd(g), bf);
    for (auto& x : hk) x = from_f(nd(g), bf);
    for (auto& x : hv) x = from_f(nd(g), bf);
    p.q_batch_stride = int64_t(c.T) * c.Nq * c.H; p.q_row_stride = int64_t(c.Nq) * c.H; p.q_head_stride = c.H;
    p.k_batch_stride = int64_t(c.S) * c.Nkv * c.H; p.k_row_stride = int64_t(c.Nkv) * c.H; p.k_head_stride = c.H;
    p.v_batch_stride = p.k_batch_stride; p.v_row_stride = p.k_row_stride; p.v_head_stride = p.k_head_stride;
    Q = hq.data(); K = hk.data(); V = hv.data();
  }
  p.o_batch_stride = int64_t(c.T) * c.Nq * c.H; p.o_row_stride = int64_t(c.Nq) * c.H; p.o_head_stride = c.H;

  // Device buffers.
  void *dbuf = nullptr, *dq, *dk, *dv, *dout; float* dlse; int *dql = nullptr, *dkl = nullptr;
  size_t in_bytes = c.packed ? hqkv.size() * 2 : (nq + 2 * nk) * 2;
  CK(cudaMalloc(&dbuf, in_bytes));
  if (c.packed) {
    CK(cudaMemcpy(dbuf, hqkv.data(), in_bytes, cudaMemcpyHostToDevice));
    dq = dbuf; dk = (uint16_t*)dbuf + c.Nq * c.H; dv = (uint16_t*)dbuf + 2 * c.Nq * c.H;
  } else {
    dq = dbuf; dk = (uint16_t*)dbuf + nq; dv = (uint16_t*)dbuf + nq + nk;
    CK(cudaMemcpy(dq, hq.data(), nq * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dk, hk.data(), nk * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dv, hv.data(), nk * 2, cudaMemcpyHostToDevice));
  }
  CK(cudaMalloc(&dout, nq * 2));
  CK(cudaMalloc(&dlse, size_t(c.B) * c.Nq * c.T * 4));
  CK(cudaMemset(dout, 0x7f, nq * 2));  // garbage: every element must be written
  CK(cudaMemset(dlse, 0x7f, size_t(c.B) * c.Nq * c.T * 4));
  if (!c.q_lens.empty()) { CK(cudaMalloc(&dql, c.B * 4)); CK(cudaMemcpy(dql, c.q_lens.data(), c.B * 4, cudaMemcpyHostToDevice)); }
  if (!c.kv_lens.empty()) { CK(cudaMalloc(&dkl, c.B * 4)); CK(cudaMemcpy(dkl, c.kv_lens.data(), c.B * 4, cudaMemcpyHostToDevice)); }
  p.q = dq; p.k = dk; p.v = dv; p.o = dout; p.lse = dlse; p.q_lens = dql; p.kv_lens = dkl;

  p.tile_counter = g_tile_counter;
  cudaError_t err = flash_fwd_sm90(p, 0);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  std::vector<uint16_t> ho(nq);
  std::vector<float> hl(size_t(c.B) * c.Nq * c.T);
  if (err == cudaSuccess) {
    CK(cudaMemcpy(ho.data(), dout, nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hl.data(), dlse, hl.size() * 4, cudaMemcpyDeviceToHost));
  }
  cudaFree(dbuf); cudaFree(dout); cudaFree(dlse); if (dql) cudaFree(dql); if (dkl) cudaFree(dkl);
  if (err != cudaSuccess) {
    printf("%-34s FAIL (launch: %s)\n", c.name, cudaGetErrorString(err));
    return false;
  }

  // Host copy of the params with host length arrays for the shared mask rules.
  FlashFwdParams hp = p;
  hp.q_lens = c.q_lens.empty() ? nullptr : c.q_lens.data();
  hp.kv_lens = c.kv_lens.empty() ? nullptr : c.kv_lens.data();
  int grp = c.Nq / c.Nkv;
  struct Acc { double eo = 0, en = 0, el = 0, eln = 0; long bad_empty = 0, nan = 0; };
  std::vector<Acc> acc(size_t(c.B) * c.Nq);
  parallel_for(c.B * c.Nq, [&](int bh) {
    int b = bh / c.Nq, h = bh % c.Nq, hk = h / grp;
    SeqMask m = make_seq_mask(hp, b);
    Acc& a = acc[bh];
    std::vector<double> s(c.S), o(c.H), on(c.H);
    std::vector<float> sn(c.S);
    for (int i = 0; i < c.T; ++i) {
      const uint16_t* q = Q + b * p.q_batch_stride + i * p.q_row_stride + h * p.q_head_stride;
      const uint16_t* og = ho.data() + b * p.o_batch_stride + i * p.o_row_stride + h * p.o_head_stride;
      float lg = hl[(size_t(b) * c.Nq + h) * c.T + i];
      int64_t lo = 0, hi = 0;
      if (i < m.q_len) { lo = m.key_lo(i); hi = m.key_hi(i); }
      if (hi <= lo) {  // empty row: exact zeros and -inf
        for (int d = 0; d < c.H; ++d) if (to_f(og[d], bf) != 0.f) { a.bad_empty++; break; }
        if (!(std::isinf(lg) && lg < 0)) a.bad_empty++;
        continue;
      }
      double mx = -INFINITY; float mxn = -INFINITY;
      for (int64_t j = lo; j < hi; ++j) {
        const uint16_t* k = K + b * p.k_batch_stride + j * p.k_row_stride + hk * p.k_head_stride;
        double d = 0; float df = 0;
        for (int t = 0; t < c.H; ++t) { double x = double(to_f(q[t], bf)) * to_f(k[t], bf); d += x; df += float(x); }
        d *= p.scale;
        float fn = rnd(df, bf) * p.scale;  // naive: logits rounded to the input dtype
        if (c.softcap > 0) { d = c.softcap * std::tanh(d / c.softcap); fn = c.softcap * std::tanh(fn / c.softcap); }
        s[j] = d; sn[j] = fn;
        mx = std::max(mx, d); mxn = std::max(mxn, fn);
      }
      double sum = 0; float sumn = 0;
      std::fill(o.begin(), o.end(), 0.0); std::fill(on.begin(), on.end(), 0.0);
      for (int64_t j = lo; j < hi; ++j) {
        const uint16_t* v = V + b * p.v_batch_stride + j * p.v_row_stride + hk * p.v_head_stride;
        double e = std::exp(s[j] - mx); sum += e;
        float en = std::exp(sn[j] - mxn); sumn += en;
        float pn = rnd(en, bf);  // naive: P in the input dtype
        for (int t = 0; t < c.H; ++t) { double vv = to_f(v[t], bf); o[t] += e * vv; on[t] += double(pn) * vv; }
      }
      for (int t = 0; t < c.H; ++t) {
        double ref = o[t] / sum;
        double naive = rnd(float(on[t] / sumn), bf);
        double got = to_f(og[t], bf);
        if (std::isnan(got)) a.nan++;
        a.eo = std::max(a.eo, std::fabs(got - ref));
        a.en = std::max(a.en, std::fabs(naive - ref));
      }
      double lref = mx + std::log(sum), ln = mxn + std::log(double(sumn));
      if (std::isnan(lg)) a.nan++;
      a.el = std::max(a.el, std::fabs(lg - lref));
      a.eln = std::max(a.eln, std::fabs(ln - lref));
    }
  });
  Acc t;
  for (auto& a : acc) {
    t.eo = std::max(t.eo, a.eo); t.en = std::max(t.en, a.en); t.el = std::max(t.el, a.el); t.eln = std::max(t.eln, a.eln);
    t.bad_empty += a.bad_empty; t.nan += a.nan;
  }
  const double eps = 1e-3;
  bool ok = t.nan == 0 && t.bad_empty == 0 && t.eo <= 2 * t.en + eps && t.el <= 2 * t.eln + eps;
  printf("%-34s %s  out err %.2e (naive %.2e)  lse err %.2e (naive %.2e)%s%s\n", c.name, ok ? "ok  " : "FAIL", t.eo, t.en,
         t.el, t.eln, t.nan ? "  NaN!" : "", t.bad_empty ? "  bad empty rows!" : "");
  return ok;
}

static bool g_fp16 = false;  // --fp16: bench float16 instead of bfloat16
static double bench(int H, int S, bool causal, int reps) {
  int B = 16384 / S, N = 2048 / H;
  FlashFwdParams p;
  p.batch = B; p.seqlen_q = S; p.seqlen_k = S; p.heads_q = N; p.heads_kv = N; p.head_dim = H;
  p.dtype = g_fp16 ? DType::kFloat16 : DType::kBFloat16;
  p.scale = 1.f / std::sqrt(float(H)); p.causal = causal; p.window_right = causal ? 0 : -1;
  size_t n = size_t(B) * S * N * H;
  void *q, *k, *v, *o; float* lse;
  CK(cudaMalloc(&q, n * 2)); CK(cudaMalloc(&k, n * 2)); CK(cudaMalloc(&v, n * 2)); CK(cudaMalloc(&o, n * 2));
  CK(cudaMalloc(&lse, size_t(B) * N * S * 4));
  // Independent random q, k, v, as in the JAX benchmark (q = k = v before session 8 measured
  // within 1% of this, NOTES.md "Harness and JAX figures").
  std::vector<uint16_t> h(n);
  std::mt19937 g(1);
  std::normal_distribution<float> nd;
  for (void* x : {q, k, v}) {
    for (auto& e : h) e = from_f(nd(g), !g_fp16);
    CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
  }
  p.q = q; p.k = k; p.v = v; p.o = o; p.lse = lse;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = int64_t(S) * N * H;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = int64_t(N) * H;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = H;
  p.tile_counter = g_tile_counter;
  double ms = median_ms([&] { return flash_fwd_sm90(p, 0); }, 3, reps, S <= 1024 ? 10 : 3);
  if (g_sustained > 0) {  // --sustained=SEC: one back-to-back run of about SEC seconds instead
    int const calls = std::max(1, int(g_sustained * 1e3 / ms));
    ms = median_ms([&] { return flash_fwd_sm90(p, 0); }, 0, 1, calls);
  }
  double flops = 4.0 * B * N * double(S) * S * H / (causal ? 2 : 1);
  cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o); cudaFree(lse);
  return flops / (ms * 1e-3) / 1e12;
}

#ifdef JF_FWD_TIMELINE
static void print_timeline(uint32_t* dbuf, int H, int S, int causal) {
  char title[96];
  snprintf(title, sizeof(title), "timeline H=%d S=%d causal=%d", H, S, causal);
  sm90::print_timeline(dbuf, title, {"wait K+ping-pong", "issue", "wait S", "softmax", "wait PV+conv+rescale"});
  sm90::print_tile_timeline(dbuf, title);
}
#endif

int main(int argc, char** argv) {
  bool do_test = true, do_bench = true;
  std::vector<int> hdims = {128, 64, 256};
  int only_s = 0, only_causal = -1;  // bench filters (one cell for ncu)
  bool static_schedule = false;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--no-bench")) do_bench = false;
    if (!strcmp(argv[i], "--fp16")) g_fp16 = true;
    if (!strcmp(argv[i], "--static-schedule")) static_schedule = true;
    if (!strcmp(argv[i], "--no-test")) do_test = false;
    if (!strncmp(argv[i], "--h=", 4)) hdims = {atoi(argv[i] + 4)};
    if (!strncmp(argv[i], "--s=", 4)) only_s = atoi(argv[i] + 4);
    if (!strncmp(argv[i], "--causal=", 9)) only_causal = atoi(argv[i] + 9);
    if (!strncmp(argv[i], "--sustained=", 12)) g_sustained = atof(argv[i] + 12);
#ifdef JF_FWD_TIMELINE
    if (!strcmp(argv[i], "--timeline")) {
      CK(cudaMalloc(&sm90::g_fwd_timeline, sm90::kTimelineBytes));
      CK(cudaMemset(sm90::g_fwd_timeline, 0, sm90::kTimelineBytes));
    }
#endif
  }
  if (!static_schedule) CK(cudaMalloc(&g_tile_counter, sizeof(int32_t)));
  int fails = 0, total = 0;
  if (do_test) {
    for (int H : hdims) {
      std::vector<Case> cs;
      auto add = [&](Case c) { c.H = H; cs.push_back(c); };
      Case c;
      c = {"nc T97 S1000 gqa4", 2, 97, 1000, 4, 1}; add(c);
      c = {"causal-tl T1000 S97 gqa4", 1, 1000, 97, 4, 1}; c.causal = true; add(c);
      c = {"causal-br T1000 S4096", 1, 1000, 4096, 2, 2}; c.causal = true; c.bottom_right = true; add(c);
      c = {"causal-br T4096 S1000 gqa4", 1, 4096, 1000, 4, 1}; c.causal = true; c.bottom_right = true; add(c);
      c = {"causal-br T1 S4096 gqa4", 2, 1, 4096, 4, 1}; c.causal = true; c.bottom_right = true; add(c);
      c = {"nc T128 S1 gqa4", 2, 128, 1, 4, 1}; add(c);
      c = {"window(256,64) T1000 S4096", 1, 1000, 4096, 4, 1}; c.wl = 256; c.wr = 64; c.q_offset = 1500; add(c);
      c = {"causal-tl softcap30 T97 S128", 2, 97, 128, 4, 1}; c.causal = true; c.softcap = 30.f; add(c);
      c = {"lens causal-br T1000 S1000", 3, 1000, 1000, 4, 1}; c.causal = true; c.bottom_right = true;
      c.q_lens = {1000, 500, 0}; c.kv_lens = {997, 3, 10}; add(c);
      c = {"softcap15 wl500 T128 S4096", 2, 128, 4096, 4, 1}; c.softcap = 15.f; c.wl = 500; c.q_offset = 3000; add(c);
      c = {"packed-qkv causal T1000", 2, 1000, 1000, 2, 2}; c.causal = true; c.packed = true; add(c);
      c = {"nc T4096 S128", 1, 4096, 128, 2, 2}; add(c);
      c = {"fp16 nc T97 S1000 gqa4", 2, 97, 1000, 4, 1}; c.bf16 = false; add(c);
      c = {"fp16 causal-br T1000 S4096", 1, 1000, 4096, 2, 2}; c.bf16 = false; c.causal = true; c.bottom_right = true; add(c);
      c = {"fp16 softcap30 causal T97 S128", 2, 97, 128, 4, 1}; c.bf16 = false; c.causal = true; c.softcap = 30.f; add(c);
      c = {"fp16 lens causal-br", 3, 1000, 1000, 4, 1}; c.bf16 = false; c.causal = true; c.bottom_right = true;
      c.q_lens = {1000, 500, 0}; c.kv_lens = {997, 3, 10}; add(c);
      c = {"fp16 packed-qkv window", 2, 1000, 1000, 2, 2}; c.bf16 = false; c.packed = true; c.wl = 100; c.wr = 30; add(c);
      // Several tiles per persistent CTA (more tiles than the 132 SMs hold at once): tile
      // boundaries inside a CTA (what v80's cross-tile step changed), empty tiles among full ones.
      c = {"persist nc T2048 S512 gqa4", 4, 2048, 512, 16, 4}; add(c);
      c = {"persist causal T2048 S2048", 2, 2048, 2048, 16, 16}; c.causal = true; add(c);
      c = {"persist lens nc T1024 S1024", 8, 1024, 1024, 16, 16};
      c.q_lens = {1024, 0, 700, 1, 1024, 129, 0, 900}; c.kv_lens = {1024, 5, 0, 1024, 1, 1024, 300, 64}; add(c);
      c = {"persist softcap30 wl300 T1024", 4, 1024, 1024, 16, 8}; c.softcap = 30.f; c.wl = 300; c.wr = 0; add(c);
      c = {"fp16 persist causal-br T1024 S3000", 4, 1024, 3000, 16, 8}; c.bf16 = false; c.causal = true; c.bottom_right = true; add(c);
      printf("== H=%d ==\n", H);
      uint64_t seed = 1;
      for (auto& cc : cs) { total++; fails += !run_case(cc, seed++); }
    }
    printf("correctness: %d/%d passed\n", total - fails, total);
  }
  if (do_bench) {
    const int Ss[3] = {1024, 4096, 16384};
    // Reference numbers (TFLOP/s, same H200): cudnn / fa3 as the JAX benchmark measures them
    // (ANCHORS.md). cuDNN's kernels alone run 10-20% faster at S = 1k (NOTES.md, session 10).
    const int ref[3][2][3][2] = {
        {{{375, 275}, {453, 332}, {454, 347}}, {{285, 233}, {390, 308}, {438, 329}}},
        {{{502, 528}, {630, 641}, {616, 630}}, {{334, 395}, {512, 579}, {593, 640}}},
        {{{529, 0}, {684, 0}, {663, 0}}, {{327, 0}, {554, 0}, {592, 0}}}};
    printf("\n   H causal%s |  S=1k ours (cudnn/fa3) |  S=4k ours (cudnn/fa3) | S=16k ours (cudnn/fa3)\n", g_fp16 ? " (fp16)" : "");
    for (int H : hdims) {
      int hi = H == 64 ? 0 : H == 128 ? 1 : 2;
      for (int causal = 0; causal < 2; ++causal) {
        if (only_causal >= 0 && causal != only_causal) continue;
        printf("%4d %6s |", H, causal ? "yes" : "no");
        for (int si = 0; si < 3; ++si) {
          if (only_s && Ss[si] != only_s) { printf("       -                |"); continue; }
          double tf = bench(H, Ss[si], causal, 7);
#ifdef JF_FWD_TIMELINE
          if (sm90::g_fwd_timeline) {
            print_timeline(sm90::g_fwd_timeline, H, Ss[si], causal);
            CK(cudaMemset(sm90::g_fwd_timeline, 0, sm90::kTimelineBytes));
          }
#endif
          printf(" %6.0f (%4d/%4d)      |", tf, ref[hi][causal][si][0], ref[hi][causal][si][1]);
          fflush(stdout);
        }
        printf("\n");
      }
    }
  }
  return fails ? 1 : 0;
}
