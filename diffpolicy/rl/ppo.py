"""PPO losses over the fine-tuned denoising steps, as pure functions of tensors (fp32 throughout).

Symbols (DESIGN.md): B decisions in a minibatch, K' fine-tuned denoising steps, Ta action horizon,
Da action dimension. A log-probability ``logp[b, k]`` is that of the k-th fine-tuned DDIM transition of
decision b (k = K'-1 is the final step, producing x_0), averaged over the executed Te x Da entries. The PPO
ratio is taken per (decision, denoising step): r = exp(new_logp - old_logp), shape (B, K').

Two surrogates (``mode``) and two normalisations (``normalize``):

- ``mode="ppo"``: the standard clipped surrogate ``min(r A, clip(r, 1-eps, 1+eps) A)``. Its clipping is
  *conditional*: for A < 0 and r > 1+eps the unclipped term ``r A`` is the minimum, so an outlier ratio
  (noise in ``old_logp``, a stale sample) passes its full size ``r`` into the gradient.
- ``mode="unconditional"`` (StableDRL, Zhong et al. 2026, "Stabilizing Reinforcement Learning for Diffusion
  Language Models"): the surrogate is ``clip(r, 1-eps, 1+eps) A`` for every element, whatever the sign of
  A. The clip is an ordinary ``clamp``: inside the range its gradient is ``r * grad log pi`` (r <= 1+eps),
  outside it is 0. No sample can contribute more than (1+eps)|A| ||grad log pi||.
- ``normalize="mean"``: divide the summed surrogate by the element count B*K'.
- ``normalize="self"``: divide by the sum of the clipped ratios, detached:
  ``loss = -sum(clip(r) A) / sum(clip(r)).detach()`` (self-normalised importance weights).

Gradient bound (unconditional): let g_i = grad log pi_i of element i and w_i = clip(r_i) / S with
S = sum_j clip(r_j) (a constant for autograd). The gradient of the loss is
``-(1/S) sum_i 1[r_i in range] r_i A_i g_i = -sum_i 1[in range] w_i A_i g_i`` since r_i = clip(r_i) in the
range. The w_i are >= 0 and sum to 1, so the gradient lies in the convex hull of {A_i g_i} and {0}:
``||grad|| <= max|A| max||g||``. With ``normalize="mean"`` the weights are r_i / M <= (1+eps) / M, so
``||grad|| <= (1+eps) max|A| max||g||``. Both are bounded by ``(1+eps) max|A| max||g||`` whatever the ratios,
which :func:`grad_bound` computes; the standard PPO loss has no such bound (its gradient grows with max r).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

MODES = ("ppo", "unconditional")
NORMALIZATIONS = ("mean", "self")
REGULARIZERS = ("none", "kl", "bc")


def clip_schedule(
    eps_first: float, eps_final: float, ft_steps: int, device: torch.device | str | None = None
) -> Tensor:
    """Clip range per fine-tuned denoising step, linear from the first step to the final step.

    Args:
        eps_first: clip range of the first fine-tuned step (k = 0).
        eps_final: clip range of the final step (k = K'-1, the one producing x_0).
        ft_steps: K'.

    Returns:
        (K',) float32; with K' = 1 the single step is the final one and gets ``eps_final``.
    """
    if ft_steps <= 0:
        raise ValueError(f"ft_steps={ft_steps} must be > 0")
    if ft_steps == 1:
        return torch.full((1,), float(eps_final), dtype=torch.float32, device=device)
    return torch.linspace(float(eps_first), float(eps_final), ft_steps, dtype=torch.float32, device=device)


def _clip_range(clip_eps: Tensor | float, like: Tensor) -> Tensor:
    """clip_eps as a float32 tensor broadcastable to ``like`` (B, K'): (K',) -> (1, K')."""
    eps = torch.as_tensor(clip_eps, dtype=torch.float32, device=like.device)
    return eps.view(1, -1) if eps.dim() == 1 else eps


def approx_kl(new_logp: Tensor, old_logp: Tensor) -> Tensor:
    """Approximate KL(old || new) = mean((r - 1) - log r), r = exp(new - old); >= 0, 0 at equality."""
    log_ratio = new_logp.float() - old_logp.float()
    return (torch.expm1(log_ratio) - log_ratio).mean()


def clipped_surrogate(
    log_ratio: Tensor, adv: Tensor, clip_eps: Tensor | float, *, mode: str = "ppo"
) -> tuple[Tensor, Tensor]:
    """PPO's surrogate per element, the one every learner uses (chain, residual, FPO).

    Args:
        log_ratio: log r = log pi_new - log pi_old, any shape (with grad).
        adv: advantages broadcastable to ``log_ratio`` (detached).
        clip_eps: the clip range, a float or a tensor broadcastable to ``log_ratio``.
        mode: ``"ppo"``, min(r A, clip(r) A) | ``"unconditional"``, clip(r) A.

    Returns:
        ``(surrogate, clipped)``, both shaped like ``log_ratio``: the surrogate to maximise and the clipped
        ratio. clip(exp(x), lo, hi) is taken as exp(clip(x, log lo, log hi)): the same value and gradient
        (exp(x) inside, 0 outside), and it never overflows however wild the ratio is.
    """
    eps = torch.as_tensor(clip_eps, dtype=torch.float32, device=log_ratio.device)
    clipped = torch.exp(torch.clamp(log_ratio, torch.log1p(-eps), torch.log1p(eps)))
    if mode == "unconditional":
        return clipped * adv, clipped
    return torch.minimum(torch.exp(log_ratio) * adv, clipped * adv), clipped


def policy_loss(
    new_logp: Tensor,
    old_logp: Tensor,
    adv: Tensor,
    clip_eps: Tensor | float,
    *,
    mode: str = "ppo",
    normalize: str = "mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss per (decision, denoising step); see the module docstring.

    Args:
        new_logp: (B, K') log-probs of the stored chain transitions under the current policy (with grad).
        old_logp: (B, K') log-probs at rollout time (no grad).
        adv: (B,) advantage per decision, broadcast over the K' steps, or (B, K') per step (e.g. after
            :func:`diffpolicy.rl.advantages.denoise_discount`).
        clip_eps: (K',) clip range per step (:func:`clip_schedule`) or one float.
        mode: ``"ppo"`` (min of clipped and unclipped surrogate) | ``"unconditional"`` (always clipped).
        normalize: ``"mean"`` (divide by B*K') | ``"self"`` (divide by the detached sum of clipped ratios).

    Returns:
        ``(loss, info)``: loss a float32 scalar to minimise; info holds detached scalars ``approx_kl``,
        ``clipfrac`` (fraction of elements with |r - 1| > eps), ``ratio_mean`` and ``ratio_max``.
    """
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not allowed; choose one of {', '.join(MODES)}")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize={normalize!r} is not allowed; choose one of {', '.join(NORMALIZATIONS)}")
    new = new_logp.float()
    old = old_logp.float().detach()
    if new.shape != old.shape or new.dim() != 2:
        raise ValueError(f"new_logp {tuple(new.shape)} and old_logp {tuple(old.shape)} must both be (B, K')")
    a = adv.float().detach()
    if a.dim() == 1:
        a = a[:, None]  # (B, 1), broadcast over K'
    eps = _clip_range(clip_eps, new)  # (1, K') or scalar
    log_ratio = new - old  # (B, K')
    surrogate, clipped = clipped_surrogate(log_ratio, a, eps, mode=mode)  # (B, K') each
    if normalize == "mean":
        loss = -surrogate.mean()
    else:
        loss = -surrogate.sum() / clipped.detach().sum()
    with torch.no_grad():
        ratio = torch.exp(log_ratio)
        info = {
            "approx_kl": (torch.expm1(log_ratio) - log_ratio).mean(),
            "clipfrac": ((ratio - 1.0).abs() > eps).float().mean(),
            "ratio_mean": ratio.mean(),
            "ratio_max": ratio.max(),
        }
    return loss, info


def grad_bound(adv: Tensor, per_sample_grad_norm: Tensor | float, clip_eps: Tensor | float) -> Tensor:
    """The bound (1 + max eps) * max|A| * max||g|| on the gradient norm of the unconditional loss.

    Args:
        adv: advantages (any shape).
        per_sample_grad_norm: norms of grad log pi of every (decision, step) element, or their max.
        clip_eps: clip range(s).
    """
    eps = torch.as_tensor(clip_eps, dtype=torch.float32).max()
    g = torch.as_tensor(per_sample_grad_norm, dtype=torch.float32).max()
    return (1.0 + eps) * adv.detach().float().abs().max().cpu() * g.cpu()


def value_loss(
    values: Tensor, returns: Tensor, old_values: Tensor | None = None, clip: float | None = None
) -> Tensor:
    """Critic loss 0.5 * mean((V - R)^2), optionally clipped around the rollout-time values.

    Args:
        values: (B,) current critic values.
        returns: (B,) targets (GAE returns or episode returns).
        old_values: (B,) values at rollout time; with ``clip`` the loss is
            0.5 * mean(max((V - R)^2, (V_old + clamp(V - V_old, -clip, clip) - R)^2)).
        clip: value clip range (None = unclipped).
    """
    v = values.float()
    r = returns.float().detach()
    err = (v - r).square()
    if clip is None or old_values is None:
        return 0.5 * err.mean()
    old = old_values.float().detach()
    v_clipped = old + torch.clamp(v - old, -clip, clip)
    return 0.5 * torch.maximum(err, (v_clipped - r).square()).mean()


def regularizer(
    kind: str,
    *,
    means: Tensor | None = None,
    ref_means: Tensor | None = None,
    stds: Tensor | float | None = None,
    bc_loss: Callable[[], Tensor] | None = None,
) -> Tensor:
    """Pull toward the pre-trained policy: KL of its per-step Gaussians, behaviour cloning, or nothing.

    Args:
        kind: ``"kl"``: KL(pi || pi_ref) of the per-step Gaussians, which share their std, in closed form
            ``(mu - mu_ref)^2 / (2 sigma^2)`` averaged over every element. ``"bc"``: ``bc_loss()`` when given
            (e.g. the DDPM loss on demonstrations), else the MSE between ``means`` and ``ref_means``.
            ``"none"``: a zero scalar.
        means: (B, K', Ta, Da) step means of the current policy (with grad).
        ref_means: (B, K', Ta, Da) step means of the frozen pre-trained policy on the same latents.
        stds: std of each step, broadcastable to ``means`` (e.g. (1, K', 1, 1)); needed for ``"kl"``.
        bc_loss: callable returning a scalar loss, used by ``"bc"`` instead of the MSE.

    Returns:
        float32 scalar.
    """
    if kind not in REGULARIZERS:
        raise ValueError(f"kind={kind!r} is not allowed; choose one of {', '.join(REGULARIZERS)}")
    if kind == "none":
        device = means.device if means is not None else None
        return torch.zeros((), dtype=torch.float32, device=device)
    if kind == "bc" and bc_loss is not None:
        return bc_loss().float()
    if means is None or ref_means is None:
        raise ValueError(f"regularizer kind={kind!r} needs means and ref_means (or bc_loss for 'bc')")
    sq = (means.float() - ref_means.float().detach()).square()  # (B, K', Ta, Da)
    if kind == "bc":
        return sq.mean()
    if stds is None:
        raise ValueError("regularizer kind='kl' needs stds")
    var = torch.as_tensor(stds, dtype=torch.float32, device=sq.device).square()
    return (sq / (2.0 * var)).mean()
