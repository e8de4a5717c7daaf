"""SequentialOrderManager[q], with dpctl's names; its wait() is a queue-wide marker."""
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
