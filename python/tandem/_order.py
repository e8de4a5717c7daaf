"""The order manager, with dpctl's names: ``SequentialOrderManager[q]``.

dpctl's manager only knows the events handed to it, so its ``wait()`` misses kernels that
user code submitted to the queue directly. This one keeps the same bookkeeping (host-task
events, computation events) but its ``wait()`` is ``q.synchronize()``: tandem's queue-wide
native marker, which covers every command on the native queue, registered or not.

``q`` is a tandem queue, or a ``dpctl.SyclQueue`` of a tandem SYCL device: then the manager
works on the tandem queue over it (``tandem.dpctl.as_tandem_queue``), takes dpctl's
``SyclEvent``s (and lists of them, as dpctl's does) and gives ``SyclEvent``s back, for the
``depends`` lists of dpctl and dpnp calls.
"""
from __future__ import annotations

import sys
import threading
import weakref
from typing import Any, Dict, List, Union

from ._tandem import Event, Queue


class SequentialOrder:
    """The order state of one queue: what later submissions should depend on.

    ``submitted_events``: computation events a new submission should list as dependencies
    (tandem's own recent submissions on the queue, and events added here); ``host_task_events``:
    events of host tasks and keep-alives (e.g. ``q.keep_alive(...)``) still pending.
    """

    def __init__(self, queue: Queue) -> None:
        self._queue_ref = weakref.ref(queue)
        self._lock = threading.Lock()
        self._host: List[Any] = []
        self._comp: List[Any] = []

    @property
    def queue(self) -> Queue:
        q = self._queue_ref()
        if q is None:
            raise ReferenceError("the queue of this order manager no longer exists")
        return q

    @staticmethod
    def _pending(events: List[Any]) -> List[Any]:
        return [e for e in events if not _done(e)]

    def add_event_pair(self, host_task_ev: Any, comp_ev: Any) -> None:
        """Registers a host-task (keep-alive) event and the computation event it goes with
        (either may be a list or tuple of events, as dpctl's manager allows)."""
        for ev in _events(host_task_ev):
            self.add_to_host_task_events(ev)
        for ev in _events(comp_ev):
            self.add_to_submitted_events(ev)

    def add_event(self, ev: Any) -> None:
        """Registers a computation event (tandem's, or a CuPy, PyTorch or pyopencl event)."""
        self.add_to_submitted_events(ev)

    def add_to_both_events(self, host_task_ev: Any, comp_ev: Any) -> None:
        """dpctl's name for add_event_pair."""
        self.add_event_pair(host_task_ev, comp_ev)

    def add_to_host_task_events(self, ev: Any) -> None:
        """Registers an event to wait for before the arguments it keeps alive may go."""
        ev = _as_event(ev, self.queue)
        with self._lock:
            self._host = self._pending(self._host)
            self._host.append(ev)

    def add_to_submitted_events(self, ev: Any) -> None:
        """Registers a computation event; the queue's order tracker learns of it too."""
        q = self.queue
        ev = _as_event(ev, q)
        q.track(ev)
        with self._lock:
            self._comp = self._pending(self._comp)
            self._comp.append(ev)

    @property
    def host_task_events(self) -> List[Event]:
        """Pending host-task events."""
        with self._lock:
            self._host = self._pending(self._host)
            return list(self._host)

    @property
    def submitted_events(self) -> List[Event]:
        """Events a new submission on the queue should depend on: the registered computation
        events still pending, and what tandem's tracker knows of the queue. Like
        ``Queue.dependencies()``, which it calls, it submits a marker to an in-order queue
        with work of tandem's own pending: read it to submit after it, not to poll."""
        deps = self.queue.dependencies()
        with self._lock:
            self._comp = self._pending(self._comp)
            # A registered event the tracker also lists comes as it was registered (an
            # imported one still knows its foreign event).
            mine = {e.handle: e for e in self._comp}
            return [mine.pop(e.handle, e) for e in deps] + list(mine.values())

    @property
    def num_host_task_events(self) -> int:
        """The number of registered host-task events still pending."""
        with self._lock:
            self._host = self._pending(self._host)
            return len(self._host)

    @property
    def num_submitted_events(self) -> int:
        """The number of registered computation events still pending (dpctl's count). A read:
        it submits nothing, unlike ``submitted_events``, which may add tandem's own."""
        with self._lock:
            self._comp = self._pending(self._comp)
            return len(self._comp)

    def wait(self) -> None:
        """Waits for the registered host tasks, then for everything on the queue: a queue-wide
        marker, so kernels other code put on the native queue without registering them are
        waited for too. Raises the queue's first error (see Queue.synchronize)."""
        for ev in self.host_task_events:
            ev.wait()
        self.queue.synchronize()
        with self._lock:
            self._host = self._pending(self._host)
            self._comp = self._pending(self._comp)


