#!/usr/bin/env python3
"""ncu_summary.py — GPU time per kernel from an Nsight Compute CSV (ncu --csv --page raw).

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \\
        --launch-skip 1000 --launch-count 1200 build-cuda/rollout-bench ... > kernels.csv
    python3 scripts/ncu_summary.py kernels.csv [--per NAME_SUBSTRING]

Prints one line per kernel name (template arguments and parameter lists stripped): launches, total
and mean microseconds, and its share of the profiled GPU time. --per divides the launches and the
total by the launch count of the first kernel whose name contains the substring (e.g. the lm_head's
GEMV, one launch per decode step), so the figures read per step. The sum of kernel times per step
against the step's wall time under graphs (rollout-bench's ms/step) is what the launches between
kernels cost.
"""
import argparse
import csv
import re
import sys
from collections import defaultdict


def short_name(name):
    name = re.sub(r"\(.*\)$", "", name.strip())  # parameter list
    depth, out = 0, []
    for ch in name:  # template arguments
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    name = "".join(out).split()[-1] if "".join(out).split() else name
    return name.split("::")[-1]


def read_rows(path):
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]  # ncu's own messages are not quoted
    rows = list(csv.reader(lines))
    head = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if head is None:
        sys.exit(f"{path}: no 'Kernel Name' column (is it ncu --csv --page raw output?)")
    cols = rows[head]
    k_name, k_time = cols.index("Kernel Name"), cols.index("gpu__time_duration.sum")
    unit = rows[head + 1][k_time] if head + 1 < len(rows) else ""
    scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}.get(unit)
    data = rows[head + 2:] if scale is not None else rows[head + 1:]
    scale = scale or 1e-3  # no units row: ncu's raw page gives ns
    out = []
    for r in data:
        if len(r) <= max(k_name, k_time):
            continue
        try:
            out.append((short_name(r[k_name]), float(r[k_time].replace(",", "")) * scale))
        except ValueError:
            continue
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--per", help="divide by the launches of the first kernel whose name contains this")
    a = ap.parse_args()
    rows = read_rows(a.csv)
    if not rows:
        sys.exit(f"{a.csv}: no kernel rows")
    count, total = defaultdict(int), defaultdict(float)
    for name, us in rows:
        count[name] += 1
        total[name] += us
    div, what = 1.0, "profiled"
    if a.per:
        match = next((n for n in count if a.per in n), None)
        if match:
            div, what = float(count[match]), f"per launch of {match} ({count[match]} launches)"
    grand = sum(total.values())
    print(f"{len(rows)} kernel launches, {grand:.1f} us of GPU time; figures {what}:")
    print(f"  {'kernel':<44} {'launches':>9} {'total us':>10} {'mean us':>9} {'share':>6}")
    for name in sorted(total, key=total.get, reverse=True):
        print(f"  {name[:44]:<44} {count[name] / div:>9.1f} {total[name] / div:>10.1f} "
              f"{total[name] / count[name]:>9.2f} {100 * total[name] / grand:>5.1f}%")
    print(f"  {'all':<44} {len(rows) / div:>9.1f} {grand / div:>10.1f}")


if __name__ == "__main__":
    main()
