"""PyTorch on tandem's CUDA queues (run by scripts/gpu-check; skipped without PyTorch or a
GPU): the request's scenario with a PyTorch op on torch.cuda.ExternalStream(q), DLPack and
__cuda_array_interface__ round trips, and PyTorch events imported into the order manager."""
import numpy as np
import pytest

import tandem
from tandem import SequentialOrderManager
from conftest import assert_same, random_floats, stall
from gpu import need_event_import, need_torch

N = 1 << 20


@pytest.fixture
def torch_dev():
    return need_torch()


def busy(torch, a, rounds=200):
    """Many dependent PyTorch ops that leave a + 1: keeps the stream busy for a while."""
    v = a.clone()
    for _ in range(rounds):
        v = v * 0.999 + 0.001
    return a.add_(1.0 + 0.0 * v)


def test_scenario_pytorch_op_on_external_stream(torch_dev, rng):
    torch, dev = torch_dev
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    s = torch.cuda.ExternalStream(q.__cuda_stream__()[1])
    with torch.cuda.stream(s):
        a = torch.from_numpy(x).to("cuda", non_blocking=False)
        busy(torch, a)                          # never registered with tandem
        ev = torch.cuda.Event()
        ev.record(s)
    SequentialOrderManager[q].wait()
    assert ev.query(), "the order manager's wait returned before PyTorch's ops"
    total = float(a.double().sum())
    want = float((x.astype(np.float64) + 1).sum())
    assert abs(total - want) <= 1e-6 * max(1.0, abs(want)) * N ** 0.5
    assert_same(a.cpu().numpy(), x + np.float32(1))


def test_dlpack_to_a_side_stream(torch_dev, rng):
    # A stream other than the legacy default one is ordered on the device.
    torch, dev = torch_dev
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, "device", dev, queue=q)
    # Made before the stall: PyTorch's first stream from its pool waits for the device with
    # the GIL held, and the stall is a Python host task, which needs the GIL (README, Python).
    s = torch.cuda.Stream()
    stall(q, 0.2)
    q.copy(buf, x)                                  # from pageable memory: tandem's thread
    with torch.cuda.stream(s):
        t = torch.from_dlpack(buf).view(torch.float32)
        got = t.cpu().numpy()
    assert_same(got, x)


def test_dlpack_and_cai_round_trip(torch_dev, rng):
    torch, dev = torch_dev
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    buf = tandem.malloc(x.nbytes, "device", dev, queue=q)
    stall(q, 0.2)
    q.copy(buf, x)
    t = torch.from_dlpack(buf).view(torch.float32)  # ordered after the copy
    assert t.data_ptr() == buf.ptr
    assert_same(t.cpu().numpy(), x)
    t.mul_(2)
    torch.cuda.current_stream().synchronize()
    out = np.full(N, np.nan, np.float32)
    q.copy(out, buf)
    q.synchronize()
    assert_same(out, x * np.float32(2))
    # A PyTorch tensor as a copy operand (its __cuda_array_interface__)
    src = torch.from_numpy(random_floats(rng, N)).cuda()
    torch.cuda.current_stream().synchronize()
    dst = torch.full((N,), float("nan"), device="cuda")
    torch.cuda.current_stream().synchronize()  # PyTorch's CAI names no stream
    q.copy(dst, src)
    q.synchronize()
    assert_same(dst.cpu().numpy(), src.cpu().numpy())
    # tandem's DLPack consumer side: a PyTorch tensor into host memory
    host = np.full(N, np.nan, np.float32)
    q.copy(host, src)
    q.synchronize()
    assert_same(host, src.cpu().numpy())


@need_event_import
def test_torch_events_in_the_order_manager(torch_dev, rng):
    torch, dev = torch_dev
    q = tandem.Queue(dev)
    x = random_floats(rng, N)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.from_numpy(x).to("cuda")
        busy(torch, a)
        ev = torch.cuda.Event()
        ev.record(s)
    som = SequentialOrderManager[q]
    som.add_event(ev)
    out = np.full(N, np.nan, np.float32)
    q.copy(out, a, deps=som.submitted_events)
    som.wait()
    assert_same(out, x + np.float32(1))
