"""bench/benchinfo.py: what the Python benchmarks stamp on their JSON results, and how they
write them.

commit(): TANDEM_COMMIT when set (a machine handed a copy of the tree, whose git metadata may
be stale, is given the commit this way), else `git describe` of this checkout, else "unknown".
utc_now(): the date and time, UTC, as the results record it.
write_json(path, doc): the results file (indented, newline-terminated; values JSON cannot hold
are written as strings).
"""
import datetime
import json
import os
import subprocess


def commit():
    if os.environ.get("TANDEM_COMMIT"):
        return os.environ["TANDEM_COMMIT"]
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"],
                              capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() \
            or "unknown"
    except OSError:
        return "unknown"


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_json(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)
        f.write("\n")
