"""tandem for dpctl and dpnp users: their own objects, with tandem's ordering.

Needs dpctl (``import tandem`` does not); the queues are ``dpctl.SyclQueue`` objects of
tandem's SYCL devices (``sycl:N``):

- ``cached_queue(device=None)``: one ``dpctl.SyclQueue`` per device, over tandem's default
  queue of that device (``tandem.get_default_queue``): in-order unless
  ``TANDEM_DEFAULT_QUEUE=out_of_order``, and the same native queue as tandem's default work.
  ``set_cached_queue(q)`` installs the program's own queue for its device instead.
- ``current_queue(device=None)`` and ``with use(q):``: per thread, like CuPy's current stream:
  the innermost ``use(q)`` of this thread (of ``device``, when given), else the cached queue.
  Inside ``use(q)``, tandem's current queue of that device (``tandem.get_current_queue``,
  ``tandem.malloc``) is the tandem queue over ``q``.
- ``keep_args_alive(q, args, events)``: holds ``args`` until ``events`` and the work on ``q``
  so far are done, then drops them on tandem's release thread.
- ``as_tandem_queue(q)``: the ``tandem.Queue`` over a dpctl queue (adopted once per native
  queue and kept, as dpctl's own ``SequentialOrderManager`` keeps one state per queue).

``tandem.SequentialOrderManager[q]`` takes these queues too. ``device``, wherever taken: a
``tandem.Device``, an id (``"sycl:0"``), a ``dpctl.SyclDevice``, or None for tandem's default
device when it is a SYCL device, else the first SYCL device.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterable, Iterator, List, Sequence, Union

import dpctl as _dpctl

from . import _tandem
from ._tandem import Device, Event, Queue

DeviceLike = Union[None, str, Device, "_dpctl.SyclDevice"]

_lock = threading.Lock()
_cached: Dict[int, "_dpctl.SyclQueue"] = {}       # device index -> the cached dpctl queue
_tandem_queues: Dict["_dpctl.SyclQueue", Queue] = {}  # dpctl queue (by native queue) -> tandem's
_local = threading.local()


def sycl_device(device: DeviceLike = None) -> Device:
    """The tandem SYCL device that ``device`` names (see the module's docstring)."""
    devs = [d for d in _tandem.devices() if d.backend == "sycl"]
    if device is None:
        default = Device()
        if default.backend == "sycl":
            return default
        if not devs:
            raise _tandem.NoDeviceError("tandem has no SYCL device (Intel's OpenCL CPU runtime "
                                        "needs OCL_ICD_VENDORS: see tandem/sycl.h)")
        return devs[0]
    if isinstance(device, _dpctl.SyclDevice):
        for d in devs:
            if d.to_dpctl() == device:
                return d
        raise _tandem.NoDeviceError(f"{device.name} ({device.filter_string}) is not one of "
                                    f"tandem's SYCL devices")
    dev = Device(device)
    if dev.backend != "sycl":
        raise _tandem.NotSupportedError(f"{dev.id} is not a SYCL device")
    return dev


def as_tandem_queue(q: Union[Queue, "_dpctl.SyclQueue"]) -> Queue:
    """The tandem queue over a dpctl queue: made with ``Queue.adopt`` the first time, the same
    object afterwards (for any dpctl queue over the same native queue); a tandem queue as it
    is."""
    if isinstance(q, Queue):
        return q
    if not isinstance(q, _dpctl.SyclQueue):
        raise TypeError(f"expected a dpctl.SyclQueue or a tandem.Queue, not {type(q).__name__}")
    with _lock:
        tq = _tandem_queues.get(q)
        if tq is None or tq.destroyed:
            tq = _tandem_queues[q] = Queue.adopt(q)
        return tq


def cached_queue(device: DeviceLike = None) -> "_dpctl.SyclQueue":
    """The device's cached dpctl queue: the one ``set_cached_queue`` installed, else one over
    tandem's default queue of the device (made on first use, then the same object)."""
    dev = sycl_device(device)
    with _lock:
        q = _cached.get(dev.index)
        if q is not None:
            return q
    tq = _tandem.get_default_queue(dev)
    q = tq.to_dpctl()
    with _lock:
        if dev.index in _cached:  # another thread was first
            return _cached[dev.index]
        _cached[dev.index] = q
        _tandem_queues.setdefault(q, tq)
        return q


def set_cached_queue(q: "_dpctl.SyclQueue") -> None:
    """Installs ``q`` as the cached queue of its device (a tandem SYCL device). Code that
    fetched the old one keeps a valid queue, no longer the cached one."""
    if not isinstance(q, _dpctl.SyclQueue):
        raise TypeError(f"set_cached_queue takes a dpctl.SyclQueue, not {type(q).__name__}")
    dev = as_tandem_queue(q).device
    with _lock:
        _cached[dev.index] = q


def _stack() -> List["_dpctl.SyclQueue"]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def current_queue(device: DeviceLike = None) -> "_dpctl.SyclQueue":
    """This thread's current dpctl queue: the innermost ``with use(q):`` (whose queue is of
    ``device``, when given), else ``cached_queue(device)``."""
    dev = None if device is None else sycl_device(device)
    for q in reversed(_stack()):
        if dev is None or as_tandem_queue(q).device is dev:
            return q
    return cached_queue(dev)


@contextlib.contextmanager
def use(q: "_dpctl.SyclQueue") -> Iterator["_dpctl.SyclQueue"]:
    """``with use(q):`` makes ``q`` this thread's current dpctl queue of its device, and the
    tandem queue over it tandem's current queue of that device, until the block ends."""
    tq = as_tandem_queue(q)
    stack = _stack()
    with tq:
        stack.append(q)
        try:
            yield q
        finally:
            stack.pop()


def keep_args_alive(q: Union[Queue, "_dpctl.SyclQueue"], args: Sequence[Any],
                    events: Iterable[Any] = ()) -> Any:
    """Holds references to ``args`` until ``events`` (dpctl or tandem events) and all work
    submitted to ``q`` so far are done; tandem's release thread drops them then. Later work on
    ``q`` waits for ``events`` (they become a barrier of the queue). Returns an event that
    completes with that work: a ``dpctl.SyclEvent`` for a dpctl queue (for
    ``SequentialOrderManager[q].add_event_pair``), a ``tandem.Event`` for a tandem queue."""
    tq = as_tandem_queue(q)
    ev = tq.keep_alive(*args, deps=list(events))
    return ev if isinstance(q, Queue) else ev.to_dpctl()


def to_dpctl_event(ev: Event, q: Queue) -> "_dpctl.SyclEvent":
    """A dpctl event for a tandem event: its own (``Event.to_dpctl``), or for an event with no
    SYCL event behind it (another backend's), a barrier on ``q`` that waits for it."""
    try:
        return ev.to_dpctl()
    except _tandem.NotSupportedError:
        return q.barrier(deps=[ev]).to_dpctl()


def _forget() -> None:
    """Forgets the cached queues and the tandem queues over dpctl queues (for tests)."""
    with _lock:
        _cached.clear()
        _tandem_queues.clear()


__all__ = ["as_tandem_queue", "cached_queue", "current_queue", "keep_args_alive",
           "set_cached_queue", "sycl_device", "to_dpctl_event", "use"]
