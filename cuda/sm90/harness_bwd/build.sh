#!/bin/bash
# Builds the standalone sm90 backward harness into cuda/sm90/harness_bwd/bin/test_bwd_sm90 (static cudart).
set -e
cd "$(dirname "$0")"
CI=${CUTLASS_INCLUDE:-$(python3 -c "import cutlass_library,os;print(os.path.dirname(cutlass_library.__file__))")/source/include}
FLAGS="-gencode=arch=compute_90a,code=sm_90a -std=c++17 --expt-relaxed-constexpr -O3 -DNDEBUG -I$CI -cudart static"
OBJ=${OBJ_DIR:-/tmp/jf_sm90_bwd_obj}
mkdir -p bin $OBJ
SRCS="../flash_bwd_sm90.cu $(ls ../flash_bwd_hdim*_sm90.cu)"
pids=()
for s in $SRCS; do
  o=$OBJ/$(basename $s .cu).o
  if [ ! -f $o ] || [ -n "$(find .. -maxdepth 1 -name '*bwd*.h' -newer $o)" ] || [ $s -nt $o ]; then
    nvcc $FLAGS ${EXTRA_FLAGS} -c $s -o $o &
    pids+=($!)
  fi
done
for p in "${pids[@]}"; do wait $p; done
nvcc $FLAGS -c test_bwd_sm90.cu -o $OBJ/test_bwd_sm90.o
nvcc $FLAGS -o bin/test_bwd_sm90 $OBJ/*.o
echo built bin/test_bwd_sm90
