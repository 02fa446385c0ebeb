"""Summarise an ncu --page source --print-source sass --csv dump: where the warp-stall samples sit.

Usage: python3 tools/ncu_source_summary.py FILE.csv [top_n]
Prints samples per opcode, the top instructions, and stall-reason totals (columns named stall_*)."""
import collections
import csv
import io
import sys


def load_rows(path):
    """The per-SASS-instruction rows of an ncu source-page CSV dump (the table after ncu's log lines)."""
    text = open(path, errors="replace").read()
    start = text.find('"Address"')
    if start < 0:
        start = text.find('"#"')
    return list(csv.DictReader(io.StringIO(text[start:])))


def sass_opcode(text):
    """A SASS instruction's opcode without predicate and modifiers (HGMMA, FMNMX, ...), "?" for none."""
    toks = [t for t in text.strip().split() if not t.startswith("@")]
    return toks[0].split(".")[0] if toks else "?"


def opcode(row):
    """The ncu source row's opcode (sass_opcode of its Source column)."""
    return sass_opcode(row.get("Source", ""))


def number(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return 0.0


def main(path, top=30):
    rows = load_rows(path)
    if not rows:
        print("no rows"); return
    cols = rows[0].keys()
    samp = next(c for c in cols if "Warp Stall Sampling (All" in c)
    reasons = [c for c in cols if c.startswith("stall_") or "Stall" in c and c != samp and "Sampling" not in c]
    f = number
    total = sum(f(r[samp]) for r in rows) or 1.0
    by_op = collections.Counter()
    for r in rows:
        by_op[opcode(r)] += f(r[samp])
    print(f"total samples {total:.0f}")
    print("by opcode:", ", ".join(f"{k} {100*v/total:.1f}%" for k, v in by_op.most_common(14)))
    rs = collections.Counter()
    for r in rows:
        for c in reasons:
            rs[c] += f(r[c])
    print("by reason:", ", ".join(f"{k} {100*v/total:.1f}%" for k, v in rs.most_common(12) if v))
    print(f"top {top} instructions:")
    for r in sorted(rows, key=lambda r: -f(r[samp]))[:top]:
        why = sorted(((f(r[c]), c) for c in reasons), reverse=True)[:2]
        why = " ".join(f"{c}={v:.0f}" for v, c in why if v)
        print(f"  {100*f(r[samp])/total:5.1f}%  {r.get('Address','')}  {r.get('Source','').strip()[:70]:70s} {why}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30)
