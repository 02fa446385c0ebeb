// A tiny fork-join helper: the CPU kernels split their (batch, head) tasks over threads.
// XLA's own intra-op pool is not used because a handler blocking on work it scheduled
// there could starve the pool it runs on.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

namespace jax_flash::cpu {

// Threads to use: JAX_FLASH_CPU_THREADS if set, else the hardware concurrency.
inline int num_threads() {
  if (const char* env = std::getenv("JAX_FLASH_CPU_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  unsigned hw = std::thread::hardware_concurrency();
  return hw == 0 ? 1 : int(hw);
}

// Calls fn(task) for task in [0, n), dynamically balanced over threads.
template <typename Fn>
void parallel_for(int64_t n, Fn&& fn) {
  int threads = int(std::min<int64_t>(num_threads(), n));
  if (threads <= 1) {
    for (int64_t t = 0; t < n; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  auto worker = [&] {
    for (int64_t t = next++; t < n; t = next++) fn(t);
  };
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int i = 0; i < threads - 1; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

}  // namespace jax_flash::cpu
