#!/usr/bin/env bash
# Builds standalone sm90 harness binaries for several compile-time variants, for one same-run
# A/B on the GPU machine (tools/harness_ab.sh):
#   tools/build_harness_variants.sh bwd main: static:"-DJF_BWD_DYNAMIC=0"
#     -> cuda/sm90/harness_bwd/bin/test_bwd_sm90_main, .../test_bwd_sm90_static
#   HDIM=128 tools/build_harness_variants.sh ...   (one head dim, bf16: build_harness.sh)
# Each variant keeps its objects in /tmp/jf_variant_<pass>_<name>_<hash of its flags> (rebuilt
# when a source or an sm90 header is newer), so a second call after an edit recompiles only what
# changed, and a name reused with other flags never links stale objects.
set -euo pipefail
cd "$(dirname "$0")/.."
pass=$1; shift
case "$pass" in
  fwd) dir=cuda/sm90/harness/bin; bin=test_sm90 ;;
  bwd) dir=cuda/sm90/harness_bwd/bin; bin=test_bwd_sm90 ;;
  *) echo "usage: $0 fwd|bwd NAME:FLAGS..." >&2; exit 2 ;;
esac
for spec in "$@"; do
  name=${spec%%:*} flags=${spec#*:}
  obj=/tmp/jf_variant_${pass}_${name}_$(printf '%s' "$flags ${HDIM:-}" | md5sum | cut -c1-8)
  OBJ_DIR=$obj EXTRA_FLAGS="-Xptxas -warn-spills $flags" \
    cuda/sm90/build_harness.sh "$pass" > "/tmp/jf_variant_${pass}_${name}.log" 2>&1 \
    || { tail -20 "/tmp/jf_variant_${pass}_${name}.log"; exit 1; }
  mv "$dir/$bin" "$dir/${bin}_$name"
  echo "built $dir/${bin}_$name ($(grep -c 'bytes spill stores' "/tmp/jf_variant_${pass}_${name}.log" || true) spill warnings)"
done
