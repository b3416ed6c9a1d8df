"""Device resolution, including the one-line npu / cuda error paths, and the runtime helpers on the CPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from diffpolicy import device as D
from diffpolicy.config import DeviceConfig


def test_cpu_resolves() -> None:
    rt = D.Runtime.from_config(DeviceConfig(type="cpu"))
    assert rt.device == torch.device("cpu")
    assert rt.dist_backend == "gloo"


def test_auto_picks_what_is_there() -> None:
    dev = D.resolve(DeviceConfig(type="auto"))
    expected = "npu" if D.npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    assert dev.type == expected


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu installed here")
def test_npu_without_torch_npu_says_what_to_install() -> None:
    with pytest.raises(D.DeviceError) as info:
        D.resolve(DeviceConfig(type="npu"))
    msg = str(info.value)
    assert "torch_npu" in msg and "\n" not in msg


def test_npu_without_cann_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    D._import_torch_npu.cache_clear()
    monkeypatch.setattr(D.importlib.util, "find_spec", lambda name: object() if name == "torch_npu" else None)
    for var in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH"):
        monkeypatch.delenv(var, raising=False)
    try:
        with pytest.raises(D.DeviceError, match="CANN"):
            D.resolve(DeviceConfig(type="npu"))
        assert not D.npu_available()
    finally:
        D._import_torch_npu.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_gpu_fails_in_one_line() -> None:
    with pytest.raises(D.DeviceError) as info:
        D.resolve(DeviceConfig(type="cuda"))
    assert "CUDA" in str(info.value) and "\n" not in str(info.value)


def test_backend_names() -> None:
    assert D.Runtime(torch.device("cpu")).dist_backend == "gloo"
    assert D.Runtime(torch.device("cuda", 0)).dist_backend == "nccl"
    assert D.backend_for("npu") == "hccl"
    with pytest.raises(ValueError, match="unknown device type"):
        D.backend_for("tpu")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_autocast_and_timer(runtime, precision: str) -> None:
    rt = D.Runtime(runtime.device, precision=precision)
    lin = torch.nn.Linear(8, 8).to(rt.device)
    with rt.timer() as t, rt.autocast():
        y = lin(torch.randn(4, 8, device=rt.device))
    assert y.dtype == (torch.float32 if precision == "fp32" else torch.bfloat16)
    assert t["ms"] >= 0
    rt.synchronize()
    assert all(v >= 0 for v in rt.memory_stats().values())


def test_grad_scaler_only_for_fp16(runtime) -> None:
    assert not D.Runtime(runtime.device, "bf16").grad_scaler().is_enabled()
