"""Shared fixtures: the devices the suite runs on, random data, and a way to make a queue
busy for a while (a host task that sleeps) so ordering is really tested.

The suite runs on cpu:0 and on PoCL's opencl:0; `make check` runs the OpenCL tests a second
time with POCL_DEVICES=basic (PoCL's other driver). A device that is absent is skipped.
"""
import faulthandler
import os
import sys
import time

import numpy as np
import pytest

import tandem

DEVICE_IDS = ["cpu:0", "opencl:0"]

# TANDEM_TEST_HANG_DUMP=<seconds>: a test still running after that long prints every thread's
# Python stack (and goes on), so a hang names where each thread is.
HANG_DUMP = float(os.environ.get("TANDEM_TEST_HANG_DUMP", "0") or 0)


@pytest.fixture(autouse=True)
def _hang_dump():
    if HANG_DUMP > 0:
        faulthandler.dump_traceback_later(HANG_DUMP, repeat=False, file=sys.stderr)
    yield
    if HANG_DUMP > 0:
        faulthandler.cancel_dump_traceback_later()


def _device(dev_id):
    try:
        return tandem.Device(dev_id)
    except tandem.NoDeviceError:
        pytest.skip(f"no {dev_id} device")


@pytest.fixture(params=DEVICE_IDS)
def device(request):
    return _device(request.param)


@pytest.fixture
def cpu():
    return _device("cpu:0")


@pytest.fixture
def opencl():
    return _device("opencl:0")


@pytest.fixture
def rng():
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def random_floats(rng, n):
    """Random float32 values, none of them zero (so a missed write cannot pass)."""
    x = rng.standard_normal(n).astype(np.float32)
    x[x == 0] = 0.5
    return x


def assert_same(got, want):
    """Element by element, naming the first difference."""
    got = np.asarray(got)
    want = np.asarray(want)
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{bad.size} of {want.size} elements differ; first at {bad[0]}: "
                           f"got {got.flat[bad[0]]!r}, want {want.flat[bad[0]]!r}")


def stall(q, seconds=0.2):
    """Keeps q busy: a host task that sleeps. Returns its event."""
    return q.host_task(time.sleep, seconds)


def eventually(cond, timeout=10.0):
    """Polls cond() until it is true or timeout passes; returns its last value."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()