class DpctlSequentialOrder:
    """``SequentialOrderManager[q]`` for a ``dpctl.SyclQueue``: the order state of the tandem
    queue over it, with dpctl's events in and out."""

    def __init__(self, order: SequentialOrder, queue: Any, tandem_queue: Queue) -> None:
        self._order = order
        self._tandem_queue = tandem_queue  # kept: the order holds it weakly
        self.queue = queue

    @property
    def tandem_queue(self) -> Queue:
        """The tandem queue over ``queue`` (the same native queue)."""
        return self._tandem_queue

    def _out(self, events: List[Event]) -> List[Any]:
        from .dpctl import to_dpctl_event
        return [to_dpctl_event(e, self._tandem_queue) for e in events]

    def add_event_pair(self, host_task_ev: Any, comp_ev: Any) -> None:
        """Registers a host-task event and the computation event it goes with (SyclEvents,
        tandem events, or lists of them)."""
        self._order.add_event_pair(host_task_ev, comp_ev)

    def add_to_both_events(self, host_task_ev: Any, comp_ev: Any) -> None:
        """dpctl's name for add_event_pair."""
        self._order.add_event_pair(host_task_ev, comp_ev)

    def add_event(self, ev: Any) -> None:
        """Registers a computation event."""
        self._order.add_to_submitted_events(ev)

    def add_to_host_task_events(self, ev: Any) -> None:
        """Registers a host-task event."""
        self._order.add_to_host_task_events(ev)

    def add_to_submitted_events(self, ev: Any) -> None:
        """Registers a computation event."""
        self._order.add_to_submitted_events(ev)

    @property
    def submitted_events(self) -> List[Any]:
        """SyclEvents a new submission on the queue should depend on (see
        SequentialOrder.submitted_events): the registered ones as they were given."""
        return self._out(self._order.submitted_events)

    @property
    def host_task_events(self) -> List[Any]:
        """Pending host-task events, as SyclEvents."""
        return self._out(self._order.host_task_events)

    @property
    def num_submitted_events(self) -> int:
        """The number of registered computation events still pending (submits nothing)."""
        return self._order.num_submitted_events

    @property
    def num_host_task_events(self) -> int:
        """The number of registered host-task events still pending (submits nothing)."""
        return self._order.num_host_task_events

    def wait(self) -> None:
        """Waits for the registered host tasks, then for everything on the native queue:
        kernels submitted to it through dpctl or dpnp and never registered included."""
        self._order.wait()


def _events(ev: Any) -> List[Any]:
    return list(ev) if isinstance(ev, (list, tuple)) else [ev]


def _is_dpctl_queue(q: Any) -> bool:
    dpctl = sys.modules.get("dpctl")
    return dpctl is not None and isinstance(q, dpctl.SyclQueue)


def _done(ev: Event) -> bool:
    try:
        return ev.done
    except Exception:  # a handle tandem no longer knows: nothing left to wait for
        return True


def _as_event(ev: Any, q: Queue) -> Event:
    return ev if isinstance(ev, Event) else Event.from_native(ev, q.device)


class _SequentialOrderManager:
    """``SequentialOrderManager[q]``: the same SequentialOrder for the same queue, as long as
    the queue lives; for a dpctl queue, the same DpctlSequentialOrder for the same native queue
    (kept, as dpctl keeps its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._orders: "weakref.WeakKeyDictionary[Queue, SequentialOrder]" = (
            weakref.WeakKeyDictionary())
        self._dpctl_orders: Dict[Any, DpctlSequentialOrder] = {}

    def __getitem__(self, q: Any) -> Union[SequentialOrder, DpctlSequentialOrder]:
        if _is_dpctl_queue(q):
            return self._dpctl_order(q)
        if not isinstance(q, Queue):
            raise TypeError(f"SequentialOrderManager[q] takes a tandem.Queue or a "
                            f"dpctl.SyclQueue, not {type(q).__name__}")
        with self._lock:
            order = self._orders.get(q)
            if order is None:
                order = self._orders[q] = SequentialOrder(q)
            return order

    def _dpctl_order(self, q: Any) -> DpctlSequentialOrder:
        with self._lock:
            view = self._dpctl_orders.get(q)
        if view is not None and not view.tandem_queue.destroyed:
            return view
        from .dpctl import as_tandem_queue
        tq = as_tandem_queue(q)
        order = self[tq]
        with self._lock:
            view = self._dpctl_orders.get(q)
            if view is None or view.tandem_queue is not tq:
                view = self._dpctl_orders[q] = DpctlSequentialOrder(order, q, tq)
            return view

    def clear(self) -> None:
        """Forgets every queue's order state."""
        with self._lock:
            self._orders.clear()
            self._dpctl_orders.clear()


SequentialOrderManager = _SequentialOrderManager()
