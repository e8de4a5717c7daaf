"""kernel_times.py: where a run's GPU time went, from Nsight Compute's CSV of one metric.

usage: kernel_times.py NCU_CSV [--json OUT] [--top N]

NCU_CSV is what `ncu --metrics gpu__time_duration.sum --csv --print-units base ...` printed
(lines before the CSV header, such as the program's own output, are skipped). Kernels are
grouped by their name without template arguments or parameters; each group's count, total
microseconds and share of the sum are printed, largest first, and written as JSON with --json.
"""
import argparse
import csv
import io
import json
import re
import sys


def short_name(name):
    """'void gm_gate_up_kernel<1>(const float *, ...)' -> 'gm_gate_up_kernel<1>'."""
    name = re.sub(r"^void\s+", "", name.strip())
    depth, out = 0, []
    for ch in name:
        if ch == "(" and depth == 0:
            break
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        out.append(ch)
    return "".join(out).strip()


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"kernel_times: {path}: no ncu CSV header (a line starting \"ID\")")
    rows = csv.DictReader(io.StringIO("".join(lines[start:])))
    out = []
    for r in rows:
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        try:
            v = float(r["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
        unit = r.get("Metric Unit", "ns")
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                 "msecond": 1e3}.get(unit, 1e-3)
        out.append((short_name(r["Kernel Name"]), v * scale))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    ks = read(a.csv)
    if not ks:
        raise SystemExit(f"kernel_times: {a.csv}: no gpu__time_duration.sum rows")
    groups = {}
    for name, us in ks:
        c, t = groups.get(name, (0, 0.0))
        groups[name] = (c + 1, t + us)
    total = sum(t for _, t in groups.values())
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
    print(f"{len(ks)} kernels, {total:.1f} us in all")
    print(f"{'kernel':<60} {'count':>6} {'us':>10} {'share':>6}")
    for name, (c, t) in rows[:a.top]:
        print(f"{name[:60]:<60} {c:>6} {t:>10.1f} {t / total:>6.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"source": a.csv, "kernels": len(ks), "total_us": total,
                       "groups": [{"name": n, "count": c, "us": t, "share": t / total}
                                  for n, (c, t) in rows]}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
