#!/usr/bin/env python3
"""compare_logits.py: holds a logits file (llama.cpp's, from bench/peer/llama_logits, or any
engine's in the same layout) against another, normally tests/model/ref_model.py's float64
reference, row by row. Both files are in ref_model.py's logits.bin layout.

usage: compare_logits.py TEST.bin REF.bin [--tol T] [--quiet]

Per row: the relative error max|test - ref| / max|ref| (the metric of tests/model/
ref_selftest.py), the largest element-wise |test - ref| / |ref| over the elements whose |ref|
is at least a tenth of the row's largest, and whether the argmax agrees. Greedy rows are
comparable only while the two files generated the same ids: a row after a differing id is
reported, not judged. Exit status 1 when a comparable row's relative error exceeds --tol
(default 1e-2, for llama.cpp's f32 kernels with bf16 activations against float64) or the
shapes or prompts differ.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "tests", "model"))
from ref_model import read_logits  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description="row-by-row relative error of two logits files")
    ap.add_argument("test")
    ap.add_argument("ref")
    ap.add_argument("--tol", type=float, default=1e-2)
    ap.add_argument("--quiet", action="store_true", help="the summary line only")
    a = ap.parse_args(argv)

    t, tp, tids = read_logits(a.test)
    r, rp, rids = read_logits(a.ref)
    if t.shape[1] != r.shape[1] or tp != rp:
        print(f"shapes differ: test {t.shape} prompt {tp}, ref {r.shape} prompt {rp}")
        return 1
    rows = min(t.shape[0], r.shape[0])
    P = rp
    # row P+j follows generated id j: comparable while ids 0..j agree
    diverged_at = next((j for j in range(min(len(tids), len(rids))) if tids[j] != rids[j]), None)

    worst = 0.0
    judged = 0
    if not a.quiet:
        print(f"{'row':>4} {'kind':<8} {'rel(max)':>10} {'elem-rel':>10} {'argmax':>12}")
    for i in range(rows):
        x, y = t[i], r[i]
        scale = max(float(np.max(np.abs(y))), 1e-300)
        rel = float(np.max(np.abs(x - y)) / scale)
        big = np.abs(y) >= 0.1 * scale
        elem = float(np.max(np.abs(x[big] - y[big]) / np.abs(y[big])))
        am_t, am_r = int(np.argmax(x)), int(np.argmax(y))
        comparable = i < P or diverged_at is None or i - P < diverged_at
        kind = f"p{i}" if i < P else f"g{i - P}"
        if comparable:
            judged += 1
            worst = max(worst, rel)
        if not a.quiet:
            note = "" if comparable else "  (after a differing id: not judged)"
            print(f"{i:>4} {kind:<8} {rel:>10.3e} {elem:>10.3e} {am_t:>5} {'==' if am_t == am_r else '!='} "
                  f"{am_r:<4}{note}")
    same = "same" if diverged_at is None else f"differ from step {diverged_at}"
    print(f"{os.path.basename(a.test)} vs {os.path.basename(a.ref)}: {judged}/{rows} rows judged, "
          f"max relative error {worst:.3e} (tol {a.tol:g}); generated ids {same}: "
          f"test {[int(i) for i in tids]} ref {[int(i) for i in rids]}")
    return 0 if worst <= a.tol else 1


if __name__ == "__main__":
    sys.exit(main())
