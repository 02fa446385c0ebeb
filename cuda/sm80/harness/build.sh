#!/bin/bash
# Build the standalone SM80 kernel harness (no GPU needed to build).
# Usage: cuda/sm80/harness/build.sh [arch list, default "90"]  ->  cuda/sm80/harness/bin/test_sm80
set -e
cd "$(dirname "$0")/.."
ARCHS=${ARCHS:-"90"}
CUTLASS_INC=${CUTLASS_INC:-$(python3 -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__))")/source/include}
# Harness subset (compile time on a small machine): head dims 64/128/256 bf16, 64/128 fp16;
# H=32 and H=80 run padded on the 64 / 128 kernels (the default dispatch).
# FULL=1 builds every instantiation, including the optional hdim 32 / 96 ones, and enables them.
if [ -n "$FULL" ]; then
  SRCS=$(ls flash_*_sm80.cu flash_sm80_api.cu); DEFS="-DJF_SM80_HDIM32 -DJF_SM80_HDIM96"
else
  SRCS="$(ls flash_*_hdim{64,128}_*_sm80.cu) flash_fwd_hdim256_bf16_sm80.cu flash_bwd_hdim256_bf16_sm80.cu flash_sm80_api.cu"
  DEFS="-DJF_SM80_NO_FP16_HDIM256"
fi
GENCODE=""
for a in $ARCHS; do GENCODE="$GENCODE -gencode arch=compute_$a,code=sm_$a"; done
FLAGS="-std=c++17 --expt-relaxed-constexpr -O3 -I$CUTLASS_INC $GENCODE $DEFS"
OBJ=harness/bin/obj
mkdir -p $OBJ
# KERNELS_LIB=/abs/path/libjf_sm80.a links the kernel archive of tools/build_kernels.sh (every
# instantiation, built for ARCHS) instead of compiling the subset here.
if [ -n "${KERNELS_LIB:-}" ]; then
  nvcc $FLAGS -c harness/test_sm80.cu -o $OBJ/test_sm80.o
  nvcc $GENCODE -cudart static -Xcompiler -static-libstdc++,-static-libgcc -o harness/bin/test_sm80 $OBJ/test_sm80.o "$KERNELS_LIB"
  echo "built harness/bin/test_sm80 (kernels from $KERNELS_LIB)"
  exit 0
fi
# Rebuild an object only when its source or any header is newer.
for s in $SRCS; do
  o=$OBJ/${s%.cu}.o
  if [ ! -f $o ] || [ -n "$(find $s *.h ../common/*.h -newer $o 2>/dev/null)" ]; then echo $s; fi
done | xargs -r -P ${JOBS:-2} -I{} sh -c 'f={}; nvcc '"$FLAGS"' -Xptxas -v -c $f -o '"$OBJ"'/${f%.cu}.o 2> '"$OBJ"'/${f%.cu}.log || { cat '"$OBJ"'/${f%.cu}.log; exit 255; }'
nvcc $FLAGS -c harness/test_sm80.cu -o $OBJ/test_sm80.o
nvcc $GENCODE -cudart static -Xcompiler -static-libstdc++,-static-libgcc -o harness/bin/test_sm80 $OBJ/test_sm80.o $(for s in $SRCS; do echo $OBJ/${s%.cu}.o; done)
echo built harness/bin/test_sm80
