#!/bin/bash
# Builds a standalone sm90 harness (static cudart, runs on the GPU machine as is):
#   cuda/sm90/build_harness.sh fwd   ->  cuda/sm90/harness/bin/test_sm90
#   cuda/sm90/build_harness.sh bwd   ->  cuda/sm90/harness_bwd/bin/test_bwd_sm90
# HDIM=128 (env): that head dim's bf16 kernels only (~1 minute instead of ~10; the binary refuses
# every other case, so test and bench with --h=128, bf16 cases only).
# Kernel objects are cached in $OBJ_DIR and rebuilt when a source or an sm90 header is newer.
set -e
cd "$(dirname "$0")"
case "${1:-fwd}" in
  fwd) dir=harness; main=test_sm90; pass=fwd ;;
  bwd) dir=harness_bwd; main=test_bwd_sm90; pass=bwd ;;
  *) echo "usage: $0 fwd|bwd" >&2; exit 2 ;;
esac
CI=${CUTLASS_INCLUDE:-$(python3 -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__))")/source/include}
FLAGS="-gencode=arch=compute_90a,code=sm_90a -std=c++17 --expt-relaxed-constexpr -O3 -DNDEBUG -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -I$CI -cudart static"
OBJ=${OBJ_DIR:-/tmp/jf_sm90_${pass}${HDIM:+_h$HDIM}_obj}
mkdir -p $dir/bin $OBJ
pids=()
sources="flash_${pass}_hdim*_sm90.cu"
if [ -n "${HDIM:-}" ]; then sources="flash_${pass}_hdim${HDIM}_bf16_sm90.cu"; EXTRA_FLAGS="${EXTRA_FLAGS:-} -DJF_HARNESS_BF16_HDIM=$HDIM"; fi
for s in flash_${pass}_sm90.cu $sources; do
  o=$OBJ/$(basename $s .cu).o
  if [ ! -f $o ] || [ -n "$(find . ../common -maxdepth 1 -name '*.h' -newer $o)" ] || [ $s -nt $o ]; then
    nvcc $FLAGS ${EXTRA_FLAGS} -c $s -o $o &
    pids+=($!)
  fi
done
for p in "${pids[@]}"; do wait $p; done
nvcc $FLAGS ${EXTRA_FLAGS} -c $dir/$main.cu -o $OBJ/$main.o
nvcc $FLAGS -o $dir/bin/$main $OBJ/flash_${pass}_sm90.o $(for f in $sources; do echo $OBJ/$(basename $f .cu).o; done) $OBJ/$main.o
echo built $dir/bin/$main
