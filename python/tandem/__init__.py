"""tandem: stream-ordered asynchronous work on accelerators.

Queues of their own on every device (CPU, CUDA, OpenCL, SYCL), device-side waits, copies that
infer their direction, host tasks, keep-alive, and an order manager whose ``wait()`` covers
work that other code put on the same native queue. Names follow CuPy (``with q:``, current and
default queues, ``__cuda_stream__``) and dpctl (``SequentialOrderManager[q]``), so code ports
by changing an import. On SYCL devices dpctl's and dpnp's own objects are taken as they are
(``Queue.adopt(dpctl_queue)``, ``Queue.to_dpctl()``, ``dpctl.SyclEvent``s, dpnp arrays as copy
operands); ``tandem.dpctl`` (imported on its own, it needs dpctl) has the cached and current
dpctl queues and ``keep_args_alive``.

The package drains every queue and shuts tandem down at interpreter exit (``atexit``), before
Python finalizes; no Python callable runs after that.
"""
from __future__ import annotations

import atexit as _atexit

from . import _tandem
from ._tandem import (
    Buffer,
    Device,
    Event,
    MoeOps,
    Queue,
    Streamer,
    TandemError,
    backends,
    devices,
    get_current_queue,
    get_default_queue,
    malloc,
    set_default_queue,
    tandem_version,
)
from ._tandem import (  # one subclass of TandemError per TDM_E* code
    BackendError,
    BusyError,
    CrossDeviceError,
    DeadlockError,
    DependencyError,
    DeviceLostError,
    DirectionError,
    ForkError,
    HandleError,
    HostTaskError,
    InvalidArgumentError,
    NoDeviceError,
    NotFoundError,
    NotInitializedError,
    NotReadyError,
    NotSupportedError,
    OutOfMemoryError,
    RangeError,
    StateError,
    VersionError,
)
from ._order import SequentialOrderManager

__version__ = "0.1.0"

__all__ = [
    "Buffer", "Device", "Event", "Queue", "SequentialOrderManager", "MoeOps",
    "Streamer", "TandemError",
    "backends",
    "devices", "get_current_queue", "get_default_queue", "malloc", "set_default_queue",
    "BackendError", "BusyError", "CrossDeviceError", "DeadlockError", "DependencyError",
    "DeviceLostError", "DirectionError", "ForkError", "HandleError", "HostTaskError",
    "InvalidArgumentError", "NoDeviceError", "NotFoundError", "NotInitializedError",
    "NotReadyError",
    "NotSupportedError", "OutOfMemoryError", "RangeError", "StateError", "VersionError",
]

# Registered at import, so it runs after the atexit handlers of code that imported tandem
# (they may still submit work) and before the interpreter finalizes.
_atexit.register(_tandem._shutdown)
