// Helpers shared by the standalone kernel harnesses (sm80, sm90 forward / backward): CUDA error
// checks, 16-bit float conversions, a host parallel_for, CUDA-event timing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#define CK(x)                                                                                   \
  do {                                                                                          \
    cudaError_t e_ = (x);                                                                       \
    if (e_ != cudaSuccess) {                                                                    \
      fprintf(stderr, "CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      exit(2);                                                                                  \
    }                                                                                           \
  } while (0)

static float to_f(uint16_t x, bool bf16) {
  if (bf16) { uint32_t u = uint32_t(x) << 16; float f; memcpy(&f, &u, 4); return f; }
  __half h; memcpy(&h, &x, 2); return __half2float(h);
}
static uint16_t from_f(float f, bool bf16) {
  uint16_t r;
  if (bf16) { __nv_bfloat16 b = __float2bfloat16(f); memcpy(&r, &b, 2); }
  else { __half h = __float2half(f); memcpy(&r, &h, 2); }
  return r;
}
// f(0..n-1) on all host threads (the float64 references).
static void parallel_for(int n, const std::function<void(int)>& f) {
  int nt = std::max(1u, std::thread::hardware_concurrency());
  std::vector<std::thread> th;
  std::atomic<int> next{0};
  for (int t = 0; t < nt; ++t)
    th.emplace_back([&] { for (int i; (i = next++) < n;) f(i); });
  for (auto& t : th) t.join();
}

// f rounded to the 16-bit type and back.
static float rnd(float f, bool bf16) { return to_f(from_f(f, bf16), bf16); }

// Median milliseconds per launch: `warmup` launches, then `reps` rounds of `inner` launches
// timed with CUDA events.
template <class Launch>
static double median_ms(Launch launch, int warmup, int reps, int inner) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  for (int i = 0; i < warmup; ++i) CK(launch());
  CK(cudaDeviceSynchronize());
  std::vector<float> ts;
  for (int r = 0; r < reps; ++r) {
    CK(cudaEventRecord(e0));
    for (int i = 0; i < inner; ++i) launch();
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms / inner);
  }
  CK(cudaGetLastError());
  cudaEventDestroy(e0); cudaEventDestroy(e1);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}
