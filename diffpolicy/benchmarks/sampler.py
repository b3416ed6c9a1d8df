"""Batch-1 latency of sampling one action chunk (Ta x Da): denoiser + DDIM sampler with a fixed cond.

``run()`` times :func:`~diffpolicy.diffusion.sampler.ddim_sample` with the chosen ``backend`` (default
``compiled``: the prepacked :class:`~diffpolicy.diffusion.fast.FastUnet1D` through ``torch.compile``;
``fast`` is the same network uncompiled) for K = 10 and 20, 64 x 7 and 16 x 7 chunks, on the small
(64/128/256) and large (256/512/1024) U-Nets, interleaved in the same process with

- the uncompiled fast path (``fast_ms``), the film-table loop on the U-Net's own modules (``eager`` backend,
  ``film_eager_ms``) and
- the plain eager loop (:func:`~diffpolicy.diffusion.sampler.ddim_sample_reference`: the U-Net's ordinary
  forward every step, ``eager_reference_ms``),
- the peer (``peer_ms``), when ``peer=<dir>`` names a Stanford diffusion_policy checkout
  (:mod:`diffpolicy.benchmarks.peer`): its ConditionalUnet1D at the same dims with diffusers' DDIMScheduler,
  as its policies sample; ``speedup_vs_peer`` = peer / ours per size, chunk and K, ``peer`` says why the row
  is absent otherwise,

so all see the same machine load. Deterministic DDIM (eta = 0), same x_K for all, medians of ``repeats``
after warm-up; compilation (once per size and chunk) is timed separately (``compile_s``) and excluded from
the latencies. ``max_abs_diff_vs_eager`` compares every timed variant of this project's sampler with the plain
eager loop's x0. Keys are ``<size>_t<Ta>_k<K>``.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import torch

from diffpolicy.benchmarks import peer as peer_lib
from diffpolicy.diffusion.fast import fast_unet
from diffpolicy.diffusion.sampler import ddim_sample, ddim_sample_reference
from diffpolicy.diffusion.schedule import NoiseSchedule
from diffpolicy.models.unet1d import ConditionalUnet1D

SIZES = {"small": [64, 128, 256], "large": [256, 512, 1024]}


def _time_ms(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def run(repeats: int = 10, threads: int = 2, **kwargs: Any) -> dict:
    """Latency (ms, median of ``repeats``) per size, chunk length and K, plus the eager references, the peer
    when given, and the speedups.

    kwargs: ``backend`` (``compiled``; or ``fast`` / ``eager`` / ``auto``), ``horizons`` ((64, 16); or one
    ``horizon``), ``action_dim`` (7), ``cond_dim`` (256), ``ks`` ((10, 20)), ``sizes`` (("small", "large")),
    ``eager`` (True: also time the eager loops), ``warmup`` (2), ``fold`` (1: our U-Nets fold that many action
    steps into one position, ``policy.fold``; the peer's never does), ``peer`` (a diffusion_policy checkout;
    else ``$DIFFPOLICY_PEER_DP``).
    """
    backend = str(kwargs.get("backend", "compiled"))
    horizons = kwargs.get("horizons") or ((kwargs["horizon"],) if "horizon" in kwargs else (64, 16))
    horizons = tuple(int(h) for h in horizons)
    action_dim = int(kwargs.get("action_dim", 7))
    cond_dim = int(kwargs.get("cond_dim", 256))
    ks = tuple(int(k) for k in kwargs.get("ks", (10, 20)))
    sizes = tuple(kwargs.get("sizes", ("small", "large")))
    eager = bool(kwargs.get("eager", True))
    warmup = int(kwargs.get("warmup", 2))
    fold = int(kwargs.get("fold", 1))
    peer_path = kwargs.get("peer")
    skipped = peer_lib.missing(peer_path)
    peer = None if skipped else peer_lib.load(peer_path)
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    result: dict[str, Any] = {
        "backend": backend,
        "threads": threads,
        "repeats": repeats,
        "horizons": list(horizons),
        "action_dim": action_dim,
        "fold": fold,
    }
    variants = {"fast": "fast", "film_eager": "eager"} if eager else {}
    variants.pop(backend if backend != "eager" else "film_eager", None)
    timed: dict[str, dict[str, float]] = {name: {} for name in [*variants, "eager_reference", "peer"]}
    compile_s: dict[str, float] = {}
    best: dict[str, float] = {}
    max_diff = 0.0
    try:
        for size in sizes:
            dims = SIZES[size]
            result[f"{size}_dims"] = dims
            torch.manual_seed(0)
            unet = ConditionalUnet1D(action_dim, cond_dim, dims, fold=fold).eval()
            peer_unet = peer_lib.unet(peer, action_dim, cond_dim, dims).eval() if peer else None
            cond = torch.randn(1, cond_dim)
            for horizon in horizons:
                noise = torch.randn(1, horizon, action_dim)
                with torch.inference_mode():
                    start = time.perf_counter()  # packing (+ compiling, for backend=compiled) once per size
                    ddim_sample(unet, NoiseSchedule(100, ks[0], min(5, ks[0])), cond, horizon, noise=noise,
                                backend=backend)  # fmt: skip
                    compile_s[f"{size}_t{horizon}"] = round(time.perf_counter() - start, 2)
                result[f"{size}_t{horizon}_convs"] = "/".join(
                    f"{impl}:{n}"
                    for impl in ("gemm", "mkldnn")
                    if (n := fast_unet(unet, horizon).impls().count(impl))
                )
                for k in ks:
                    sched = NoiseSchedule(100, k, min(5, k), eta=0.0)
                    args = (unet, sched, cond, horizon)
                    fns = {
                        "main": functools.partial(
                            ddim_sample, *args, deterministic=True, noise=noise, backend=backend
                        )
                    }
                    for name, b in variants.items():
                        fns[name] = functools.partial(
                            ddim_sample, *args, deterministic=True, noise=noise, backend=b
                        )
                    ref = functools.partial(ddim_sample_reference, *args, deterministic=True, noise=noise)
                    if eager:
                        fns["eager_reference"] = ref
                    if peer_unet is not None:
                        fns["peer"] = functools.partial(peer_lib.sampler(peer, peer_unet, k), noise, cond)
                    with torch.inference_mode():
                        for _ in range(warmup):
                            for fn in fns.values():
                                fn()
                        times: dict[str, list[float]] = {name: [] for name in fns}
                        for _ in range(repeats):
                            for name, fn in fns.items():
                                times[name].append(_time_ms(fn))
                        if eager:
                            want = ref()
                            for name, fn in fns.items():
                                if name not in ("eager_reference", "peer"):
                                    max_diff = max(max_diff, float((fn().x0 - want).abs().max()))
                    key = f"{size}_t{horizon}_k{k}"
                    result[f"{key}_ms"] = round(statistics.median(times["main"]), 3)
                    best[key] = round(min(times["main"]), 3)
                    for name in fns:
                        if name != "main":
                            timed[name][key] = round(statistics.median(times[name]), 3)
    finally:
        torch.set_num_threads(prev_threads)
    result["min_ms"] = best  # fastest repeat of the main backend: the less load-sensitive number
    result["compile_s"] = compile_s
    if eager:
        for name in variants:
            result[f"{name}_ms"] = timed[name]
        result["eager_reference_ms"] = timed["eager_reference"]
        result["speedup_vs_eager"] = {
            k: round(v / result[f"{k}_ms"], 3) for k, v in timed["eager_reference"].items()
        }
        result["max_abs_diff_vs_eager"] = max_diff
    if peer is None:
        result["peer"] = skipped
    else:
        result["peer"] = "Stanford diffusion_policy ConditionalUnet1D + diffusers DDIMScheduler"
        result["peer_ms"] = timed["peer"]
        result["speedup_vs_peer"] = {k: round(v / result[f"{k}_ms"], 3) for k, v in timed["peer"].items()}
        result["min_speedup_vs_peer"] = min(result["speedup_vs_peer"].values())
    return result


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
