"""Build and load the compiled kernels of kernels/ for the device a tensor lives on.

Every kernel registers itself for its dispatch key under the operator names defined in its Python module
(:mod:`diffpolicy.ops._gae`, :mod:`diffpolicy.ops._group_norm_mish`) when its shared library is loaded:

=================== ===========  ============  ====================================================
kernel              device type  dispatch key  source, built how
=================== ===========  ============  ====================================================
``gae``             ``cpu``      CPU           ``kernels/gae/cpu/gae_cpu.cpp``, cpp_extension
``gae``             ``cuda``     CUDA          ``kernels/gae/cuda/gae.cu``, cpp_extension with nvcc
``gae``             ``npu``      PrivateUse1   ``kernels/gae/ascendc`` (AscendC + torch binding), CMake
``group_norm_mish`` ``cpu``      CPU           ``kernels/group_norm_mish/cpu/group_norm_mish_cpu.cpp``
=================== ===========  ============  ====================================================

Builds happen once per machine, on first use or through :func:`build` (``python -m diffpolicy.ops``),
into a user cache directory: ``$DIFFPOLICY_CACHE/torch_extensions``, else
``$XDG_CACHE_HOME/diffpolicy/torch_extensions``, else ``~/.cache/diffpolicy/torch_extensions``.
When a kernel cannot be built (no compiler, no nvcc, no CANN) the operator runs its pure-torch
implementation and :func:`warn_fallback` says so once per kernel and device type. Setting a kernel's
environment variable to ``torch`` (``DIFFPOLICY_GAE_BACKEND``, ``DIFFPOLICY_NORM_BACKEND``) skips its builds
and forces that path.

``torch_npu`` is never imported here at module import time, only when an ``npu`` tensor is seen (and
therefore ``torch_npu`` is already imported by the caller).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels"
"""The kernel sources, located from this file so the op works from any working directory."""


@dataclasses.dataclass(frozen=True)
class _Kernel:
    """One compiled operator of kernels/ and how each device type gets it."""

    op: str
    """The operator whose registration says that the kernel's library is loaded."""
    env: str
    """Environment variable: ``auto`` (default) builds the compiled kernels, ``torch`` never does."""
    fallback_cost: str
    """What the pure-torch path costs, for the fallback warning."""
    loaders: dict[str, Callable[[bool], None]]
    """Device type -> the function that builds and loads it (``verbose``)."""


_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "npu": "PrivateUse1"}
_lock = threading.RLock()
_status: dict[tuple[str, str], str] = {}
"""(kernel, device type) -> ``"compiled"`` or the reason the pure-torch implementation runs."""
_warned: set[tuple[str, str]] = set()


class KernelFallbackWarning(UserWarning):
    """A compiled kernel is unavailable for a device type; the pure-torch implementation runs."""


