"""Data parallelism over processes started by torchrun: process group, rank helpers, gradient averaging,
seeding.

``torchrun --nproc_per_node=N -m diffpolicy.train dist=ddp`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`process_group` reads them, picks the backend from
the device layer (gloo on the CPU, nccl on CUDA, hccl on Ascend), bounds every collective by
``dist.timeout_s`` and always destroys the group, also when the job raises. A rank that raises exits
non-zero; torchrun then stops the other ranks and the job exits non-zero with the failing rank's message.
Work that only rank 0 does and that may outlast that timeout (collecting demonstrations and training BC
on first use) goes through :func:`main_rank_first`, whose wait is bounded by rank 0's liveness instead.

The HCCL-specific part is :func:`_hccl_environment` (four environment variables for Atlas 800T nodes);
it was written from Ascend's documentation and not run here (no Ascend hardware in this project's CI).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from diffpolicy.config import DistConfig

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that alone logs, checkpoints and evaluates."""
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """True when a process group is in use (more than one process or ``dist=ddp``)."""
        return dist.is_available() and dist.is_initialized()


def seed_for_rank(seed: int, rank: int) -> int:
    """Per-rank seed: ranks step different environments but a run is reproducible."""
    return seed + 1000 * rank


def apply_visible_devices(cfg: DistConfig, device_type: str) -> None:
    """Export ``dist.visible_devices`` for the device's runtime (call before the device is initialised)."""
    if not cfg.visible_devices:
        return
    var = "ASCEND_RT_VISIBLE_DEVICES" if device_type == "npu" else "CUDA_VISIBLE_DEVICES"
    os.environ.setdefault(var, cfg.visible_devices)


def _hccl_environment(cfg: DistConfig) -> None:
    """HCCL settings that matter on Atlas 800T (8 NPUs per node); not run in this project's CI."""
    os.environ.setdefault("HCCL_CONNECT_TIMEOUT", str(cfg.hccl_connect_timeout_s))
    os.environ.setdefault("HCCL_EXEC_TIMEOUT", str(cfg.timeout_s))
    os.environ.setdefault("HCCL_BUFFSIZE", str(cfg.hccl_buffsize_mb))
    os.environ.setdefault("HCCL_WHITELIST_DISABLE", "1")


def backend_name(cfg: DistConfig, device_backend: str) -> str:
    """The torch.distributed backend: ``dist.backend`` or, for ``auto``, the device layer's choice."""
    return device_backend if cfg.backend == "auto" else cfg.backend


@contextlib.contextmanager
def process_group(
    cfg: DistConfig, device_backend: str, device: torch.device | None = None
) -> Iterator[DistInfo]:
    """Initialise the process group from torchrun's environment for ``dist=ddp``; destroy it on exit.

    Args:
        cfg: the ``dist`` config; ``mode=none`` yields a single-process :class:`DistInfo`.
        device_backend: the device layer's backend name (``Runtime.dist_backend``).
        device: this rank's device (binds NCCL/HCCL communicators to it).
    """
    if cfg.mode == "none":
        yield DistInfo()
        return
    missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"dist={cfg.name} needs torchrun's environment ({', '.join(missing)} unset): "
            "launch with torchrun --nproc_per_node=N -m diffpolicy.train dist=ddp"
        )
    backend = backend_name(cfg, device_backend)
    if backend == "hccl":
        _hccl_environment(cfg)
    info = DistInfo(
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        local_rank=int(os.environ["LOCAL_RANK"]),
    )
    dist.init_process_group(
        backend=backend,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
        rank=info.rank,
        world_size=info.world_size,
    )
    try:
        yield info
        # Leave together: a peer that tears its connections down while another rank is still finishing
        # its last collective makes gloo abort that rank. (Not on an exception: the others are gone.)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def mean_metrics(metrics: Mapping[str, float], info: DistInfo, device: torch.device) -> dict[str, float]:
    """Average scalar metrics over ranks (identity in a single process); every rank gets the result."""
    if not info.enabled or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    buf = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    buf /= info.world_size
    return dict(zip(keys, buf.tolist()))


def rank_mean(value: float, info: DistInfo, device: torch.device) -> float:
    """One scalar averaged over ranks: decisions that stop or scale an update must agree on every rank."""
    return mean_metrics({"v": float(value)}, info, device)["v"]


def sum_metrics(metrics: Mapping[str, float], info: DistInfo, device: torch.device) -> dict[str, float]:
    """Sum scalar metrics (counts such as environment steps) over ranks."""
    if not info.enabled or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    buf = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return dict(zip(keys, buf.tolist()))


def barrier(info: DistInfo) -> None:
    """Wait for every rank (no-op in a single process)."""
    if info.enabled:
        dist.barrier()


class MainRankError(RuntimeError):
    """Rank 0 failed, or stopped showing signs of life, while the other ranks waited for it."""


