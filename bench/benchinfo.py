"""bench/benchinfo.py: what the Python benchmarks stamp on their JSON results.

commit(): TANDEM_COMMIT when set (a machine handed a copy of the tree, whose git metadata may
be stale, is given the commit this way), else `git describe` of this checkout, else "unknown".
"""
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
