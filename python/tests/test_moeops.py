"""tandem.MoeOps: libtandem_moe's operation table from Python, on pointers. A whole MoE layer
(router, grouping on the device, grouped experts, combine) on random data against a float64
reference written here; experts in GGUF blocks made by the gguf package, against float64 on
its own dequantization; a recorded graph where the table records them; the errors (a closed
table, bad arguments, a queue in use)."""
import numpy as np
import pytest

import tandem

T, H, I, E, K = 7, 64, 32, 6, 2
EXPERT = 3 * H * I  # bf16 values an expert: Wg (I x H), Wu (I x H), Wd (H x I)
GROUP = 16  # bytes of a tdm_moe_group


def bf16(x):
    """float32 -> (bf16 bits as uint16, the float32 values they hold), rounded to nearest even."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return r, (r.astype(np.uint32) << 16).view(np.float32)


class Dev:
    """Device buffers on one queue, filled from and read into numpy arrays."""

    def __init__(self, q):
        self.q, self.bufs = q, []

    def put(self, a):
        b = tandem.malloc(max(a.nbytes, 16), "device", self.q.device, self.q)
        self.q.copy(b, np.ascontiguousarray(a))
        self.bufs.append(b)
        return b.ptr

    def zeros(self, nbytes):
        return self.put(np.zeros(nbytes, np.uint8))

    def get(self, ptr, dtype, n):
        out = np.empty(n, dtype)
        buf = next(b for b in self.bufs if b.ptr == ptr)
        self.q.copy(out, buf, out.nbytes)
        self.q.synchronize()
        return out


def open_ops(q):
    """The table for q's device, or a skip where this build has none (a GPU machine without
    CLBlast has no OpenCL table)."""
    try:
        return tandem.MoeOps(q)
    except tandem.NotSupportedError as e:
        pytest.skip(str(e))


def reference(x, wr, w):
    """float64: routing (softmax, top-k with ties to the lower index, renormalized) and the
    layer's output sum_j p_j SwiGLU_e(x)."""
    x64 = x.astype(np.float64)
    logits = x64 @ wr.astype(np.float64).T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :K]
    pk = np.take_along_axis(p, idx, 1)
    pk /= pk.sum(1, keepdims=True)
    y = np.zeros((T, H))
    for t in range(T):
        for j in range(K):
            e = w[idx[t, j]].astype(np.float64)
            g, u, d = e[:I * H].reshape(I, H), e[I * H:2 * I * H].reshape(I, H), e[2 * I * H:]
            a, b = g @ x64[t], u @ x64[t]
            y[t] += pk[t, j] * (d.reshape(H, I) @ (a / (1 + np.exp(-a)) * b))
    return idx, pk, y


def test_layer_matches_float64(device, rng):
    q = tandem.Queue(device)
    ops = open_ops(q)
    assert ops.name == device.backend and ops.queue is q
    x = rng.standard_normal((T, H)).astype(np.float32)
    wr_bits, wr = bf16(rng.standard_normal((E, H)) * 0.5)
    w_bits, w = bf16(rng.standard_normal((E, EXPERT)) * 0.2)
    d = Dev(q)
    px, pwr, pw = d.put(x), d.put(wr_bits), d.put(w_bits)
    pidx, pwt = d.zeros(T * K * 4), d.zeros(T * K * 4)
    ops.router(px, pwr, 0, T, H, E, K, True, pidx, pwt)
    pwofs = d.put(np.arange(E, dtype=np.int64) * EXPERT)
    G = min(E, T * K)
    prows, pslot, pgroups = d.zeros(T * K * 4), d.zeros(T * K * 4), d.zeros(G * GROUP)
    ops.group(pidx, T, K, E, pwofs, prows, pslot, pgroups)
    pout = d.zeros(T * K * H * 4)
    ws = tandem.MoeOps.workspace_bytes(T * K, H, I)
    pws = d.zeros(ws)
    ops.experts(px, prows, pslot, T * K, pw, pgroups, G, H, I, pout, pws, ws)
    py = d.put(np.zeros((T, H), np.float32))
    ops.combine(py, pout, pwt, T, H, K)
    ridx, rw, ry = reference(x, wr, w)
    assert (d.get(pidx, np.int32, T * K).reshape(T, K) == ridx).all()
    np.testing.assert_allclose(d.get(pwt, np.float32, T * K).reshape(T, K), rw, rtol=1e-5)
    y = d.get(py, np.float32, T * H).reshape(T, H)
    err = np.abs(y - ry).max() / np.abs(ry).max()
    assert err < 1e-3, err
    ops.close()
    ops.close()  # closing twice is allowed
    assert ops.queue is None
    with pytest.raises(tandem.StateError):
        ops.combine(py, pout, pwt, T, H, K)


