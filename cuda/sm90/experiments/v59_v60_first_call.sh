#!/usr/bin/env bash
# The first device call planned for v59 (get_tile by multiply-high divisors) and v60 (one tile
# hand-off barrier per consumer WG), NOTES.md session 22. Two halves:
#   here:   cuda/sm90/experiments/v59_v60_first_call.sh build
#           (applies both patches to the working tree, builds harness variants into scratch/bin;
#            ~10 minutes on 2 cores)
#   device: bash cuda/sm90/experiments/v59_v60_first_call.sh run     (~3 minutes of GPU time)
# Variants (HDIM=128, bf16): base = both off, v59, v60, both; timeline builds of base with the tile
# start mark at the loop top / after the coordinates / before the Q wait, and of both.
set -euo pipefail
cd "$(dirname "$0")/../../.."
case "${1:-}" in
  build)
    git apply cuda/sm90/experiments/v59-fast-tile-coords.patch
    git apply cuda/sm90/experiments/v60-handoff-per-wg.patch
    off59=-DJF_FAST_TILE_DIV=0 off60=-DJF_FWD_HANDOFF_PER_WG=0 tl=-DJF_FWD_TIMELINE
    HDIM=128 tools/build_harness_variants.sh fwd base:"$off59 $off60" v59:"$off60" v60:"$off59" both: \
      tl0:"$tl $off59 $off60" tl1:"$tl $off59 $off60 -DJF_FWD_TL_START=1" \
      tl2:"$tl $off59 $off60 -DJF_FWD_TL_START=2" tlboth:"$tl"
    mkdir -p scratch/bin
    for v in base v59 v60 both tl0 tl1 tl2 tlboth; do cp cuda/sm90/harness/bin/test_sm90_$v scratch/bin/f128_$v; done
    HDIM=64 tools/build_harness_variants.sh fwd base:"$off59 $off60" both:
    for v in base both; do cp cuda/sm90/harness/bin/test_sm90_$v scratch/bin/f64_$v; done ;;
  run)
    set +e  # the HDIM builds exit 1 for the fp16 cases they refuse; keep going
    OUT=${OUT:-/tmp/jf_out}; mkdir -p "$OUT"; cd scratch/bin
    for b in f128_both f64_both; do  # correctness first (the HDIM builds refuse fp16 cases)
      h=${b#f}; h=${h%%_*}; timeout 120 ./$b --no-bench --h=$h > /tmp/c_$b.txt 2>&1
      echo "$b: $(grep -c '  ok' /tmp/c_$b.txt) ok, $(grep FAIL /tmp/c_$b.txt | grep -vc 'not supported') unexpected FAIL"
    done
    for b in f128_tl0 f128_tl1 f128_tl2 f128_tlboth; do
      timeout 60 ./$b --no-test --timeline --h=128 --s=1024 --causal=1 > /tmp/$b.txt 2>&1
      echo "== $b"; grep -E "mean over" /tmp/$b.txt; { echo "===== $b"; cat /tmp/$b.txt; } >> "$OUT/timelines.txt"
    done
    AB=../../tools/harness_ab.sh
    AB_TIMEOUT=60 $AB 2 "--no-test --h=128 --s=1024" ./f128_base ./f128_v59 ./f128_v60 ./f128_both
    AB_TIMEOUT=60 $AB 2 "--no-test --h=64 --s=1024" ./f64_base ./f64_both
    AB_TIMEOUT=90 $AB 1 "--no-test --h=128" ./f128_base ./f128_both ;;
  *) echo "usage: $0 build | run" >&2; exit 2 ;;
esac
