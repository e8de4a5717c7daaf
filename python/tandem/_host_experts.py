"""Host placement for tandem.torch's decode passes: a share of each layer's experts that are
not resident is computed by the host CPU, from the pinned host buffer where they lie, while the
GPU reads the others in place across the link.

A pass (policy "mapped", decoding, the device table) splits its routed (token, k) pairs by a
mask of host experts, on the device. A second stream of the handle copies x and the host's
pairs to pinned memory, runs libtandem_moe's host pass there as a host function of the stream
(MoeOps.host_call: group() and experts() of the CPU table, on tandem's CPU queue, waited for)
and copies the host's rows back, while the handle's stream groups and computes the device's
pairs; the stream then waits for the second one and takes the host's rows. Nothing waits on the
host's Python thread, so a CUDA graph captured from the handle's stream holds the whole of it
(the copies, the host function and the join), and every replay computes the host's experts
again.

The host's experts: in each layer, the experts that are not resident, ranked by the routed
counts seen so far (most first, then by index), every one whose rank r has floor((r + 1) *
share) > floor(r * share), so that the host gets about `share` of the routed load
(_offload.host_keys). The set is
chosen again with the resident set, written into one mask tensor in place (a graph stays
valid). The host computes in f32 from the bf16 weights, with other kernels than the GPU's:
results differ from the all-resident run within rounding, where every other setting of the
offload is bitwise the same.

Buffers are per decode batch size (tokens a pass): pinned x, routing, rows, slot, table and
output, a host workspace, the device's copy of the host's output, and one host pass per layer
(MoeOps.host_pass). They live as long as the handle, since a graph may name them.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

import torch

import tandem

from . import _offload as plan



class _Buffers:
    """One decode batch size's buffers and its host pass per layer. The ones the device copies
    are tandem's pinned memory (PyTorch keeps no bookkeeping of it, which a capture could
    trip on), viewed as tensors."""

    def __init__(self, hops: Any, wofs: torch.Tensor, lay: plan.ExpertLayout, ntok: int,
                 topk: int, device: torch.device) -> None:
        n, H, I, E = ntok * topk, lay.hidden, lay.intermediate, lay.experts
        tdev = tandem.Device(f"cuda:{device.index}")
        self._pinned: List[Any] = []

        def pinned(dtype: torch.dtype, *shape: int) -> torch.Tensor:
            count = torch.empty((), dtype=dtype).element_size()
            for d in shape:
                count *= d
            buf = tandem.malloc(count, "pinned", tdev)
            self._pinned.append(buf)
            return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(*shape)

        self.x = pinned(torch.float32, ntok, H)
        self.idx = pinned(torch.int32, ntok, topk)
        self.out = pinned(torch.float32, n, H)
        self.rows = torch.empty(n, dtype=torch.int32)
        self.slot = torch.empty(n, dtype=torch.int32)
        self.groups = torch.empty(min(E, n) * plan.GROUP_BYTES, dtype=torch.uint8)
        wsb = tandem.MoeOps.workspace_bytes(n, H, I)
        self.ws = torch.empty(wsb, dtype=torch.uint8)
        self.out_dev = torch.empty(n, H, dtype=torch.float32, device=device)
        self.passes = [hops.host_pass(self.x.data_ptr(), self.idx.data_ptr(), ntok, topk, E,
                                      wofs[layer].data_ptr(), plan.ANYWHERE, H, I,
                                      self.rows.data_ptr(), self.slot.data_ptr(),
                                      self.groups.data_ptr(), self.out.data_ptr(),
                                      self.ws.data_ptr(), wsb)
                       for layer in range(lay.layers)]

    def free(self) -> None:
        self.x = self.idx = self.out = None
        for buf in self._pinned:
            try:
                buf.free()
            except (BufferError, tandem.TandemError):
                pass    # a view is still alive: freed with the last one


def adopt(stream: "torch.cuda.Stream") -> Any:
    """A torch stream as a tandem Queue (through __cuda_stream__, else its handle)."""
    try:
        return tandem.Queue.adopt(stream)
    except TypeError:      # a torch without __cuda_stream__
        return tandem.Queue.adopt(stream.cuda_stream,
                                  device=tandem.Device(f"cuda:{stream.device.index}"))


def _cpu_ops(queue: Any) -> Any:
    """The CPU table (NotSupportedError in a build without it). Its pool of threads, one a
    process, is sized by the first state opened: here the cores this process may run on less
    4, left to the threads that feed the GPU (a pool thread preempted in the middle of an
    expert holds the whole expert up), unless TANDEM_MOE_CPU_THREADS sets it."""
    key = "TANDEM_MOE_CPU_THREADS"
    if key in os.environ:
        return tandem.MoeOps(queue)
    os.environ[key] = str(max(1, len(os.sched_getaffinity(0)) - 4))
    try:
        return tandem.MoeOps(queue)
    finally:
        del os.environ[key]


class HostExperts:
    """The host's share of a handle's decode passes (see the module's docstring)."""

    def __init__(self, lay: plan.ExpertLayout, device: torch.device, share: float) -> None:
        self.share = share
        self._lay = lay
        self._device = device
        self._queue = tandem.Queue(tandem.Device("cpu:0"))
        self._ops = _cpu_ops(self._queue)
        self._side = torch.cuda.Stream(device)
        self._side_ops = tandem.MoeOps(adopt(self._side))
        self.mask = torch.zeros(lay.layers, lay.experts, dtype=torch.bool, device=device)
        self._pairs = torch.zeros((), dtype=torch.int64, device=device)
        self._wofs: Any = None
        self._bufs: Dict[Tuple[int, int], _Buffers] = {}

    def bind(self, host_ptr: int) -> None:
        """Every expert's place in the pinned host buffer, as the host's experts() takes it."""
        lay = self._lay
        places = plan.host_places(host_ptr, lay.layers * lay.experts, lay.expert_bytes)
        self._wofs = torch.tensor(places, dtype=torch.int64).view(lay.layers, lay.experts)

    def choose(self, key_counts: List[int], resident: List[int]) -> None:
        """The host's experts among those not resident (plan.host_keys), written into mask
        in place."""
        lay = self._lay
        mask = torch.zeros(lay.layers * lay.experts, dtype=torch.bool)
        keys = plan.host_keys(key_counts, resident, lay.layers, lay.experts, self.share)
        if keys:
            mask[torch.tensor(keys)] = True
        self.mask.copy_(mask.view(lay.layers, lay.experts))

    def host_pairs(self) -> int:
        return int(self._pairs)

    def reset(self) -> None:
        self._pairs.zero_()

    def split(self, layer: int, x32: torch.Tensor, idx: torch.Tensor
              ) -> Tuple[torch.Tensor, Any]:
        """On the current stream (the handle's): the device's routing (the host's pairs as
        -1, which group() drops), and the host's work queued on the second stream. Returns
        the device's idx and what join() takes."""
        ntok, topk = idx.shape
        b = self._bufs.get((ntok, topk))
        if b is None:
            if torch.cuda.is_current_stream_capturing():
                raise plan.OffloadError(
                    f"host placement: run one eager decode pass of {ntok} tokens before a "
                    f"CUDA graph captures one (its pinned buffers are made then)")
            b = self._bufs[(ntok, topk)] = _Buffers(self._ops, self._wofs, self._lay, ntok,
                                                      topk, self._device)
        mine = self.mask[layer][idx.long()]
        self._pairs += mine.sum()
        dev_idx = torch.where(mine, -1, idx)
        host_idx = torch.where(mine, idx, -1)
        self._side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self._side):
            b.x.copy_(x32, non_blocking=True)
            b.idx.copy_(host_idx, non_blocking=True)
            self._side_ops.host_call(self._ops, b.passes[layer])
            b.out_dev.copy_(b.out, non_blocking=True)
        return dev_idx, (mine, b.out_dev, host_idx)   # host_idx lives until the join

    def join(self, out: torch.Tensor, pending: Any) -> torch.Tensor:
        """out [T*k, H] with the host's rows in, once the second stream is done."""
        mine, out_dev, _ = pending
        torch.cuda.current_stream(self._device).wait_stream(self._side)
        return torch.where(mine.reshape(-1, 1), out_dev, out)

    def check(self) -> None:
        """Raises the first failure of a host pass (once the device has run it)."""
        for b in self._bufs.values():
            for h in b.passes:
                self._ops.host_pass_status(h)

    def close(self) -> None:
        """After the device's work: the passes are freed with the CPU table."""
        self._side.synchronize()
        self._side_ops.close()
        self._ops.close()
        for b in self._bufs.values():
            b.free()
        self._bufs.clear()
