"""gRPC action-server latency and throughput on loopback with 1, 4 and 16 concurrent clients.

The policy is a state-only ``unet_small`` DiffusionPolicy (Ta = 64, Da = 7, K = 10, random weights: the
cost of a call does not depend on the weights) wrapped by :class:`~diffpolicy.serving.sampler.PolicySampler`
and served by :class:`~diffpolicy.serving.server.PolicyServer` on 127.0.0.1 (port 0) with dynamic batching
(``max_batch=16``, ``max_wait_ms=10``). Each client is a closed loop (send, wait, send) on its own channel,
in threads of this process, for ``duration_s`` per level (at least ``min_requests`` each).

The policy is built on the server's batching thread (a sampler factory, as ``python -m diffpolicy.serve``
does), and nothing else in the process runs torch: on a CPU a second thread running torch ops has its own
OpenMP team, and on 2 cores that made batch-1 sampling 2-2.5x slower on both threads.

Reported: ``inprocess_ms`` (median time of the sampler call itself for 1-client requests, measured on the
serving thread and returned with each answer as ``compute_ms``) and ``served_ms`` (median round trip of
the same requests; ``p50_over_inprocess`` is their ratio), ``p50_ms_N`` / ``p99_ms_N`` (request latency
seen by the clients of level N), ``rps_N`` (answered requests per second), ``mean_batch_N`` (requests per
policy call), ``inprocess_ms_b16`` (median sampler time of the full batches of the 16-client level, else
of the warm-up's last full batch) and ``batch_bound`` = 16 x inprocess_ms / inprocess_ms_b16, the most that
batching can raise throughput on this hardware (on a CPU the U-Net is largely compute-bound at batch 1, so
this bound, not the server, limits ``rps_16 / rps_1``; on an accelerator it is large).
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
    compute: dict[int, list[float]] = {}
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
                sizes.append(int(c.last_info["batch_size"]))
                compute.setdefault(sizes[-1], []).append(float(c.last_info["compute_ms"]))

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
        "compute_ms": {b: statistics.median(v) for b, v in compute.items()},
    }


def run(repeats: int = 3, threads: int = 2, **kw: Any) -> dict:
    """p50 / p99 latency and throughput of the served policy for 1, 4 and 16 clients (see module doc).

    kw: ``clients`` ((1, 4, 16)), ``duration_s`` (3.0 per level), ``min_requests`` (3 per client),
    ``max_batch`` (16), ``max_wait_ms`` (10.0), ``horizon`` (64), ``ddim_steps`` (10).
    ``repeats`` x 5 single-client requests give ``inprocess_ms`` (their sampler time) and ``served_ms``.
    """
    clients = tuple(int(c) for c in kw.get("clients", (1, 4, 16)))
    duration_s = float(kw.get("duration_s", 3.0))
    min_requests = int(kw.get("min_requests", 3))
    max_batch = int(kw.get("max_batch", 16))
    max_wait_ms = float(kw.get("max_wait_ms", 10.0))
    steps = int(kw.get("ddim_steps", 10))
    cfg = PolicyConfig(horizon=int(kw.get("horizon", 64)), ddim_steps=steps, ft_steps=steps)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)

    def build() -> PolicySampler:  # runs on the serving thread
        torch.manual_seed(0)
        policy = make_policy(cfg, {"state": [STATE_DIM]}, 7).eval()
        return PolicySampler(policy, {"state": [STATE_DIM]})

    server = PolicyServer(
        build, host="127.0.0.1", port=0, max_batch=max_batch, max_wait_ms=max_wait_ms, warmup_sizes="ends"
    )
    result: dict[str, Any] = {
        "policy": "unet_small state-only",
        "horizon": cfg.horizon,
        "ddim_steps": cfg.ddim_steps,
    }
    try:
        server.start()  # the policy is built and warmed up on the serving thread here
        rng = np.random.default_rng(0)
        compute, served = [], []
        with PolicyClient(server.address, timeout_s=120) as c:
            c.wait_ready(30)
            c.act({"state": np.zeros(STATE_DIM, np.float32)})  # the first served request (already warm)
            for _ in range(5 * repeats):
                obs = rng.normal(size=STATE_DIM).astype(np.float32)
                t0 = time.perf_counter()
                c.act({"state": obs})
                served.append(1e3 * (time.perf_counter() - t0))
                compute.append(float(c.last_info["compute_ms"]))
        result["inprocess_ms"] = round(statistics.median(compute), 3)
        result["served_ms"] = round(statistics.median(served), 3)
        for n in clients:
            level = _closed_loop(server.address, n, duration_s, min_requests)
            for key in ("p50_ms", "p99_ms"):
                result[f"{key[:3]}_ms_{n}"] = round(level[key], 3)
            result[f"rps_{n}"] = round(level["rps"], 3)
            result[f"mean_batch_{n}"] = round(level["mean_batch"], 3)
            result[f"requests_{n}"] = level["requests"]
            if max_batch in level["compute_ms"]:  # the first level that formed full batches
                result.setdefault(f"inprocess_ms_b{max_batch}", round(level["compute_ms"][max_batch], 3))
        # no full batch formed at any level: the warm-up's last full batch
        result.setdefault(f"inprocess_ms_b{max_batch}", round(server.warmup["batch_max_ms"], 3))
        result["batch_bound"] = round(
            max_batch * result["inprocess_ms"] / result[f"inprocess_ms_b{max_batch}"], 3
        )
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
