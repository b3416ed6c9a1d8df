"""One metrics logger: namespaced scalars to TensorBoard and ``metrics.jsonl``, a tqdm bar on long loops.

Metric names are namespaced (``rollout/success_rate``, ``losses/policy``, ``time/sps``). The logger is
rank-aware: only rank 0 writes files and shows progress; on other ranks every method is a cheap no-op, so
callers never branch on the rank themselves.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

T = TypeVar("T")

NAMESPACES = ("rollout", "losses", "time", "eval", "val", "train", "stability", "charts", "system")
"""Allowed metric prefixes (the part before the first '/')."""


class Logger:
    """Namespaced metrics logger.

    Args:
        run_dir: directory for ``metrics.jsonl`` and TensorBoard event files.
        rank: process rank; only rank 0 writes.
        tensorboard: also write TensorBoard event files.
        progress: show tqdm progress bars from :meth:`progress`.
    """

    def __init__(
        self, run_dir: str | Path, *, rank: int = 0, tensorboard: bool = True, progress: bool = True
    ):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.enabled = rank == 0
        self.show_progress = progress and self.enabled
        self._tb = None
        self._fh = None
        self._bar: tqdm | None = None
        self._t0 = time.perf_counter()
        if self.enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tb"))

    @staticmethod
    def _check(name: str) -> None:
        head = name.split("/", 1)[0]
        if "/" not in name or head not in NAMESPACES:
            raise ValueError(
                f"metric name {name!r} must be '<namespace>/<name>' with namespace in {NAMESPACES}"
            )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Record scalar ``metrics`` at ``step`` (e.g. environment steps); non-finite values are kept as null."""
        if not self.enabled:
            return
        record: dict[str, Any] = {"step": int(step), "wall_time_s": round(time.perf_counter() - self._t0, 3)}
        for name, value in metrics.items():
            self._check(name)
            v = float(value.item() if hasattr(value, "item") else value)
            record[name] = v if math.isfinite(v) else None
            if self._tb is not None:
                self._tb.add_scalar(name, v, global_step=int(step))
        assert self._fh is not None
        self._fh.write(json.dumps(record) + "\n")
        if self._bar is not None:
            shown = {k.split("/", 1)[1]: f"{v:.3g}" for k, v in record.items() if "/" in k and v is not None}
            self._bar.set_postfix(dict(list(shown.items())[:4]), refresh=False)

    def event(self, kind: str, message: str, step: int, **fields: Any) -> None:
        """Record a discrete event (gradient spike, NaN skip, rollback...): a JSON line and a console line."""
        if not self.enabled:
            return
        record = {"step": int(step), "event": kind, "message": message, **fields}
        assert self._fh is not None
        self._fh.write(json.dumps(record, default=str) + "\n")
        line = f"[{kind}] step {step}: {message}"
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def progress(self, iterable: Iterable[T], *, total: int | None = None, desc: str = "") -> Iterator[T]:
        """Iterate with a tqdm bar on stderr (rank 0 only); metrics logged meanwhile appear as its postfix."""
        if not self.show_progress:
            yield from iterable
            return
        with tqdm(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, leave=True) as bar:
            self._bar = bar
            try:
                yield from bar
            finally:
                self._bar = None

    def close(self) -> None:
        """Flush and close files (safe to call twice)."""
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> Logger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Scalar records of a ``metrics.jsonl`` (events skipped), in order."""
    out = []
    with open(path) as fh:
        for line in fh:
            rec = json.loads(line)
            if "event" not in rec:
                out.append(rec)
    return out