@pytest.mark.parametrize("fmt", [("q8_0", "q8_0"), ("q4_k", "q6_k")])
def test_experts_in_blocks(device, rng, fmt):
    # Q4_K and Q6_K rows are superblocks of 256 values: H and I of 256 here
    quants = pytest.importorskip("gguf.quants")
    gguf = pytest.importorskip("gguf")
    q = tandem.Queue(device)
    ops = open_ops(q)
    if not ops.has_experts_q:
        pytest.skip(f"the {ops.name} table has no experts in blocks")
    h, i, e, n = 256, 256, 3, 5
    kind = {t: getattr(gguf.GGMLQuantizationType, t.upper()) for t in fmt}

    def blocks(rows, cols, t):
        """rows x cols values in type t: the gguf package's quantization (Q8_0), or random
        blocks with sane f16 scales (it has no K-quant quantizer)."""
        if t == "q8_0":
            return quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.2,
                                   kind[t])
        size, scales = {"q4_k": (144, (0, 2)), "q6_k": (210, (208,))}[t]
        raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
        for at in scales:
            d = (rng.uniform(0.002, 0.01, raw.shape[:2])).astype(np.float16)
            raw[:, :, at:at + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
        return raw.reshape(rows, -1)
    size = tandem.MoeOps.expert_bytes(fmt, h, i)
    stride = -(-size // 16) * 16
    blob = np.zeros(e * stride, np.uint8)
    wide = []
    for x in range(e):
        gu, dn = blocks(2 * i, h, fmt[0]), blocks(h, i, fmt[1])
        raw = np.concatenate([gu.reshape(-1), dn.reshape(-1)]).view(np.uint8)
        assert raw.size == size
        blob[x * stride:x * stride + size] = raw
        wide.append((quants.dequantize(gu, kind[fmt[0]]), quants.dequantize(dn, kind[fmt[1]])))
    xs = rng.standard_normal((n, h)).astype(np.float32)
    # token t to expert t % e: rows sorted by expert, each its own slot
    order = sorted(range(n), key=lambda t: t % e)
    table = np.zeros(e, dtype=[("w", "<i8"), ("first", "<i4"), ("count", "<i4")])
    at = 0
    for x in range(e):
        cnt = sum(1 for t in order if t % e == x)
        table[x] = (x * stride // 2, at, cnt)
        at += cnt
    d = Dev(q)
    px, pw = d.put(xs), d.put(blob)
    prows, pslot = d.put(np.array(order, np.int32)), d.put(np.array(order, np.int32))
    pgroups, pout = d.put(table), d.zeros(n * h * 4)
    ws = tandem.MoeOps.workspace_bytes(n, h, i)
    ops.experts(px, prows, pslot, n, pw, pgroups, e, h, i, pout, d.zeros(ws), ws, fmt=fmt)
    got = d.get(pout, np.float32, n * h).reshape(n, h)
    for t in range(n):
        gu, dn = (w.astype(np.float64) for w in wide[t % e])
        a, b = gu[:i] @ xs[t], gu[i:] @ xs[t]
        ref = dn @ (a / (1 + np.exp(-a)) * b)
        err = np.abs(got[t] - ref).max() / np.abs(ref).max()
        assert err < 1e-3, (fmt, t, err)
    with pytest.raises(tandem.InvalidArgumentError):
        ops.experts(px, prows, pslot, n, pw, pgroups, e, h, i, pout, 0, 0, fmt=("q9", "q8_0"))


def test_experts_read_anywhere(device, rng):
    # A base in no tandem allocation (16): the offsets then name any memory the device reads.
    # Half the experts in device memory and half in pinned host memory (which a GPU's
    # kernels read in place, across the link) give the bits of one allocation's table.
    if device.backend not in ("cpu", "cuda"):
        pytest.skip(f"{device.backend}: the table names weights by allocation, not address")
    q = tandem.Queue(device)
    ops = open_ops(q)
    d = Dev(q)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w_bits, _ = bf16(rng.standard_normal((E, EXPERT)) * 0.2)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    host = tandem.malloc(w_bits.nbytes, "pinned", device)
    np.frombuffer(host, np.uint16)[:] = w_bits.ravel()
    px, pidx, pw = d.put(x), d.put(idx), d.put(w_bits)
    n, G = T * K, min(E, T * K)
    ws = tandem.MoeOps.workspace_bytes(n, H, I)
    pws = d.zeros(ws)
    anywhere = 16
    outs = []
    for wbase, wofs in ((pw, np.arange(E, dtype=np.int64) * EXPERT),
                        (anywhere, np.array([((pw if e % 2 else host.ptr) + 2 * e * EXPERT
                                              - anywhere) // 2 for e in range(E)], np.int64))):
        prows, pslot, pgroups = d.zeros(n * 4), d.zeros(n * 4), d.zeros(G * GROUP)
        ops.group(pidx, T, K, E, d.put(wofs), prows, pslot, pgroups)
        pout = d.put(np.full(n * H, np.nan, np.float32))
        ops.experts(px, prows, pslot, n, wbase, pgroups, G, H, I, pout, pws, ws)
        outs.append(d.get(pout, np.float32, n * H))
    assert np.isfinite(outs[0]).all()
    assert np.array_equal(outs[0], outs[1])
    ops.close()
    host.free()


def test_host_pass(device, rng):
    # A layer's host-placed experts (every third expert), as a device runs them: x comes to
    # pinned memory by a copy on the device's queue, the CPU table's pass runs as that queue's
    # host call, its slots go back to the device. They hold float64's expert outputs; the
    # device's slots are untouched; a failing run is recorded and raised once, by status.
    q = tandem.Queue(device)
    ops = open_ops(q)
    if not ops.has_host_call:
        pytest.skip(f"the {ops.name} table has no host_call()")
    hq = tandem.Queue(tandem.Device("cpu:0"))
    hops = tandem.MoeOps(hq)
    d = Dev(q)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w_bits, w = bf16(rng.standard_normal((E, EXPERT)) * 0.2)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32)
    idx[0, 0] = 0
    mine = np.where(idx % 3 == 0, idx, -1).astype(np.int32)
    n, G = T * K, min(E, T * K)
    wsb = tandem.MoeOps.workspace_bytes(n, H, I)

    def pinned(a):
        b = tandem.malloc(max(a.nbytes, 16), "pinned", device)
        np.frombuffer(b, np.uint8)[:a.nbytes] = np.ascontiguousarray(a).view(np.uint8).ravel()
        return b

    bufs = [pinned(a) for a in (np.zeros((T, H), np.float32), mine, w_bits,
                                np.arange(E, dtype=np.int64) * EXPERT, np.zeros(n, np.int32),
                                np.zeros(n, np.int32), np.zeros(G * GROUP, np.uint8),
                                np.full((n, H), np.nan, np.float32), np.zeros(wsb, np.uint8))]
    xh, ih, wh, oh, rh, sh, gh, outh, wsh = bufs
    h = hops.host_pass(xh.ptr, ih.ptr, T, K, E, oh.ptr, wh.ptr, H, I, rh.ptr, sh.ptr, gh.ptr,
                       outh.ptr, wsh.ptr, wsb)
    px, pout = d.put(x), d.put(np.zeros((n, H), np.float32))
    dev_x = next(b for b in d.bufs if b.ptr == px)
    dev_out = next(b for b in d.bufs if b.ptr == pout)
    q.copy(xh, dev_x, x.nbytes)
    ops.host_call(hops, h)
    q.copy(dev_out, outh, n * H * 4)
    got = d.get(pout, np.float32, n * H).reshape(n, H)
    assert hops.host_pass_status(h) == 1
    for s in range(n):
        e = mine.ravel()[s]
        if e < 0:
            assert np.isnan(got[s]).all()
            continue
        ex = w[e].astype(np.float64)
        g, u = ex[:I * H].reshape(I, H) @ x[s // K], ex[I * H:2 * I * H].reshape(I, H) @ x[s // K]
        want = ex[2 * I * H:].reshape(H, I) @ (g / (1 + np.exp(-g)) * u)
        assert np.linalg.norm(got[s] - want) <= 1e-4 * np.linalg.norm(want)
    with pytest.raises(tandem.InvalidArgumentError):
        ops.host_call(hops, h + 1)
    if ops.name != "cpu":
        with pytest.raises(tandem.InvalidArgumentError):
            ops.host_pass(xh.ptr, ih.ptr, T, K, E, oh.ptr, wh.ptr, H, I, rh.ptr, sh.ptr, gh.ptr,
                          outh.ptr, wsh.ptr, wsb)
    # An expert whose weights leave wbase's allocation: the run fails, the queue goes on.
    np.frombuffer(oh, np.int64)[:E] = 1 << 40
    ops.host_call(hops, h)
    q.synchronize()
    with pytest.raises(tandem.RangeError):
        hops.host_pass_status(h)
    hops.close()                       # a closed host: refused, nothing runs
    with pytest.raises(tandem.StateError):
        ops.host_call(hops, h)
    with pytest.raises(tandem.StateError):
        hops.host_pass_status(h)
    ops.close()
    for b in bufs:
        b.free()


def test_graphs_where_recorded(device):
    q = tandem.Queue(device)
    ops = open_ops(q)
    if not ops.has_graphs:
        with pytest.raises(tandem.NotSupportedError):
            ops.graph_begin()
        return
    d = Dev(q)  # a recorded combine, launched twice: y = 2 * (w out)
    py, pout = d.put(np.zeros(H, np.float32)), d.put(np.ones(H, np.float32))
    pw = d.put(np.full(1, 0.5, np.float32))
    ops.graph_begin()
    ops.combine(py, pout, pw, 1, H, 1)
    g = ops.graph_end()
    ops.graph_launch(g)
    ops.graph_launch(g)
    assert (d.get(py, np.float32, H) == 1.0).all()
    ops.graph_free(g)
    with pytest.raises(tandem.InvalidArgumentError):
        ops.graph_launch(g)


def test_errors(device):
    q = tandem.Queue(device)
    ops = open_ops(q)
    d = Dev(q)
    p = d.zeros(4096)
    with pytest.raises(tandem.InvalidArgumentError):  # a NULL operand
        ops.combine(0, p, p, 1, 16, 1)
    with pytest.raises(tandem.InvalidArgumentError):  # negative sizes
        ops.router(p, p, 0, -1, 16, 4, 2, True, p, p)
    with pytest.raises(OverflowError):
        ops.combine(-1, p, p, 1, 16, 1)
    with pytest.raises(tandem.BusyError):  # the queue is in use
        q.destroy()
    ops.close()
    q.destroy()
    with pytest.raises(tandem.TandemError):
        tandem.MoeOps(q)
    assert tandem.MoeOps.workspace_bytes(0, H, I) == 0
    assert tandem.MoeOps.expert_bytes(("bf16", "bf16"), H, I) == EXPERT * 2
    assert tandem.MoeOps.expert_bytes((4, 4), 100, I) == 0  # rows not whole blocks
    b = tandem.malloc(1000, "device", device)
    assert tandem.MoeOps.allocation(b.ptr + 100) == (b.ptr, 1000)
    with pytest.raises(tandem.NotFoundError):
        tandem.MoeOps.allocation(12345)
