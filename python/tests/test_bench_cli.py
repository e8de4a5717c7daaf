"""The Python benchmarks' command lines (bench/*.py), which otherwise run only on the GPU
machine: they must parse their options and refuse bad ones without PyTorch or a GPU, so a
typo is found here rather than in the first GPU run."""
import pathlib
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "bench"


def run(*args):
    return subprocess.run([sys.executable, str(BENCH / "torch_offload.py"), *args],
                          capture_output=True, text=True, timeout=60)


def test_torch_offload_help():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--layers", "--prefill", "--decode", "--configs", "--quick", "--trace-decode",
                "--trace-prefill", "--cudnn-sdpa", "--json"):
        assert opt in r.stdout


def test_torch_offload_rejects_unknown_config():
    r = run("--configs", "resident,nonsense")
    assert r.returncode == 2
    assert "nonsense" in r.stderr


def load_bench():
    import importlib.util
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location("torch_offload", BENCH / "torch_offload.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH))
    return mod


def test_trace_breakdown_finds_link_gaps():
    """The trace breakdown on a hand-made trace: a 1000 us step whose link is busy 100-400 and
    450-900 (so idle 0-100, 400-450 and 900-1000), with a kernel in the first gap."""
    b = load_bench()
    ev = [{"ph": "X", "cat": "user_annotation", "name": "prefill", "ts": 0, "dur": 1000},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 100,
           "dur": 300, "args": {"bytes": 3000}},
          {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 450,
           "dur": 450, "args": {"bytes": 4500}},
          {"ph": "X", "cat": "kernel", "name": "attention", "ts": 10, "dur": 80},
          {"ph": "X", "cat": "cuda_runtime", "name": "cudaEventSynchronize", "ts": 905,
           "dur": 90}]
    r = b.breakdown({"traceEvents": ev}, "t.json", "prefill")
    assert r["link_busy_us"] == 750
    assert r["h2d_copies"] == 2 and r["h2d_bytes"] == 7500
    assert r["link_first_us"] == 100 and r["link_last_us"] == 100
    assert r["link_gaps"] == 3 and r["link_gaps_us"] == 250
    first = r["link_longest_gaps"][0]
    assert first["us"] == 100 and first["at_us"] in (0, 900)
    by_at = {g["at_us"]: g for g in r["link_longest_gaps"]}
    assert by_at[0]["kernels"] == ["attention (80 us)"]
    assert by_at[900]["host"] == ["cudaEventSynchronize (90 us)"]
    assert b.breakdown({"traceEvents": ev}, "t.json", "decode_step") == \
        {"error": "no decode_step annotation in the trace"}


def test_torch_offload_host_sweep_rows():
    """--host-share and --host-threads lists: every -host configuration once for each pair,
    named apart, and each compared with its own eager twin and with the link alone."""
    b = load_bench()
    a = b.parse_args(["--configs", "tandem0-graph,tandem0-host,tandem0-host-graph",
                      "--host-share", "0.3,0.5", "--host-threads", "8,0"])
    rows = b.runs(a)
    assert [r[0] for r in rows[:3]] == ["tandem0-graph", "tandem0-host s0.3 t8",
                                        "tandem0-host s0.3 t0"]
    assert len(rows) == 9 and ("tandem0-host-graph s0.5 t0", "tandem0-host-graph", 0.5, 0) in rows
    res = [{"config": lab, "base": name, "prefill": [],
            "decode": {"tokens_per_s": 10.0 + i, "ms_per_token_median": 1.0}}
           for i, (lab, name, _, _) in enumerate(rows)]
    d = b.derive(res)
    g = d["tandem0-host-graph s0.5 t8"]
    assert g["decode_vs_tandem0-host s0.5 t8"] == 17.0 / 13.0
    assert g["decode_vs_tandem0-graph"] == 17.0 / 10.0
    one = b.runs(b.parse_args(["--configs", "tandem0-host-graph"]))
    assert one == [("tandem0-host-graph", "tandem0-host-graph", 0.5, 0)]
    for bad in (["--host-share", "1.5"], ["--host-threads", "-1"]):
        with pytest.raises(SystemExit):
            b.parse_args(bad)
