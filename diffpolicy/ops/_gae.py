"""Generalised advantage estimation as one custom operator, ``diffpolicy::gae``.

Symbols: T decisions per environment, N environments. ``dones[t, n] == 1`` means the episode of
environment n ended at decision t, so nothing after t is bootstrapped into t::

    delta_t = r_t + gamma * V_{t+1} * (1 - d_t) - V_t          V_T = last_value
    A_t     = delta_t + gamma * lam * (1 - d_t) * A_{t+1}      A_T = 0
    returns = A + V

The whole reverse recursion is one operator (on an NPU each of the O(T) element-wise steps would
otherwise be a separate small operator launch). Implementations, one per dispatch key:

- ``CPU``, ``CUDA``, ``PrivateUse1`` (NPU): compiled kernels from ``kernels/gae``, registered when
  :mod:`diffpolicy.ops._loader` loads them;
- ``CompositeExplicitAutograd``: builds/loads the compiled kernel for the tensor's device on first
  use and re-dispatches to it, or, when none can be built, runs :func:`gae_reference` (one warning);
- ``Meta`` / fake: output shapes only, so the op composes with ``torch.compile(fullgraph=True)``.

The op is not differentiable: advantages and returns are targets, computed under ``no_grad``.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from diffpolicy.ops import _loader

__all__ = ["gae", "gae_reference"]

_SCHEMA = (
    "gae(Tensor rewards, Tensor values, Tensor dones, Tensor last_value, float gamma, float lam) "
    "-> (Tensor advantages, Tensor returns)"
)
_DTYPES = (torch.float32, torch.float64)

_lib = torch.library.Library("diffpolicy", "FRAGMENT")
_lib.define(_SCHEMA)


def gae_reference(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Readable pure-torch GAE: the reverse recursion over T, vectorised over N.

    The oracle every compiled kernel is tested against, and the fallback when none can be built.

    Args:
        rewards: (T, N) reward of each decision.
        values: (T, N) critic value V_t of the observation each decision was taken from.
        dones: (T, N) 1.0 where the episode ended at that decision, else 0.0.
        last_value: (N,) critic value of the observation after the last decision.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, both (T, N), contiguous, in the inputs' dtype.
    """
    advantages = torch.empty(rewards.shape, dtype=rewards.dtype, device=rewards.device)
    returns = torch.empty_like(advantages)
    next_value = last_value  # (N,)
    next_advantage = torch.zeros_like(last_value)  # (N,)
    for t in reversed(range(rewards.shape[0])):
        not_done = 1.0 - dones[t]  # (N,)
        delta = rewards[t] + gamma * next_value * not_done - values[t]
        next_advantage = delta + gamma * lam * not_done * next_advantage
        advantages[t] = next_advantage
        next_value = values[t]
    torch.add(advantages, values, out=returns)
    return advantages, returns


def _gae_any_device(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    # Reached only while no compiled kernel is registered for this device's dispatch key.
    device_type = rewards.device.type
    if _loader.ensure_kernel(device_type):
        return torch.ops.diffpolicy.gae.default(rewards, values, dones, last_value, gamma, lam)
    _loader.warn_fallback(device_type)
    return gae_reference(rewards, values, dones, last_value, gamma, lam)


_lib.impl("gae", _gae_any_device, "CompositeExplicitAutograd")


@torch.library.register_fake("diffpolicy::gae", lib=_lib)
def _gae_fake(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    shape, options = rewards.shape, {"dtype": rewards.dtype, "device": rewards.device}
    return torch.empty(shape, **options), torch.empty(shape, **options)


def _check_coefficient(name: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"gae: {name} must be a real number in [0, 1], got {type(x).__name__}")
    x = float(x)
    if not (0.0 <= x <= 1.0) or math.isnan(x):
        raise ValueError(f"gae: {name} must lie in [0, 1], got {x}")
    return x


def _validate(rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor) -> None:
    tensors = {"rewards": rewards, "values": values, "dones": dones, "last_value": last_value}
    for name, x in tensors.items():
        if not isinstance(x, Tensor):
            raise TypeError(f"gae: {name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _DTYPES:
            raise TypeError(f"gae: {name} must be float32 or float64, got {x.dtype} (convert with .float())")
    dtypes = {x.dtype for x in tensors.values()}
    if len(dtypes) > 1:
        found = ", ".join(f"{k}={x.dtype}" for k, x in tensors.items())
        raise TypeError(f"gae: all inputs must share one dtype, got {found}")
    devices = {x.device for x in tensors.values()}
    if len(devices) > 1:
        found = ", ".join(f"{k}={x.device}" for k, x in tensors.items())
        raise ValueError(f"gae: all inputs must be on one device, got {found}")
    for name in ("rewards", "values", "dones"):
        if tensors[name].dim() != 2:
            raise ValueError(f"gae: {name} must be 2-D (T, N), got shape {tuple(tensors[name].shape)}")
    if last_value.dim() != 1:
        raise ValueError(f"gae: last_value must be 1-D (N,), got shape {tuple(last_value.shape)}")
    if values.shape != rewards.shape or dones.shape != rewards.shape:
        raise ValueError(
            f"gae: rewards, values, dones must share one (T, N) shape, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(dones.shape)}"
        )
    if last_value.shape[0] != rewards.shape[1]:
        raise ValueError(
            f"gae: last_value must be (N,) = ({rewards.shape[1]},), got {tuple(last_value.shape)}"
        )
    if rewards.device.type == "npu" and rewards.dtype != torch.float32:
        raise TypeError("gae: the NPU kernel supports float32 only; convert with .float()")


def gae(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over T decisions of N environments, as one operator.

    ``dones[t, n] == 1`` means the episode of environment n ended at decision t: nothing after t is
    bootstrapped into t (fold time-limit truncation into the reward before calling). Runs the
    compiled kernel of the inputs' device (CPU C++, CUDA, AscendC on NPU), built on first use, or
    :func:`gae_reference` with a one-time :class:`KernelFallbackWarning` when none can be built.

    Args:
        rewards: (T, N) float32 (float64 on CPU/CUDA also works) reward of each decision.
        values: (T, N) critic value V_t of the observation each decision was taken from.
        dones: (T, N) 1.0 where the episode ended at that decision, else 0.0.
        last_value: (N,) critic value of the observation after the last decision (V_T).
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        ``(advantages, returns)``, both (T, N) contiguous tensors; ``returns = advantages + values``.

    Raises:
        TypeError: a non-tensor input, a non-float or mixed dtype, a non-real gamma/lam.
        ValueError: wrong ndim, mismatched shapes, mixed devices, gamma/lam outside [0, 1].
    """
    gamma = _check_coefficient("gamma", gamma)
    lam = _check_coefficient("lam", lam)
    _validate(rewards, values, dones, last_value)
    return torch.ops.diffpolicy.gae.default(rewards, values, dones, last_value, gamma, lam)
