#!/usr/bin/env bash
# Profile one forward harness cell with ncu (GPU machine): summary sections + per-SASS-instruction
# stall samples + the L2 traffic by operation (loads, stores, reductions).
# Usage: tools/ncu_fwd.sh BIN H S CAUSAL OUTPREFIX
# KERNEL=flash_bwd_kernel (env) profiles a backward harness (test_bwd_sm90) instead; the L2 table's
# reduction row is the dQ bulk reduce-adds (NOTES.md, next steps after session 20).
set -uo pipefail
bin=$1 h=$2 s=$3 c=$4 out=$5
# One profiled launch (the second) of the kernel in the chosen harness cell.
profile() {
  ncu --clock-control none -k "regex:${KERNEL:-flash_fwd_kernel}" --launch-skip 1 --launch-count 1 "$@" \
    "$bin" --no-test --h=$h --s=$s --causal=$c
}
profile --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section InstructionStats --section Occupancy > "$out.summary.txt" 2>&1
profile --section WarpStateStats --section SourceCounters --page source --print-source sass --csv \
  > "$out.source.csv" 2>&1
profile --section MemoryWorkloadAnalysis_Tables --metrics "lts__t_sectors_op_red.sum.per_second,\
lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_op_red.avg.pct_of_peak_sustained_elapsed" \
  > "$out.l2.txt" 2>&1
pct=avg.pct_of_peak_sustained_active
profile --metrics "sm__inst_executed_pipe_xu.$pct,sm__pipe_tensor_op_hmma_cycles_active.$pct,\
sm__inst_executed_pipe_fma.$pct,sm__inst_executed_pipe_alu.$pct,sm__issue_active.$pct,\
sm__pipe_shared_cycles_active.$pct,sm__inst_executed_pipe_lsu.$pct,sm__throughput.avg.pct_of_peak_sustained_elapsed,\
sm__pipe_fmaheavy_cycles_active.$pct,sm__pipe_fmalite_cycles_active.$pct" > "$out.pipes.txt" 2>&1
grep -E "pct|Duration|Issue Slots|No Eligible|Active Warps|Eligible" "$out.summary.txt" "$out.pipes.txt" | head -40
grep -E "lts__|L2|Reduction|red" "$out.l2.txt" | head -20
