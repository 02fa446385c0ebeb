#!/usr/bin/env bash
# Same-run A/B of standalone sm90 harness binaries on the GPU machine (cuda/sm90/build_harness.sh
# builds them here; carry their bin folders): every binary benches once per pass, passes
# interleaved, so clock drift hits all alike. The table lines last; every run's whole log goes into
# one file, $OUT/ab_logs.txt (the device tool brings back at most 8 files from $OUT; session 20
# lost a call's test log to that), the per-run logs stay in $AB_LOG_DIR (default /tmp/jf_ab).
#   tools/harness_ab.sh PASSES "ARGS" BIN...     e.g. tools/harness_ab.sh 2 "--no-test --h=64" a b
# Each run is cut off after $AB_TIMEOUT seconds (default 120): a hung kernel costs one run.
# AB_GREP: the table lines to show (default: the sm90 harnesses' rows; '^bench' for test_sm80).
set -uo pipefail
passes=$1 args=$2; shift 2
OUT=${OUT:-/tmp/jf_out}
logs=${AB_LOG_DIR:-/tmp/jf_ab}
mkdir -p "$OUT" "$logs"
for pass in $(seq 1 "$passes"); do
  for bin in "$@"; do
    # shellcheck disable=SC2086
    timeout "${AB_TIMEOUT:-120}" "$bin" $args > "$logs/ab_$(basename "$bin")_$pass.log" 2>&1 || echo "$bin failed (rc $?)"
  done
done
for bin in "$@"; do
  for pass in $(seq 1 "$passes"); do
    log="$logs/ab_$(basename "$bin")_$pass.log"
    echo "== $(basename "$bin") pass $pass ($args)"
    grep -E "${AB_GREP:-^ *(H=)?[0-9]+ |causal}" "$log" | grep -v '^ *H causal'
    { echo "===== $(basename "$bin") pass $pass ($args)"; cat "$log"; } >> "$OUT/ab_logs.txt"
  done
done
