#!/bin/bash
# Prepared in session 25, run in session 26: where our H=128 backward executes
# 24-26% more instructions per FLOP than FA3's (NOTES.md, "Session 25: ours against FA3 per
# GFLOP"). Per SASS opcode, ours against FA3, on one backward call through JAX at bf16 H=128,
# B*S = 16k, N = 16: 4k causal (FA3 also runs 64-row tiles there) and 4k non-causal (FA3: 80 rows).
# On the device, after the package is installed (carry .whl and build/prebuilt.tar.xz):
#   tools/gpu_session.sh run "bash \$repo/cuda/sm90/experiments/bwd_opcodes.sh"
# Output: the opcode tables on stdout and in $OUT/bwd_opcodes.md.
set -uo pipefail
repo=${repo:-$(cd "$(dirname "$0")/../../.." && pwd)}
OUT=${OUT:-/tmp/jf_out}; mkdir -p "$OUT"
cat > /tmp/bwd_once.py <<'PY'
import sys
import jax, jax.numpy as jnp
sys.path.insert(0, sys.argv[4])
from kernel_times import _profiler
from jax_flash.bench import _implementations
impl = _implementations(True)[sys.argv[1]]
S, causal = int(sys.argv[2]), bool(int(sys.argv[3]))
B, N, H = 16384 // S, 16, 128
ks = jax.random.split(jax.random.key(0), 4)
q, k, v, do = (jax.random.normal(x, (B, S, N, H), jnp.float32).astype(jnp.bfloat16) for x in ks)
_, pullback = jax.vjp(lambda q, k, v: impl(q, k, v, causal), q, k, v)
bwd = jax.jit(pullback)
jax.block_until_ready(bwd(do)); jax.block_until_ready(bwd(do))
_profiler(True); jax.block_until_ready(bwd(do)); _profiler(False)
PY
cd /tmp
# CELLS narrows the cells, e.g. CELLS="4096:0" (default "4096:1 4096:0"; S:causal).
for cell in ${CELLS:-4096:1 4096:0}; do
  cell=${cell/:/ }
  set -- $cell
  for impl in jax_flash fa3_jax; do
    # The profiled call launches three kernels in both (row statistics / preprocess, the main
    # kernel, the dQ conversion, session 25's kernel_times table): skip one, take one.
    timeout 200 ncu --clock-control none --profile-from-start off --launch-skip 1 --launch-count 1 \
      --section SourceCounters --page source --print-source sass --csv \
      python3 /tmp/bwd_once.py $impl $1 $2 "$repo/tools" > /tmp/src_${impl}_$1_$2.csv 2>/tmp/src_${impl}_$1_$2.err \
      || { echo "ncu $impl $cell failed:"; tail -5 /tmp/src_${impl}_$1_$2.err; }
  done
  { echo "## S=$1 causal=$2: A = ours, B = FA3"; python3 "$repo/tools/ncu_opcode_diff.py" /tmp/src_jax_flash_$1_$2.csv /tmp/src_fa3_jax_$1_$2.csv 30; } \
    | tee -a "$OUT/bwd_opcodes.md"
  for impl in jax_flash fa3_jax; do
    { echo "### $impl S=$1 causal=$2 stall samples"; python3 "$repo/tools/ncu_source_summary.py" /tmp/src_${impl}_$1_$2.csv 25; } >> "$OUT/bwd_opcodes.md"
  done
done
# The raw dumps, for reading offline (tools/ncu_source_summary.py, ncu_opcode_diff.py).
tar cJf "$OUT/bwd_src_csv.tar.xz" -C /tmp $(cd /tmp && ls src_*.csv)
