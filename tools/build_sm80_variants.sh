#!/usr/bin/env bash
# Builds standalone sm80 harness binaries (cuda/sm80/harness/test_sm80.cu) for compile-time
# variants of some instantiation files, for one same-run A/B on the GPU machine
# (AB_GREP='^bench' tools/harness_ab.sh): every variant links its own objects of the named .cu
# files ahead of the prebuilt kernel archive, whose members of the same files are then not pulled.
#   tools/build_sm80_variants.sh "flash_fwd_hdim128_bf16_sm80.cu flash_fwd_hdim128_fp16_sm80.cu" \
#       base: w8:"-DJF_SM80_FWD128_WARPS=8"
#     -> cuda/sm80/harness/bin/test_sm80_base, .../test_sm80_w8
# KERNELS_LIB (default build/kernels/libjf_sm80.a, tools/build_kernels.sh) supplies everything
# else; ARCHS (default 90) the architectures of the variant objects and the harness.
set -euo pipefail
cd "$(dirname "$0")/.."
tus=$1; shift
lib=${KERNELS_LIB:-$PWD/build/kernels/libjf_sm80.a}
[ -f "$lib" ] || { echo "no kernel archive $lib (tools/build_kernels.sh)" >&2; exit 1; }
CI=${CUTLASS_INC:-$(python3 -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__))")/source/include}
gencode=""
for a in ${ARCHS:-90}; do gencode="$gencode -gencode arch=compute_$a,code=sm_$a"; done
flags="-std=c++17 --expt-relaxed-constexpr -O3 -I$CI $gencode"
bin=cuda/sm80/harness/bin
obj=/tmp/jf_sm80_variants
mkdir -p "$bin" "$obj"
[ "$obj/test_sm80.o" -nt cuda/sm80/harness/test_sm80.cu ] || nvcc $flags -c cuda/sm80/harness/test_sm80.cu -o "$obj/test_sm80.o"
for spec in "$@"; do
  name=${spec%%:*} vflags=${spec#*:}
  objs=() pids=()
  for tu in $tus; do
    o="$obj/${name}_${tu%.cu}.o"
    objs+=("$o")
    # shellcheck disable=SC2086
    nvcc $flags $vflags -Xptxas -v -c "cuda/sm80/$tu" -o "$o" > "${o%.o}.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || { cat "$obj/${name}"_*.log | tail -30; exit 1; }; done
  nvcc $gencode -cudart static -Xcompiler -static-libstdc++,-static-libgcc -o "$bin/test_sm80_$name" \
    "$obj/test_sm80.o" "${objs[@]}" "$lib"
  spills=$(cat "$obj/${name}"_*.log | grep -o '[0-9]* bytes spill stores' | awk '{s += $1} END {print s + 0}')
  echo "built $bin/test_sm80_$name (spill stores over its kernels: $spills B)"
done
