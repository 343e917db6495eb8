#!/usr/bin/env python3
"""The SASS lines of a kernel that collect the most warp-stall samples, from ncu's source page as CSV.

    ncu ... --section SourceCounters -o rep python3 workload.py
    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python3 scripts/ncu_source_top.py rep.csv [--top 40] [--by "L1 Wavefronts Shared"]

Prints the columns ncu reports, the share of samples per opcode, then the top lines by all-samples stalls with
their address, SASS text and the counts of the other sampling columns (ncu's page has the not-issued samples there,
not a count per stall reason). `--by COLUMN` ranks by another column of the page instead (the column of that name,
else the first whose name contains it), e.g. the shared-memory wavefronts each instruction issued, with the ideal and
excessive counts beside them.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter

from sass_loops import opcode  # an instruction's opcode without its predicate


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--by", help="rank by the first column whose name contains this text (default: stall samples)")
    args = ap.parse_args(argv)
    with open(args.csv, newline="") as f:
        lines = [line for line in f if line.strip() and not line.startswith("==")]
    # ncu puts the kernel's name on a line of its own before the header
    while lines and not lines[0].startswith('"Address"'):
        lines = lines[1:]
    rows = list(csv.DictReader(lines))
    if not rows:
        sys.exit("no rows")
    columns = list(rows[0].keys())
    print("columns:", columns)
    if args.by:
        # the column of that name, else the first whose name contains it ("L1 Wavefronts Shared" is not its
        # "... Excessive" neighbour, which comes first on ncu's page)
        total_col = next((c for c in columns if args.by.lower() == c.lower()), None) or \
            next((c for c in columns if args.by.lower() in c.lower()), None)
        if total_col is None:
            sys.exit(f"no column contains {args.by!r}")
    else:
        total_col = next((c for c in columns if "Sampling" in c and "All" in c), None) or \
            next((c for c in columns if "Sampling" in c), None)
    source_col = next((c for c in columns if c.lower() in ("source", "sass")), columns[1] if len(columns) > 1 else columns[0])
    address_col = next((c for c in columns if "Address" in c), columns[0])
    if total_col is None:
        sys.exit("no sampling column")
    total = sum(number(r[total_col]) for r in rows) or 1.0
    print(f"{total_col}: {total:.0f} in all over {len(rows)} lines")
    by_op = Counter()
    for r in rows:
        text = r[source_col].strip()
        by_op[opcode(text) if text else "?"] += number(r[total_col])
    print("by opcode:", ", ".join(f"{k} {100 * v / total:.1f}%" for k, v in by_op.most_common(15)))
    # beside each line: the other sampling columns, or (ranking by another column) that column's relatives, e.g. the
    # ideal wavefronts beside the wavefronts
    stem = total_col.split("(")[0].strip()
    reasons = [c for c in columns if c != total_col and ("Sampling" in c if not args.by else c.startswith(stem))]
    for r in sorted(rows, key=lambda r: -number(r[total_col]))[: args.top]:
        detail = ", ".join(f"{c.split('(')[-1].rstrip(')')}={number(r[c]):.0f}" for c in reasons if number(r[c]) > 0)
        print(f"{r[address_col]:>8} {100 * number(r[total_col]) / total:5.1f}%  {r[source_col].strip()[:70]:70s} {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
