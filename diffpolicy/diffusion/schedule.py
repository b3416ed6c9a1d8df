"""Noise schedule (squaredcos_cap_v2), DDPM training loss and the precomputed DDIM step coefficients.

Every denoiser returns eps (a U-Net whose trunk predicts the clean chunk converts it, ``prediction=sample``;
the DDPM loss then scores that x0). Actions live in normalised units ([-1, 1]). One DDIM step from x_k (at
training timestep t_k) to x_{k-1} (at t_{k-1}, alpha_bar = 1 after the last step) is the Gaussian

    x0_hat = clip((x_k - sqrt(1 - a_t) eps) / sqrt(a_t), +-clip_sample)
    eps'   = (x_k - sqrt(a_t) x0_hat) / sqrt(1 - a_t)             (noise re-derived from the clipped x0)
    mean   = sqrt(a_prev) x0_hat + sqrt(1 - a_prev - sigma^2) eps'
    sigma  = eta sqrt((1 - a_prev) / (1 - a_t)) sqrt(1 - a_t / a_prev)

which simplifies to ``mean = c_x x_k + c_x0 x0_hat``. The std of a step is ``sigma`` for the K - K' base
steps and ``noise_scale * max(sigma, min_std)`` for the K' fine-tuned steps (DPPO's with ``noise_scale`` 1;
a smaller scale explores closer to the means, which stay as they are). :func:`ddim_step_mean_std` is the
single implementation used by the sampling loop and by ``log_prob``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


def cosine_betas(train_timesteps: int, max_beta: float = 0.999) -> torch.Tensor:
    """squaredcos_cap_v2 betas (Nichol & Dhariwal), float64 (T,)."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    T = train_timesteps
    betas = [min(1 - alpha_bar((i + 1) / T) / alpha_bar(i / T), max_beta) for i in range(T)]
    return torch.tensor(betas, dtype=torch.float64)


class StepCoefs(NamedTuple):
    """Coefficients of one DDIM step (floats, or tensors broadcastable to (M, Ta, Da))."""

    inv_sqrt_a: float | torch.Tensor
    """1 / sqrt(a_t)."""
    eps_to_x0: float | torch.Tensor
    """sqrt(1 - a_t) / sqrt(a_t)."""
    c_x: float | torch.Tensor
    """Weight of x_k in the mean: sqrt(1 - a_prev - sigma^2) / sqrt(1 - a_t)."""
    c_x0: float | torch.Tensor
    """Weight of the clipped x0_hat in the mean: sqrt(a_prev) - c_x sqrt(a_t)."""
    std: float | torch.Tensor
    """Std of the step's Gaussian (after the min_std floor on fine-tuned steps)."""


def ddim_step_mean_std(
    x: torch.Tensor,
    eps: torch.Tensor,
    coefs: StepCoefs,
    clip_sample: float,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, float | torch.Tensor]:
    """Gaussian of one DDIM step: x_k (M, Ta, Da), eps_theta (M, Ta, Da) -> (mean (M, Ta, Da), std).

    With ``out=(x0_buf, mean_buf)`` (float coefficients only) the step is computed in place into the given
    buffers without allocating (sampling loop); otherwise out of place, differentiable (log-prob).
    """
    if out is None:
        x0 = (x * coefs.inv_sqrt_a - eps * coefs.eps_to_x0).clamp(-clip_sample, clip_sample)
        return x * coefs.c_x + x0 * coefs.c_x0, coefs.std
    x0, mean = out
    torch.mul(x, coefs.inv_sqrt_a, out=x0)
    x0.add_(eps, alpha=-coefs.eps_to_x0)
    x0.clamp_(-clip_sample, clip_sample)
    torch.mul(x, coefs.c_x, out=mean)
    mean.add_(x0, alpha=coefs.c_x0)
    return mean, coefs.std


