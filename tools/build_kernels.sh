#!/usr/bin/env bash
# Compile the CUDA kernels into static archives (libjf_sm80.a, libjf_sm90.a) on a machine
# with nvcc, for linking into an extension built elsewhere:
#   tools/build_kernels.sh [OUT_DIR] [ARCHS] [extra cmake args...]   (defaults: build/kernels, "90-real")
#   JAX_FLASH_PREBUILT_KERNELS_DIR=OUT_DIR pip install --no-build-isolation .
# The archives hold no Python or XLA code, so they do not depend on the Python version.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-build/kernels}
archs=${2:-90-real}
shift $(( $# < 2 ? $# : 2 ))
cmake -S . -B "$out/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DJAX_FLASH_CUDA=ON \
  -DJAX_FLASH_CUDA_ARCHS="$archs" -DPython_EXECUTABLE="$(command -v python3)" "$@" >/dev/null
targets="jf_sm80"
grep -q "jf_sm90" "$out/cmake/build.ninja" && targets="$targets jf_sm90"
cmake --build "$out/cmake" --target $targets -j "${JOBS:-$(nproc)}"
cp "$out"/cmake/libjf_sm8*.a "$out"/
[ -f "$out/cmake/libjf_sm90.a" ] && cp "$out/cmake/libjf_sm90.a" "$out"/
ls -la "$out"/*.a
