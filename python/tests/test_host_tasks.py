"""Host tasks: Python callables on tandem's threads, with the GIL; their exceptions become
the event's error and the queue's next synchronize raises them."""
import gc
import threading
import time
import weakref

import numpy as np
import pytest

import tandem
from conftest import assert_same, random_floats, stall


class Boom(Exception):
    pass


def test_runs_in_order_on_a_tandem_thread(device, rng):
    q = tandem.Queue(device)
    x = random_floats(rng, 4096)
    pinned = tandem.malloc(x.nbytes, "pinned", device)
    dev = tandem.malloc(x.nbytes, "device", device)
    seen = {}

    def check(tag, scale):  # runs after the copy into pinned memory
        seen[tag] = (threading.get_ident(), np.frombuffer(pinned, np.float32) * scale)

    q.copy(dev, x)
    q.copy(pinned, dev)
    ev = q.host_task(check, "a", np.float32(2))
    ev.wait()
    assert ev.done and ev.error is None
    tid, got = seen["a"]
    assert tid != threading.get_ident()
    assert_same(got, x * np.float32(2))


def test_later_work_waits_for_the_task(device, rng):
    q = tandem.Queue(device)
    x = random_floats(rng, 4096)
    src = tandem.malloc(x.nbytes, "pinned", device)
    out = np.full(4096, np.nan, np.float32)

    def produce():
        time.sleep(0.1)
        np.frombuffer(src, np.float32)[:] = x

    q.host_task(produce)
    q.copy(out, src)
    q.synchronize()
    assert_same(out, x)


def test_exception_becomes_error_and_synchronize_raises_it(device):
    q = tandem.Queue(device)

    def fail(msg):
        raise Boom(msg)

    ev = q.host_task(fail, "from the task")
    with pytest.raises(Boom, match="from the task"):
        ev.wait()
    assert isinstance(ev.error, Boom)
    with pytest.raises(Boom, match="from the task") as e:
        q.synchronize()
    assert e.value.__traceback__ is not None
    # Reported once: the queue is usable again.
    ran = []
    q.host_task(ran.append, 1).wait()
    q.synchronize()
    assert ran == [1]


def test_work_after_a_failed_task_does_not_run(device, rng):
    q = tandem.Queue(device)
    ran = []
    stall(q, 0.05)
    q.host_task(lambda: 1 / 0)
    after = q.host_task(ran.append, "after")
    with pytest.raises(tandem.DependencyError):
        after.wait()
    assert isinstance(after.error, tandem.DependencyError)
    with pytest.raises(ZeroDivisionError):
        q.synchronize()
    assert ran == []


def test_task_that_synchronizes_its_own_queue_gets_deadlock_error(device):
    q = tandem.Queue(device)
    caught = []

    def sync_self():
        try:
            q.synchronize()
        except tandem.DeadlockError as e:
            caught.append(e)

    q.host_task(sync_self).wait()
    q.synchronize()
    assert len(caught) == 1 and caught[0].name == "TDM_EDEADLK"


def test_deps_keyword(device):
    a = tandem.Queue(device)
    b = tandem.Queue(device)
    order = []
    first = a.host_task(lambda: (time.sleep(0.1), order.append("a")))
    b.host_task(order.append, "b", deps=[first]).wait()
    assert order == ["a", "b"]
    with pytest.raises(TypeError):
        b.host_task(print, deps=[first], other=1)


def test_many_tasks_from_threads(device):
    q = tandem.Queue(device)
    counts = []
    lock = threading.Lock()

    def add(i):
        with lock:
            counts.append(i)

    def submit(base):
        for i in range(50):
            q.host_task(add, base + i)

    threads = [threading.Thread(target=submit, args=(k * 100,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q.synchronize()
    assert sorted(counts) == sorted(k * 100 + i for k in range(4) for i in range(50))


def test_destroy_from_its_own_task_is_refused_and_keeps_the_queue(device):
    """destroy() from a host task of the queue itself is refused (DeadlockError); the object
    still holds the queue, which stays usable and is destroyed later as usual."""
    q = tandem.Queue(device)
    caught = []

    def destroy_self():
        try:
            q.destroy()
        except tandem.DeadlockError as e:
            caught.append(e)

    q.host_task(destroy_self).wait()
    assert len(caught) == 1 and caught[0].name == "TDM_EDEADLK"
    assert not q.destroyed
    ran = []
    q.host_task(ran.append, 1).wait()
    q.synchronize()
    assert ran == [1]
    q.destroy()
    assert q.destroyed


class _Payload:
    """A large object a failing task has in its locals."""


def _failing_task(refs, i):
    payload = _Payload()  # noqa: F841 (kept alive by the traceback's frame)
    refs[i] = weakref.ref(payload)
    raise Boom(f"failure {i}")


def test_failed_tasks_keep_nothing_once_their_events_are_gone(device):
    """A failed task's exception stays with its event while the program holds the event
    (.error, with the traceback's frames and their locals); once the event is gone nothing
    but the queue's first error is kept for synchronize(), and that without the frames'
    locals. Errors handled per event and never synchronized do not pile up."""
    q = tandem.Queue(device, in_order=False)
    refs = {}
    events = [q.host_task(_failing_task, refs, i) for i in range(20)]
    for i in range(20):
        with pytest.raises(Boom, match=f"failure {i}$"):
            events[i].wait()
    assert len(refs) == 20
    held = events[3].error
    assert held.__traceback__ is not None and refs[3]() is not None  # the event still has it
    del held
    del events
    gc.collect()
    alive = sorted(i for i, r in refs.items() if r() is not None)
    assert alive == [], f"the locals of failed tasks {alive} are still held"
    # A task whose event was dropped before it ran keeps nothing either.
    more = {}
    q.host_task(_failing_task, more, 99)
    with pytest.raises(tandem.TandemError):
        q.barrier().wait()
    gc.collect()
    assert more and more[99]() is None
    # The queue's first error is still there for synchronize(), with a traceback.
    with pytest.raises(Boom) as e:
        q.synchronize()
    assert e.value.__traceback__ is not None
    q.synchronize()  # reported once
