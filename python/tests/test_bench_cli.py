"""The Python benchmarks' command lines (bench/*.py), which otherwise run only on the GPU
machine: they must parse their options and refuse bad ones without PyTorch or a GPU, so a
typo is found here rather than in the first GPU run."""
import pathlib
import subprocess
import sys

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def run(*args):
    return subprocess.run([sys.executable, str(BENCH / "torch_offload.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_torch_offload_help():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--layers", "--prefill", "--decode", "--configs", "--quick", "--trace-decode",
                "--json"):
        assert opt in r.stdout


def test_torch_offload_rejects_unknown_config():
    r = run("--configs", "resident,nonsense")
    assert r.returncode == 2
    assert "nonsense" in r.stderr
