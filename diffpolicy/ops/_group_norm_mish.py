"""``mish(group_norm(x) * weight + bias)`` as one operator with its own backward: the U-Net's
Conv -> GroupNorm -> Mish block after the convolution.

Symbols: x (B, C, L), ``groups`` G dividing C, weight and bias (C,) or None (no affine).

On the CPU in float32 the forward and the backward are one compiled kernel each
(``kernels/group_norm_mish/cpu``): the statistics and the activation in two passes over a sample, mish
with one exp instead of ATen's three transcendentals, and the group-norm backward folded into the
activation's. At the U-Net's training shapes this is 2.2-3.8x ATen's group_norm + mish forward and backward
on one thread (``python -m diffpolicy.bench group_norm_mish``), and the largest part of what makes a BC step
with ``policy.train_kernels`` faster than the same network built from ATen's ops. Everywhere else (CUDA, NPU, bf16/fp16 under autocast, float64,
``torch.compile``, tracing and ONNX export) :func:`group_norm_mish` runs :func:`group_norm_mish_reference`,
ATen's ops, which those backends fuse or export themselves.

Operators (schemas in this module, CPU implementations registered when the library loads):

- ``diffpolicy::group_norm_mish(x, weight, bias, groups, eps) -> (y, mean, rstd)``, mean and rstd (B, G);
- ``diffpolicy::group_norm_mish_backward(grad, x, weight, bias, mean, rstd, groups) -> (dx, dweight, dbias)``
  (dweight, dbias (C,), also returned when the block has no affine parameters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from diffpolicy.ops import _loader

__all__ = ["group_norm_mish", "group_norm_mish_reference"]

_lib = torch.library.Library("diffpolicy", "FRAGMENT")
_lib.define(
    "group_norm_mish(Tensor x, Tensor? weight, Tensor? bias, int groups, float eps) -> (Tensor, Tensor, Tensor)"
)
_lib.define(
    "group_norm_mish_backward(Tensor grad, Tensor x, Tensor? weight, Tensor? bias, Tensor mean, Tensor rstd, "
    "int groups) -> (Tensor, Tensor, Tensor)"
)


def group_norm_mish_reference(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, groups: int, eps: float = 1e-5
) -> Tensor:
    """ATen's ``mish(group_norm(x, groups, weight, bias, eps))``: x (B, C, L) -> (B, C, L). The oracle the
    compiled kernel is tested against, and the path wherever the kernel does not run."""
    return F.mish(F.group_norm(x, groups, weight, bias, eps))


class _GroupNormMish(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: Tensor, weight: Tensor | None, bias: Tensor | None, groups: int, eps: float
    ) -> Tensor:
        y, mean, rstd = torch.ops.diffpolicy.group_norm_mish(x, weight, bias, groups, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.groups = groups
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias, mean, rstd = ctx.saved_tensors
        dx, dweight, dbias = torch.ops.diffpolicy.group_norm_mish_backward(
            grad, x, weight, bias, mean, rstd, ctx.groups
        )
        return (
            dx if ctx.needs_input_grad[0] else None,
            dweight if weight is not None and ctx.needs_input_grad[1] else None,
            dbias if bias is not None and ctx.needs_input_grad[2] else None,
            None,
            None,
        )


def _compiled_applies(x: Tensor, weight: Tensor | None, bias: Tensor | None) -> bool:
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 3:
        return False
    if x.shape[0] * x.shape[2] == 1:  # ATen's group_norm refuses one value per channel: let it say so
        return False
    if any(p is not None and p.dtype != torch.float32 for p in (weight, bias)):
        return False
    if torch.is_autocast_enabled("cpu") or torch.compiler.is_compiling():
        return False
    if torch.jit.is_tracing() or torch.onnx.is_in_onnx_export():
        return False
    if not _loader.ensure_kernel("cpu", kernel="group_norm_mish"):
        _loader.warn_fallback("cpu", kernel="group_norm_mish")
        return False
    return True


def group_norm_mish(
    x: Tensor, weight: Tensor | None, bias: Tensor | None, groups: int, eps: float = 1e-5
) -> Tensor:
    """``mish(group_norm(x, groups, weight, bias, eps))``, x (B, C, L) -> (B, C, L), differentiable in x,
    weight and bias (once): the compiled CPU kernel for float32 CPU tensors outside autocast, compile,
    tracing and export, else :func:`group_norm_mish_reference`."""
    if not _compiled_applies(x, weight, bias):
        return group_norm_mish_reference(x, weight, bias, groups, eps)
    return _GroupNormMish.apply(x, weight, bias, groups, eps)
