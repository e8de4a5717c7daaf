"""Interpreter exit with work still pending: the package drains and shuts tandem down before
Python finalizes; the process exits 0, pending host tasks and keep-alive releases run first,
and no Python callable runs afterwards."""
import os
import subprocess
import sys
import textwrap

import pytest

PROGRAM = textwrap.dedent("""
    import sys, time, atexit
    import numpy as np
    import tandem

    dev = tandem.Device(sys.argv[1])
    log = open(sys.argv[2], "w", buffering=1)
    queues = [tandem.Queue(dev), tandem.Queue(dev, in_order=False)]
    x = np.arange(1 << 16, dtype=np.float32) + 1
    for i, q in enumerate(queues):
        buf = tandem.malloc(x.nbytes, "device", dev)
        q.host_task(time.sleep, 0.2)
        q.copy(buf, x)
        q.host_task(log.write, f"task {i}\\n")
        q.keep_alive(x, buf)
        q.copy(np.empty_like(x), buf)
        q.host_task(lambda: 1 / 0)          # an error nobody collects
    # A queue made and dropped, a buffer freed, with work pending.
    tmp = tandem.Queue(dev)
    tmp.host_task(time.sleep, 0.1)
    del tmp
    if sys.argv[3] == "exit":
        sys.exit(0)
    elif sys.argv[3] == "raise":
        raise SystemExit(0)
    # else: fall off the end
""")


@pytest.mark.parametrize("how", ["end", "exit", "raise"])
def test_exit_with_pending_work(device, tmp_path, how):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    log = tmp_path / "log.txt"
    for run in range(3):
        out = subprocess.run([sys.executable, str(prog), device.id, str(log), how],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert out.returncode == 0, f"run {run}: exit {out.returncode}\n{out.stderr}"
        assert "Fatal" not in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert sorted(log.read_text().split("\n")[:-1]) == ["task 0", "task 1"], \
            "the pending host tasks did not run before exit"


def test_calls_after_shutdown_raise(device, tmp_path):
    code = textwrap.dedent(f"""
        import tandem
        q = tandem.Queue({device.id!r})
        tandem._tandem._shutdown()
        try:
            q.record()
        except tandem.NotInitializedError as e:
            print("raised", e.name)
        del q
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised TDM_ENOTINIT"
