#!/usr/bin/env bash
# compute-sanitizer memcheck and racecheck over small case sets of the standalone harnesses, on
# the GPU machine (build the binaries here: cuda/sm80/harness/build.sh, cuda/sm90/build_harness.sh
# fwd|bwd; carry their bin folders). One summary line per run on stdout; every run's full log in
# one file, $OUT/san_logs.txt (the device tool brings back at most 8 files from $OUT), the per-run
# logs in $SAN_LOG_DIR (default: a fresh /tmp/jf_san.* folder per invocation).
#   tools/sanitize.sh [sm80] [fwd] [bwd]          (default: all three)
#   [FILTER=TEXT] tools/sanitize.sh extras_memcheck | extras_racecheck
#       the Hopper kernels' optional inputs through JAX (tools/sanitize_extras.py; needs the
#       installed package, e.g. under tools/gpu_session.sh run): one process per case whose label
#       contains FILTER, $SAN_JOBS (default 8) at once; a run the sanitizer itself dies in (rc 139,
#       no report: about 1 in 10 in session 19, different cases each time) is run once more.
# Binaries: $SM80_BIN, $FWD_BIN, $BWD_BIN (defaults: the build scripts' outputs). Each run is cut
# off after $SAN_TIMEOUT seconds (default 150); racecheck runs ~100x slower than the kernels.
# SAN_PARALLEL=1 starts every run at once (they share the GPU; the lines come as runs finish).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jf_out}
logs=${SAN_LOG_DIR:-$(mktemp -d /tmp/jf_san.XXXXXX)}
mkdir -p "$OUT" "$logs"
SM80_BIN=${SM80_BIN:-cuda/sm80/harness/bin/test_sm80}
FWD_BIN=${FWD_BIN:-cuda/sm90/harness/bin/test_sm90}
BWD_BIN=${BWD_BIN:-cuda/sm90/harness_bwd/bin/test_bwd_sm90}
export PATH=/usr/local/cuda/bin:$PATH

san() {  # tool name binary args...
  local tool=$1 name=$2; shift 2
  local log="$logs/san_${tool}_${name}.log" t0
  t0=$(date +%s)
  timeout "${SAN_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 99 "$@" >"$log" 2>&1
  local rc=$?
  echo "$tool $name: rc $rc, $(( $(date +%s) - t0 )) s, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
}
if [ "${SAN_PARALLEL:-0}" = 1 ]; then
  run_san() { san "$@" & }
else
  run_san() { san "$@"; }
fi

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(sm80 fwd bwd)
for t in "${targets[@]}"; do
  case "$t" in
    sm80)  # every portable kernel kind on 4 cases (lengths, GQA, window, softcap, deterministic)
      run_san memcheck sm80_small "$SM80_BIN" --small
      run_san racecheck sm80_small "$SM80_BIN" --small
      run_san memcheck sm80_even "$SM80_BIN" --even ;;
    fwd)  # H=64: 64-row two-CTA and 128-row dynamic kernels; H=128: the per-WG tile hand-off
          # (v60) on the dynamic schedule; H=256: the 64-key tiles
      for h in 64 128 256; do run_san memcheck "fwd_h$h" "$FWD_BIN" --no-bench --h=$h; done
      for h in 64 128 256; do run_san racecheck "fwd_h$h" "$FWD_BIN" --no-bench --h=$h; done ;;
    bwd)  # non-causal persistent (0: H=128 GQA), causal on the dynamic schedule (6: H=128 GQA,
          # 19: H=64, 24: H=256), H=256 non-causal with S^T / dP^T by role (22), deterministic causal
          # (28), padded H=72 (32); the case numbers of test_bwd_sm90.cu's list. The key split's dS
          # ring (v43) runs in 0, 6, 19, 28, 32.
      for c in 0 6 19 22 24 28 32; do run_san memcheck "bwd_case$c" "$BWD_BIN" --no-bench --case=$c; done
      for c in 0 6 19 22 24; do run_san racecheck "bwd_case$c" "$BWD_BIN" --no-bench --case=$c; done ;;
    extras_memcheck | extras_racecheck)
      tool=${t#extras_}
      extra_case() {  # label
        local log="$logs/san_${tool}_$(echo "$1" | tr -c 'A-Za-z0-9' _ | cut -c1-80).log" rc try
        for try in 1 2; do
          timeout "${SAN_TIMEOUT:-150}" compute-sanitizer --tool "$tool" --error-exitcode 99 --kernel-name kns=jax_flash \
            python3 tools/sanitize_extras.py --exact="$1" >"$log" 2>&1
          rc=$?
          [ $rc = 139 ] || break
        done
        echo "$tool rc $rc (try $try): $1: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -1)"
      }
      export -f extra_case
      export tool logs SAN_TIMEOUT
      python3 tools/sanitize_extras.py --list | grep -F -- "${FILTER:-}" |
        xargs -d '\n' -P "${SAN_JOBS:-8}" -I{} bash -c 'extra_case "$1"' _ {} ;;
    *) echo "unknown target $t (sm80 | fwd | bwd | extras_memcheck | extras_racecheck)" >&2; exit 2 ;;
  esac
done
wait
for f in "$logs"/san_*.log; do
  [ -f "$f" ] && { echo "===== $(basename "$f")"; cat "$f"; }
done >> "$OUT/san_logs.txt"
