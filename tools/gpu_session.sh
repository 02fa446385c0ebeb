#!/usr/bin/env bash
# One call on the GPU machine (the device tool): install jax_flash linking kernel archives
# prebuilt by tools/build_kernels.sh, then run a step. Logs go under $OUT.
#   tools/gpu_session.sh test [1|2]      # GPU test group, or one half of it; cut after
#                                        # $TEST_TIMEOUT s (default 500); $OUT/passed.txt lists the
#                                        # tests passed so far: bring it back and set
#                                        # JF_TEST_DONE=<that file> (absolute or repo-relative)
#                                        # to run only the rest next call
#   tools/gpu_session.sh bench [args]    # jax-flash-bench with args
#   tools/gpu_session.sh run "CMD"       # any command after the install (cwd /tmp, $repo set)
# The device tool brings back at most 8 files from $OUT (2 folders deep): keep a call's logs few
# (tools/harness_ab.sh writes one; other steps' logs belong in /tmp, printed or tailed).
# Carry: .whl (flash-attn3-jax wheel, optional) and build/prebuilt (libjf_sm80.a, libjf_sm90.a,
# 39 MB) or build/prebuilt.tar.xz (the same, 2 MB: `tar cJf build/prebuilt.tar.xz -C build prebuilt`;
# with the 29 MB wheel the plain folder passes the 64 MiB carry limit; the tarball wins when both
# are there).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# The tarball replaces a folder left by an earlier call, once per tarball (its checksum is kept
# beside the archives): a second invocation in the same call finds it unpacked.
if [ -f "$repo/build/prebuilt.tar.xz" ]; then
  sum=$(md5sum < "$repo/build/prebuilt.tar.xz")
  if [ "$(cat "$repo/build/prebuilt/.tarball_md5" 2>/dev/null)" != "$sum" ]; then
    rm -rf "$repo/build/prebuilt" && tar xJf "$repo/build/prebuilt.tar.xz" -C "$repo/build" \
      && echo "$sum" > "$repo/build/prebuilt/.tarball_md5"
  fi
fi
OUT=${OUT:-/tmp/jf_out}
mkdir -p "$OUT"
export PATH=/usr/local/cuda/bin:$PATH PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$repo"/.whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
cd /tmp  # never import jax_flash from the source tree
if ! python3 -c "import jax_flash, sys; sys.exit(0 if jax_flash.WITH_CUDA else 1)" 2>/dev/null; then
  t0=$(date +%s)
  (cd "$repo" && JAX_FLASH_CUDA=ON JAX_FLASH_PREBUILT_KERNELS_DIR="$repo/build/prebuilt" \
     python3 -m pip install --no-build-isolation --no-deps -v . >"$OUT/build.log" 2>&1) \
    || { tail -60 "$OUT/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
python3 -c "import jax, jax_flash; print(jax.__version__, jax.devices(), 'cuda kernels:', jax_flash.WITH_CUDA)"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
step=${1:-test}; shift || true
case "$step" in
  test)
    # Half 1: the shape and feature grids; half 2: everything else (extras, dropout, determinism,
    # transforms, long context).
    case "${1:-all}" in
      1) sel=(-k "test_gpu_shapes or test_gpu_features") ;;
      2) sel=(-k "not test_gpu_shapes and not test_gpu_features") ;;
      *) sel=() ;;
    esac
    export JF_TEST_PASSED_LOG="$OUT/passed.txt"
    if [ -n "${JF_TEST_DONE:-}" ]; then
      case "$JF_TEST_DONE" in /*) ;; *) export JF_TEST_DONE="$repo/$JF_TEST_DONE" ;; esac  # pytest runs in /tmp
      sort -u "$JF_TEST_DONE" > "$OUT/passed.txt"
    else
      : > "$OUT/passed.txt"
    fi
    timeout "${TEST_TIMEOUT:-500}" pytest -q -ra -n 14 -p no:cacheprovider "$repo/tests/test_gpu.py" \
      ${sel[@]+"${sel[@]}"} --durations=10 > "$OUT/test_gpu.log" 2>&1
    rc=$?
    sort -u -o "$OUT/passed.txt" "$OUT/passed.txt"
    echo "pytest rc $rc ($([ $rc = 124 ] && echo 'cut by TEST_TIMEOUT' || echo finished)); passed or skipped so far: $(wc -l < "$OUT/passed.txt")"
    grep -E '^(FAILED|ERROR)' "$OUT/test_gpu.log" | head -30
    grep -vE 'Benchmark|warner\(' "$OUT/test_gpu.log" | tail -25
    ;;
  run)
    export repo
    bash -c "$1"
    ;;
  bench)
    jax-flash-bench --json "$OUT/bench.json" "$@" 2>"$OUT/bench_progress.log" | tee "$OUT/bench.md"
    ;;
esac
