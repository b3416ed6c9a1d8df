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
from pathlib import Path
from typing import Any

from diffpolicy.config import ServeConfig


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


if __name__ == "__main__":
    from diffpolicy.cli import launch

    launch("serve", main)
