// Standalone correctness + speed harness for the sm90 backward (flash_bwd_sm90).
// Forward (o, lse) and backward references on the CPU in float64. Ours must be within 2x the
// error of a naive same-dtype computation (P and dS rounded to the dtype, fp32 math) plus
// eps = 1e-3 * max(1, max|ref|). Speed: B*S = 16384, N*H = 2048, bf16 (--fp16: float16), median TFLOP/s with
// TFLOP/s = 2.5 * 4*B*N*S*S*H / time (halved for causal).
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
#include "../flash_bwd_sm90.h"
#include "../timeline_print.h"

using namespace jax_flash;


struct Case {
  const char* name;
  int B, T, S, Nq, Nkv;
  bool bf16 = true;
  int H = 128;
  bool det = false;  // deterministic: also run 3 more times and require identical dq bits
  bool causal = false, bottom_right = false;
  int wl = -1, wr = -1;
  float softcap = 0.f;
  int64_t q_offset = 0;
  std::vector<int> q_lens, kv_lens;
};


static bool run_case(const Case& c, uint64_t seed) {
  const int H = c.H;
  const bool bf = c.bf16;
  FlashBwdParams p;
  p.batch = c.B; p.seqlen_q = c.T; p.seqlen_k = c.S; p.heads_q = c.Nq; p.heads_kv = c.Nkv; p.head_dim = H;
  p.dtype = bf ? DType::kBFloat16 : DType::kFloat16;
  p.scale = 1.f / std::sqrt(float(H));
  p.softcap = c.softcap;
  p.causal = c.causal;
  p.window_left = c.wl;
  p.window_right = c.causal ? 0 : c.wr;
  p.q_offset = c.q_offset;
  p.bottom_right = c.bottom_right;
  p.q_batch_stride = int64_t(c.T) * c.Nq * H; p.q_row_stride = int64_t(c.Nq) * H; p.q_head_stride = H;
  p.k_batch_stride = int64_t(c.S) * c.Nkv * H; p.k_row_stride = int64_t(c.Nkv) * H; p.k_head_stride = H;
  p.v_batch_stride = p.k_batch_stride; p.v_row_stride = p.k_row_stride; p.v_head_stride = H;
  p.o_batch_stride = p.do_batch_stride = p.dq_batch_stride = p.q_batch_stride;
  p.o_row_stride = p.do_row_stride = p.dq_row_stride = p.q_row_stride;
  p.o_head_stride = p.do_head_stride = p.dq_head_stride = H;
  p.dk_batch_stride = p.dv_batch_stride = p.k_batch_stride;
  p.dk_row_stride = p.dv_row_stride = p.k_row_stride;
  p.dk_head_stride = p.dv_head_stride = H;
  p.seqlen_q_rounded = int(dq_accum_rows(c.T));
  p.head_dim_rounded = int(dq_accum_cols(H));

  size_t nq = size_t(c.B) * c.T * c.Nq * H, nk = size_t(c.B) * c.S * c.Nkv * H;
  std::vector<uint16_t> hq(nq), hk(nk), hv(nk), hdo(nq), ho(nq);
  std::vector<float> hl(size_t(c.B) * c.Nq * c.T);
  std::mt19937_64 g(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (auto& x : hq) x = from_f(nd(g), bf);
  for (auto& x : hk) x = from_f(nd(g), bf);
  for (auto& x : hv) x = from_f(nd(g), bf);
  for (auto& x : hdo) x = from_f(nd(g), bf);
  FlashBwdParams hp = p;
  hp.q_lens = c.q_lens.empty() ? nullptr : c.q_lens.data();
  hp.kv_lens = c.kv_lens.empty() ? nullptr : c.kv_lens.data();
  const int grp = c.Nq / c.Nkv;
  auto Qp = [&](int b, int64_t i, int h) { return hq.data() + b * p.q_batch_stride + i * p.q_row_stride + h * H; };
  auto Kp = [&](int b, int64_t j, int h) { return hk.data() + b * p.k_batch_stride + j * p.k_row_stride + h * H; };
  auto Vp = [&](int b, int64_t j, int h) { return hv.data() + b * p.k_batch_stride + j * p.k_row_stride + h * H; };
  auto logit = [&](int b, int64_t i, int h, int64_t j, double* capped, double* grad) {
    const uint16_t *q = Qp(b, i, h), *k = Kp(b, j, h / grp);
    double d = 0;
    for (int t = 0; t < H; ++t) d += double(to_f(q[t], bf)) * to_f(k[t], bf);
    d *= p.scale;
    *grad = 1;
    if (c.softcap > 0) { double tt = std::tanh(d / c.softcap); d = c.softcap * tt; *grad = 1 - tt * tt; }
    *capped = d;
  };
  // Forward reference: o (rounded to the dtype, as a forward kernel would store it) and lse.
  std::vector<double> lse_ref(hl.size());
  parallel_for(c.B * c.Nq, [&](int bh) {
    int b = bh / c.Nq, h = bh % c.Nq;
    SeqMask m = make_seq_mask(hp, b);
    std::vector<double> s(c.S), o(H);
    for (int i = 0; i < c.T; ++i) {
      int64_t lo = 0, hi = 0;
      if (i < m.q_len) { lo = m.key_lo(i); hi = m.key_hi(i); }
      uint16_t* og = ho.data() + b * p.o_batch_stride + int64_t(i) * p.o_row_stride + h * H;
      size_t li = (size_t(b) * c.Nq + h) * c.T + i;
      if (hi <= lo) {
        for (int t = 0; t < H; ++t) og[t] = from_f(0.f, bf);
        hl[li] = -INFINITY; lse_ref[li] = -INFINITY;
        continue;
      }
      double mx = -INFINITY, gr;
      for (int64_t j = lo; j < hi; ++j) { logit(b, i, h, j, &s[j], &gr); mx = std::max(mx, s[j]); }
      double sum = 0;
      std::fill(o.begin(), o.end(), 0.0);
      for (int64_t j = lo; j < hi; ++j) {
        double e = std::exp(s[j] - mx); sum += e;
        const uint16_t* v = Vp(b, j, h / grp);
        for (int t = 0; t < H; ++t) o[t] += e * to_f(v[t], bf);
      }
      for (int t = 0; t < H; ++t) og[t] = from_f(float(o[t] / sum), bf);
      lse_ref[li] = mx + std::log(sum);
      hl[li] = float(lse_ref[li]);
    }
  });

  // Device.
  void *dq_in, *dk_in, *dv_in, *do_in, *o_in, *dq, *dk, *dv;
  float *dlse, *ddsum, *dlse2, *dacc; int *dql = nullptr, *dkl = nullptr, *dsem;
  CK(cudaMalloc(&dq_in, nq * 2)); CK(cudaMalloc(&dk_in, nk * 2)); CK(cudaMalloc(&dv_in, nk * 2));
  CK(cudaMalloc(&do_in, nq * 2)); CK(cudaMalloc(&o_in, nq * 2));
  CK(cudaMalloc(&dq, nq * 2)); CK(cudaMalloc(&dk, nk * 2)); CK(cudaMalloc(&dv, nk * 2));
  size_t const n_stats = size_t(c.B) * c.Nq * p.seqlen_q_rounded;
  CK(cudaMalloc(&dlse, hl.size() * 4)); CK(cudaMalloc(&ddsum, n_stats * 4)); CK(cudaMalloc(&dlse2, n_stats * 4));
  CK(cudaMalloc(&dsem, n_stats / 64 * 4)); CK(cudaMemset(dsem, 0x7f, n_stats / 64 * 4));
  p.deterministic = c.det; p.dq_semaphore = dsem;
  size_t acc_n = size_t(c.B) * c.Nq * p.seqlen_q_rounded * p.head_dim_rounded;
  CK(cudaMalloc(&dacc, acc_n * 4));
  CK(cudaMemcpy(dq_in, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dk_in, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv_in, hv.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(do_in, hdo.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(o_in, ho.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dlse, hl.data(), hl.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dq, 0x7f, nq * 2)); CK(cudaMemset(dk, 0x7f, nk * 2)); CK(cudaMemset(dv, 0x7f, nk * 2));
  CK(cudaMemset(dacc, 0x7f, acc_n * 4)); CK(cudaMemset(ddsum, 0x7f, n_stats * 4)); CK(cudaMemset(dlse2, 0x7f, n_stats * 4));
  // The int32 workspace as the FFI handler passes it without segment ids (the split tail's slots;
  // garbage first: the row statistics kernel must zero what the main kernel reads).
  int* dws = nullptr;
  int64_t const ws_ints = bwd_workspace_ints(c.B, c.Nkv, c.S, false);
  CK(cudaMalloc(&dws, ws_ints * 4)); CK(cudaMemset(dws, 0x7f, ws_ints * 4));
  p.tile_counter = dws;
  if (!c.q_lens.empty()) { CK(cudaMalloc(&dql, c.B * 4)); CK(cudaMemcpy(dql, c.q_lens.data(), c.B * 4, cudaMemcpyHostToDevice)); }
  if (!c.kv_lens.empty()) { CK(cudaMalloc(&dkl, c.B * 4)); CK(cudaMemcpy(dkl, c.kv_lens.data(), c.B * 4, cudaMemcpyHostToDevice)); }
  p.q = dq_in; p.k = dk_in; p.v = dv_in; p.o = o_in; p.lse = dlse; p.dout = do_in;
  p.dq = dq; p.dk = dk; p.dv = dv; p.dsum = ddsum; p.lse_log2 = dlse2; p.dq_accum = dacc; p.q_lens = dql; p.kv_lens = dkl;
  cudaError_t err = flash_bwd_sm90(p, 0);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  std::vector<uint16_t> gq(nq), gk(nk), gv(nk);
  bool same_bits = true;
  if (err == cudaSuccess) {
    CK(cudaMemcpy(gq.data(), dq, nq * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gk.data(), dk, nk * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(gv.data(), dv, nk * 2, cudaMemcpyDeviceToHost));
    for (int rep = 0; c.det && rep < 3 && err == cudaSuccess; ++rep) {
      err = flash_bwd_sm90(p, 0);
      if (err == cudaSuccess) err = cudaDeviceSynchronize();
      std::vector<uint16_t> g2(nq);
      CK(cudaMemcpy(g2.data(), dq, nq * 2, cudaMemcpyDeviceToHost));
      same_bits = same_bits && g2 == gq;
    }
  }
  for (void* x : {dq_in, dk_in, dv_in, do_in, o_in, dq, dk, dv}) cudaFree(x);
  cudaFree(dlse); cudaFree(ddsum); cudaFree(dlse2); cudaFree(dsem); cudaFree(dacc); cudaFree(dws);
  if (dql) cudaFree(dql); if (dkl) cudaFree(dkl);
  if (err != cudaSuccess) {
    printf("%-34s FAIL (launch: %s)\n", c.name, cudaGetErrorString(err));
    return false;
  }

  // Backward reference: tasks over (b, hq, row chunk), private dK/dV, reduced afterwards.
  int chunk = std::max(32, int((int64_t(c.B) * c.Nq * c.T + 63) / 64));
  int nch = (c.T + chunk - 1) / chunk;
  int ntask = c.B * c.Nq * nch;
  size_t kvsz = size_t(c.S) * H;
  std::vector<double> rdq(nq, 0.0), rdk(nk, 0.0), rdv(nk, 0.0);
  std::vector<float> ndq(nq, 0.f), ndk(nk, 0.f), ndv(nk, 0.f);
  std::vector<std::vector<double>> tdk(ntask), tdv(ntask);
  std::vector<std::vector<float>> tndk(ntask), tndv(ntask);
  parallel_for(ntask, [&](int task) {
    int b = task / (c.Nq * nch), h = (task / nch) % c.Nq, ch = task % nch, hk_ = h / grp;
    SeqMask m = make_seq_mask(hp, b);
    auto& DK = tdk[task]; auto& DV = tdv[task]; auto& NDK = tndk[task]; auto& NDV = tndv[task];
    DK.assign(kvsz, 0.0); DV.assign(kvsz, 0.0); NDK.assign(kvsz, 0.f); NDV.assign(kvsz, 0.f);
    std::vector<double> dov(H), qv(H);
    for (int i = ch * chunk; i < std::min(c.T, (ch + 1) * chunk); ++i) {
      int64_t lo = 0, hi = 0;
      if (i < m.q_len) { lo = m.key_lo(i); hi = m.key_hi(i); }
      if (hi <= lo) continue;
      size_t li = (size_t(b) * c.Nq + h) * c.T + i;
      const uint16_t* q = Qp(b, i, h);
      const uint16_t* dO = hdo.data() + b * p.do_batch_stride + int64_t(i) * p.do_row_stride + h * H;
      const uint16_t* og = ho.data() + b * p.o_batch_stride + int64_t(i) * p.o_row_stride + h * H;
      double D = 0; float Dn = 0;
      for (int t = 0; t < H; ++t) { double x = double(to_f(dO[t], bf)) * to_f(og[t], bf); D += x; Dn += float(x); dov[t] = to_f(dO[t], bf); qv[t] = to_f(q[t], bf); }
      double* rq = rdq.data() + b * p.q_batch_stride + int64_t(i) * p.q_row_stride + h * H;
      float* nqd = ndq.data() + b * p.q_batch_stride + int64_t(i) * p.q_row_stride + h * H;
      for (int64_t j = lo; j < hi; ++j) {
        double s, gr; logit(b, i, h, j, &s, &gr);
        const uint16_t *k = Kp(b, j, hk_), *v = Vp(b, j, hk_);
        double P = std::exp(s - lse_ref[li]);
        float Pn = rnd(std::exp(float(s) - hl[li]), bf);
        double dP = 0; float dPn = 0;
        for (int t = 0; t < H; ++t) { double x = dov[t] * to_f(v[t], bf); dP += x; dPn += float(x); }
        double dS = P * (dP - D) * gr;
        float dSn = rnd(Pn * (dPn - Dn) * float(gr), bf);
        double* dk_ = DK.data() + j * H; double* dv_ = DV.data() + j * H;
        float* ndk_ = NDK.data() + j * H; float* ndv_ = NDV.data() + j * H;
        for (int t = 0; t < H; ++t) {
          double kt = to_f(k[t], bf);
          rq[t] += p.scale * dS * kt; nqd[t] += p.scale * dSn * float(kt);
          dk_[t] += p.scale * dS * qv[t]; ndk_[t] += p.scale * dSn * float(qv[t]);
          dv_[t] += P * dov[t]; ndv_[t] += Pn * float(dov[t]);
        }
      }
    }
  });
  for (int task = 0; task < ntask; ++task) {
    int b = task / (c.Nq * nch), h = (task / nch) % c.Nq, hk_ = h / grp;
    for (int j = 0; j < c.S; ++j)
      for (int t = 0; t < H; ++t) {
        size_t gi = b * p.k_batch_stride + int64_t(j) * p.k_row_stride + hk_ * H + t, li = size_t(j) * H + t;
        rdk[gi] += tdk[task][li]; rdv[gi] += tdv[task][li]; ndk[gi] += tndk[task][li]; ndv[gi] += tndv[task][li];
      }
  }
  auto cmp = [&](const std::vector<uint16_t>& got, const std::vector<double>& ref, const std::vector<float>& naive,
                 double* e, double* en, double* mx, long* nan) {
    *e = *en = *mx = 0; *nan = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      double gv_ = to_f(got[i], bf);
      if (std::isnan(gv_) || std::isinf(gv_)) (*nan)++;
      *e = std::max(*e, std::fabs(gv_ - ref[i]));
      *en = std::max(*en, std::fabs(double(rnd(naive[i], bf)) - ref[i]));
      *mx = std::max(*mx, std::fabs(ref[i]));
    }
  };
  double e[3], en[3], mx[3]; long nan[3];
  cmp(gq, rdq, ndq, &e[0], &en[0], &mx[0], &nan[0]);
  cmp(gk, rdk, ndk, &e[1], &en[1], &mx[1], &nan[1]);
  cmp(gv, rdv, ndv, &e[2], &en[2], &mx[2], &nan[2]);
  bool ok = true;
  for (int i = 0; i < 3; ++i) ok = ok && nan[i] == 0 && e[i] <= 2 * en[i] + 1e-3 * std::max(1.0, mx[i]);
  if (c.det && !same_bits) { printf("%-34s deterministic: dq bits differ between runs\n", c.name); ok = false; }
  printf("%-34s %s  dq %.2e (naive %.2e)  dk %.2e (%.2e)  dv %.2e (%.2e)  max|ref| %.1f/%.1f/%.1f%s\n", c.name,
         ok ? "ok  " : "FAIL", e[0], en[0], e[1], en[1], e[2], en[2], mx[0], mx[1], mx[2],
         nan[0] + nan[1] + nan[2] ? "  NaN/Inf!" : "");
  return ok;
}

#ifdef JF_BWD_TIMELINE
static void print_timeline(uint32_t* dbuf, int H, int S, int causal) {
  char title[96];
  snprintf(title, sizeof(title), "bwd timeline H=%d S=%d causal=%d", H, S, causal);
  sm90::print_timeline(dbuf, title, {"wait Q/dO (key split: + issue S)", "issue S,dP (by role: + GEMM)", "P, dS", "to dS shared", "to dQ done",
                                     "dQ out (+ dK)"});
  sm90::print_bwd_tile_timeline(dbuf, title);
}
#endif

static bool g_det = false;
static bool g_fp16 = false;  // --fp16: bench float16 instead of bfloat16
static bool g_no_split = false;  // --no-split: bench without the workspace (no split tail)
static double bench(int H, int S, bool causal, int reps) {
  const int B = 16384 / S, N = 2048 / H;
  FlashBwdParams p;
  p.batch = B; p.seqlen_q = S; p.seqlen_k = S; p.heads_q = N; p.heads_kv = N; p.head_dim = H;
  p.dtype = g_fp16 ? DType::kFloat16 : DType::kBFloat16; p.scale = 1.f / std::sqrt(float(H)); p.causal = causal; p.window_right = causal ? 0 : -1;
  size_t n = size_t(B) * S * N * H;
  void *q, *k, *v, *o, *dO, *dq, *dk, *dv; float *lse, *dsum, *lse2, *acc; int* sem;
  for (void** x : {&q, &k, &v, &o, &dO, &dq, &dk, &dv}) CK(cudaMalloc(x, n * 2));
  p.seqlen_q_rounded = int(dq_accum_rows(S)); p.head_dim_rounded = int(dq_accum_cols(H));
  CK(cudaMalloc(&lse, size_t(B) * N * S * 4)); CK(cudaMalloc(&dsum, size_t(B) * N * p.seqlen_q_rounded * 4));
  CK(cudaMalloc(&lse2, size_t(B) * N * p.seqlen_q_rounded * 4));
  CK(cudaMalloc(&sem, size_t(B) * N * p.seqlen_q_rounded / 64 * 4));
  p.deterministic = g_det; p.dq_semaphore = sem;
  CK(cudaMalloc(&acc, size_t(B) * N * p.seqlen_q_rounded * p.head_dim_rounded * 4));
  // The workspace as the FFI handler passes it (the split tail's slots); --no-split: none.
  int* ws = nullptr;
  if (!g_no_split) {
    CK(cudaMalloc(&ws, bwd_workspace_ints(B, N, S, false) * 4));
    p.tile_counter = ws;
  }
  // Independent random operands, and each row's lse as for N(0, 1) logits (ln(visible keys) +
  // 1/2), so P is ~1 / keys as in a real backward (q = k = v = o = dO and lse = 12 before
  // session 8 measured within 1-2% of this, NOTES.md "Harness and JAX figures").
  std::vector<uint16_t> h(n);
  std::mt19937 g(1);
  std::normal_distribution<float> nd;
  for (void* x : {q, k, v, o, dO}) {
    for (auto& e : h) e = from_f(nd(g), !g_fp16);
    CK(cudaMemcpy(x, h.data(), n * 2, cudaMemcpyHostToDevice));
  }
  std::vector<float> hl(size_t(B) * N * S);
  for (size_t r = 0; r < hl.size(); ++r) hl[r] = std::log(float(causal ? r % S + 1 : S)) + 0.5f;
  CK(cudaMemcpy(lse, hl.data(), hl.size() * 4, cudaMemcpyHostToDevice));
  p.q = q; p.k = k; p.v = v; p.o = o; p.dout = dO; p.dq = dq; p.dk = dk; p.dv = dv; p.lse = lse; p.dsum = dsum; p.lse_log2 = lse2; p.dq_accum = acc;
  p.q_batch_stride = p.k_batch_stride = p.v_batch_stride = p.o_batch_stride = p.do_batch_stride = p.dq_batch_stride =
      p.dk_batch_stride = p.dv_batch_stride = int64_t(S) * N * H;
  p.q_row_stride = p.k_row_stride = p.v_row_stride = p.o_row_stride = p.do_row_stride = p.dq_row_stride = p.dk_row_stride =
      p.dv_row_stride = int64_t(N) * H;
  p.q_head_stride = p.k_head_stride = p.v_head_stride = p.o_head_stride = p.do_head_stride = p.dq_head_stride =
      p.dk_head_stride = p.dv_head_stride = H;
  double ms = median_ms([&] { return flash_bwd_sm90(p, 0); }, 2, reps, S <= 1024 ? 10 : 3);
  double flops = 2.5 * 4.0 * B * N * double(S) * S * H / (causal ? 2 : 1);
  for (void* x : {q, k, v, o, dO, dq, dk, dv}) cudaFree(x);
  cudaFree(lse); cudaFree(dsum); cudaFree(lse2); cudaFree(sem); cudaFree(acc); cudaFree(ws);
  return flops / (ms * 1e-3) / 1e12;
}

int main(int argc, char** argv) {
  bool do_test = true, do_bench = true;
  int only = -1, only_h = 0, only_s = 0, only_causal = -1;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--no-bench")) do_bench = false;
    if (!strcmp(argv[i], "--no-test")) do_test = false;
    if (!strncmp(argv[i], "--case=", 7)) only = atoi(argv[i] + 7);
    if (!strncmp(argv[i], "--h=", 4)) only_h = atoi(argv[i] + 4);  // bench one head dim (e.g. under ncu)
    if (!strncmp(argv[i], "--s=", 4)) only_s = atoi(argv[i] + 4);  // bench one seqlen
    if (!strncmp(argv[i], "--causal=", 9)) only_causal = atoi(argv[i] + 9);  // bench one mask kind
    if (!strcmp(argv[i], "--det")) g_det = true;  // bench the deterministic mode
    if (!strcmp(argv[i], "--fp16")) g_fp16 = true;
    if (!strcmp(argv[i], "--no-split")) g_no_split = true;
#ifdef JF_BWD_TIMELINE
    if (!strcmp(argv[i], "--timeline")) {
      CK(cudaMalloc(&sm90::g_bwd_timeline, sm90::kTimelineBytes));
      CK(cudaMemset(sm90::g_bwd_timeline, 0, sm90::kTimelineBytes));
    }
#endif
  }
  int fails = 0, total = 0;
  if (do_test) {
    std::vector<Case> cs;
    Case c;
    c = {"nc T97 S1000 gqa4", 2, 97, 1000, 4, 1}; cs.push_back(c);
    c = {"nc T1000 S128 mha", 1, 1000, 128, 2, 2}; cs.push_back(c);
    c = {"nc T1 S97 gqa4", 2, 1, 97, 4, 1}; cs.push_back(c);
    c = {"nc T128 S1 gqa4", 2, 128, 1, 4, 1}; cs.push_back(c);
    c = {"causal-tl T1000 S97 gqa4", 1, 1000, 97, 4, 1}; c.causal = true; cs.push_back(c);
    c = {"causal-tl T128 S1000", 1, 128, 1000, 2, 2}; c.causal = true; cs.push_back(c);
    c = {"causal-br T97 S1000 gqa4", 2, 97, 1000, 4, 1}; c.causal = true; c.bottom_right = true; cs.push_back(c);
    c = {"causal-br T1000 S128", 1, 1000, 128, 2, 2}; c.causal = true; c.bottom_right = true; cs.push_back(c);
    c = {"causal-br T1 S1000 gqa4", 2, 1, 1000, 4, 1}; c.causal = true; c.bottom_right = true; cs.push_back(c);
    c = {"window(256,64) T97 S1000 off500", 1, 97, 1000, 4, 1}; c.wl = 256; c.wr = 64; c.q_offset = 500; cs.push_back(c);
    c = {"window(100,30) T1000 S128", 1, 1000, 128, 2, 2}; c.wl = 100; c.wr = 30; cs.push_back(c);
    c = {"softcap30 causal-tl T97 S128 gqa4", 2, 97, 128, 4, 1}; c.causal = true; c.softcap = 30.f; cs.push_back(c);
    c = {"softcap15 nc T128 S1000", 1, 128, 1000, 2, 2}; c.softcap = 15.f; cs.push_back(c);
    c = {"lens causal-br T1000 S97 gqa4", 3, 1000, 97, 4, 1}; c.causal = true; c.bottom_right = true;
    c.q_lens = {1000, 500, 0}; c.kv_lens = {97, 3, 10}; cs.push_back(c);
    c = {"lens nc T97 S1000", 3, 97, 1000, 2, 2}; c.q_lens = {97, 40, 1}; c.kv_lens = {997, 0, 130}; cs.push_back(c);
    c = {"fp16 nc T128 S1000 gqa4", 1, 128, 1000, 4, 1}; c.bf16 = false; cs.push_back(c);
    c = {"fp16 causal-br T1000 S97", 1, 1000, 97, 2, 2}; c.bf16 = false; c.causal = true; c.bottom_right = true; cs.push_back(c);
    c = {"fp16 softcap30 window T97 S1000", 1, 97, 1000, 4, 1}; c.bf16 = false; c.softcap = 30.f; c.wl = 300; c.wr = 0;
    c.q_offset = 600; cs.push_back(c);
    // Head dim 64: the same mask features through the other instantiation.
    c = {"h64 nc T97 S1000 gqa4", 2, 97, 1000, 4, 1}; c.H = 64; cs.push_back(c);
    c = {"h64 causal-br T1000 S97", 1, 1000, 97, 2, 2}; c.H = 64; c.causal = true; c.bottom_right = true; cs.push_back(c);
    c = {"h64 lens window T97 S1000", 3, 97, 1000, 2, 2}; c.H = 64; c.q_lens = {97, 40, 1}; c.kv_lens = {997, 0, 130};
    c.wl = 200; c.wr = 10; cs.push_back(c);
    c = {"h64 fp16 softcap30 causal T128 S128", 1, 128, 128, 2, 2}; c.H = 64; c.bf16 = false; c.softcap = 30.f; c.causal = true; cs.push_back(c);
    // Head dim 256: the head-dim-split instantiation (64-key CTAs; plain launches by role, v69 / v70).
    c = {"h256 nc T97 S1000 gqa4", 2, 97, 1000, 4, 1}; c.H = 256; cs.push_back(c);
    // Non-causal H=256 launches run S^T / dP^T (and dV / dK) by role: lengths, odd sizes, padding.
    c = {"h256 nc lens T1000 S600 gqa2", 2, 1000, 600, 4, 2}; c.H = 256; c.q_lens = {1000, 333}; c.kv_lens = {600, 111};
    cs.push_back(c);
    c = {"h256 fp16 nc T300 S257", 1, 300, 257, 2, 2}; c.H = 256; c.bf16 = false; cs.push_back(c);
    // (Head dims 129..192 take the portable backward: their dq_accum rows are 192 floats.)
    c = {"pad h200 nc T129 S700 gqa2", 2, 129, 700, 4, 2}; c.H = 200; cs.push_back(c);
    c = {"h256 causal-br T1000 S97", 1, 1000, 97, 2, 2}; c.H = 256; c.causal = true; c.bottom_right = true; cs.push_back(c);
    c = {"h256 causal-tl T300 S300", 1, 300, 300, 2, 2}; c.H = 256; c.causal = true; cs.push_back(c);
    c = {"h256 lens window T97 S1000", 3, 97, 1000, 2, 2}; c.H = 256; c.q_lens = {97, 40, 1}; c.kv_lens = {997, 0, 130};
    c.wl = 200; c.wr = 10; cs.push_back(c);
    c = {"h256 fp16 softcap30 causal T128 S128", 1, 128, 128, 2, 2}; c.H = 256; c.bf16 = false; c.softcap = 30.f; c.causal = true; cs.push_back(c);
    c = {"det h256 causal-tl T700 S1000 gqa2", 1, 700, 1000, 4, 2}; c.H = 256; c.causal = true; c.det = true; cs.push_back(c);
    c = {"det causal-tl T1000 S1000 gqa2", 2, 1000, 1000, 4, 2}; c.causal = true; c.det = true; cs.push_back(c);
    c = {"det nc T700 S900", 1, 700, 900, 2, 2}; c.det = true; cs.push_back(c);
    c = {"det h64 lens window T1000 S600", 2, 1000, 600, 2, 1}; c.H = 64; c.det = true; c.wl = 300; c.wr = 20;
    c.q_lens = {1000, 333}; c.kv_lens = {600, 111}; cs.push_back(c);
    c = {"det causal-br T300 S1000", 1, 300, 1000, 2, 2}; c.causal = true; c.bottom_right = true; c.det = true; cs.push_back(c);
    // Padded head dims: the 64 / 128 / 256 kernels with zero columns past head_dim.
    c = {"pad h72 causal-br T1000 S97 gqa2", 1, 1000, 97, 4, 2}; c.H = 72; c.causal = true; c.bottom_right = true; cs.push_back(c);
    c = {"pad h32 nc T97 S1000", 2, 97, 1000, 2, 2}; c.H = 32; cs.push_back(c);
    c = {"pad h200 lens window T300 S700", 2, 300, 700, 2, 1}; c.H = 200; c.q_lens = {300, 77}; c.kv_lens = {700, 250};
    c.wl = 150; c.wr = 40; cs.push_back(c);
    c = {"pad det h96 causal-tl T500 S500", 1, 500, 500, 2, 2}; c.H = 96; c.causal = true; c.det = true; cs.push_back(c);
    // The split tail (unbounded masks without lengths, more tiles than the 132 SMs, at least
    // JF_BWD_SPLIT_MIN_STEPS steps per tile): the last round's tiles in a second launch, in pieces
    // of a few steps, several per tile, or none for some CTAs.
    c = {"split nc T2600 S2100 gqa2", 1, 2600, 2100, 18, 9}; cs.push_back(c);
    c = {"split fp16 nc T900 S4000 gqa3", 1, 900, 4000, 15, 5}; c.bf16 = false; cs.push_back(c);
    c = {"split softcap15 nc T1100 S2100 gqa2", 3, 1100, 2100, 6, 3}; c.softcap = 15.f; cs.push_back(c);
    c = {"split h64 nc T4100 S4200", 1, 4100, 4200, 5, 5}; c.H = 64; cs.push_back(c);
    c = {"split h256 nc T2100 S9000 gqa2", 1, 2100, 9000, 2, 1}; c.H = 256; cs.push_back(c);
    c = {"split h256 softcap30 nc T2100 S8500", 1, 2100, 8500, 1, 1}; c.H = 256; c.softcap = 30.f; cs.push_back(c);
    uint64_t seed = 1;
    for (int i = 0; i < int(cs.size()); ++i) {
      if (only >= 0 && i != only) continue;
      total++; fails += !run_case(cs[i], seed + i);
      fflush(stdout);
    }
    printf("correctness: %d/%d passed\n", total - fails, total);
  }
  if (do_bench) {
    const int Ss[3] = {1024, 4096, 16384};
    printf("\nbwd %s TFLOP/s%s | S=1k  | S=4k  | S=16k |\n", g_fp16 ? "fp16" : "bf16", g_det ? " (det)" : "      ");
    for (int H : {64, 128, 256})
      for (int causal = 0; causal < 2; ++causal) {
        if (only_h && H != only_h) continue;
        if (only_causal >= 0 && causal != only_causal) continue;
        printf("H=%-3d causal=%-3s      |", H, causal ? "yes" : "no");
        for (int si = 0; si < 3; ++si) {
          if (only_s && Ss[si] != only_s) { printf("   -   |"); continue; }
          printf(" %5.0f |", bench(H, Ss[si], causal, 7)); fflush(stdout);
#ifdef JF_BWD_TIMELINE
          if (sm90::g_bwd_timeline) {
            printf("\n");
            print_timeline(sm90::g_bwd_timeline, H, Ss[si], causal);
            CK(cudaMemset(sm90::g_bwd_timeline, 0, sm90::kTimelineBytes));
          }
#endif
        }
        printf("\n");
      }
  }
  return fails ? 1 : 0;
}