class NoiseSchedule(nn.Module):
    """The DDPM schedule and its K-step DDIM sub-schedule, all precomputed as (non-persistent) buffers.

    Buffers: ``alphas_cumprod`` (T,), ``timesteps`` (K,) long (descending, t_K first), and per DDIM step
    (K,) float32: ``inv_sqrt_a``, ``eps_to_x0``, ``c_x``, ``c_x0``, ``sigma`` (eta-scaled) and ``std``
    (= sigma on the first K - K' steps, max(sigma, min_std) on the last K' steps). Buffers are derived from
    the config, so they are left out of the state_dict.
    """

    def __init__(
        self,
        train_timesteps: int = 100,
        ddim_steps: int = 10,
        ft_steps: int = 5,
        eta: float = 1.0,
        min_std: float = 0.1,
        clip_sample: float = 1.0,
        noise_scale: float = 1.0,
    ) -> None:
        super().__init__()
        if not 0 < ft_steps <= ddim_steps <= train_timesteps:
            raise ValueError(f"need 0 < ft_steps={ft_steps} <= ddim_steps={ddim_steps} <= {train_timesteps}")
        if not noise_scale > 0:
            raise ValueError(f"noise_scale={noise_scale} must be > 0")
        self.train_timesteps = train_timesteps
        self.ddim_steps = ddim_steps
        self.ft_steps = ft_steps
        self.eta = eta
        self.min_std = min_std
        self.clip_sample = clip_sample
        self.noise_scale = noise_scale
        ac = torch.cumprod(1.0 - cosine_betas(train_timesteps), dim=0)  # (T,) float64
        ratio = train_timesteps // ddim_steps
        ts = torch.arange(ddim_steps - 1, -1, -1, dtype=torch.long) * ratio  # (K,) "leading" spacing
        a_t = ac[ts]
        a_prev = torch.cat([ac[ts[1:]], torch.ones(1, dtype=torch.float64)])  # alpha_bar = 1 after the end
        sigma = eta * ((1 - a_prev) / (1 - a_t)).sqrt() * (1 - a_t / a_prev).sqrt()
        c_x = (1 - a_prev - sigma**2).clamp_min(0).sqrt() / (1 - a_t).sqrt()
        std = sigma.clone()
        std[ddim_steps - ft_steps :] = std[ddim_steps - ft_steps :].clamp_min(min_std) * noise_scale
        f32 = dict(dtype=torch.float32)
        self.register_buffer("alphas_cumprod", ac.to(**f32), persistent=False)
        self.register_buffer("timesteps", ts, persistent=False)
        self.register_buffer("inv_sqrt_a", (1 / a_t.sqrt()).to(**f32), persistent=False)
        self.register_buffer("eps_to_x0", ((1 - a_t).sqrt() / a_t.sqrt()).to(**f32), persistent=False)
        self.register_buffer("c_x", c_x.to(**f32), persistent=False)
        self.register_buffer("c_x0", (a_prev.sqrt() - c_x * a_t.sqrt()).to(**f32), persistent=False)
        self.register_buffer("sigma", sigma.to(**f32), persistent=False)
        self.register_buffer("std", std.to(**f32), persistent=False)
        # Python floats of the same float32 values for the allocation-free sampling loop.
        self._float_coefs = [
            StepCoefs(
                *(float(getattr(self, n)[i]) for n in ("inv_sqrt_a", "eps_to_x0", "c_x", "c_x0", "std"))
            )
            for i in range(ddim_steps)
        ]

    def with_natural_std(self, floor: float = 1e-3) -> NoiseSchedule:
        """A copy whose steps draw with their own eta-scaled std floored at ``floor``, and none at the last step
        (DPPO's deterministic evaluation: the chain's natural stds, no exploration floor ``min_std`` or
        ``noise_scale``, no final-step noise); everything else (means, timesteps) the same."""
        twin = NoiseSchedule(
            self.train_timesteps, self.ddim_steps, self.ft_steps, self.eta, 0.0, self.clip_sample
        ).to(self.std.device)
        std = self.sigma.clamp_min(floor)
        std[-1] = 0.0
        twin.std = std
        twin._float_coefs = [c._replace(std=float(v)) for c, v in zip(twin._float_coefs, std.tolist())]
        return twin

    def with_eta(self, eta: float) -> NoiseSchedule:
        """A copy with another eta, the same timesteps, K', floor, noise scale and clipping (``eta=0`` with
        every step's mean taken is DDIM's deterministic sampler: the ``ddim`` protocol)."""
        return NoiseSchedule(
            self.train_timesteps, self.ddim_steps, self.ft_steps, eta, self.min_std, self.clip_sample,
            self.noise_scale,
        ).to(self.std.device)  # fmt: skip

    @property
    def first_ft_step(self) -> int:
        """Index (in sampling order 0..K-1) of the first fine-tuned step, K - K'."""
        return self.ddim_steps - self.ft_steps

    def step_coefs(self, idx: int | torch.Tensor) -> StepCoefs:
        """Coefficients of DDIM step ``idx`` (sampling order): floats for an int, (M, 1, 1) for an (M,) tensor."""
        if isinstance(idx, int):
            return self._float_coefs[idx]
        names = ("inv_sqrt_a", "eps_to_x0", "c_x", "c_x0", "std")
        return StepCoefs(*(getattr(self, n)[idx].view(-1, 1, 1) for n in names))


def ddpm_loss(
    model: nn.Module,
    x0: torch.Tensor,
    cond: torch.Tensor,
    schedule: NoiseSchedule,
    *,
    generator: torch.Generator | None = None,
    t: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """DDPM loss: x0 (B, Ta, Da) normalised actions, cond (B, cond_dim) -> scalar.

    Draws t ~ U{0..T-1} and eps ~ N(0, I) per sample (or takes the given ``t`` (B,) and ``noise``, e.g. to
    compare conditions on the same draw), noises ``x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps`` and returns the
    mean squared error of ``model(x_t, t, cond)`` against eps (in float32); ``reduction="none"`` returns the
    squared errors themselves (B, Ta, Da), for a caller that weighs the chunk's steps.

    A model whose trunk predicts the clean chunk (``model.prediction == "sample"``; it still returns eps) is
    scored on what it predicts, the squared error of x0_hat against x0 (Chi et al.'s ``sample`` target): the
    eps error times ``sqrt((1 - a_t) / a_t)``, since ``eps_hat - eps = sqrt(a_t / (1 - a_t)) (x0 - x0_hat)``.
    In eps units the low-noise steps would weigh up to a / (1 - a) ~ 1600x the others, and such a BC fits its
    demonstrations' chunks 10x worse (docs/experiments.md, 2026-12-07 fourth session).
    """
    B = x0.shape[0]
    if t is None:
        t = torch.randint(0, schedule.train_timesteps, (B,), device=x0.device, generator=generator)
    if noise is None:
        noise = torch.randn(x0.shape, device=x0.device, dtype=x0.dtype, generator=generator)
    a = schedule.alphas_cumprod[t].view(B, 1, 1)
    x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise
    eps = model(x_t, t, cond).float()
    if getattr(model, "prediction", "epsilon") == "sample":
        err = (eps - noise.float()) * ((1 - a) / a).sqrt().float()  # (B, Ta, Da) = x0 - x0_hat
        return F.mse_loss(err, torch.zeros_like(err), reduction=reduction)
    return F.mse_loss(eps, noise.float(), reduction=reduction)
