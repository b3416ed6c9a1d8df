"""Time-aligned observation buffer for real sensors (camera ~30 Hz, control 10 Hz, text at any time).

Sensors push timestamped frames from their own threads; the controller calls :meth:`SyncBuffer.tick` at
each control time ``t`` and gets, per stream, the newest frame whose timestamp is **not newer than** ``t``
and **not older than** ``t - max_lag``. All times are seconds on one clock (the robot's monotonic clock).

Rules, per stream (each has its own bounded ring, kept sorted by timestamp):

- *Insert by timestamp.* Frames may arrive out of order (network jitter, several camera threads); they are
  inserted at their timestamp's place, so a late frame that is still useful is used.
- *Out of order.* A frame not newer than the last frame a tick consumed (``ts <= consumed``) can never be
  used again: it is dropped and counted in ``dropped_out_of_order``.
- *Stale.* A frame older than ``last_tick - max_lag`` (on arrival) or than ``t - max_lag`` (at tick ``t``,
  when it is the newest candidate) is dropped and counted in ``dropped_stale``.
- *Superseded.* At a tick, frames older than the chosen one are discarded (``superseded``, the normal
  case for a 30 Hz camera read at 10 Hz: two of three frames); frames newer than ``t`` wait for later ticks.
  The chosen frame stays available, so a slow sensor's frame is reused while it is within ``max_lag``.
- *Overflow.* A full ring drops its oldest frame (``dropped_overflow``).
- *Missing.* A stream with no usable frame at a tick counts in ``ticks_missing``; its value is ``None``,
  or, when the stream is ``required``, the tick raises :class:`MissingModalityError` naming the stream and
  why (counters are updated and every other stream is consumed first).

Text instructions use ``max_lag=None`` (no lag limit): the latest instruction at or before the tick.

Example::

    buf = SyncBuffer({
        "rgb": StreamSpec(max_lag=0.1),            # camera, 30 Hz
        "state": StreamSpec(max_lag=0.05),         # proprioception
        "instruction": StreamSpec(max_lag=None),   # text, any time
    })
    buf.push("rgb", cam_ts, image)                 # from the camera thread
    obs = buf.tick(now).values                     # at 10 Hz, in the control loop

The buffer is thread-safe (one lock); values are stored by reference, never copied.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class MissingModalityError(LookupError):
    """A required stream has no frame within its lag at a control tick."""

    def __init__(self, stream: str, t: float, reason: str) -> None:
        super().__init__(f"modality '{stream}' is missing at t={t:.6f} s: {reason}")
        self.stream = stream
        self.t = t
        self.reason = reason


@dataclass(frozen=True)
class StreamSpec:
    """How one sensor stream is buffered and aligned."""

    max_lag: float | None = 0.1
    """Oldest usable frame relative to the tick, in seconds (None: no limit, e.g. text)."""
    capacity: int = 32
    """Frames kept in the ring (oldest dropped first when full)."""
    required: bool = True
    """A tick without a usable frame raises MissingModalityError (False: the value is None)."""

    def __post_init__(self) -> None:
        if self.max_lag is not None and not (self.max_lag >= 0 and math.isfinite(self.max_lag)):
            raise ValueError(f"max_lag={self.max_lag!r} must be a finite number >= 0 s or None")
        if self.capacity < 1:
            raise ValueError(f"capacity={self.capacity!r} must be >= 1")


@dataclass
class StreamStats:
    """Counters of one stream (monotonic since construction or :meth:`SyncBuffer.reset_counters`)."""

    received: int = 0
    """Frames pushed."""
    dropped_stale: int = 0
    """Frames dropped because they were older than the lag limit."""
    dropped_out_of_order: int = 0
    """Frames that arrived not newer than the frame already consumed by a tick."""
    dropped_overflow: int = 0
    """Frames evicted from a full ring."""
    superseded: int = 0
    """Frames never used because a newer one was chosen at a tick (normal when a sensor outpaces control)."""
    ticks_missing: int = 0
    """Ticks at which the stream had no usable frame."""


@dataclass
class Tick:
    """What one control tick sees."""

    t: float
    """Tick time (s)."""
    values: dict[str, Any]
    """Stream name -> the chosen frame's value (None where missing and not required)."""
    stamps: dict[str, float | None]
    """Stream name -> the chosen frame's timestamp (None where missing)."""
    missing: tuple[str, ...] = field(default_factory=tuple)
    """Streams without a usable frame at this tick."""

    def lag(self, name: str) -> float | None:
        """Age of the chosen frame of ``name`` at the tick (s), or None where missing."""
        ts = self.stamps.get(name)
        return None if ts is None else self.t - ts


class _Stream:
    """A bounded ring kept sorted by timestamp (capacity is small, so list insertion is cheap)."""

    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.stamps: list[float] = []
        self.values: list[Any] = []
        self.consumed: float = -math.inf
        """Timestamp of the last frame a tick returned."""
        self.stats = StreamStats()


