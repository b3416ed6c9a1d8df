"""Batch-1 latency of sampling one (Ta=64, Da=7) chunk: denoiser + DDIM sampler with a fixed cond.

``run()`` times the fast path (:func:`~diffpolicy.diffusion.sampler.ddim_sample`: FiLM projections of all
blocks computed once per chunk, preallocated in-place loop, inference mode) against the plain eager loop
(:func:`~diffpolicy.diffusion.sampler.ddim_sample_reference`: the U-Net's ordinary forward every step),
interleaved in the same process so both see the same machine load, for K = 10 and 20 on the small
(64/128/256) and large (256/512/1024) U-Nets. Deterministic DDIM (eta = 0), median over ``repeats``.
For comparison, Stanford diffusion_policy's ConditionalUnet1D with diffusers' DDIMScheduler was measured at
about 53 ms (small, K=10) and 686 ms (large, K=20) on 2 threads of the CI machine.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import torch

from diffpolicy.diffusion.sampler import ddim_sample, ddim_sample_reference
from diffpolicy.diffusion.schedule import NoiseSchedule
from diffpolicy.models.unet1d import ConditionalUnet1D

SIZES = {"small": [64, 128, 256], "large": [256, 512, 1024]}
REFERENCE_MS = {"small_k10": 53.0, "large_k20": 686.0}
"""diffusion_policy ConditionalUnet1D + diffusers DDIM, 2 threads (measured outside this module)."""


def _time_ms(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run(repeats: int = 10, threads: int = 2, **kwargs: Any) -> dict:
    """Latency (ms, median of ``repeats``) per size and K, plus the eager reference and the speedups.

    kwargs: ``horizon`` (64), ``action_dim`` (7), ``cond_dim`` (256), ``ks`` ((10, 20)), ``sizes``
    (("small", "large")), ``eager`` (True: also time the plain loop), ``warmup`` (2).
    """
    horizon = int(kwargs.get("horizon", 64))
    action_dim = int(kwargs.get("action_dim", 7))
    cond_dim = int(kwargs.get("cond_dim", 256))
    ks = tuple(int(k) for k in kwargs.get("ks", (10, 20)))
    sizes = tuple(kwargs.get("sizes", ("small", "large")))
    eager = bool(kwargs.get("eager", True))
    warmup = int(kwargs.get("warmup", 2))
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    result: dict[str, Any] = {
        "threads": threads,
        "repeats": repeats,
        "horizon": horizon,
        "action_dim": action_dim,
    }
    eager_ms: dict[str, float] = {}
    max_diff = 0.0
    try:
        for size in sizes:
            dims = SIZES[size]
            result[f"{size}_dims"] = dims
            torch.manual_seed(0)
            unet = ConditionalUnet1D(action_dim, cond_dim, dims).eval()
            cond = torch.randn(1, cond_dim)
            noise = torch.randn(1, horizon, action_dim)
            for k in ks:
                sched = NoiseSchedule(100, k, min(5, k), eta=0.0)
                args = (unet, sched, cond, horizon)
                fast = functools.partial(ddim_sample, *args, deterministic=True, noise=noise)
                plain = functools.partial(ddim_sample_reference, *args, deterministic=True, noise=noise)
                with torch.inference_mode():
                    for _ in range(warmup):
                        fast()
                        if eager:
                            plain()
                    t_fast, t_plain = [], []
                    for _ in range(repeats):
                        t_fast.append(_time_ms(fast))
                        if eager:
                            t_plain.append(_time_ms(plain))
                    if eager:
                        max_diff = max(max_diff, float((fast().x0 - plain()).abs().max()))
                key = f"{size}_k{k}"
                result[f"{key}_ms"] = round(statistics.median(t_fast), 3)
                if eager:
                    eager_ms[key] = round(statistics.median(t_plain), 3)
    finally:
        torch.set_num_threads(prev_threads)
    if eager:
        result["eager_reference_ms"] = eager_ms
        result["speedup_vs_eager"] = {k: round(v / result[f"{k}_ms"], 3) for k, v in eager_ms.items()}
        result["max_abs_diff_vs_eager"] = max_diff
    result["reference_chi_diffusers_ms"] = REFERENCE_MS
    result["speedup_vs_reference"] = {
        k: round(v / result[f"{k}_ms"], 3) for k, v in REFERENCE_MS.items() if f"{k}_ms" in result
    }
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
