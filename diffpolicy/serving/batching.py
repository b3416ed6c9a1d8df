"""Dynamic batching: concurrent requests -> one batched sampler call -> each result back to its caller.

A :class:`BatchingWorker` owns one thread and a queue. :meth:`~BatchingWorker.submit` enqueues one
validated observation and returns a :class:`concurrent.futures.Future`; the worker takes the oldest request,
then keeps collecting until it has ``max_batch`` requests or ``max_wait_ms`` have passed since it started
collecting, calls ``sampler.act`` once on the stacked batch and resolves every future with its own
``(Ta, Da)`` row. The wait counts from the start of collection, not from the oldest request's arrival:
requests that queued up during the previous call would otherwise be past their wait already, and closed-loop
clients answered by that call, which return a few milliseconds later, would always miss the next batch
(16 clients on 2 cores got batches of ~10 instead of ~16, and 30 % less throughput).

It only waits when waiting can pay: the wait stops as soon as the batch holds as many requests as the
recent peak of outstanding requests (submitted, not yet answered; the max over the last
``window`` batches). A single closed-loop client therefore never waits (its peak is 1) and pays no
batching latency, while 16 concurrent clients are gathered into batches of ~16 even though their
requests arrive spread over a few milliseconds. Requests already queued are always taken, wait or not.

A sampler with ``per_step = True`` (a base + residual policy, :class:`~diffpolicy.serving.sampler
.ResidualSampler`) keeps state per session: its ``act`` also receives the B requests' session ids.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from diffpolicy.serving.wire import ObsSpec, collate


class Sampler(Protocol):
    """What the server runs: a batched policy call plus the spec of what it expects.

    A sampler may also set ``per_step = True``: it then answers one control step per request (action_shape
    (1, Da)), keeps per-session state, and is called as ``act(obs_batch, sessions)`` with the B requests'
    session ids (list of B strings, in the batch's order).
    """

    obs_spec: ObsSpec
    """Modality name -> expected per-request shape and dtype."""
    action_shape: tuple[int, int]
    """(Ta, Da) of one chunk."""

    def act(self, obs_batch: dict[str, np.ndarray | list[str]]) -> np.ndarray:
        """obs_batch: tensors (B, *shape), texts list of B strings -> actions (B, Ta, Da) float32."""
        ...


@dataclass
class Result:
    """One request's answer."""

    actions: np.ndarray
    """(Ta, Da) float32."""
    batch_size: int
    """Requests in the sampler call that produced it."""
    queue_ms: float
    """Time from submit to the start of that call."""
    compute_ms: float
    """Duration of that call."""


@dataclass
class _Pending:
    obs: Mapping[str, Any]
    future: Future
    session: str = ""
    t_submit: float = field(default_factory=time.perf_counter)


class BatchingWorker:
    """One worker thread turning concurrent :meth:`submit` calls into batched ``sampler.act`` calls."""

    def __init__(
        self,
        sampler: Sampler | Callable[[], Sampler],
        *,
        max_batch: int = 16,
        max_wait_ms: float = 10.0,
        window: int = 8,
        warmup: Callable[[Sampler], Any] | None = None,
    ) -> None:
        """
        Args:
            sampler: the batched policy, or a function without arguments that builds it; the worker thread
                then calls it first, so that loading the model and every later call share one thread. On a
                CPU that matters: once two threads have run torch ops, each has its own OpenMP team, and on
                2 cores batch-1 sampling measured 2-2.5x slower on either of them.
            max_batch: most requests per ``sampler.act`` call.
            max_wait_ms: longest the worker, once free, waits for more requests to join a batch.
            window: batches over which the peak of outstanding requests is remembered.
            warmup: called with the sampler on the worker thread before it serves (per-thread state such as
                OpenMP pools, CUDA/NPU streams and graph caches is then warm where requests run); see
                :meth:`wait_ready`.
        """
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be >= 1")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms={max_wait_ms} must be >= 0")
        self._build = None if hasattr(sampler, "act") else sampler  # a factory: built on the worker thread
        self.sampler: Any = sampler if self._build is None else None
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1e3
        self.batch_sizes: collections.Counter[int] = collections.Counter()
        """Histogram of the batch sizes of every sampler call."""
        self.served = 0
        """Requests answered (successfully or with an error)."""
        self.failed_batches = 0
        """Sampler calls that raised or returned a bad array."""
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._lock = threading.Lock()
        self._outstanding = 0
        self._peak = 0
        self._peaks: collections.deque[int] = collections.deque([1], maxlen=window)
        self._closed = False
        self._warmup = warmup
        self._ready = threading.Event()
        self._warmup_result: Any = None
        self._warmup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="diffpolicy-batcher", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> Any:
        """Block until the warm-up finished; return its result or re-raise its error."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"warm-up did not finish within {timeout} s")
        if self._warmup_error is not None:
            raise self._warmup_error
        return self._warmup_result

    # ------------------------------------------------------------------------------------------- producers
    def submit(self, obs: Mapping[str, Any], session: str = "") -> Future:
        """Queue a validated observation (of ``session``, for a per-step sampler); its future resolves to a
        :class:`Result` or the sampler's error."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the batching worker is shut down")
            self._outstanding += 1
            self._peak = max(self._peak, self._outstanding)
            self._queue.put(_Pending(obs, future, session))
        return future

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting, answer everything already queued, then stop the thread."""
        with self._lock:
            self._closed = True
        self._thread.join(timeout)

    # --------------------------------------------------------------------------------------------- worker
    def _collect(self) -> list[_Pending] | None:
        try:
            first = self._queue.get(timeout=0.05)
        except queue.Empty:
            return None
        batch = [first]
        with self._lock:
            target = min(self.max_batch, max(self._peaks))
        deadline = time.perf_counter() + self.max_wait_s  # from now: see the module docstring
        while len(batch) < self.max_batch:
            try:
                batch.append(self._queue.get_nowait())
                continue
            except queue.Empty:
                pass
            remaining = deadline - time.perf_counter()
            if len(batch) >= target or remaining <= 0 or self._closed:
                break
            try:
                batch.append(self._queue.get(timeout=remaining))
            except queue.Empty:
                break
        return batch

    def _main(self) -> None:
        try:
            if self._build is not None:
                self.sampler = self._build()
            if self._warmup is not None:
                self._warmup_result = self._warmup(self.sampler)
        except BaseException as exc:  # reported by wait_ready; the worker does not serve
            self._warmup_error = exc
            with self._lock:
                self._closed = True
            return
        finally:
            self._ready.set()
        self._run()

    def _run(self) -> None:
        while True:
            batch = self._collect()
            if batch is None:
                if self._closed and self._queue.empty():
                    return
                continue
            with self._lock:
                self._peaks.append(self._peak)
                self._peak = self._outstanding
            self._serve(batch)

    def _serve(self, batch: list[_Pending]) -> None:
        B = len(batch)
        t0 = time.perf_counter()
        try:
            obs_batch = collate([p.obs for p in batch], self.sampler.obs_spec)
            if getattr(self.sampler, "per_step", False):
                actions = np.asarray(self.sampler.act(obs_batch, [p.session for p in batch]))
            else:
                actions = np.asarray(self.sampler.act(obs_batch))
            Ta, Da = self.sampler.action_shape
            if actions.shape != (B, Ta, Da):
                raise RuntimeError(
                    f"sampler returned shape {actions.shape}, expected (B, Ta, Da)={(B, Ta, Da)}"
                )
            if not np.isfinite(actions).all():
                raise RuntimeError("sampler returned NaN or inf actions")
            error: BaseException | None = None
        except Exception as exc:  # routed to every waiting caller; the worker keeps serving
            error = exc
        compute_ms = 1e3 * (time.perf_counter() - t0)
        with self._lock:  # before answering: a caller that resubmits at once must not count twice
            self._outstanding -= B
            self.served += B
            self.batch_sizes[B] += 1
            self.failed_batches += error is not None
        for i, p in enumerate(batch):
            if error is not None:
                p.future.set_exception(error)
            else:
                queue_ms = 1e3 * (t0 - p.t_submit)
                rows = actions[i].astype(np.float32, copy=False)  # (Ta, Da)
                p.future.set_result(Result(rows, B, queue_ms, compute_ms))
