"""Shared fixtures: the devices the suite runs on, random data, and a way to make a queue
busy for a while (a host task that sleeps) so ordering is really tested.

The suite runs on cpu:0 and on PoCL's OpenCL device (opencl:0); `make check` runs the OpenCL
tests a second time with POCL_DEVICES=basic (PoCL's other driver). A device that is absent is
skipped. The SYCL tests (test_dpctl.py) run on sycl:0, Intel's OpenCL CPU runtime under
Intel's SYCL runtime, which scripts/bootstrap installs into a cache folder: see
_sycl_opencl_vendors below.
"""
import atexit
import faulthandler
import glob
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sycl_version():
    """The SYCL runtime's version that scripts/bootstrap pins (its sycl_version=... line)."""
    try:
        with open(os.path.join(REPO, "scripts", "bootstrap")) as f:
            return next(line.strip().split("=", 1)[1] for line in f
                        if line.startswith("sycl_version="))
    except (OSError, StopIteration):
        return None


def _sycl_root():
    """The SYCL runtime's folder, found as scripts/bootstrap and cmake/sycl.cmake find it:
    $TANDEM_SYCL_ROOT (relative to the clone), else ${XDG_CACHE_HOME:-$HOME/.cache}/tandem/
    sycl-<the sycl_version=... line of scripts/bootstrap>. None when TANDEM_SYCL=off."""
    if os.environ.get("TANDEM_SYCL", "").lower() == "off":
        return None
    root = os.environ.get("TANDEM_SYCL_ROOT")
    if not root:
        version = sycl_version()
        if not version:
            return None
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                 ".cache")
        root = os.path.join(cache, "tandem", f"sycl-{version}")
    return os.path.join(REPO, root)  # an absolute root stays as it is


def _sycl_opencl_vendors():
    """Where OCL_ICD_VENDORS is unset, sets it before tandem starts (the ICD loader reads it
    once) to a folder of its own holding the system's OpenCL drivers (/etc/OpenCL/vendors:
    PoCL) and the SYCL runtime's (<root>/icd, Intel's OpenCL CPU runtime, the one device with
    USM that SYCL can use here). Naming <root>/icd alone, as the C tests on sycl:0 do, would
    hide PoCL from the whole suite. SYCL itself is kept off PoCL's platform
    (SYCL_DEVICE_ALLOWLIST, unless set): PoCL has no USM, and with it listed dpnp 0.20's first
    kernel aborts the process (a Python call without the GIL). Returns the .icd files it added
    for SYCL's sake."""
    if "OCL_ICD_VENDORS" in os.environ:
        return []
    root = _sycl_root()
    added = sorted(glob.glob(os.path.join(root, "icd", "*.icd"))) if root else []
    if not added:
        return []
    folder = tempfile.mkdtemp(prefix="tandem-ocl-vendors-")
    atexit.register(shutil.rmtree, folder, True)
    for icd in sorted(glob.glob("/etc/OpenCL/vendors/*.icd")):
        shutil.copy(icd, folder)
    for icd in added:
        shutil.copy(icd, os.path.join(folder, "tandem-sycl-" + os.path.basename(icd)))
    os.environ["OCL_ICD_VENDORS"] = folder
    os.environ.setdefault("SYCL_DEVICE_ALLOWLIST", "PlatformVersion:{{(?!.*PoCL).*}}")
    return added


_SYCL_ICDS = _sycl_opencl_vendors()

import tandem  # noqa: E402  (after OCL_ICD_VENDORS)


def _opencl_id():
    """The OpenCL device the suite tests: opencl:0, or where the folder above added Intel's
    runtime, the first OpenCL device that is not that runtime's (the ICD loader lists platforms
    in no fixed order). Intel's OpenCL CPU device has the name its SYCL device has."""
    opencl = [d for d in tandem.devices() if d.backend == "opencl"]
    if _SYCL_ICDS:
        sycl_names = {d.name for d in tandem.devices() if d.backend == "sycl"}
        opencl = [d for d in opencl if d.name not in sycl_names]
    return opencl[0].id if opencl else "opencl:0"


DEVICE_IDS = ["cpu:0", _opencl_id()]

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
    return _device(DEVICE_IDS[1])


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


def pytest_configure(config):
    # pytest-timeout's marker, named here too so that a run without that plugin knows it
    config.addinivalue_line("markers", "timeout(seconds): the test's own time limit")
