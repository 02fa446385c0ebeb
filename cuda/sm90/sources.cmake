# Hopper (sm_90a) forward kernels. Compile with -gencode=arch=compute_90a,code=sm_90a
# -std=c++17 --expt-relaxed-constexpr -O3 -DNDEBUG -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED and the
# CUTLASS/CuTe include dir.
set(JF_SM90_SOURCES
  cuda/sm90/flash_fwd_sm90.cu
  cuda/sm90/flash_fwd_hdim64_bf16_sm90.cu
  cuda/sm90/flash_fwd_hdim64_fp16_sm90.cu
  cuda/sm90/flash_fwd_hdim128_bf16_sm90.cu
  cuda/sm90/flash_fwd_hdim128_fp16_sm90.cu
  cuda/sm90/flash_fwd_hdim256_bf16_sm90.cu
  cuda/sm90/flash_fwd_hdim256_fp16_sm90.cu
)
