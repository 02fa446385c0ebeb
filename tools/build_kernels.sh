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
# TARGETS narrows the build, e.g. TARGETS=jf_sm90 (default: every kernel library).
targets=${TARGETS:-jf_sm80}
if [ -z "${TARGETS:-}" ] && grep -q "jf_sm90" "$out/cmake/build.ninja"; then targets="$targets jf_sm90"; fi
cmake --build "$out/cmake" --target $targets -j "${JOBS:-$(nproc)}"
for lib in libjf_sm80.a libjf_sm90.a; do
  if [ -f "$out/cmake/$lib" ]; then cp "$out/cmake/$lib" "$out/"; fi
done
ls -la "$out"/*.a
