"""SequentialOrderManager[q], with dpctl's names; its wait() is a queue-wide marker."""
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tandem
from tandem import SequentialOrderManager
from conftest import assert_same, random_floats, stall


def test_same_object_for_the_same_queue(device):
    q = tandem.Queue(device)
    assert SequentialOrderManager[q] is SequentialOrderManager[q]
    assert SequentialOrderManager[q] is not SequentialOrderManager[tandem.Queue(device)]
    d = tandem.get_default_queue(device)
    assert SequentialOrderManager[tandem.get_current_queue(device)] is SequentialOrderManager[d]


def test_dpctl_workflow(device, rng):
    q = tandem.Queue(device, in_order=False)
    som = SequentialOrderManager[q]
    x = random_floats(rng, 1 << 14)
    buf = tandem.malloc(x.nbytes, "device", device)
    out = np.full(x.size, np.nan, np.float32)
    comp = q.copy(buf, x, deps=som.submitted_events)
    ht = q.keep_alive(x, deps=[comp])
    som.add_event_pair(ht, comp)
    assert comp.handle in {e.handle for e in som.submitted_events} or comp.done
    comp2 = q.copy(out, buf, deps=som.submitted_events)
    som.add_event(comp2)
    som.wait()
    assert_same(out, x)
    assert som.host_task_events == [] and som.num_submitted_events == 0


def test_wait_covers_unregistered_work(device, rng):
    """A host task submitted directly (never registered) is still waited for."""
    q = tandem.Queue(device)
    som = SequentialOrderManager[q]
    done = []
    q.host_task(lambda: (time.sleep(0.2), done.append(1)))
    som.wait()
    assert done == [1]


def test_wait_raises_the_queue_error(device):
    q = tandem.Queue(device)
    q.host_task(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        SequentialOrderManager[q].wait()
    SequentialOrderManager[q].wait()  # reported once


def test_host_task_events_are_waited_for(device):
    a, b = tandem.Queue(device), tandem.Queue(device)
    order = []
    ht = a.host_task(lambda: (time.sleep(0.1), order.append("ht")))
    SequentialOrderManager[b].add_to_host_task_events(ht)
    SequentialOrderManager[b].wait()
    assert order == ["ht"]


COUNT_PROGRAM = textwrap.dedent("""
    import sys, threading
    import tandem
    from tandem import SequentialOrderManager

    q = tandem.Queue(sys.argv[1])
    gate = threading.Event()
    q.host_task(gate.wait, 60)                  # the queue is busy
    som = SequentialOrderManager[q]
    ev = q.record()
    som.add_event(ev)
    counts = {som.num_submitted_events for _ in range(50)}
    q.dependencies()                            # one marker: the trace must show it
    gate.set()
    q.synchronize()
    print(sorted(counts))
""")


def test_num_submitted_events_submits_nothing(device, tmp_path):
    """Reading num_submitted_events (or num_host_task_events) is a read: it counts the
    registered events still pending and submits no command. The trace of a process that polls
    it 50 times behind a busy task holds exactly the one marker of its explicit
    q.dependencies() call."""
    prog = tmp_path / "prog.py"
    prog.write_text(COUNT_PROGRAM)
    trace = tmp_path / "trace.json"
    out = subprocess.run([sys.executable, str(prog), device.id], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, TANDEM_TRACE=str(trace)))
    assert out.returncode == 0, out.stderr
    doc = json.loads(trace.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    markers = [e for e in events if e.get("name") == "dependencies"]
    assert len(markers) == 1, f"{len(markers)} dependency markers were submitted, not 1"
    assert out.stdout.strip() == "[1]"  # the registered marker, pending behind the task
