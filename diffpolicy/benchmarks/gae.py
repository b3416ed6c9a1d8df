"""Benchmark of the GAE operator against the loops it replaces and a memory-copy floor.

For T x N in 256 x 16, 2048 x 64 and 1024 x 1024 (float32, 10 % episode ends) it times, as medians
of ``repeats`` samples after warm-up and with the torch thread count the caller set:

- ``op_ms_<T>x<N>``: ``diffpolicy.ops.gae`` (the compiled kernel of the device, outputs allocated);
- ``torch_loop_ms_<T>x<N>``: ``gae_reference``, the reverse loop over T vectorised over N in torch;
- ``numpy_loop_ms_<T>x<N>``: a NumPy loop like Stable-Baselines3's
  ``RolloutBuffer.compute_returns_and_advantage``;
- ``copy_ms_1024x1024``: the same bytes moved without arithmetic (read 3 (T, N) arrays, write 2:
  ``torch.add(a, b, out=c); d.copy_(v)`` into preallocated outputs);

plus ``speedup_vs_numpy_2048x64`` (numpy loop / op) and ``ratio_vs_copy_1024x1024`` (op / copy).
Goals: the speedup at least 40, the ratio at most 3.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from diffpolicy.ops import gae, gae_reference, kernel_status

SHAPES = ((256, 16), (2048, 64), (1024, 1024))
GAMMA, LAM = 0.99, 0.95


def numpy_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    dones: np.ndarray,
    last_value: np.ndarray,
    gamma: float,
    lam: float,
) -> tuple[np.ndarray, np.ndarray]:
    """SB3-style loop over (T, N) arrays (done at t: no bootstrap from t + 1)."""
    T = rewards.shape[0]
    advantages = np.zeros_like(rewards)
    last_gae = np.zeros_like(last_value)
    for step in reversed(range(T)):
        next_values = last_value if step == T - 1 else values[step + 1]
        next_non_terminal = 1.0 - dones[step]
        delta = rewards[step] + gamma * next_values * next_non_terminal - values[step]
        last_gae = delta + gamma * lam * next_non_terminal * last_gae
        advantages[step] = last_gae
    return advantages, advantages + values


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 3, min_sample_s: float = 2e-4) -> float:
    """Median wall time of ``fn`` in ms; each sample averages enough calls to last ``min_sample_s``."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    fn()
    once = max(time.perf_counter() - start, 1e-7)
    inner = max(1, int(min_sample_s / once))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples) * 1e3


def _inputs(T: int, N: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, N, generator=g)
    values = torch.randn(T, N, generator=g)
    dones = (torch.rand(T, N, generator=g) < 0.1).float()
    last_value = torch.randn(N, generator=g)
    return tuple(x.to(device) for x in (rewards, values, dones, last_value))


def run(repeats: int = 20, device: str = "cpu", **kwargs) -> dict:
    """Time op / torch loop / numpy loop for every shape and the copy floor at 1024 x 1024.

    Args:
        repeats: samples per median.
        device: torch device of the op and the torch loop (the NumPy loop always runs on the CPU).
        **kwargs: ignored (the benchmark registry passes a shared set of options).

    Returns:
        Flat dict of float metrics (ms and ratios) plus ``threads`` and ``gae_kernel`` (how the op ran).
    """
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    results: dict[str, float | int | str] = {"threads": torch.get_num_threads(), "device": device}
    for T, N in SHAPES:
        tag = f"{T}x{N}"
        inputs = _inputs(T, N, device)
        arrays = [x.cpu().numpy() for x in inputs]

        def op(inputs=inputs):
            gae(*inputs, GAMMA, LAM)
            sync()

        def torch_loop(inputs=inputs):
            gae_reference(*inputs, GAMMA, LAM)
            sync()

        results[f"op_ms_{tag}"] = median_ms(op, repeats)
        results[f"torch_loop_ms_{tag}"] = median_ms(torch_loop, max(3, repeats // 4))
        results[f"numpy_loop_ms_{tag}"] = median_ms(
            lambda arrays=arrays: numpy_gae(*arrays, GAMMA, LAM), repeats
        )

    rewards, values, dones, _ = _inputs(1024, 1024, device)
    out_a, out_b = torch.empty_like(rewards), torch.empty_like(rewards)

    def copy():
        torch.add(rewards, dones, out=out_a)
        out_b.copy_(values)
        sync()

    results["copy_ms_1024x1024"] = median_ms(copy, repeats)
    results["speedup_vs_numpy_2048x64"] = results["numpy_loop_ms_2048x64"] / results["op_ms_2048x64"]
    results["ratio_vs_copy_1024x1024"] = results["op_ms_1024x1024"] / results["copy_ms_1024x1024"]
    results["gae_kernel"] = kernel_status().get(torch.device(device).type, "not run")
    return results


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
