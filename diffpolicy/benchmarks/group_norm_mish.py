"""Benchmark of the GroupNorm + Mish operator against ATen's ops at the U-Net's training shapes.

For every (B, C, L) a ``policy=unet_small`` BC step runs through (batch 128, 16-step chunks: (128, 64, 16),
(128, 128, 8), (128, 256, 4); 8 groups, affine, float32) it times, as medians of ``repeats`` samples after
warm-up, forward + backward of

- ``op_ms``: :func:`diffpolicy.ops.group_norm_mish` (the compiled CPU kernel when it is built),
- ``aten_ms``: :func:`diffpolicy.ops.group_norm_mish_reference` (``mish(group_norm(x))``, ATen's kernels),

and their ratio ``speedup`` (ATen over the op), plus ``max_abs_error`` of the op's output and input
gradient against a float64 evaluation of the reference. ``kernel`` says whether the compiled kernel ran.
"""

from __future__ import annotations

from typing import Any

import torch

from diffpolicy.benchmarks.gae import median_ms
from diffpolicy.ops import group_norm_mish, group_norm_mish_reference, kernel_status

SHAPES = ((128, 64, 16), (128, 128, 8), (128, 256, 4))
GROUPS = 8


def run(repeats: int = 20, threads: int = 2, **kwargs: Any) -> dict:
    """Per shape ``op_ms``, ``aten_ms``, ``speedup``, ``max_abs_error`` (kwargs: ``shapes``, a list of
    [B, C, L])."""
    shapes = [tuple(int(v) for v in s) for s in kwargs.pop("shapes", SHAPES)]
    if kwargs:
        raise ValueError(f"group_norm_mish takes shapes; got {sorted(kwargs)}")
    g = torch.Generator().manual_seed(0)
    rows: dict[str, dict[str, float]] = {}
    for b, c, length in shapes:
        x = (torch.randn(b, c, length, generator=g) * 2).requires_grad_()
        weight = (1 + 0.1 * torch.randn(c, generator=g)).requires_grad_()
        bias = (0.1 * torch.randn(c, generator=g)).requires_grad_()
        grad = torch.randn(b, c, length, generator=g)

        def step(fn: Any, x=x, weight=weight, bias=bias, grad=grad) -> None:
            x.grad = weight.grad = bias.grad = None
            fn(x, weight, bias, GROUPS).backward(grad)

        op_ms = median_ms(lambda: step(group_norm_mish), repeats)
        aten_ms = median_ms(lambda: step(group_norm_mish_reference), repeats)
        step(group_norm_mish)
        y = group_norm_mish(x, weight, bias, GROUPS).detach()
        dx = x.grad.clone()
        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
        y64 = group_norm_mish_reference(x64, w64, b64, GROUPS)
        y64.backward(grad.double())
        error = max((y.double() - y64).abs().max().item(), (dx.double() - x64.grad).abs().max().item())
        rows["x".join(map(str, (b, c, length)))] = {
            "op_ms": round(op_ms, 4),
            "aten_ms": round(aten_ms, 4),
            "speedup": round(aten_ms / op_ms, 2),
            "max_abs_error": float(f"{error:.2e}"),
        }
    return {
        "shapes": rows,
        "min_speedup": min(r["speedup"] for r in rows.values()),
        "kernel": kernel_status("group_norm_mish").get("cpu", "not run"),
    }
