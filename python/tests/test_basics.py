"""Devices, queues, errors, and wrong arguments that must raise rather than crash."""
import numpy as np
import pytest

import tandem
from conftest import DEVICE_IDS


def test_devices_listed():
    devs = tandem.devices()
    assert any(d.id == "cpu:0" for d in devs)
    for i, d in enumerate(devs):
        assert d.index == i
        assert tandem.Device(d.id) is d  # one object per device
        assert str(d) == d.id
        assert d.backend in ("cpu", "cuda", "opencl", "sycl")


def test_default_device():
    assert tandem.Device() is tandem.Device(None)
    assert tandem.Device("cpu:0").host_memory
    assert not tandem.Device("cpu:0").is_gpu


def test_queue_properties(device):
    q = tandem.Queue(device)
    assert q.device is device and q.in_order and not q.timing and not q.adopted
    q2 = tandem.Queue(device.id, in_order=False, timing=True)
    assert not q2.in_order and q2.timing
    assert q.native != 0
    assert "in_order" in repr(q)
    q.synchronize()
    q2.synchronize()


def test_error_classes():
    assert issubclass(tandem.DependencyError, tandem.TandemError)
    assert tandem.DependencyError.code == -8
    assert tandem.DependencyError.name == "TDM_EDEP"
    assert tandem.DeadlockError.name == "TDM_EDEADLK"
    with pytest.raises(tandem.NoDeviceError) as e:
        tandem.Device("cuda:99")
    assert e.value.code == -3 and e.value.name == "TDM_ENODEV"
    assert "cuda:99" in str(e.value)  # the message is tdm_last_error()


def test_wrong_types_raise(device):
    q = tandem.Queue(device)
    with pytest.raises(TypeError):
        tandem.Queue(42)
    with pytest.raises(TypeError):
        q.wait("not an event")
    with pytest.raises(TypeError):
        q.copy(object(), np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        q.host_task(17)
    with pytest.raises(TypeError):
        tandem.Event()
    with pytest.raises(TypeError):
        tandem.Buffer()
    with pytest.raises(ValueError):
        tandem.malloc(0)
    with pytest.raises(ValueError):
        tandem.malloc(16, "nonsense", device)
    with pytest.raises(TypeError):
        tandem.set_default_queue(device, "q")
    with pytest.raises(TypeError):
        tandem.SequentialOrderManager["q"]


def test_bad_sizes_raise(device, rng):
    q = tandem.Queue(device)
    buf = tandem.malloc(64, "device", device)
    small = np.zeros(8, np.float32)  # 32 bytes
    with pytest.raises(ValueError):
        q.copy(small, buf)  # 64 bytes into 32
    with pytest.raises(ValueError):
        q.copy(buf, small, nbytes=65)
    with pytest.raises(ValueError):
        q.copy(buf, small, nbytes=-1)
    with pytest.raises(ValueError):
        q.fill(buf, 1, nbytes=100)
    with pytest.raises(ValueError):
        q.fill(buf, 256)
    with pytest.raises(ValueError):  # read-only numpy destination
        ro = np.zeros(16, np.float32)
        ro.flags.writeable = False
        q.copy(ro, buf)
    with pytest.raises(tandem.OutOfMemoryError):
        tandem.malloc(1 << 62, "device", device)
    q.synchronize()


def test_released_objects_raise(device):
    q = tandem.Queue(device)
    buf = tandem.malloc(64, "pinned", device)
    buf.free()
    assert buf.released
    buf.free()  # again: nothing
    with pytest.raises(tandem.HandleError):
        q.fill(buf, 1)
    with pytest.raises(tandem.HandleError):
        buf.ptr
    with pytest.raises(BufferError):
        memoryview(buf)
    q.destroy()
    assert q.destroyed
    for call in (q.record, q.synchronize, lambda: q.copy(buf, buf), lambda: q.host_task(print)):
        with pytest.raises(tandem.HandleError):
            call()
    q.destroy()  # again: nothing


def test_free_refused_while_viewed(device):
    buf = tandem.malloc(64, "host", device)
    view = np.frombuffer(buf, dtype=np.uint8)
    with pytest.raises(tandem.BusyError):
        buf.free()
    del view
    buf.free()


def test_default_queue_cannot_be_destroyed(device):
    with pytest.raises(tandem.BusyError):
        tandem.get_default_queue(device).destroy()


def test_backend_specific_handles_raise_elsewhere(cpu):
    q = tandem.Queue(cpu)
    with pytest.raises(tandem.NotSupportedError):
        q.__cuda_stream__()
    with pytest.raises(tandem.NotSupportedError):
        q.cl_command_queue
    with pytest.raises(tandem.NotSupportedError):
        cpu.cl_context
    with pytest.raises(tandem.NotSupportedError):
        tandem.malloc(16, "device", cpu).cl_mem
    assert cpu.native is None


def test_adopt_raw_handle_refused_on_cpu(cpu):
    with pytest.raises(tandem.NotSupportedError):
        tandem.Queue.adopt(12345, device=cpu)  # nothing in Python makes a tdm_cpu_stream
    with pytest.raises(TypeError):
        tandem.Queue.adopt(object())


def test_dlpack_arguments_checked(device):
    buf = tandem.malloc(64, "pinned", device)
    with pytest.raises(TypeError):
        buf.__dlpack__(max_version="x")
    with pytest.raises(TypeError):
        buf.__dlpack__(dl_device=1)
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(2, 0))
    with pytest.raises(BufferError):
        buf.__dlpack__(copy=True)
    cap = buf.__dlpack__(max_version=(1, 0))
    assert "dltensor_versioned" in repr(cap)
    del cap  # unconsumed: its destructor gives the buffer back
    buf.free()


