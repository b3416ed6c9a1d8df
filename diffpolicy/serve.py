"""``python -m diffpolicy.serve checkpoint=PATH port=50051``: a trained policy as a gRPC action service.

Reads top to bottom: load the checkpoint into a batched sampler on the serving thread, warm it up at every
batch size (before the port opens, so the first request is as fast as the hundredth), serve ``Act`` /
``Health`` with dynamic batching (up to ``max_batch`` concurrent requests per policy call, waiting at most
``max_wait_ms``), and on SIGTERM / SIGINT stop accepting, finish what is in flight and exit 0 with the
summary JSON line.

When the port is open, one line ``{"event": "ready", "address": "HOST:PORT", ...}`` is printed on stdout
and ``endpoint.json`` is written into the run directory (useful with ``port=0``, which picks a free port).
Clients: :class:`diffpolicy.serving.client.PolicyClient`. Wire format: ``diffpolicy/serving/policy.proto``.

A base + residual checkpoint (``algo=residual``) is served per control step (``"per_step": true`` in the
ready line and ``Health``): its head corrects every step's action with that step's state, which a chunk
answered once per decision could not do. Each request carries ``Observation.session`` (one robot's episode)
and gets that step's action (1, Da); the server keeps each session's base chunk and phase
(:class:`diffpolicy.serving.sampler.ResidualSampler`), so what a robot executes is what evaluation's
``StepActor`` executes. The base chunk is sampled with deterministic DDIM and the head takes its mean,
whatever ``deterministic`` says.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diffpolicy.config import DeviceConfig

DEFAULT_PORT = 50051


@dataclass
class ServeConfig:
    """``python -m diffpolicy.serve``: serve a checkpoint's policy over gRPC."""

    checkpoint: str = ""
    """Checkpoint directory (or a root holding ``latest``) to serve (required)."""
    host: str = "127.0.0.1"
    """Interface to bind: 127.0.0.1 (this machine only) | 0.0.0.0 (every interface)."""
    port: int = DEFAULT_PORT
    """TCP port (0 picks a free one, reported in the ready line and endpoint.json)."""
    max_batch: int = 16
    """Most concurrent requests answered by one batched policy call."""
    max_wait_ms: float = 10.0
    """Longest a request waits for others to join its batch (ms); a lone client never waits."""
    workers: int = 64
    """gRPC handler threads = requests in flight at most (more get RESOURCE_EXHAUSTED)."""
    warmup_rounds: int = 2
    """Extra warm-up calls at batch 1 and max_batch."""
    warmup_sizes: str = "all"
    """all (every batch size 1..max_batch; NPU / GPU compile new shapes) | ends (1 and max_batch)."""
    request_timeout_s: float = 30.0
    """Longest one request waits for its action chunk (s)."""
    grace_s: float = 10.0
    """On SIGTERM / SIGINT, time given to requests in flight before the server exits (s)."""
    deterministic: bool = False
    """Take every DDIM step's mean instead of sampling (base + residual: always)."""
    seed: int = 0
    """Seed of the sampling generator."""
    max_sessions: int = 4096
    """Base + residual: sessions whose chunk is kept at most (the least recently served is forgotten)."""
    text_backend: str = ""
    """Instruction embedder: '' (the checkpoint's, else minilm) | minilm (shipped MiniLM) | hash (tests)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint is required: pass checkpoint=PATH to a checkpoint directory")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is out of range; it must lie in [0, 65535] (0 = any free)")
        for name in ("max_batch", "workers", "request_timeout_s", "max_sessions"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is out of range; it must be > 0")
        for name in ("max_wait_ms", "warmup_rounds", "grace_s", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)!r} is out of range; it must be >= 0")
        if self.workers < self.max_batch:
            raise ValueError(
                f"workers={self.workers} must be >= max_batch={self.max_batch} to ever fill a batch"
            )
        if self.warmup_sizes not in ("all", "ends"):
            raise ValueError(f"warmup_sizes={self.warmup_sizes!r} is not allowed; choose one of all, ends")
        if self.text_backend not in ("", "minilm", "hash"):
            raise ValueError(f"text_backend={self.text_backend!r} is not allowed; choose '', minilm or hash")


def main(cfg: ServeConfig, run_dir: Path) -> dict[str, Any]:
    from diffpolicy.device import Runtime
    from diffpolicy.serving.sampler import sampler_from_checkpoint
    from diffpolicy.serving.server import PolicyServer

    runtime = Runtime.from_config(cfg.device)

    def load() -> Any:  # on the serving thread, so that loading and sampling share one thread's state
        return sampler_from_checkpoint(
            cfg.checkpoint,
            runtime=runtime,
            text_backend=cfg.text_backend,
            deterministic=cfg.deterministic,
            seed=cfg.seed,
            max_sessions=cfg.max_sessions,
        )

    server = PolicyServer(
        load,
        host=cfg.host,
        port=cfg.port,
        max_batch=cfg.max_batch,
        max_wait_ms=cfg.max_wait_ms,
        workers=cfg.workers,
        warmup_rounds=cfg.warmup_rounds,
        warmup_sizes=cfg.warmup_sizes,
        request_timeout_s=cfg.request_timeout_s,
    )

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.start()  # warm-up happens here, before the port opens
        started = time.perf_counter()
        sampler = server.sampler
        ready = {
            "event": "ready",
            "address": server.address,
            "obs_spec": {k: [*m.shape] if not m.is_text else "text" for k, m in sampler.obs_spec.items()},
            "action_shape": list(sampler.action_shape),
            "per_step": bool(getattr(sampler, "per_step", False)),
            **{k: round(v, 3) for k, v in server.warmup.items()},
        }
        (run_dir / "endpoint.json").write_text(json.dumps(ready) + "\n")
        print(json.dumps(ready), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop(cfg.grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return {
        "address": server.address,
        "uptime_s": round(time.perf_counter() - started, 3),
        **server.stats(),
        **{k: round(v, 3) for k, v in server.warmup.items()},
        "device": runtime.type,
    }


def register() -> None:
    """Register ``serve_schema`` in Hydra's ConfigStore (conf/serve.yaml builds on it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="serve_schema", node=ServeConfig)


if __name__ == "__main__":
    from diffpolicy.cli import launch

    register()
    launch("serve", main)
