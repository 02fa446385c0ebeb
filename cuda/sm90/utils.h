// Small helpers shared by the sm90 kernels: wgmma issue, accumulator layout views,
// fp32 -> 16-bit conversion, fast exp2; on the host, the global view behind a TMA descriptor.
#pragma once

#include <cute/tensor.hpp>
// After cute/tensor.hpp (the other order breaks cute's copy overloads).
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace jax_flash::sm90 {
using namespace cute;

// Issue one warpgroup GEMM (all K slices) as a single wgmma batch. wg_wait < 0 leaves it in
// flight so the caller can overlap softmax with it.
template <bool zero_init = false, int wg_wait = 0, class TiledMma, class TA, class TB, class TC>
__forceinline__ __device__ void wg_gemm(TiledMma& tiled_mma, TA const& tCrA, TB const& tCrB, TC& tCrC) {
  constexpr bool Is_RS = !cute::is_base_of<cute::GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (Is_RS) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
  warpgroup_fence_operand(tCrC);
  warpgroup_arrive();
  if constexpr (zero_init) { tiled_mma.accumulate_ = GMMA::ScaleOut::Zero; }
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tCrA); ++k) {
    cute::gemm(tiled_mma, tCrA(_, _, k), tCrB(_, _, k), tCrC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (wg_wait >= 0) { warpgroup_wait<wg_wait>(); }
  warpgroup_fence_operand(tCrC);
  if constexpr (Is_RS) { warpgroup_fence_operand(const_cast<TA&>(tCrA)); }
}

// wgmma accumulator ((2,2,N/8), MMA_M, MMA_N) viewed as (rows=(2,MMA_M), cols=(2,N/8,MMA_N)).
template <class L>
__forceinline__ __device__ auto acc_rowcol(L l) {
  static_assert(decltype(rank<0>(l))::value == 3);
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// For 16-bit types the accumulator register order equals the wgmma A-operand register order,
// so P can be fed back without shuffles: ((2,2,N/8),M,1) -> ((2,2,2),M,(N/16)).
template <class L>
__forceinline__ __device__ auto acc_to_Aregs(L l) {
  auto d = logical_divide(get<0, 2>(l), Tile<_2>{});
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(d)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(d), get<2>(l))));
}

template <class E, class L, class EO, class LO>
__forceinline__ __device__ void convert_out(Tensor<E, L> const& in, Tensor<EO, LO>& out) {
  using From = typename E::value_type;
  using To = typename EO::value_type;
  Tensor a = recast<cutlass::Array<From, 2> const>(in);
  Tensor b = recast<cutlass::Array<To, 2>>(out);
  cutlass::NumericArrayConverter<To, From, 2> op;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(a); ++i) { b(i) = op(a(i)); }
}

// Global (rows, head_dim, heads, batch) view of one attention operand, head_dim contiguous, as
// the source of a TMA descriptor. TMA wants every stride legal (a 16-byte multiple) even on a
// size-1 mode, so a single head or batch takes the row stride.
template <class Element>
auto tma_operand(void const* ptr, int rows, int head_dim, int heads, int batch, int64_t row_stride, int64_t head_stride,
                 int64_t batch_stride) {
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), make_shape(rows, head_dim, heads, batch),
                     make_stride(row_stride, _1{}, heads == 1 ? row_stride : head_stride, batch == 1 ? row_stride : batch_stride));
}

// This thread's consumer warpgroup (warpgroup 0 is the producer), warp-uniform: through the
// shuffle the compiler knows every lane holds the same value, so smem descriptors, barrier ids
// and addresses derived from it stay in uniform registers (from threadIdx.x / 128 alone, each
// wgmma paid two R2UR moves and the descriptors held ordinary registers).
__forceinline__ __device__ int consumer_warpgroup() { return __shfl_sync(0xffffffff, int(threadIdx.x) / 128, 0) - 1; }