def cache_dir() -> Path:
    """Directory where compiled kernels are cached, one subdirectory per Python/torch build."""
    if os.environ.get("DIFFPOLICY_CACHE"):
        root = Path(os.environ["DIFFPOLICY_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "diffpolicy"
    else:
        root = Path.home() / ".cache" / "diffpolicy"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__.replace('+', '_')}"
    path = root / "torch_extensions" / tag
    path.mkdir(parents=True, exist_ok=True)
    return path


def _has_kernel(device_type: str, kernel: str = "gae") -> bool:
    key = _DISPATCH_KEYS.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(_KERNELS[kernel].op, key)


def _openmp_flags() -> list[str]:
    # ATen's at::parallel_for is an inline OpenMP region when torch is built with OpenMP; without
    # -fopenmp it silently runs on one thread. libgomp is then shared with torch's (same soname).
    if platform.system() == "Linux" and "OpenMP" in torch.__config__.parallel_info():
        return ["-fopenmp"]
    return []


def _cpp_extension(kernel: str, verbose: bool) -> None:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler ({compiler!r} not on PATH)")
    omp = _openmp_flags()
    # -O3 without -march: the binary must run on any CPU of the same architecture (shared caches,
    # clusters); the sources pick an AVX2 clone of their loops at load time where the CPU has it.
    cpp_extension.load(
        name=f"diffpolicy_{kernel}_cpu",
        sources=[str(KERNELS_DIR / kernel / "cpu" / f"{kernel}_cpu.cpp")],
        extra_cflags=["-O3", *omp],
        extra_ldflags=omp,
        build_directory=str(_build_dir(f"{kernel}_cpu")),
        is_python_module=False,
        verbose=verbose,
    )


def _load_cuda(verbose: bool) -> None:
    from torch.utils import cpp_extension

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False")
    if cpp_extension.CUDA_HOME is None:
        raise RuntimeError("no CUDA toolkit (nvcc) found: set CUDA_HOME")
    cpp_extension.load(
        name="diffpolicy_gae_cuda",
        sources=[str(KERNELS_DIR / "gae" / "cuda" / "gae.cu")],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        build_directory=str(_build_dir("gae_cuda")),
        is_python_module=False,
        verbose=verbose,
    )


def _ascend_home() -> str | None:
    return os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME")


def _load_npu(verbose: bool) -> None:
    if importlib.util.find_spec("torch_npu") is None:
        raise RuntimeError("torch_npu is not installed")
    ascend_home = _ascend_home()
    if not ascend_home:
        raise RuntimeError("CANN not found: set ASCEND_HOME_PATH or ASCEND_TOOLKIT_HOME")
    if shutil.which("cmake") is None:
        raise RuntimeError("cmake is not on PATH")
    import torch_npu  # noqa: F401  (lazy: only reached for npu tensors or an explicit build)

    soc = os.environ.get("DIFFPOLICY_ASCEND_SOC") or torch.npu.get_device_name()
    source = KERNELS_DIR / "gae" / "ascendc"
    build = _build_dir(f"gae_npu_{soc}")
    library = build / "libdiffpolicy_gae_npu.so"
    stamp = build / "sources.stamp"
    sources = sorted(p for p in source.rglob("*") if p.is_file() and p.suffix in {".cpp", ".h", ".txt"})
    fingerprint = "\n".join(f"{p.relative_to(source)} {p.stat().st_mtime_ns}" for p in sources)
    if not (library.exists() and stamp.exists() and stamp.read_text() == fingerprint):
        out = None if verbose else subprocess.DEVNULL
        configure = [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DSOC_VERSION={soc}",
            f"-DASCEND_CANN_PACKAGE_PATH={ascend_home}",
            f"-DPython3_EXECUTABLE={sys.executable}",
        ]
        subprocess.run(configure, check=True, stdout=out, stderr=out)
        subprocess.run(["cmake", "--build", str(build), "-j"], check=True, stdout=out, stderr=out)
        stamp.write_text(fingerprint)
    torch.ops.load_library(str(library))


_KERNELS = {
    "gae": _Kernel(
        "diffpolicy::gae",
        "DIFFPOLICY_GAE_BACKEND",
        "launches O(T) small operations",
        {"cpu": functools.partial(_cpp_extension, "gae"), "cuda": _load_cuda, "npu": _load_npu},
    ),
    "group_norm_mish": _Kernel(
        "diffpolicy::group_norm_mish",
        "DIFFPOLICY_NORM_BACKEND",
        "runs ATen's group_norm and mish as separate passes",
        {"cpu": functools.partial(_cpp_extension, "group_norm_mish")},
    ),
}
"""Every compiled kernel of kernels/, by name."""


def _build_dir(name: str) -> Path:
    path = cache_dir() / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def ensure_kernel(device_type: str, verbose: bool = False, kernel: str = "gae") -> bool:
    """Build/load ``kernel``'s compiled implementation for ``device_type`` once; True when registered.

    Never raises: a failed build is recorded (see :func:`kernel_status`) and the caller falls back.
    """
    key = (kernel, device_type)
    if _status.get(key) == "compiled":  # once registered, a kernel stays: no dispatcher query per call
        return True
    if _has_kernel(device_type, kernel):
        _status[key] = "compiled"
        return True
    with _lock:
        if key in _status:
            return _status[key] == "compiled"
        env = _KERNELS[kernel].env
        if os.environ.get(env, "auto").lower() == "torch":
            _status[key] = f"disabled by {env}=torch"
            return False
        loader = _KERNELS[kernel].loaders.get(device_type)
        if loader is None:
            _status[key] = f"no compiled kernel for device type {device_type!r}"
            return False
        try:
            loader(verbose)
        except Exception as exc:  # any build or load failure means: use the pure-torch path
            _status[key] = f"build failed: {type(exc).__name__}: {exc}".splitlines()[0][:500]
            return False
        if not _has_kernel(device_type, kernel):
            _status[key] = "library loaded but registered no kernel"
            return False
        _status[key] = "compiled"
        return True


def warn_fallback(device_type: str, kernel: str = "gae") -> None:
    """Warn once per kernel and device type that the pure-torch implementation is running."""
    if (kernel, device_type) in _warned:
        return
    _warned.add((kernel, device_type))
    reason = _status.get((kernel, device_type), "not built")
    warnings.warn(
        f"diffpolicy.ops.{kernel}: no compiled {device_type} kernel ({reason}); running the pure-torch "
        f"implementation, which is correct but {_KERNELS[kernel].fallback_cost}.",
        KernelFallbackWarning,
        stacklevel=3,
    )


def kernel_status(kernel: str = "gae") -> dict[str, str]:
    """Device type -> ``"compiled"`` or why ``kernel``'s pure-torch implementation runs (tried types only)."""
    return {device: status for (k, device), status in _status.items() if k == kernel}


def build(device_types: list[str] | None = None, verbose: bool = False) -> dict[str, dict[str, str]]:
    """Prebuild every kernel for ``device_types`` (default: every device type present here).

    Returns kernel -> device type -> status, for the device types each kernel has an implementation
    for. CPU kernels are always attempted; CUDA when ``torch.cuda.is_available()``; NPU when
    ``torch_npu`` and CANN are installed.
    """
    if device_types is None:
        device_types = ["cpu"]
        if torch.cuda.is_available():
            device_types.append("cuda")
        if importlib.util.find_spec("torch_npu") is not None and _ascend_home():
            device_types.append("npu")
    out: dict[str, dict[str, str]] = {}
    for kernel, spec in _KERNELS.items():
        out[kernel] = {}
        for device_type in device_types:
            if device_type in spec.loaders:
                ensure_kernel(device_type, verbose=verbose, kernel=kernel)
                out[kernel][device_type] = _status.get((kernel, device_type), "not attempted")
    return out
