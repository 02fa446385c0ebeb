#!/usr/bin/env bash
# Profile one forward harness cell with ncu (GPU machine): summary sections + per-SASS-instruction
# stall samples. Usage: tools/ncu_fwd.sh BIN H S CAUSAL OUTPREFIX
set -uo pipefail
bin=$1 h=$2 s=$3 c=$4 out=$5
k="regex:flash_fwd_kernel"
ncu --clock-control none -k "$k" --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
  --section InstructionStats --section Occupancy \
  "$bin" --no-test --h=$h --s=$s --causal=$c > "$out.summary.txt" 2>&1
ncu --clock-control none -k "$k" --launch-skip 1 --launch-count 1 --section WarpStateStats --section SourceCounters \
  --page source --print-source sass --csv "$bin" --no-test --h=$h --s=$s --causal=$c > "$out.source.csv" 2>&1
ncu --clock-control none -k "$k" --launch-skip 1 --launch-count 1 --metrics \
sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active,sm__issue_active.avg.pct_of_peak_sustained_active,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_fmaheavy_cycles_active.avg.pct_of_peak_sustained_active,sm__pipe_fmalite_cycles_active.avg.pct_of_peak_sustained_active \
  "$bin" --no-test --h=$h --s=$s --causal=$c > "$out.pipes.txt" 2>&1
grep -E "pct|Duration|Issue Slots|No Eligible|Active Warps|Eligible" "$out.summary.txt" "$out.pipes.txt" | head -40