class _FakeCudaArray:
    """An object that only has __cuda_array_interface__, as a hostile client may hand over."""

    def __init__(self, shape, typestr="<f4", strides=None):
        self.__cuda_array_interface__ = {"data": (0x1000, False), "shape": shape,
                                         "typestr": typestr, "strides": strides, "version": 3}


def test_cuda_array_interface_sizes_checked(device):
    """A shape whose size product wraps around is an error, not an operand of 0 bytes; strides
    that do not match the shape, and a missing typestr, are errors too."""
    q = tandem.Queue(device)
    dst = np.zeros(4, np.float32)
    for shape in [(1 << 32, 1 << 32), (1 << 62, 4), (3, 1 << 63)]:
        with pytest.raises((ValueError, OverflowError)):
            q.copy(dst, _FakeCudaArray(shape))
        with pytest.raises((ValueError, OverflowError)):
            q.fill(_FakeCudaArray(shape), 0)
    with pytest.raises((ValueError, OverflowError)):
        q.copy(dst, _FakeCudaArray((2,), typestr="<f99999999999999999999"))
    for strides in [(4,), [12, 4], (4, "x")]:
        with pytest.raises((ValueError, TypeError)):
            q.copy(dst, _FakeCudaArray((2, 3), strides=strides))
    bad = _FakeCudaArray((2,))
    del bad.__cuda_array_interface__["typestr"]
    with pytest.raises(ValueError):
        q.copy(dst, bad)
    q.synchronize()


class _FakeDLPack:
    """An object that only has __dlpack__ (kDLCPU), with whatever shape it is given: its
    DLManagedTensor is built with ctypes and kept alive by the object."""

    def __init__(self, shape, bits=32):
        import ctypes as C

        class DLTensor(C.Structure):
            _fields_ = [("data", C.c_void_p), ("device_type", C.c_int32),
                        ("device_id", C.c_int32), ("ndim", C.c_int32), ("code", C.c_uint8),
                        ("bits", C.c_uint8), ("lanes", C.c_uint16),
                        ("shape", C.POINTER(C.c_int64)), ("strides", C.POINTER(C.c_int64)),
                        ("byte_offset", C.c_uint64)]

        class DLManagedTensor(C.Structure):
            _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", C.c_void_p),
                        ("deleter", C.c_void_p)]

        self._data = (C.c_char * 16)()
        self._shape = (C.c_int64 * len(shape))(*shape)
        self._t = DLManagedTensor()
        t = self._t.dl_tensor
        t.data = C.cast(self._data, C.c_void_p)
        t.device_type, t.device_id, t.ndim = 1, 0, len(shape)
        t.code, t.bits, t.lanes = 2, bits, 1
        t.shape = self._shape
        new = C.pythonapi.PyCapsule_New
        new.restype = C.py_object
        new.argtypes = [C.c_void_p, C.c_char_p, C.c_void_p]
        self._new = lambda: new(C.addressof(self._t), b"dltensor", None)

    def __dlpack__(self, stream=None):
        return self._new()

    def __dlpack_device__(self):
        return (1, 0)


def test_dlpack_sizes_checked(cpu):
    """A DLPack tensor whose size product wraps around, or with a negative dimension, is an
    error, not an operand of 0 (or billions of) bytes."""
    q = tandem.Queue(cpu)
    dst = np.zeros(4, np.float32)
    for shape in [(1 << 32, 1 << 32), (1 << 62, 4), (-1,), (2, -2)]:
        with pytest.raises((ValueError, OverflowError)):
            q.copy(dst, _FakeDLPack(shape))
    sound = _FakeDLPack((4,))
    q.copy(dst, sound).wait()  # a sound one still goes
    q.synchronize()


def test_event_in_a_forked_child_raises(cpu):
    """In a child forked after tandem started, an event's state cannot be known: .done and
    .error raise ForkError (as wait() does) instead of answering True and returning it."""
    import os
    import warnings

    q = tandem.Queue(cpu)
    ev = q.record()
    ev.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads running
        pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for i, get in enumerate((lambda: ev.done, lambda: ev.error, ev.wait)):
                try:
                    get()
                    code |= 1 << i
                except tandem.ForkError:
                    pass
        except BaseException:
            code |= 8
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, (f"in the child: {'.done answered; ' if code & 1 else ''}"
                       f"{'.error answered; ' if code & 2 else ''}"
                       f"{'wait() returned; ' if code & 4 else ''}"
                       f"{'something else raised' if code & 8 else ''}")
    assert ev.done and ev.error is None  # the parent is unaffected
