"""The gRPC action server: validation, dynamic batching, warm-up before the port opens, graceful stop.

:class:`PolicyServer` wraps any :class:`~diffpolicy.serving.batching.Sampler` (an object with
``obs_spec``, ``action_shape`` = (Ta, Da) and ``act(obs_batch) -> (B, Ta, Da)``), so it runs and is tested
without a trained checkpoint. Lifecycle::

    server = PolicyServer(sampler, host="127.0.0.1", port=0, max_batch=16, max_wait_ms=10)
    server.start()          # warm-up on the serving thread (every batch size), then bind and serve
    server.address          # "127.0.0.1:PORT" (port 0 picks a free one)
    server.stop(grace_s=5)  # refuse new RPCs, finish the ones in flight, stop the batching thread

``Act``: INVALID_ARGUMENT with a one-line message for a malformed observation (missing or unknown
modality, wrong shape or dtype, NaN/inf, empty text); UNAVAILABLE while shutting down; INTERNAL if the
policy itself fails (the server keeps serving in every case); DEADLINE_EXCEEDED after ``request_timeout_s``.
``Health``: SERVING / NOT_SERVING plus the observation spec, (Ta, Da), max_batch and the requests served.

A per-step sampler (``per_step = True``: a base + residual policy, whose head corrects every control step
with that step's state, so a chunk per request could not apply it) answers each request with one action
(1, Da) of the request's ``Observation.session``; a request without a session gets INVALID_ARGUMENT, and
``Health.per_step`` tells clients which kind they talk to.

A sampler of a policy that reads a dialogue (``dialogue = True``: an instruction memory) gets, as its
``instruction``, the whole dialogue of the request's session (:class:`~diffpolicy.serving.dialogue.Dialogues`):
a request carries ``texts["instruction"]`` only when something new is said, and needs ``Observation.session``;
``Health.dialogue`` says so.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from diffpolicy.serving import policy_pb2 as pb
from diffpolicy.serving import policy_pb2_grpc as pb_grpc
from diffpolicy.serving.batching import BatchingWorker, Sampler
from diffpolicy.serving.dialogue import Dialogues
from diffpolicy.serving.wire import (
    MAX_TEXT_CHARS,
    InvalidObservation,
    ObsSpec,
    collate,
    decode_observation,
    spec_to_pb,
    to_tensor,
)

MAX_MESSAGE_BYTES = 64 << 20
"""Largest request / response accepted (bytes)."""


def example_observation(spec: ObsSpec) -> dict[str, np.ndarray | str]:
    """A valid observation of zeros (and a short instruction) for warm-up and smoke tests."""
    return {
        name: "pick up the red cube" if m.is_text else np.zeros(m.shape, dtype=m.dtype)
        for name, m in spec.items()
    }


def warm_up(sampler: Sampler, max_batch: int, rounds: int = 2, sizes: str = "all") -> dict[str, float]:
    """Call ``sampler.act`` at every batch size the batcher can produce, then ``rounds`` more at 1 and B max.

    ``sizes="all"`` warms 1..max_batch: on accelerators each new shape may compile kernels or graphs
    (NPU op compilation, cuDNN autotuning), so every shape is paid for before a client sees the server
    and the first request costs what the hundredth does. ``sizes="ends"`` warms only 1 and max_batch
    (enough on a CPU, where a new batch size costs nothing extra). Text embeddings are cached on the
    way. Returns timings in ms.
    """
    if sizes not in ("all", "ends"):
        raise ValueError(f"warm-up sizes={sizes!r} is not allowed; choose one of all, ends")
    obs = example_observation(sampler.obs_spec)
    t0 = time.perf_counter()
    every = range(1, max_batch + 1) if sizes == "all" else sorted({1, max_batch})
    sizes_run = [1] * rounds + list(every) + [max_batch] * rounds
    per_step = getattr(sampler, "per_step", False)
    last: dict[int, float] = {}
    for n, b in enumerate(sizes_run):
        t = time.perf_counter()
        batch = collate([obs] * b, sampler.obs_spec)
        if per_step:  # fresh sessions: every call plans (base) and corrects (head) at batch size b
            sampler.act(batch, [f"warmup/{n}/{i}" for i in range(b)])
        else:
            sampler.act(batch)
        last[b] = 1e3 * (time.perf_counter() - t)
    if per_step:
        sampler.clear_sessions()
    return {
        "warmup_ms": 1e3 * (time.perf_counter() - t0),
        "batch1_ms": last[1],
        "batch_max_ms": last[max_batch],
    }


class _Servicer(pb_grpc.PolicyServicer):
    def __init__(self, server: PolicyServer) -> None:
        self.server = server

    def Act(self, request: pb.Observation, context: grpc.ServicerContext) -> pb.ActionChunk:
        srv = self.server
        if not srv.serving:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the policy server is shutting down")
        dialogue = getattr(srv.sampler, "dialogue", False)
        try:
            obs = decode_observation(request, srv.sampler.obs_spec, ("instruction",) if dialogue else ())
            if dialogue:  # what the session has heard so far, with what this request says
                obs["instruction"] = srv.dialogues.hear(request.session, obs.get("instruction"))
        except InvalidObservation as exc:
            srv.count("invalid")
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        session = request.session
        if getattr(srv.sampler, "per_step", False) and not 0 < len(session) <= MAX_TEXT_CHARS:
            srv.count("invalid")
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "this policy acts one control step at a time (base + residual): set Observation.session "
                f"(1..{MAX_TEXT_CHARS} characters) to an id of the robot's episode",
            )
        try:
            future = srv.worker.submit(obs, session)
        except RuntimeError:  # closed between the check above and now
            context.abort(grpc.StatusCode.UNAVAILABLE, "the policy server is shutting down")
        remaining = context.time_remaining()
        timeout = srv.request_timeout_s if remaining is None else min(remaining, srv.request_timeout_s)
        code, message, result = grpc.StatusCode.OK, "", None
        try:
            result = future.result(timeout=max(timeout, 0.0))
        except futures.TimeoutError:
            code, message = grpc.StatusCode.DEADLINE_EXCEEDED, f"no action within {timeout:.3f} s"
        except Exception as exc:
            code, message = grpc.StatusCode.INTERNAL, f"policy failed: {type(exc).__name__}: {exc}"
        if result is None:
            srv.count("failed")
            context.abort(code, message)
        return pb.ActionChunk(
            actions=to_tensor(result.actions),
            batch_size=result.batch_size,
            queue_ms=result.queue_ms,
            compute_ms=result.compute_ms,
        )

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        srv = self.server
        status = pb.HealthResponse.SERVING if srv.serving else pb.HealthResponse.NOT_SERVING
        return pb.HealthResponse(
            status=status,
            modalities=spec_to_pb(srv.sampler.obs_spec),
            action_shape=list(srv.sampler.action_shape),
            max_batch=srv.worker.max_batch,
            served=srv.worker.served,
            per_step=bool(getattr(srv.sampler, "per_step", False)),
            dialogue=bool(getattr(srv.sampler, "dialogue", False)),
        )


class PolicyServer:
    """A gRPC ``Policy`` service over a sampler, with dynamic batching (see the module docstring)."""

    def __init__(
        self,
        sampler: Sampler | Callable[[], Sampler],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_batch: int = 16,
        max_wait_ms: float = 10.0,
        workers: int = 64,
        warmup_rounds: int = 2,
        warmup_sizes: str = "all",
        request_timeout_s: float = 30.0,
    ) -> None:
        """
        Args:
            sampler: the batched policy (``act(obs_batch) -> (B, Ta, Da)``; a per-step sampler:
                ``act(obs_batch, sessions) -> (B, 1, Da)``), or a function without
                arguments that builds it on the serving thread (what ``python -m diffpolicy.serve`` does:
                on a CPU, model loading and sampling on different threads made batch-1 sampling 2-2.5x
                slower on 2 cores; see :class:`~diffpolicy.serving.batching.BatchingWorker`).
            host: interface to bind (127.0.0.1 = loopback only; 0.0.0.0 = every interface).
            port: TCP port (0 picks a free one; read :attr:`port` after :meth:`start`).
            max_batch: most requests per sampler call.
            max_wait_ms: longest the batching thread, once free, waits for more requests to join a batch.
            workers: gRPC handler threads (= most requests in flight; more get RESOURCE_EXHAUSTED).
            warmup_rounds: extra warm-up calls at batch 1 and max_batch.
            warmup_sizes: all (every batch size 1..max_batch once) | ends (1 and max_batch only).
            request_timeout_s: longest a request waits for its action.
        """
        self.sampler = sampler
        self.host = host
        self.port = port
        self.max_batch = max_batch
        self.max_wait_ms = max_wait_ms
        self.workers = workers
        self.warmup_rounds = warmup_rounds
        self.warmup_sizes = warmup_sizes
        self.request_timeout_s = request_timeout_s
        self.worker: BatchingWorker | None = None
        self.warmup: dict[str, float] = {}
        self.counters = {"invalid": 0, "failed": 0}
        self.dialogues = Dialogues()
        """Each session's utterances, for a sampler whose policy reads a dialogue."""
        self._counter_lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._serving = False

    @property
    def serving(self) -> bool:
        """True between :meth:`start` and :meth:`stop`."""
        return self._serving

    @property
    def address(self) -> str:
        """``host:port`` clients connect to (after :meth:`start`)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "[::]") else self.host
        return f"{host}:{self.port}"

    def count(self, key: str) -> None:
        with self._counter_lock:
            self.counters[key] += 1

    def start(self) -> PolicyServer:
        """Warm the sampler up, start the batching thread, then bind the port and serve."""
        if self._grpc is not None:
            raise RuntimeError("server already started")
        self.worker = BatchingWorker(
            self.sampler,
            max_batch=self.max_batch,
            max_wait_ms=self.max_wait_ms,
            warmup=lambda sampler: warm_up(sampler, self.max_batch, self.warmup_rounds, self.warmup_sizes),
        )
        self.warmup = self.worker.wait_ready()  # on the thread that will serve, before the port opens
        self.sampler = self.worker.sampler  # built there when a factory was given
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="diffpolicy-rpc"),
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=self.workers,
        )
        pb_grpc.add_PolicyServicer_to_server(_Servicer(self), server)
        bound = server.add_insecure_port(f"{self.host}:{self.port}")
        if bound == 0:
            self.worker.close()
            raise OSError(f"cannot bind {self.host}:{self.port} (in use or not allowed)")
        self.port = bound
        self._serving = True
        server.start()
        self._grpc = server
        return self

    def stop(self, grace_s: float = 5.0) -> None:
        """Refuse new RPCs, let those in flight finish (at most ``grace_s``), stop the batching thread."""
        self._serving = False
        if self._grpc is not None:
            self._grpc.stop(grace_s).wait()
            self._grpc = None
        if self.worker is not None:
            self.worker.close(timeout=grace_s)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server stops (True) or ``timeout`` passes (False)."""
        if self._grpc is None:
            return True
        return self._grpc.wait_for_termination(timeout)

    def stats(self) -> dict[str, Any]:
        """Requests served, rejected and failed, and the histogram of batch sizes."""
        sizes = dict(sorted(self.worker.batch_sizes.items())) if self.worker else {}
        calls = sum(sizes.values())
        return {
            "served": self.worker.served if self.worker else 0,
            **self.counters,
            "batches": calls,
            "mean_batch": (sum(b * n for b, n in sizes.items()) / calls) if calls else 0.0,
            "batch_sizes": {str(b): n for b, n in sizes.items()},
        }

    def __enter__(self) -> PolicyServer:
        return self.start() if self._grpc is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