// Named barriers that also order memory for the compiler: cutlass's bar.sync / bar.arrive asm
// carries no "memory" clobber, so a plain smem load or store could move across it (hand-offs
// through smem between warps need these).
__forceinline__ __device__ void named_sync(int threads, int id) {
  asm volatile("" ::: "memory");
  cutlass::arch::NamedBarrier::sync(threads, id);
  asm volatile("" ::: "memory");
}
__forceinline__ __device__ void named_arrive(int threads, int id) {
  asm volatile("" ::: "memory");
  cutlass::arch::NamedBarrier::arrive(threads, id);
  asm volatile("" ::: "memory");
}
// named_sync that also ORs a predicate over the participating threads (bar.red.or), at the
// hardware id cutlass's NamedBarrier would use for id.
__forceinline__ __device__ bool named_sync_or(int threads, int id, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(any)
      : "r"(uint32_t(pred)), "r"(id + int(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount)), "r"(threads)
      : "memory");
  return any != 0;
}
// Programmatic dependent launch (support.h launch_dependent): pdl_trigger lets the next kernel in the
// stream, if launched as a programmatic dependent, be scheduled once every CTA of this one has
// called it or exited; pdl_wait waits until the previous kernel (if this one is such a
// dependent) has completed and its writes are visible. Both are no-ops otherwise.
__forceinline__ __device__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
__forceinline__ __device__ void pdl_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
// Generic-proxy smem writes made visible to the async proxy (TMA / bulk copies, wgmma operands);
// with a memory clobber, unlike cutlass::arch::fence_view_async_shared.
__forceinline__ __device__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Before the CTA exits: every bulk operation the WG's first thread issued (TMA stores, bulk
// reduce-adds) has completed, so the smem they read stays valid until then.
__forceinline__ __device__ void wg_bulk_drain(int tidx) {
  if (tidx % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// The bulk operations the WG's first thread issued (TMA stores, bulk reduce-adds) have read
// their smem sources, so the WG may overwrite them: the issuer waits, then the WG syncs on its
// 128-thread named barrier bar.
__forceinline__ __device__ void wg_wait_bulk_reads(int tidx, int bar) {
  if (tidx % 128 == 0) cute::tma_store_wait<0>();
  named_sync(128, bar);
}

// wg_tma_store's parts, for callers that stage several tiles behind one wait and one barrier:
// stmatrix of this thread's fragment into the buffer, and the issuer's TMA store of it.
template <class TiledMmaWG, class SmemLayout, class Frag>
__forceinline__ __device__ void wg_stage_tile(Frag const& frag16, typename Frag::value_type* smem, int tidx) {
  using Element = typename Frag::value_type;
  Tensor s = make_tensor(make_smem_ptr(smem), SmemLayout{});
  auto r2s = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, TiledMmaWG{});
  auto thr = r2s.get_thread_slice(tidx % 128);
  cute::copy(r2s, thr.retile_S(frag16), thr.partition_D(s));
}
template <class SmemLayout, class Element, class Tma, class GTile>
__forceinline__ __device__ void issue_tma_store(Element const* smem, Tma const& tma, GTile const& gtile) {
  Tensor s = make_tensor(make_smem_ptr(smem), SmemLayout{});
  auto c = tma.get_slice(_0{});
  cute::copy(tma, group_modes<0, 3>(c.partition_S(s)), group_modes<0, 3>(c.partition_D(gtile)));
}

// One consumer warpgroup's 64 x N tile of 16-bit values, held as the C fragment of TiledMmaWG
// (a single-warpgroup wgmma), out to global memory: registers -> the WG's smem buffer (stmatrix,
// SmemLayout) -> one TMA store issued by the WG's first thread, which a few instructions hand
// off instead of per-element stores with their address math and bounds checks (forward O,
// backward dK / dV). The buffer's previous store is waited for first; bar is a 128-thread named
// barrier id of this WG; make_gtile() gives the destination tile (called by the issuer only).
// TMA clips rows and columns past the tensor's extents.
template <class TiledMmaWG, class SmemLayout, class Frag, class Tma, class MakeGTile>
__forceinline__ __device__ void wg_tma_store(Frag const& frag16, typename Frag::value_type* smem, Tma const& tma,
                                             MakeGTile const& make_gtile, int bar, int tidx) {
  wg_wait_bulk_reads(tidx, bar);
  wg_stage_tile<TiledMmaWG, SmemLayout>(frag16, smem, tidx);
  fence_async_smem();
  named_sync(128, bar);
  if (tidx % 128 == 0) {
    issue_tma_store<SmemLayout>(smem, tma, make_gtile());
    cute::tma_store_arrive();
  }
}

// A swizzled smem tensor for per-thread copies (stmatrix / ldmatrix) with the swizzle applied to
// the offset from ptr, not to the absolute address (cute's position-independent form, as
// CUTLASS's epilogues use it). ptr must sit on the swizzle's period (1 KB for the 128-byte
// swizzle), as every ring stage here does. On the address form, a base that changes per step
// (a ring stage) made the compiler recompute each thread's swizzled addresses every step; here
// they do not depend on the base. wgmma descriptors keep the address form.
template <class Layout, class Element>
__forceinline__ __device__ auto smem_tensor_for_copy(Element* ptr) {
  auto t = make_tensor(make_smem_ptr(ptr), Layout{});
  using SwizzleFn = get_swizzle_t<decltype(t)>;
  if constexpr (SwizzleFn::num_bits == 0) {
    return t;
  } else {
    return make_tensor(make_smem_ptr(ptr), composition(recast_layout<uint8_t, Element>(SwizzleFn{}), Int<0>{}, t.layout()));
  }
}

__forceinline__ __device__ float ex2(float x) {
#ifdef JF_FAKE_EX2  // diagnostic only (wrong results): what the softmax costs without MUFU
  return x * 0.999f;
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// 2^x on the FMA / ALU pipes, no MUFU (the forward at H = 64 is bound by the MUFU's 16 exp2
// per clock per SM): x = j + f with j = round(x), |f| <= 1/2; 2^f by a degree-3 minimax
// polynomial (max relative error 7.5e-5, far below bf16 / fp16 rounding of P); j added to
// the exponent bits. Inputs below -127 give ~2^-127, not 0: use only where no score is -inf.
__forceinline__ __device__ float exp2_fma(float x) {
  x = fmaxf(x, -127.f);
  float const t = x + 12582912.f;  // 1.5 * 2^23: round(x) lands in t's low mantissa bits
  float const f = x - (t - 12582912.f);
  float const p = fmaf(fmaf(fmaf(0.05517134f, f, 0.24261034f), f, 0.69326097f), f, 0.9999281f);
  return __int_as_float(__float_as_int(p) + (__float_as_int(t) << 23));
}

// exp2 of element k of a thread's tile: every kPolyEvery-th one (kPolyEvery > 0) as exp2_fma on
// the FMA pipe, the rest on the MUFU. Check_inf (the tile may hold -inf scores): MUFU only.
template <int kPolyEvery, bool Check_inf>
__forceinline__ __device__ float exp2_at(int k, float x) {
  if constexpr (kPolyEvery > 0 && !Check_inf) {
    if (k % kPolyEvery == kPolyEvery - 1) return exp2_fma(x);
  }
  return ex2(x);
}

}  // namespace jax_flash::sm90
