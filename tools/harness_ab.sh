#!/usr/bin/env bash
# Same-run A/B of standalone sm90 harness binaries on the GPU machine (cuda/sm90/build_harness.sh
# builds them here; carry their bin folders): every binary benches once per pass, passes
# interleaved, so clock drift hits all alike. Logs under $OUT; the table lines last.
#   tools/harness_ab.sh PASSES "ARGS" BIN...     e.g. tools/harness_ab.sh 2 "--no-test --h=64" a b
# Each run is cut off after $AB_TIMEOUT seconds (default 120): a hung kernel costs one run.
# AB_GREP: the table lines to show (default: the sm90 harnesses' rows; '^bench' for test_sm80).
set -uo pipefail
passes=$1 args=$2; shift 2
OUT=${OUT:-/tmp/jf_out}
mkdir -p "$OUT"
for pass in $(seq 1 "$passes"); do
  for bin in "$@"; do
    # shellcheck disable=SC2086
    timeout "${AB_TIMEOUT:-120}" "$bin" $args > "$OUT/ab_$(basename "$bin")_$pass.log" 2>&1 || echo "$bin failed (rc $?)"
  done
done
for bin in "$@"; do
  for pass in $(seq 1 "$passes"); do
    echo "== $(basename "$bin") pass $pass ($args)"
    grep -E "${AB_GREP:-^ *(H=)?[0-9]+ |causal}" "$OUT/ab_$(basename "$bin")_$pass.log" | grep -v '^ *H causal'
  done
done