def main_rank_first(
    work: Callable[[], T],
    info: DistInfo,
    device: torch.device,
    status_dir: str | Path,
    *,
    stall_s: float,
    what: str = "its first-use work",
    poll_s: float = 1.0,
) -> T:
    """``work()`` on rank 0, then on every other rank once rank 0 has finished it; returns its result.

    For slow work with a cached result that only rank 0 should produce (collect demonstrations, train BC):
    the other ranks run ``work()`` afterwards and find the cache filled. Their wait is not a collective,
    because a barrier is bounded by the collective timeout (``dist.timeout_s``) and would kill a healthy job
    whose rank 0 simply needs longer than that. The wait is bounded by rank 0's liveness instead:

    * rank 0 keeps a status file ``<status_dir>/.main-first-<token>.json`` current (``token`` is drawn by
      rank 0 and broadcast first, so a file left by an earlier job is never read): a heartbeat counter
      rewritten every ``poll_s`` by a daemon thread while ``work()`` runs, then ``done``, or ``failed`` with
      the exception; every write is an atomic ``os.replace``;
    * the other ranks poll it: ``done`` -> run ``work()``; ``failed`` -> :class:`MainRankError` with rank
      0's error; no change for ``stall_s`` seconds -> :class:`MainRankError` (rank 0 died without a word,
      or ``status_dir`` is not on a filesystem that every rank shares). A rank 0 that dies also makes
      torchrun stop the job.

    The ranks then leave through one barrier (they are at most ``poll_s`` plus the cached ``work()`` apart),
    after which rank 0 removes its status file. A failed job leaves its status file behind (a few bytes).
    In a single process this is just ``work()``.
    """
    if not info.enabled:
        return work()
    token = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64, device=device)
    if info.is_main:  # the status file exists before the other ranks learn its name
        heartbeat = _Heartbeat(Path(status_dir) / f".main-first-{token.item():x}.json", poll_s)
    dist.broadcast(token, src=0)
    status = Path(status_dir) / f".main-first-{token.item():x}.json"
    if info.is_main:
        try:
            result = work()
        except BaseException as exc:
            heartbeat.finish({"state": "failed", "error": f"{type(exc).__name__}: {exc}"})
            raise
        heartbeat.finish({"state": "done"})
    else:
        _wait_for_main(status, stall_s, what, poll_s)
        result = work()
    dist.barrier()
    if info.is_main:
        status.unlink(missing_ok=True)
    return result


class _Heartbeat:
    """Rank 0's side of :func:`main_rank_first`: a status file rewritten every ``poll_s`` until finished."""

    def __init__(self, path: Path, poll_s: float) -> None:
        self.path, self.beat = path, 0
        self.lock, self.stop = threading.Lock(), threading.Event()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._write({"state": "running", "beat": 0})
        self.thread = threading.Thread(target=self._run, args=(poll_s,), daemon=True, name="main-first")
        self.thread.start()

    def _run(self, poll_s: float) -> None:
        while not self.stop.wait(poll_s):
            self.beat += 1
            with contextlib.suppress(OSError):  # a missed beat shows up as a stall on the other ranks
                self._write({"state": "running", "beat": self.beat})

    def _write(self, state: dict[str, object]) -> None:
        with self.lock:
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, self.path)

    def finish(self, state: dict[str, object]) -> None:
        """Stop beating and write the final ``state`` (``done`` or ``failed``)."""
        self.stop.set()
        self.thread.join()
        self._write(state)


def _wait_for_main(status: Path, stall_s: float, what: str, poll_s: float) -> None:
    """Poll rank 0's status file until it says ``done``; raise if it failed or went quiet for ``stall_s``."""
    last, changed = None, time.monotonic()
    while True:
        try:
            state = json.loads(status.read_text())
        except (OSError, ValueError):
            state = None
        if state is not None and state.get("state") == "done":
            return
        if state is not None and state.get("state") == "failed":
            raise MainRankError(f"rank 0 failed during {what}: {state.get('error')}")
        if state != last:
            last, changed = state, time.monotonic()
        elif time.monotonic() - changed > stall_s:
            raise MainRankError(
                f"no sign of life from rank 0 during {what} for {stall_s:g} s (dist.timeout_s): its status "
                f"file {status} {'stopped changing' if state else 'is not visible here'}; rank 0 died or "
                "hangs, or the cache directory is not on a filesystem that every rank shares"
            )
        time.sleep(poll_s)


def broadcast_flag(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """Rank 0's decision (e.g. 'roll back now') made known to every rank."""
    if not info.enabled:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return bool(t.item())


def average_gradients(params: list[torch.nn.Parameter], info: DistInfo) -> None:
    """Average ``.grad`` of ``params`` over ranks with one bucketed all-reduce (no-op in one process).

    Equivalent to DistributedDataParallel's reducer for modules whose loss is not computed by ``forward``
    (the PPO loss calls ``policy.log_prob``): gradients are flattened into one buffer, summed, divided by the
    world size and copied back. Parameters without a gradient contribute zeros, so every rank sends the same
    layout.
    """
    if not info.enabled:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= info.world_size
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        if p.grad is None:
            p.grad = flat[offset : offset + n].view_as(p).clone()
        else:
            p.grad.copy_(flat[offset : offset + n].view_as(p))
        offset += n


def broadcast_parameters(modules: list[torch.nn.Module], info: DistInfo) -> None:
    """Make every rank start from rank 0's parameters and buffers."""
    if not info.enabled:
        return
    for module in modules:
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)
