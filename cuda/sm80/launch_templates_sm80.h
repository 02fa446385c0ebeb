// Grid setup and tile configurations per head dim. Included only by the per-instantiation
// .cu files.
#pragma once

#include "flash_bwd_kernel_sm80.h"
#include "flash_fwd_kernel_sm80.h"
#include "flash_sm80_internal.h"
#include "kernel_traits_sm80.h"
#include "static_switch.h"

namespace jax_flash {
namespace sm80 {

template <typename Kernel>
inline cudaError_t set_smem(Kernel kernel, int bytes) {
  if (bytes < 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

template <typename Kt>
cudaError_t launch_fwd(const FlashFwdParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.heads_q == 0) return cudaSuccess;
  const dim3 grid((p.seqlen_q + Kt::kBlockM - 1) / Kt::kBlockM, p.heads_q, p.batch);
  cudaError_t err = cudaSuccess;
  if (has_extras(p)) {
    // Segment ids / bias / mask / dropout: one variant, softcap tested at runtime (flash_fwd_kernel_sm80.h).
    auto kernel = &flash_fwd_kernel<Kt, false, true>;
    err = set_smem(kernel, Kt::kSmemSize);
    if (err == cudaSuccess) kernel<<<grid, Kt::kNThreads, Kt::kSmemSize, stream>>>(p);
  } else {
    // Every tile in range: the predicate-free variant (flash_fwd_kernel_sm80.h, kEven).
    const bool even = p.q_lens == nullptr && p.kv_lens == nullptr && p.seqlen_q % Kt::kBlockM == 0 &&
                      p.seqlen_k % Kt::kBlockN == 0 && p.head_dim == Kt::kHeadDim;
    auto run = [&](auto softcap, auto even_tiles) {
      auto kernel = &flash_fwd_kernel<Kt, decltype(softcap)::value, false, decltype(even_tiles)::value>;
      err = set_smem(kernel, Kt::kSmemSize);
      if (err == cudaSuccess) kernel<<<grid, Kt::kNThreads, Kt::kSmemSize, stream>>>(p);
    };
    JF_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&] {
      using Softcap = std::integral_constant<bool, kSoftcap>;
      if constexpr (Kt::kEvenVariant) {
        if (even) run(Softcap{}, std::true_type{}); else run(Softcap{}, std::false_type{});
      } else {
        run(Softcap{}, std::false_type{});
      }
    });
  }
  if (err != cudaSuccess) return err;
  return cudaGetLastError();
}

template <typename Kt>
cudaError_t launch_bwd(const FlashBwdParams& p, cudaStream_t stream) {
  using Element = typename Kt::Element;
  // With no queries the dK/dV kernel still runs: it writes dk = dv = 0.
  if (p.batch == 0 || p.heads_q == 0) return cudaSuccess;
  const int64_t acc_rows = p.seqlen_q_rounded > 0 ? p.seqlen_q_rounded : dq_accum_rows(p.seqlen_q);
  const int64_t acc_cols = p.head_dim_rounded > 0 ? p.head_dim_rounded : dq_accum_cols(p.head_dim);
  const int64_t rows_total = int64_t(p.batch) * p.heads_q * p.seqlen_q;
  cudaError_t err;
  if (rows_total > 0) {
    err = cudaMemsetAsync(p.dq_accum, 0, sizeof(float) * int64_t(p.batch) * p.heads_q * acc_rows * acc_cols, stream);
    if (err != cudaSuccess) return err;
    const int threads = 256;
    const int64_t blocks = (rows_total * 32 + threads - 1) / threads;
    flash_bwd_dsum_kernel<Element><<<unsigned(blocks), threads, 0, stream>>>(p);
  }
  const int n_blocks = (p.seqlen_k + Kt::kBlockN - 1) / Kt::kBlockN;
  err = cudaSuccess;
  if (n_blocks > 0) {
    auto launch = [&](auto kernel) {
      err = set_smem(kernel, Kt::kSmemSize);
      if (err != cudaSuccess) return;
      if (p.deterministic) {
        // One launch per key block: within a launch every dq_accum element has a single
        // writer, and launches are stream-ordered, so the fp32 sums have a fixed order.
        for (int j = 0; j < n_blocks; ++j)
          kernel<<<dim3(1, p.heads_kv, p.batch), Kt::kNThreads, Kt::kSmemSize, stream>>>(p, j, acc_rows, acc_cols);
      } else {
        kernel<<<dim3(n_blocks, p.heads_kv, p.batch), Kt::kNThreads, Kt::kSmemSize, stream>>>(p, 0, acc_rows, acc_cols);
      }
    };
    if (has_extras(p)) {
      launch(&flash_bwd_dkdv_kernel<Kt, false, true>);  // softcap tested at runtime
    } else {
      JF_BOOL_SWITCH(p.softcap > 0.f, kSoftcap, [&] { launch(&flash_bwd_dkdv_kernel<Kt, kSoftcap, false>); });
    }
    if (err != cudaSuccess) return err;
  }
  if (rows_total > 0) {
    const int64_t total = rows_total * p.head_dim;
    const int64_t blocks = std::min<int64_t>((total + 255) / 256, 1 << 20);
    flash_bwd_convert_dq_kernel<Element><<<unsigned(blocks), 256, 0, stream>>>(p, acc_rows, acc_cols);
  }
  return cudaGetLastError();
}

// --- tile configurations ---
// Forward: 4 warps, each owning 16-row slices of the query block.
template <typename T, int kHeadDim> struct FwdConfig;
// H <= 128 also get the predicate-free kEven variant for aligned shapes, without kLean's row
// masks (H=256's kLean configuration has it regardless): +7% at H=128 4k / 8k, +6.5% at H=64 2k
// (session 49, H100 harness A/B; NOTES.md). JF_SM80_FWD_EVEN=0 builds without it (A/B).
#ifndef JF_SM80_FWD_EVEN
#define JF_SM80_FWD_EVEN 1
#endif
template <typename T> struct FwdConfig<T, 32> { using type = FwdTraits<T, 32, 128, 64, 4, false, JF_SM80_FWD_EVEN>; };
template <typename T> struct FwdConfig<T, 64> { using type = FwdTraits<T, 64, 128, 64, 4, false, JF_SM80_FWD_EVEN>; };
template <typename T> struct FwdConfig<T, 96> { using type = FwdTraits<T, 96, 128, 64, 4, false, JF_SM80_FWD_EVEN>; };
// JF_SM80_FWD128_M / _N / _WARPS override the hd128 tile (experiments: the 128 x 64 tile with 4
// warps keeps 32 rows of O per warp, 128 + 64 accumulator registers per thread, and spills).
#ifndef JF_SM80_FWD128_M
#define JF_SM80_FWD128_M 128
#endif
#ifndef JF_SM80_FWD128_N
#define JF_SM80_FWD128_N 64
#endif
#ifndef JF_SM80_FWD128_WARPS
#define JF_SM80_FWD128_WARPS 4
#endif
template <typename T> struct FwdConfig<T, 128> {
  using type = FwdTraits<T, 128, JF_SM80_FWD128_M, JF_SM80_FWD128_N, JF_SM80_FWD128_WARPS, false, JF_SM80_FWD_EVEN>;
};
template <typename T> struct FwdConfig<T, 256> { using type = FwdTraits<T, 256, 64, 64, 4, /*kLean=*/true>; };

// Backward: 8 warps; (kBlockM, kBlockN) and the warp layouts of the S/dP, dK/dV and dQ GEMMs.
template <typename T, int kHeadDim> struct BwdConfig;
template <typename T> struct BwdConfig<T, 32> { using type = BwdTraits<T, 32, 64, 128, 8, 2, 4, 4>; };
template <typename T> struct BwdConfig<T, 64> { using type = BwdTraits<T, 64, 64, 128, 8, 2, 4, 4>; };
template <typename T> struct BwdConfig<T, 96> { using type = BwdTraits<T, 96, 64, 128, 8, 2, 4, 4>; };
// hd128 dQ GEMM: warps 2 (rows) x 4 (head dim), 32 x 32 per warp (FA2's choice): 20 % fewer
// ldmatrix bytes in that GEMM than 4 x 2 (16 x 64 per warp); with the 16-byte dQ reductions it
// also spills less on sm_90 (4 / 4 B vs 8 / 8 B). -DJF_SM80_BWD128_ATOM_MDQ=4: the old layout.
#ifndef JF_SM80_BWD128_ATOM_MDQ
#define JF_SM80_BWD128_ATOM_MDQ 2
#endif
template <typename T> struct BwdConfig<T, 128> {
  using type = BwdTraits<T, 128, 64, 128, 8, 2, 4, JF_SM80_BWD128_ATOM_MDQ>;
};
template <typename T> struct BwdConfig<T, 256> { using type = BwdTraits<T, 256, 64, 64, 8, 2, 4, 4>; };

}  // namespace sm80
}  // namespace jax_flash

// Body of one instantiation file.
#define JF_SM80_INSTANTIATE_FWD(T, HD)                                                        \
  namespace jax_flash {                                                                      \
  namespace sm80 {                                                                           \
  template <>                                                                                \
  cudaError_t run_fwd<T, HD>(const FlashFwdParams& p, cudaStream_t stream) {                 \
    return launch_fwd<typename FwdConfig<T, HD>::type>(p, stream);                           \
  }                                                                                          \
  }                                                                                          \
  }
#define JF_SM80_INSTANTIATE_BWD(T, HD)                                                        \
  namespace jax_flash {                                                                      \
  namespace sm80 {                                                                           \
  template <>                                                                                \
  cudaError_t run_bwd<T, HD>(const FlashBwdParams& p, cudaStream_t stream) {                 \
    return launch_bwd<typename BwdConfig<T, HD>::type>(p, stream);                           \
  }                                                                                          \
  }                                                                                          \
  }
