"""Executed instructions per SASS opcode, ours against a peer, from two ncu source dumps.

    ncu --clock-control none --section SourceCounters --page source --print-source sass --csv \
        -k regex:NAME --launch-count 1 ... > A.csv
    python3 tools/ncu_opcode_diff.py A.csv B.csv [top_n]

Prints, per opcode (modifiers stripped to the first field, e.g. HGMMA, FMNMX, IMAD), the warp-level
executed instruction counts of both kernels and their difference, largest difference first:
where a kernel that runs more instructions than its peer spends them.
"""
import collections
import sys

from ncu_source_summary import load_rows, number, opcode


def opcode_counts(path):
    """Executed warp instructions and warp-stall samples per opcode."""
    rows = load_rows(path)
    col = next(c for c in rows[0] if c.strip() == "Instructions Executed")
    samp = next((c for c in rows[0] if "Warp Stall Sampling (All" in c), None)
    counts, samples = collections.Counter(), collections.Counter()
    for r in rows:
        if r.get("Source", "").strip():
            op = opcode(r)
            counts[op] += number(r[col])
            if samp:
                samples[op] += number(r[samp])
    return counts, samples


def main(a_path, b_path, top=25):
    (a, sa), (b, sb) = opcode_counts(a_path), opcode_counts(b_path)
    ta, tb = sum(a.values()), sum(b.values())
    print(f"total executed (warp instructions): A {ta / 1e6:.2f}M  B {tb / 1e6:.2f}M  A/B {ta / max(tb, 1):.3f}")
    print(f"stall samples: A {sum(sa.values()):.0f}  B {sum(sb.values()):.0f}")
    print(f"{'opcode':>10} {'A (M)':>8} {'B (M)':>8} {'A-B (M)':>8} {'samples A':>10} {'samples B':>10}")
    ops = sorted(set(a) | set(b), key=lambda k: -abs(a[k] - b[k]))
    for k in ops[:top]:
        print(f"{k:>10} {a[k] / 1e6:8.3f} {b[k] / 1e6:8.3f} {(a[k] - b[k]) / 1e6:+8.3f} {sa[k]:10.0f} {sb[k]:10.0f}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(x) for x in sys.argv[3:4]))
