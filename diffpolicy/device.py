"""The only module that knows cpu / cuda / npu.

Resolves ``device.type`` to a ``torch.device``, and provides autocast, synchronisation, timing, memory
statistics and the name of the distributed backend for the resolved device. Nothing else in the package
branches on device strings: it asks a :class:`Runtime`.

``torch_npu`` is imported lazily, here only, and only when ``npu`` is asked for or probed by ``auto``.
What was run where: the cpu paths run in this project's CI; the cuda paths were written against the public
torch API and checked on a CUDA machine when one was lent; the npu paths follow torch_npu's documented API
(``torch.npu.*`` after ``import torch_npu``) and were **not** run here (no Ascend hardware, no CANN).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from diffpolicy.config import DeviceConfig

# An installed torch_npu registers itself through torch's device-backend autoload and then breaks
# ``import torch`` on machines without CANN. We opt out of the autoload unless the user asked for it and
# import torch_npu explicitly when npu is wanted.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

_PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_BACKEND = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def backend_for(device_type: str) -> str:
    """torch.distributed backend for a device type: hccl (npu), nccl (cuda), gloo (cpu)."""
    if device_type not in _BACKEND:
        raise ValueError(f"unknown device type {device_type!r}; expected one of {', '.join(_BACKEND)}")
    return _BACKEND[device_type]


class DeviceError(RuntimeError):
    """The requested device cannot be used here; the message says what to install or change."""


def _cann_present() -> bool:
    return any(os.environ.get(k) for k in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH"))


@functools.lru_cache(maxsize=1)
def _import_torch_npu() -> str | None:
    """Import torch_npu once; return None on success or a one-line reason it is unusable."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed: pip install 'diffpolicy[npu]' (needs Ascend CANN)"
    if not _cann_present():
        return "torch_npu needs the Ascend CANN toolkit: source <CANN>/set_env.sh (ASCEND_HOME_PATH unset)"
    try:
        import torch_npu  # noqa: F401  (registers the torch.npu namespace)
    except Exception as exc:  # pragma: no cover - needs a broken Ascend install
        return f"torch_npu failed to import ({type(exc).__name__}: {exc}); check the CANN version"
    return None


def npu_available() -> bool:
    """True when torch_npu imports and at least one NPU is visible (never raises)."""
    if importlib.util.find_spec("torch_npu") is None or not _cann_present():
        return False
    if _import_torch_npu() is not None:  # pragma: no cover - Ascend only
        return False
    return bool(torch.npu.is_available() and torch.npu.device_count() > 0)  # pragma: no cover


def _local_index(index: int) -> int:
    return int(os.environ.get("LOCAL_RANK", "0")) if index < 0 else index


def resolve(cfg: DeviceConfig) -> torch.device:
    """Map ``device.type`` to a usable ``torch.device`` or raise :class:`DeviceError` with one line."""
    kind = cfg.type
    if kind == "auto":
        kind = "npu" if npu_available() else "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                "device=cuda but no CUDA GPU is usable (torch.cuda.is_available() is False; "
                f"this torch is {torch.__version__}); install a CUDA build of torch or use device=cpu"
            )
        idx = _local_index(cfg.index)
        if idx >= torch.cuda.device_count():
            raise DeviceError(
                f"device.index={idx} but only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
        return torch.device("cuda", idx)
    # npu: written for Ascend hardware; not run in this project's CI.
    reason = _import_torch_npu()
    if reason is not None:
        raise DeviceError(f"device=npu unavailable: {reason}")
    if not torch.npu.is_available():  # pragma: no cover - Ascend only
        raise DeviceError(
            "device=npu: torch_npu imported but no NPU is visible (check ASCEND_RT_VISIBLE_DEVICES)"
        )
    idx = _local_index(cfg.index)  # pragma: no cover
    return torch.device("npu", idx)  # pragma: no cover


@dataclass
class Runtime:
    """A resolved device with everything device-specific the rest of the package needs."""

    device: torch.device
    precision: str = "fp32"

    @classmethod
    def from_config(cls, cfg: DeviceConfig) -> Runtime:
        """Resolve ``cfg`` (raising :class:`DeviceError`), set threads / determinism and select the card."""
        device = resolve(cfg)
        if cfg.threads > 0:
            torch.set_num_threads(cfg.threads)
        if cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type != "cpu":
            cls._module(device.type).set_device(device)
        return cls(device=device, precision=cfg.precision)

    @staticmethod
    def _module(kind: str):  # torch.cuda or torch.npu
        return getattr(torch, kind)

    @property
    def type(self) -> str:
        """``cpu`` | ``cuda`` | ``npu``."""
        return self.device.type

    @property
    def autocast_dtype(self) -> torch.dtype:
        """Dtype used inside :meth:`autocast` (float32 means autocast is off)."""
        return _PRECISION[self.precision]

    @property
    def dist_backend(self) -> str:
        """torch.distributed backend for this device: hccl (npu), nccl (cuda) or gloo (cpu)."""
        return backend_for(self.type)

    def autocast(self, enabled: bool = True) -> contextlib.AbstractContextManager:
        """Autocast context for encoders and denoiser; a no-op in fp32 or when ``enabled`` is False."""
        if not enabled or self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.type, dtype=self.autocast_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler that is active only for fp16 (bf16 and fp32 need none)."""
        return torch.amp.GradScaler(self.type, enabled=self.precision == "fp16")

    def synchronize(self) -> None:
        """Wait for all queued work on the device (no-op on the CPU)."""
        if self.type != "cpu":
            self._module(self.type).synchronize(self.device)

    @contextlib.contextmanager
    def timer(self) -> Iterator[dict[str, float]]:
        """Time a block in milliseconds, synchronising the device: ``with rt.timer() as t: ...; t['ms']``."""
        out: dict[str, float] = {}
        if self.type == "cpu":
            start = time.perf_counter()
            yield out
            out["ms"] = (time.perf_counter() - start) * 1e3
            return
        mod = self._module(self.type)
        begin, end = mod.Event(enable_timing=True), mod.Event(enable_timing=True)
        begin.record()
        yield out
        end.record()
        end.synchronize()
        out["ms"] = float(begin.elapsed_time(end))

    def memory_stats(self) -> dict[str, float]:
        """Allocated / peak device memory in MiB (process RSS on the CPU when psutil-free /proc is readable)."""
        if self.type == "cpu":
            rss = 0.0
            with contextlib.suppress(OSError, ValueError, IndexError):
                with open("/proc/self/statm") as fh:
                    rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
            return {"rss_mib": rss}
        mod = self._module(self.type)
        return {
            "allocated_mib": mod.memory_allocated(self.device) / 2**20,
            "peak_mib": mod.max_memory_allocated(self.device) / 2**20,
        }

    def manual_seed(self, seed: int) -> None:
        """Seed torch's CPU generator and this device's generator."""
        torch.manual_seed(seed)
        if self.type != "cpu":
            self._module(self.type).manual_seed_all(seed)
