#!/bin/bash
# v64 (skip / lazy O rescale, NOTES.md) on the head dims and paths session 24 did not run.
# Prepare here: mkdir -p scratch/bin && cp cuda/sm90/harness/bin/test_sm90_{main,lazy}{64,256}
#   cuda/sm80/harness/bin/test_sm80_{base,lazy} scratch/bin/   (for `retune`: test_sm90_{lazy128,
#   lazyp8,lazya1,lazya2}; scratch/ travels with the tree, 64 MiB in all) (built in session 24; rebuild with
#   HDIM=64|256 tools/build_harness_variants.sh fwd mainNN: lazyNN:"-DJF_FWD_RESCALE_SKIP=1 -DJF_FWD_LAZY_MAX=8"
#   and tools/build_sm80_variants.sh "flash_fwd_hdim128_bf16_sm80.cu" base: lazy:"-DJF_SM80_LAZY_MAX=8")
# then on the device: bash cuda/sm90/experiments/v64_first_call.sh   (~6-8 min; log in $OUT/v64.txt)
# `... retune`: instead, H=128 with v64 against v64 plus PolyEvery 8 (exp2 1 in 8 on the FMA pipe)
# or the GEMM-issue hand-over after the row max / half the exp2s (test_sm90_{lazy128,lazyp8,
# lazya1,lazya2}: HDIM=128 variants with JF_FWD_POLY128=8 / JF_FWD_ARRIVE128=1 / 2, ~3 min).
cd "$(dirname "$0")/../../.."
OUT=${OUT:-/tmp/jf_out}; mkdir -p "$OUT"; L=$OUT/v64.txt
export PATH=/usr/local/cuda/bin:$PATH
B=scratch/bin
log() { echo "$*" | tee -a "$L"; }
t0=$(date +%s)
if [ "${1:-}" = retune ]; then
  for v in lazyp8 lazya1 lazya2; do
    timeout 60 $B/test_sm90_$v --no-bench --h=128 > /tmp/corr_$v.txt 2>&1
    log "$v correctness: $(grep -c ' ok ' /tmp/corr_$v.txt) ok, $(grep FAIL /tmp/corr_$v.txt | grep -vc 'not supported') real fails"
  done
  for cell in "--s=4096 --causal=0" "--s=1024 --causal=1" "--s=16384 --causal=0"; do
    for pass in 1 2; do for v in lazy128 lazyp8 lazya1 lazya2; do
      log "$v $cell pass $pass: $(timeout 40 $B/test_sm90_$v --no-test --h=128 $cell 2>&1 | grep -E '^ *128 ' | tail -1) ($(( $(date +%s) - t0 )) s)"
    done; done
  done
  exit 0
fi
for h in 64 256; do
  timeout 60 $B/test_sm90_lazy$h --no-bench --h=$h > /tmp/corr_$h.txt 2>&1
  log "lazy$h correctness: $(grep -c ' ok ' /tmp/corr_$h.txt) ok, $(grep FAIL /tmp/corr_$h.txt | grep -vc 'not supported') real fails"
  for t in racecheck memcheck; do
    timeout 90 compute-sanitizer --tool $t $B/test_sm90_lazy$h --no-bench --h=$h > /tmp/san_$t$h.txt 2>&1
    log "  $t: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' /tmp/san_$t$h.txt | tail -1)"
  done
done
for h in 64 256; do
  for cell in "--s=4096 --causal=0" "--s=1024 --causal=1" "--s=16384 --causal=0" "--s=4096 --causal=1"; do
    for pass in 1 2; do for v in main lazy; do
      log "$v$h $cell pass $pass: $(timeout 40 $B/test_sm90_$v$h --no-test --h=$h $cell 2>&1 | grep -E "^ *$h " | tail -1) ($(( $(date +%s) - t0 )) s)"
    done; done
  done
done
timeout 60 $B/test_sm80_lazy --small > /tmp/sm80_small.txt 2>&1; log "sm80 lazy --small rc $?: $(tail -1 /tmp/sm80_small.txt)"
for pass in 1 2; do for v in base lazy; do
  timeout 90 $B/test_sm80_$v --bench > /tmp/sm80_$v.txt 2>&1
  log "sm80 $v pass $pass:"; grep '^bench' /tmp/sm80_$v.txt | tee -a "$L"
done; done
log "done ($(( $(date +%s) - t0 )) s)"
