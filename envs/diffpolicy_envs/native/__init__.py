"""C versions of the environments' per-observation loops, built on first use and loaded through ctypes.

The environments need only NumPy; where a loop costs more in NumPy's call overhead than in arithmetic, its C
twin (a source file beside this module) is compiled once per machine with the system C compiler (``$CC``,
else ``cc``) into a cache directory (``$DIFFPOLICY_CACHE/envs_native``, else
``$XDG_CACHE_HOME/diffpolicy/envs_native``, else ``~/.cache/diffpolicy/envs_native``), under a name that
carries a hash of the source and the platform, written atomically so that worker processes may build at the
same time. Without a compiler, or with ``DIFFPOLICY_ENVS_NATIVE=0``, the NumPy reference runs; both return
the same indices (tests/test_metaworld.py compares them).

- :func:`farthest_points`: farthest-point sampling of the point cloud (``fps.c``); for Meta-World's ~1,400
  voxels and 512 points, ~3 ms in NumPy's loop of 511 vectorised updates.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ENV_VAR = "DIFFPOLICY_ENVS_NATIVE"
"""``0`` keeps every loop in NumPy (no build is attempted)."""
_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_why: dict[str, str] = {}


def cache_dir() -> Path:
    """Where the built libraries live (created on demand): the root ``diffpolicy.ops`` builds its kernels under,
    resolved here again because the environments never import ``diffpolicy``."""
    if os.environ.get("DIFFPOLICY_CACHE"):
        root = Path(os.environ["DIFFPOLICY_CACHE"]).expanduser()
    elif os.environ.get("XDG_CACHE_HOME"):
        root = Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "diffpolicy"
    else:
        root = Path.home() / ".cache" / "diffpolicy"
    return root / "envs_native"


def _build(name: str) -> ctypes.CDLL:
    source = HERE / f"{name}.c"
    text = source.read_bytes()
    tag = hashlib.sha256(text + platform.platform().encode() + sys.version.encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}_{tag}.so"
    if not target.is_file():
        compiler = os.environ.get("CC", "cc")
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C compiler ({compiler!r} not on PATH)")
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            cmd = [compiler, "-O3", "-ffp-contract=off", "-shared", "-fPIC", str(source), "-o", str(built)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-500:]}")
            os.replace(built, target)  # atomic: a concurrent builder's file is as good as ours
    return ctypes.CDLL(str(target))


def library(name: str) -> ctypes.CDLL | None:
    """The built library of ``<name>.c``, or None (then :func:`why` says why) when it cannot be built."""
    with _lock:
        if name not in _libs:
            if os.environ.get(ENV_VAR, "1") == "0":
                _libs[name], _why[name] = None, f"{ENV_VAR}=0"
            else:
                try:
                    _libs[name] = _build(name)
                except (OSError, RuntimeError) as err:
                    _libs[name], _why[name] = None, str(err)
        return _libs[name]


def why(name: str) -> str:
    """Why ``<name>.c`` runs in NumPy instead ('' when the C version is loaded)."""
    return _why.get(name, "")


def _fps_function() -> ctypes._CFuncPtr | None:
    lib = library("fps")
    if lib is None:
        return None
    fn = lib.farthest_points
    if fn.argtypes is None:
        dbl = np.ctypeslib.ndpointer(np.float64, flags="C_CONTIGUOUS")
        i64 = np.ctypeslib.ndpointer(np.int64, flags="C_CONTIGUOUS")
        fn.argtypes = [dbl, dbl, dbl, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, dbl, i64]
        fn.restype = None
    return fn


def farthest_points(xyz: np.ndarray, n: int, start: int) -> np.ndarray | None:
    """Indices (n,) int64 of ``n`` farthest-point samples of ``xyz`` (M, 3), M >= n, from row ``start``, the
    same as :func:`diffpolicy_envs.meta_world.farthest_points`; None when the C version is unavailable."""
    fn = _fps_function()
    if fn is None:
        return None
    m = len(xyz)
    if not 0 < n <= m or not 0 <= start < m:
        raise ValueError(
            f"farthest_points needs 0 < n <= M and 0 <= start < M; got n={n}, M={m}, start={start}"
        )
    x, y, z = np.ascontiguousarray(np.asarray(xyz, dtype=np.float64).T)
    if not np.isfinite(x).all() or not np.isfinite(y).all() or not np.isfinite(z).all():
        raise ValueError("farthest_points needs finite coordinates")
    out = np.empty(n, np.int64)
    fn(x, y, z, m, n, start, np.empty(m, np.float64), out)
    return out
