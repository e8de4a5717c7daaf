"""Helpers of the GPU tests: skip (never pass) without CuPy / PyTorch / a GPU / cuda:0."""
import pytest

import tandem


def cuda_device():
    try:
        return tandem.Device("cuda:0")
    except tandem.NoDeviceError:
        info = [b for b in tandem.backends() if b["name"] == "cuda"]
        pytest.skip(f"no cuda:0 device (cuda backend: {info})")


def need_cupy():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("CuPy sees no CUDA GPU")
    except Exception as e:  # CUDARuntimeError without a driver
        pytest.skip(f"CuPy sees no CUDA GPU: {e}")
    dev = cuda_device()
    cp.cuda.Device(dev.native).use()
    return cp, dev


def need_torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA GPU")
    dev = cuda_device()
    torch.cuda.set_device(dev.native)
    return torch, dev


need_event_import = pytest.mark.skipif(not tandem._tandem.has_event_import,
                                       reason="this libtandem has no tdm_event_import")
