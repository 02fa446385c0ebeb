# Hopper (sm_90a) backward kernels (same flags as sources.cmake).
set(JF_SM90_BWD_SOURCES
  cuda/sm90/flash_bwd_sm90.cu
  cuda/sm90/flash_bwd_hdim64_bf16_sm90.cu
  cuda/sm90/flash_bwd_hdim64_fp16_sm90.cu
  cuda/sm90/flash_bwd_hdim128_bf16_sm90.cu
  cuda/sm90/flash_bwd_hdim128_fp16_sm90.cu
  cuda/sm90/flash_bwd_hdim256_bf16_sm90.cu
  cuda/sm90/flash_bwd_hdim256_fp16_sm90.cu
)
