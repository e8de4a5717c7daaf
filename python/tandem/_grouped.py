"""tandem.torch's grouped path: a layer's routed experts on libtandem_moe's operations
(tandem.MoeOps on the handle's queue), as a mixin of OffloadHandle. Two ways, both with
group() sorting the routing by expert on the device, experts() computing the table in one
launch a projection, and combine() summing over k in f32:
- from the device table (_experts_device): every expert resident, or policy "mapped"
  decoding, where each expert's place (a streamer slot, or the pinned host buffer, read in
  place) is known ahead, so nothing comes back to the host and a CUDA graph can hold the pass
  (with host placement, the host's share joins it: tandem/_host_experts.py);
- while experts stream (_experts_grouped): the counts come back, the routed experts are
  acquired a window of staging slots at a time, one experts() call a window.
An expert's rows, and so the results, are the same either way and at every budget.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

import tandem

from . import _offload as plan


class GroupedPath:
    """OffloadHandle's grouped path (the attributes are the handle's)."""

    def _workspace(self, nbytes: int) -> torch.Tensor:
        if self._ws is None or self._ws.numel() < nbytes:
            self._ws = None
            self._ws = torch.empty(max(nbytes, 256), dtype=torch.uint8, device=self._device)
        return self._ws

    def _learn_places(self) -> None:
        """The device table: each expert's place as experts() takes it from plan.ANYWHERE, the
        resident ones in the streamer's slots (acquiring a resident expert tells where it
        lies; those acquires are not counted) and the others in the pinned host buffer, which
        the kernels read across the link. Written to the device once per streamer, so that a
        layer's routing is grouped there and never comes back to the host."""
        lay, s = self._layout, self._streamer
        keys = lay.layers * lay.experts
        resident = range(keys) if self._all_resident else self._residents
        host = self._host.ptr
        places = plan.host_places(host, keys, lay.expert_bytes)
        mask = torch.zeros(keys, dtype=torch.int64)
        before = s.stats()
        for key in resident:
            layer, e = divmod(key, lay.experts)
            ptr = s.acquire(layer, e)[0]
            s.release(layer, e)
            places[key] = (ptr - plan.ANYWHERE) // 2
            mask[key] = 1
        for k, v in s.stats().items():
            if k in plan.COUNTERS:
                self._carry[k] = self._carry.get(k, 0) - (v - before.get(k, 0))
        table = torch.tensor(places, dtype=torch.int64).view(lay.layers, lay.experts)
        # The mask changes below: the counts scored against the old one were folded when
        # _open_streamer (the only caller) chose this set.
        if self._wofs is None:
            self._wofs = table.to(self._device)
        else:
            self._wofs.copy_(table)
        if self._resident_mask is None:
            self._resident_mask = mask.view(lay.layers, lay.experts).to(self._device)
        else:       # in place: no allocation where torch.compile's graphs pool their memory
            self._resident_mask.copy_(mask.view(lay.layers, lay.experts))
        if self._hostx is not None:
            self._hostx.choose(self._key_counts, list(resident))
        self._table_ok = True

    def _grouped_buffers(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor
                         ) -> Tuple[torch.Tensor, ...]:
        """What the grouped operations take for a pass: x, idx and weights in f32/int32, and
        empty rows, slot, the group table and the expert-sorted output [T*k, H] in f32."""
        ntok, topk = index.shape
        n, dev = ntok * topk, x.device
        return (x.to(torch.float32).contiguous(), index.to(torch.int32).contiguous(),
                weights.to(torch.float32).contiguous(),
                torch.empty(n, dtype=torch.int32, device=dev),
                torch.empty(n, dtype=torch.int32, device=dev),
                torch.empty(min(self._layout.experts, n) * plan.GROUP_BYTES, dtype=torch.uint8,
                            device=dev),
                torch.empty(n, self._layout.hidden, dtype=torch.float32, device=dev))

    def _combine(self, out: torch.Tensor, wts: torch.Tensor, ntok: int, topk: int,
                 dtype: torch.dtype) -> torch.Tensor:
        y = torch.zeros(ntok, self._layout.hidden, dtype=torch.float32, device=out.device)
        self._ops.combine(y.data_ptr(), out.data_ptr(), wts.data_ptr(), ntok,
                          self._layout.hidden, topk)
        return y.to(dtype)

    def _experts_device(self, layer: int, x: torch.Tensor, weights: torch.Tensor,
                        index: torch.Tensor) -> torch.Tensor:
        """The block's routed experts from the device table (every expert resident, or
        policy "mapped" decoding: the resident ones in the slots, the others read where they
        lie in pinned host memory): group() on the device, experts() for the whole table in
        one launch a projection, combine() in f32. Nothing comes back to the host and nothing
        waits for it, so a CUDA graph can hold the pass: its buffers come from PyTorch's
        allocator for the pass (a graph's private pool while capturing), never from a cache
        that a later pass could replace."""
        lay, ops = self._layout, self._ops
        H, I, E = lay.hidden, lay.intermediate, lay.experts
        ntok, topk = index.shape
        n = ntok * topk
        x32, idx, wts, rows, slot, groups, out = self._grouped_buffers(x, weights, index)
        wsb = tandem.MoeOps.workspace_bytes(n, H, I)
        ws = torch.empty(max(wsb, 256), dtype=torch.uint8, device=x.device)
        hx = self._hostx if not self._all_resident else None
        pending = None
        if hx is not None:    # the host's share on the second stream, meanwhile
            idx, pending = hx.split(layer, x32, idx)
        ops.group(idx.data_ptr(), ntok, topk, E, self._wofs[layer].data_ptr(), rows.data_ptr(),
                  slot.data_ptr(), groups.data_ptr())
        ops.experts(x32.data_ptr(), rows.data_ptr(), slot.data_ptr(), n, plan.ANYWHERE,
                    groups.data_ptr(), min(E, n), H, I, out.data_ptr(), ws.data_ptr(), wsb)
        if pending is not None:
            out = hx.join(out, pending)
        flat = index.reshape(-1).to(torch.int64)
        self._dev_counts[layer].scatter_add_(0, flat, torch.ones_like(flat))
        self._device_routed += 1
        return self._combine(out, wts, ntok, topk, x.dtype)

    def _experts_grouped(self, layer: int, x: torch.Tensor, weights: torch.Tensor,
                         index: torch.Tensor, ntok: int, topk: int) -> torch.Tensor:
        """The block's routed experts as libtandem_moe computes a layer (MoeOps, on the
        handle's stream) while they stream: the layer's counts come back (one copy, as on the
        per-expert path), the routed experts are acquired in index order, a window of staging
        slots at a time, and each window is one experts() call on its slice of the table that
        group() writes on the device (routed experts in index order), its places uploaded
        first; then the weighted sum over k (combine), in f32. An expert's rows, and so the
        result, do not depend on the windows: results are bitwise the same at every budget,
        and as _experts_device's."""
        lay, ops, s = self._layout, self._ops, self._streamer
        H, I, E, n = lay.hidden, lay.intermediate, lay.experts, ntok * topk
        dev = x.device
        x32, idx, wts, rows, slot, groups, out = self._grouped_buffers(x, weights, index)
        wsb = tandem.MoeOps.workspace_bytes(n, H, I)
        ws = self._workspace(wsb)
        args = (x32.data_ptr(), rows.data_ptr(), slot.data_ptr(), n)
        counts, predicted = self._route(layer, x, index, topk)
        routed = [e for e in range(E) if counts[e]]
        if self._streamer_policy in ("static", "mapped"):
            s.prefetch(layer, routed)    # see _experts: copies start now, in this order
        window, first, at = max(1, self.slots - 1), 0, 0
        while at < len(routed):
            held: List[int] = []
            try:
                places = [0] * E
                while at < len(routed) and len(held) < window:
                    try:
                        ptr = s.acquire(layer, routed[at])[0]
                    except tandem.BusyError:
                        if not held:
                            raise
                        break    # every slot pinned: compute the ones held first
                    held.append(routed[at])
                    at += 1
                    if self._wbase is None:
                        self._wbase = tandem.MoeOps.allocation(ptr)[0]
                    places[held[-1]] = (ptr - self._wbase) // 2
                wofs = torch.tensor(places, dtype=torch.int64, pin_memory=True)
                wdev = wofs.to(dev, non_blocking=True)
                ops.group(idx.data_ptr(), ntok, topk, E, wdev.data_ptr(), rows.data_ptr(),
                          slot.data_ptr(), groups.data_ptr())
                ops.experts(*args, self._wbase, groups.data_ptr() + first * plan.GROUP_BYTES,
                            len(held), H, I, out.data_ptr(), ws.data_ptr(), wsb)
                first += len(held)
            finally:
                for e in held:
                    s.release(layer, e)    # after the window's kernels
        if predicted:
            s.prefetch(layer + 1, predicted)
        return self._combine(out, wts, ntok, topk, x.dtype)
