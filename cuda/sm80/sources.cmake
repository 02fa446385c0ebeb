set(JF_SM80_SOURCES
  cuda/sm80/flash_sm80_api.cu
  cuda/sm80/flash_fwd_hdim64_bf16_sm80.cu
  cuda/sm80/flash_fwd_hdim64_fp16_sm80.cu
  cuda/sm80/flash_fwd_hdim128_bf16_sm80.cu
  cuda/sm80/flash_fwd_hdim128_fp16_sm80.cu
  cuda/sm80/flash_fwd_hdim256_bf16_sm80.cu
  cuda/sm80/flash_fwd_hdim256_fp16_sm80.cu
  cuda/sm80/flash_bwd_hdim64_bf16_sm80.cu
  cuda/sm80/flash_bwd_hdim64_fp16_sm80.cu
  cuda/sm80/flash_bwd_hdim128_bf16_sm80.cu
  cuda/sm80/flash_bwd_hdim128_fp16_sm80.cu
  cuda/sm80/flash_bwd_hdim256_bf16_sm80.cu
  cuda/sm80/flash_bwd_hdim256_fp16_sm80.cu
)
# Built and dispatched only with -DJF_SM80_HDIM32 / -DJF_SM80_HDIM96 on flash_sm80_api.cu
# (compiled, not yet GPU-tested; without them head dims 32 / 96 run padded on 64 / 128).
set(JF_SM80_OPTIONAL_SOURCES
  cuda/sm80/flash_fwd_hdim32_bf16_sm80.cu
  cuda/sm80/flash_fwd_hdim32_fp16_sm80.cu
  cuda/sm80/flash_fwd_hdim96_bf16_sm80.cu
  cuda/sm80/flash_fwd_hdim96_fp16_sm80.cu
  cuda/sm80/flash_bwd_hdim32_bf16_sm80.cu
  cuda/sm80/flash_bwd_hdim32_fp16_sm80.cu
  cuda/sm80/flash_bwd_hdim96_bf16_sm80.cu
  cuda/sm80/flash_bwd_hdim96_fp16_sm80.cu
)
