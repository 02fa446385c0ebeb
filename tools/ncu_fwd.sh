#!/usr/bin/env bash
# Profile one forward harness cell with ncu (GPU machine): summary sections + per-SASS-instruction
# stall samples. Usage: tools/ncu_fwd.sh BIN H S CAUSAL OUTPREFIX
set -uo pipefail
bin=$1 h=$2 s=$3 c=$4 out=$5
# One profiled launch (the second) of the forward kernel in the chosen harness cell.
profile() {
  ncu --clock-control none -k "regex:flash_fwd_kernel" --launch-skip 1 --launch-count 1 "$@" \
    "$bin" --no-test --h=$h --s=$s --causal=$c
}
profile --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section InstructionStats --section Occupancy > "$out.summary.txt" 2>&1
profile --section WarpStateStats --section SourceCounters --page source --print-source sass --csv \
  > "$out.source.csv" 2>&1
pct=avg.pct_of_peak_sustained_active
profile --metrics "sm__inst_executed_pipe_xu.$pct,sm__pipe_tensor_op_hmma_cycles_active.$pct,\
sm__inst_executed_pipe_fma.$pct,sm__inst_executed_pipe_alu.$pct,sm__issue_active.$pct,\
sm__pipe_shared_cycles_active.$pct,sm__inst_executed_pipe_lsu.$pct,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__pipe_fmaheavy_cycles_active.$pct,sm__pipe_fmalite_cycles_active.$pct" > "$out.pipes.txt" 2>&1
grep -E "pct|Duration|Issue Slots|No Eligible|Active Warps|Eligible" "$out.summary.txt" "$out.pipes.txt" | head -40