class SyncBuffer:
    """Per-stream bounded rings aligned at control ticks (see the module docstring for the rules)."""

    def __init__(self, streams: Mapping[str, StreamSpec]) -> None:
        if not streams:
            raise ValueError("SyncBuffer needs at least one stream")
        self._streams = {name: _Stream(spec) for name, spec in streams.items()}
        self._last_tick = -math.inf
        self._lock = threading.Lock()

    @property
    def names(self) -> tuple[str, ...]:
        """Stream names in construction order."""
        return tuple(self._streams)

    def push(self, name: str, t: float, value: Any) -> bool:
        """Store a frame of stream ``name`` stamped ``t`` (s); return False when it was dropped."""
        if not math.isfinite(t):
            raise ValueError(f"timestamp of '{name}' must be finite, got {t!r}")
        with self._lock:
            s = self._stream(name)
            s.stats.received += 1
            if t <= s.consumed:
                s.stats.dropped_out_of_order += 1
                return False
            lag = s.spec.max_lag
            if lag is not None and t < self._last_tick - lag:
                s.stats.dropped_stale += 1
                return False
            i = bisect.bisect_right(s.stamps, t)
            if i > 0 and s.stamps[i - 1] == t:  # same stamp twice: the newer arrival wins
                s.values[i - 1] = value
                return True
            s.stamps.insert(i, t)
            s.values.insert(i, value)
            if len(s.stamps) > s.spec.capacity:
                del s.stamps[0], s.values[0]
                s.stats.dropped_overflow += 1
                if i == 0:  # the frame just inserted was the oldest
                    return False
            return True

    def tick(self, t: float) -> Tick:
        """Align every stream at control time ``t`` (s; ticks must not go back in time).

        Raises:
            MissingModalityError: a ``required`` stream has no usable frame (after updating counters).
        """
        if not math.isfinite(t):
            raise ValueError(f"tick time must be finite, got {t!r}")
        with self._lock:
            if t < self._last_tick:
                raise ValueError(f"tick at t={t} goes back in time (last tick at t={self._last_tick})")
            self._last_tick = t
            values: dict[str, Any] = {}
            stamps: dict[str, float | None] = {}
            missing: list[str] = []
            first_error: MissingModalityError | None = None
            for name, s in self._streams.items():
                value, stamp, reason = self._take(s, t)
                values[name], stamps[name] = value, stamp
                if reason is not None:
                    s.stats.ticks_missing += 1
                    missing.append(name)
                    if s.spec.required and first_error is None:
                        first_error = MissingModalityError(name, t, reason)
            if first_error is not None:
                raise first_error
            return Tick(t=t, values=values, stamps=stamps, missing=tuple(missing))

    def _take(self, s: _Stream, t: float) -> tuple[Any, float | None, str | None]:
        """Choose the newest frame at or before ``t``; drop older ones; (value, stamp, reason-if-missing)."""
        i = bisect.bisect_right(s.stamps, t)  # frames [0, i) are not newer than t
        if i == 0:
            if s.stamps:
                return None, None, f"no frame at or before the tick (oldest buffered is {s.stamps[0]:.6f} s)"
            return None, None, "no frame received"
        newest = s.stamps[i - 1]
        s.stats.superseded += sum(1 for ts in s.stamps[: i - 1] if ts > s.consumed)
        lag = s.spec.max_lag
        if lag is not None and newest < t - lag:
            if newest > s.consumed:  # never used: it was stale before it was ever read
                s.stats.dropped_stale += 1
            del s.stamps[:i], s.values[:i]
            return (
                None,
                None,
                f"newest frame is {1e3 * (t - newest):.1f} ms old, lag limit {1e3 * lag:.1f} ms",
            )
        value = s.values[i - 1]
        del s.stamps[: i - 1], s.values[: i - 1]  # keep the chosen frame for later ticks
        s.consumed = newest
        return value, newest, None

    def _stream(self, name: str) -> _Stream:
        try:
            return self._streams[name]
        except KeyError:
            raise KeyError(f"unknown stream '{name}'; streams are {', '.join(self._streams)}") from None

    def stats(self, name: str | None = None) -> dict[str, int]:
        """Counters of one stream, or their sums over all streams when ``name`` is None."""
        with self._lock:
            if name is not None:
                return dict(vars(self._stream(name).stats))
            total: dict[str, int] = dict.fromkeys(vars(StreamStats()), 0)
            for s in self._streams.values():
                for k, v in vars(s.stats).items():
                    total[k] += v
            return total

    @property
    def dropped_stale(self) -> int:
        """Frames dropped as older than their lag limit, over all streams."""
        return self.stats()["dropped_stale"]

    @property
    def dropped_out_of_order(self) -> int:
        """Frames dropped as not newer than what a tick already consumed, over all streams."""
        return self.stats()["dropped_out_of_order"]

    @property
    def ticks_missing(self) -> int:
        """(tick, stream) pairs without a usable frame, over all streams."""
        return self.stats()["ticks_missing"]

    def reset_counters(self) -> None:
        """Zero every counter (the buffered frames stay)."""
        with self._lock:
            for s in self._streams.values():
                s.stats = StreamStats()

    def clear(self) -> None:
        """Forget every frame and the tick/consumption history (e.g. at an episode start); keep counters."""
        with self._lock:
            for s in self._streams.values():
                s.stamps.clear()
                s.values.clear()
                s.consumed = -math.inf
            self._last_tick = -math.inf

    def __len__(self) -> int:
        """Frames currently buffered over all streams."""
        with self._lock:
            return sum(len(s.stamps) for s in self._streams.values())
