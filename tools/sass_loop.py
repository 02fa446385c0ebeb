"""Static SASS of a kernel's GEMM loops, and an opcode diff of two loops, without a GPU.

cuobjdump / nvdisasm are not in this machine's CUDA install, but PyPI has them (CUDA 13.5):
    pip download --no-deps -d /tmp/nvd nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
    python3 -m zipfile -e /tmp/nvd/nvidia_cuda_cuobjdump-*.whl /tmp/nvtools   # bin: nvidia/cu13/bin
Dump an object of a kernel archive, or a peer's cubin (FA3's wheel: `cuobjdump -xelf NAME.cubin
flash_api*.so` first):
    ar x build/prebuilt/libjf_sm90.a flash_bwd_hdim128_bf16_sm90.cu.o
    cuobjdump -sass flash_bwd_hdim128_bf16_sm90.cu.o > ours.sass
Then
    python3 tools/sass_loop.py loops ours.sass REGEX             # loops holding HGMMA, per kernel
    python3 tools/sass_loop.py path ours.sass REGEX START END    # one path's control / sync skeleton
    python3 tools/sass_loop.py diff A.sass REGEX_A RANGES_A B.sass REGEX_B RANGES_B
REGEX picks the kernel (first mangled name that matches); RANGES are hex address spans of the path
to count, e.g. 2510-32b0,4bb0-5de0,5f50-60a0 (a loop's steady path: skip the branches it does not
take). Static counts per pass of the path, not executed counts: ncu's (tools/ncu_opcode_diff.py)
weigh each row by how often it ran.
"""
import collections
import re
import sys

from ncu_source_summary import sass_opcode

_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def kernel(path, regex):
    """[(address, instruction text)] of the first function whose mangled name matches regex."""
    out, on = [], False
    for line in open(path):
        if "Function :" in line:
            if on:
                break
            on = re.search(regex, line.split("Function :", 1)[1].strip()) is not None
            continue
        m = _INSTR.match(line) if on else None
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    if not out:
        sys.exit(f"no kernel matching {regex!r} in {path}")
    return out


def in_ranges(ranges):
    spans = [tuple(int(x, 16) for x in r.split("-")) for r in ranges.split(",")]
    return lambda a: any(lo <= a <= hi for lo, hi in spans)


def loops(instrs):
    """Backward branches whose body holds HGMMAs: (start, end, body length, HGMMA count)."""
    index = {a: i for i, (a, _) in enumerate(instrs)}
    for i, (a, t) in enumerate(instrs):
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            body = instrs[index.get(int(m.group(1), 16), 0):i + 1]
            gemms = sum("GMMA" in x for _, x in body)
            if gemms:
                yield body[0][0], a, len(body), gemms


_SKELETON = re.compile(r"GMMA|DEPBAR|BAR\.|SYNCS|MEMBAR|BRA|ARRIVE|FENCE|STSM|LDSM|UBLK|STS|LDL|STL|EXIT")


def main(argv):
    cmd = argv[0]
    if cmd == "loops":
        for lo, hi, n, g in loops(kernel(argv[1], argv[2])):
            print(f"{lo:#06x}-{hi:#06x}: {n} instructions, {g} GEMM instructions")
    elif cmd == "path":
        keep = in_ranges(f"{argv[3]}-{argv[4]}")
        last = None
        for a, t in kernel(argv[1], argv[2]):
            if keep(a) and _SKELETON.search(t):
                key = " ".join(t.split()[:2])
                if key != last or "GMMA" not in t:  # a run of one GEMM's instructions: its first
                    print(f"{a:#06x} {t}")
                last = key
    elif cmd == "diff":
        counts = []
        for path, regex, ranges in ((argv[1], argv[2], argv[3]), (argv[4], argv[5], argv[6])):
            keep = in_ranges(ranges)
            counts.append(collections.Counter(sass_opcode(t) for a, t in kernel(path, regex) if keep(a)))
        a, b = counts
        print(f"instructions per pass: A {sum(a.values())}, B {sum(b.values())}")
        for op in sorted(set(a) | set(b), key=lambda k: (-abs(a[k] - b[k]), k)):
            if a[op] != b[op]:
                print(f"{op:10s} {a[op]:5d} {b[op]:5d} {a[op] - b[op]:+5d}")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:] or ["help"])
