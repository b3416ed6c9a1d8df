"""gRPC action-server latency and throughput on loopback with 1, 4 and 16 concurrent clients.

The policy is a state-only ``unet_small`` DiffusionPolicy (Ta = 64, Da = 7, K = 10, random weights: the
cost of a call does not depend on the weights) wrapped by :class:`~diffpolicy.serving.sampler.PolicySampler`
and served by :class:`~diffpolicy.serving.server.PolicyServer` on 127.0.0.1 (port 0) with dynamic batching
(``max_batch=16``, ``max_wait_ms=10``). Each client is a closed loop (send, wait, send) on its own channel,
in threads of this process, for ``duration_s`` per level (at least ``min_requests`` each).

Reported: ``inprocess_ms`` and ``served_ms`` (medians of ``sampler.act`` at batch 1 in this thread and
of 1-client requests, measured in alternating blocks of 5 so both see the same machine load;
``p50_over_inprocess`` is their ratio), ``p50_ms_N`` / ``p99_ms_N`` (request latency seen by the
clients of level N), ``rps_N`` (answered requests per second), ``mean_batch_N`` (requests per policy call),
``inprocess_ms_b16`` and ``batch_bound`` = 16 x inprocess_ms / inprocess_ms_b16, the most that batching
can raise throughput on this hardware (on a CPU the U-Net is already compute-bound at batch 1, so this
bound, not the server, limits ``rps_16 / rps_1``; on an accelerator it is large).
Goals: ``p50_ms_1 <= 1.2 x inprocess_ms`` and ``rps_16 >= 3 x rps_1`` (where ``batch_bound`` allows).
"""

from __future__ import annotations

import statistics
import threading
import time
from typing import Any

import numpy as np
import torch

from diffpolicy.config import PolicyConfig
from diffpolicy.policy import make_policy
from diffpolicy.serving.client import PolicyClient
from diffpolicy.serving.sampler import PolicySampler
from diffpolicy.serving.server import PolicyServer

STATE_DIM = 10


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def _closed_loop(address: str, n_clients: int, duration_s: float, min_requests: int) -> dict[str, Any]:
    """``n_clients`` threads, each on its own channel, sending requests back to back."""
    latencies: list[list[float]] = [[] for _ in range(n_clients)]
    sizes: list[int] = []
    barrier = threading.Barrier(n_clients + 1)
    deadline = [0.0]

    def client(i: int) -> None:
        rng = np.random.default_rng(i)
        with PolicyClient(address, timeout_s=120) as c:
            c.wait_ready(30)
            c.obs_spec  # noqa: B018  (fetch the spec before the clock starts)
            barrier.wait()
            while time.perf_counter() < deadline[0] or len(latencies[i]) < min_requests:
                obs = {"state": rng.normal(size=STATE_DIM).astype(np.float32)}
                t0 = time.perf_counter()
                c.act(obs)
                latencies[i].append(1e3 * (time.perf_counter() - t0))
                sizes.append(c.last_info["batch_size"])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n_clients)]
    for th in threads:
        th.start()
    barrier.wait()
    start = time.perf_counter()
    deadline[0] = start + duration_s
    for th in threads:
        th.join()
    wall = time.perf_counter() - start
    flat = [x for per in latencies for x in per]
    return {
        "p50_ms": _percentile(flat, 50),
        "p99_ms": _percentile(flat, 99),
        "rps": len(flat) / wall,
        "requests": len(flat),
        "mean_batch": float(np.mean(sizes)) if sizes else 0.0,
    }


def run(repeats: int = 3, threads: int = 2, **kw: Any) -> dict:
    """p50 / p99 latency and throughput of the served policy for 1, 4 and 16 clients (see module doc).

    kw: ``clients`` ((1, 4, 16)), ``duration_s`` (3.0 per level), ``min_requests`` (3 per client),
    ``max_batch`` (16), ``max_wait_ms`` (10.0), ``horizon`` (64), ``ddim_steps`` (10).
    ``repeats`` x 5 interleaved pairs of in-process and 1-client calls give ``inprocess_ms`` / ``p50_ms_1``.
    """
    clients = tuple(int(c) for c in kw.get("clients", (1, 4, 16)))
    duration_s = float(kw.get("duration_s", 3.0))
    min_requests = int(kw.get("min_requests", 3))
    max_batch = int(kw.get("max_batch", 16))
    max_wait_ms = float(kw.get("max_wait_ms", 10.0))
    cfg = PolicyConfig(horizon=int(kw.get("horizon", 64)), ddim_steps=int(kw.get("ddim_steps", 10)))
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    policy = make_policy(cfg, {"state": [STATE_DIM]}, 7).eval()
    sampler = PolicySampler(policy, {"state": [STATE_DIM]})
    server = PolicyServer(
        sampler, host="127.0.0.1", port=0, max_batch=max_batch, max_wait_ms=max_wait_ms, warmup_sizes="ends"
    )
    result: dict[str, Any] = {
        "policy": "unet_small state-only",
        "horizon": cfg.horizon,
        "ddim_steps": cfg.ddim_steps,
    }
    try:
        server.start()  # warm-up at every batch size happens here
        rng = np.random.default_rng(0)
        inproc, served = [], []
        with PolicyClient(server.address, timeout_s=120) as c:
            c.wait_ready(30)
            c.act({"state": np.zeros(STATE_DIM, np.float32)})  # the first served request (already warm)
            for _ in range(repeats):  # alternating blocks: both see the same machine load
                for _ in range(5):
                    obs = rng.normal(size=(1, STATE_DIM)).astype(np.float32)
                    t0 = time.perf_counter()
                    sampler.act({"state": obs})
                    inproc.append(1e3 * (time.perf_counter() - t0))
                for _ in range(5):
                    obs = rng.normal(size=STATE_DIM).astype(np.float32)
                    t0 = time.perf_counter()
                    c.act({"state": obs})
                    served.append(1e3 * (time.perf_counter() - t0))
        result["inprocess_ms"] = round(statistics.median(inproc), 3)
        result["served_ms"] = round(statistics.median(served), 3)
        big = {"state": np.zeros((max_batch, STATE_DIM), np.float32)}
        t16 = []
        for _ in range(max(2, repeats)):
            t0 = time.perf_counter()
            sampler.act(big)
            t16.append(1e3 * (time.perf_counter() - t0))
        result[f"inprocess_ms_b{max_batch}"] = round(statistics.median(t16), 3)
        result["batch_bound"] = round(
            max_batch * result["inprocess_ms"] / result[f"inprocess_ms_b{max_batch}"], 3
        )
        for n in clients:
            level = _closed_loop(server.address, n, duration_s, min_requests)
            for key in ("p50_ms", "p99_ms"):
                result[f"{key[:3]}_ms_{n}"] = round(level[key], 3)
            result[f"rps_{n}"] = round(level["rps"], 3)
            result[f"mean_batch_{n}"] = round(level["mean_batch"], 3)
            result[f"requests_{n}"] = level["requests"]
        if 1 in clients:
            result["p50_over_inprocess"] = round(result["served_ms"] / result["inprocess_ms"], 3)
        if 1 in clients and 16 in clients:
            result["rps_16_over_1"] = round(result["rps_16"] / result["rps_1"], 3)
        result["warmup_ms"] = round(server.warmup["warmup_ms"], 1)
    finally:
        server.stop(grace_s=5)
        torch.set_num_threads(prev_threads)
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run(repeats=1, duration_s=1.0)))
