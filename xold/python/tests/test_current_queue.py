"""Current and default queues: `with q:` per thread and device, set_default_queue, and
$TANDEM_DEFAULT_QUEUE."""
import os
import subprocess
import sys
import threading

import pytest

import tandem


def test_with_makes_current(device):
    default = tandem.get_current_queue(device)
    assert default is tandem.get_default_queue(device)  # cached: the same object
    q = tandem.Queue(device)
    with q as entered:
        assert entered is q
        assert tandem.get_current_queue(device) is q
        assert tandem.get_current_queue() is q
        inner = tandem.Queue(device)
        with inner:
            assert tandem.get_current_queue(device) is inner
        assert tandem.get_current_queue(device) is q
    assert tandem.get_current_queue(device) is default


def test_current_is_per_device(cpu, opencl):
    qc = tandem.Queue(cpu)
    with qc:
        assert tandem.get_current_queue(cpu) is qc
        assert tandem.get_current_queue(opencl) is tandem.get_default_queue(opencl)
        qo = tandem.Queue(opencl)
        with qo:
            assert tandem.get_current_queue(cpu) is qc
            assert tandem.get_current_queue(opencl) is qo
            assert tandem.get_current_queue() is qo


def test_current_is_thread_local(device):
    q = tandem.Queue(device)
    seen = {}
    entered = threading.Event()
    leave = threading.Event()

    def other():
        seen["before"] = tandem.get_current_queue(device)
        mine = tandem.Queue(device)
        with mine:
            seen["mine"] = mine
            seen["inside"] = tandem.get_current_queue(device)
            entered.set()
            leave.wait(10)

    with q:
        t = threading.Thread(target=other)
        t.start()
        assert entered.wait(10)
        assert tandem.get_current_queue(device) is q  # the other thread's `with` is its own
        leave.set()
        t.join()
    assert seen["before"] is tandem.get_default_queue(device)
    assert seen["inside"] is seen["mine"]


def test_exit_of_a_queue_that_is_not_current(device):
    a, b = tandem.Queue(device), tandem.Queue(device)
    a.__enter__()
    with pytest.raises(tandem.StateError):
        b.__exit__(None, None, None)
    a.__exit__(None, None, None)


def test_set_default_queue(device):
    old = tandem.get_default_queue(device)
    mine = tandem.Queue(device, in_order=True)
    tandem.set_default_queue(device, mine)
    try:
        assert tandem.get_default_queue(device) is mine
        assert tandem.get_current_queue(device) is mine
        buf = tandem.malloc(16, "device", device)
        assert buf.queue is mine  # new buffers follow the current queue
        # The old default stays valid and usable: it is just no longer the default.
        old.record().wait()
        old.synchronize()
    finally:
        tandem.set_default_queue(device, None)
    cached = tandem.get_default_queue(device)
    assert cached is old
    with pytest.raises(tandem.CrossDeviceError):
        other = [d for d in tandem.devices() if d is not device]
        if not other:
            pytest.skip("one device only")
        tandem.set_default_queue(other[0], mine)


def _default_in_order(env_value):
    code = ("import tandem; q = tandem.get_default_queue('cpu:0'); "
            "print(q.in_order); q.record().wait()")
    env = dict(os.environ)
    if env_value is None:
        env.pop("TANDEM_DEFAULT_QUEUE", None)
    else:
        env["TANDEM_DEFAULT_QUEUE"] = env_value
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_environment_variable_decides_the_cached_queue():
    assert _default_in_order(None) == "True"
    assert _default_in_order("in_order") == "True"
    assert _default_in_order("out_of_order") == "False"
