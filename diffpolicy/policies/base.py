"""What every policy shares: the sample record, exact Gaussian log-probs, the encoders and acting path
(:class:`PolicyBase`, whose :meth:`PolicyBase.plan` is the single acting path of training rollouts and
evaluation: one chunk per decision, the Te executed actions in env units plus the full
:class:`SampleOutput`), the receding-horizon :class:`ActionQueue`, and the bridge from environments:
:func:`to_policy_obs` (batched env observation -> policy observation) and :func:`act` (the one call through
which evaluation and training rollouts sample, as numpy actions).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from diffpolicy.config import PolicyConfig
from diffpolicy.encoders.fusion import POSITION_MIN_SPAN, ObservationEncoder
from diffpolicy.modalities import MODALITIES
from diffpolicy.normalizer import MinMaxNormalizer

Obs = Mapping[str, Any]
_HALF_LOG_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass
class SampleOutput:
    """One sampled chunk per observation (everything detached)."""

    actions: torch.Tensor
    """(B, Ta, Da) actions in env units (un-normalised)."""
    normalized: torch.Tensor
    """(B, Ta, Da) the same actions in normalised units (x_0)."""
    chain: torch.Tensor | None
    """(B, K'+1, Ta, Da) normalised latents x_{K'} .. x_0 of the fine-tuned steps (None unless asked)."""
    means: torch.Tensor | None
    """(B, K', Ta, Da) mean of each fine-tuned transition at sampling time (None unless asked)."""
    stds: torch.Tensor | None
    """Std of each fine-tuned transition, broadcastable to ``means``: (1, K', 1, 1) diffusion, (1, 1, Ta, Da)
    Gaussian (None unless asked)."""
    log_probs: torch.Tensor | None
    """(B, K') log-probability of each stored transition at sampling time (None unless asked)."""
    cond: torch.Tensor
    """(B, cond_dim) observation conditioning vector the chunk was sampled with."""


def normal_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2), the same formula as ``torch.distributions.Normal.log_prob``."""
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    return -((x - mean) ** 2) / (2 * std**2) - std.log() - _HALF_LOG_2PI


def correlated_normal_log_prob(
    x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float, corr: float
) -> torch.Tensor:
    """Joint log N(x; mean, Sigma) along the steps axis: x, mean (..., Te, Da) -> (..., Da), where each action
    dimension's Te steps share the covariance Sigma = std^2 ((1 - corr) I + corr 1 1^T) (equicorrelated noise:
    one draw held over the steps plus one per step). Sherman-Morrison gives the inverse and the determinant in
    closed form; corr = 0 is the sum over steps of :func:`normal_log_prob`. ``std`` broadcasts to x and is
    the same along the steps."""
    if not 0.0 <= corr < 1.0:
        raise ValueError(f"corr={corr} must lie in [0, 1)")
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    r = (x - mean) / std  # (..., Te, Da) in units of std
    te = x.shape[-2]
    denom = 1.0 - corr + corr * te
    quad = ((r**2).sum(-2) - corr / denom * r.sum(-2) ** 2) / (1.0 - corr)  # (..., Da)
    log_std = std.log().expand_as(mean).mean(-2)  # (..., Da): the std is one along the steps
    logdet = 2 * te * log_std + (te - 1) * math.log(1.0 - corr) + math.log(denom)
    return -0.5 * (quad + logdet) - te * _HALF_LOG_2PI


def held_normal_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """log N(u; 0, std^2) of the held offset u = mean over the steps of (x - mean): x, mean (..., Te, Da) ->
    (..., Da). The density of x = mean + std z 1 (one draw z per action dimension held over the Te steps: the
    corr = 1 limit of :func:`correlated_normal_log_prob`), taken on the offset alone, so a change of the mean
    that leaves its average over the steps unchanged leaves the log-probability unchanged (the chunk's shape
    is the deterministic chain's, which this likelihood does not see). ``std`` broadcasts to x and is the
    same along the steps."""
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    offset = (x - mean).mean(-2)  # (..., Da)
    return normal_log_prob(offset, torch.zeros_like(offset), std.expand_as(mean).mean(-2))


class PolicyBase(nn.Module):
    """What diffusion and Gaussian policies share: encoders, action normaliser, acting and reductions."""

    ft_steps: int
    """K': transitions per decision whose log-probabilities ``log_prob`` returns."""

    def __init__(self, cfg: PolicyConfig, obs_spec: Obs, action_dim: int, *, text_backend: str = "minilm"):
        super().__init__()
        self.cfg = cfg
        self.action_dim = action_dim
        self.horizon = cfg.horizon
        self.n_obs_steps = cfg.n_obs_steps
        self.n_action_steps = cfg.n_action_steps
        self.obs_encoder = ObservationEncoder(
            cfg.encoder, obs_spec, cfg.n_obs_steps, cfg.cond_dim, text_backend=text_backend
        )
        self.obs_encoder.grad_checkpointing = cfg.grad_checkpointing
        self.action_normalizer = MinMaxNormalizer(action_dim)
        self.set_freeze_encoders(cfg.freeze_encoders)

    # ------------------------------------------------------------------------------------------ setup
    def set_freeze_encoders(self, frozen: bool) -> None:
        """Switch requires_grad of all encoder weights (the MiniLM itself is always frozen)."""
        self.encoders_frozen = frozen
        self.obs_encoder.requires_grad_(not frozen)

    def fit_normalizers(
        self,
        actions: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        instructions: list[str] | None = None,
    ) -> None:
        """Fit min/max of actions (..., Da) and proprioception (..., Ds) from demonstration data, with
        predict-then-act of the labelled positions (..., 3 k) m (each range at least
        :data:`~diffpolicy.encoders.fusion.POSITION_MIN_SPAN`), and with ``encoder.text_standardize`` the
        instruction's standardisation to the distinct ``instructions``."""
        if actions is not None:
            self.action_normalizer.fit(actions)
        if state is not None and self.obs_encoder.state_dim:
            self.obs_encoder.state_normalizer.fit(state)
        if positions is not None and self.obs_encoder.position_points:
            self.obs_encoder.position_normalizer.fit(positions, min_span=POSITION_MIN_SPAN)
        if instructions:
            self.obs_encoder.fit_text(instructions)

    @property
    def device(self) -> torch.device:
        return self.action_normalizer.low.device

    @property
    def exec_slice(self) -> slice:
        """Executed actions of a chunk: [To - 1, To - 1 + Te) along Ta."""
        start = self.n_obs_steps - 1
        return slice(start, start + self.n_action_steps)

    def chunk_loss_weights(self) -> torch.Tensor | None:
        """(Ta,) weights of the BC loss along the chunk: 1 on :attr:`exec_slice`, ``policy.unexecuted_weight``
        elsewhere; None when that is 1 (the plain mean)."""
        if self.cfg.unexecuted_weight == 1.0:
            return None
        w = torch.full((self.horizon,), self.cfg.unexecuted_weight, device=self.device)
        w[self.exec_slice] = 1.0
        return w

    def chunk_loss(self, elements: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Per-element BC losses (B, Ta, Da) -> scalar: their mean, each chunk step weighted by
        :meth:`chunk_loss_weights` (divided by the weights' sum, so the scale stays that of a mean); ``mask``
        (B, Ta) bool leaves a window's unmasked steps out (weight 0) and divides by what is left."""
        w = self.chunk_loss_weights()
        if mask is None:
            if w is None:
                return elements.mean()
            return (elements.mean(dim=(0, 2)) * w.to(elements.dtype)).sum() / w.sum()
        weights = mask.to(elements.dtype) * (1.0 if w is None else w.to(elements.dtype))  # (B, Ta)
        return (elements.mean(dim=2) * weights).sum() / weights.sum().clamp_min(1e-12)

    # --------------------------------------------------------------------------------------- encoding
    def encode(
        self, obs: Obs, *, augment: bool | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Observation dict -> cond (B, cond_dim); random-shift augmentation defaults to training mode.
        ``positions`` (B, 3 k) m: predict-then-act's condition from these instead of the predicted ones."""
        augment = self.training if augment is None else augment
        if self.encoders_frozen:
            with torch.no_grad():
                return self.obs_encoder(obs, augment, positions=positions)
        return self.obs_encoder(obs, augment, positions=positions)

    def reduce_executed(self, log_prob: torch.Tensor) -> torch.Tensor:
        """(..., Ta, Da) elementwise log-probs -> (...) mean over the executed Te x Da part."""
        return log_prob[..., self.exec_slice, :].mean(dim=(-2, -1))

    # ----------------------------------------------------------------------------------------- acting
    def sample(
        self,
        obs: Obs | None = None,
        *,
        cond: torch.Tensor | None = None,
        deterministic: bool = False,
        return_chain: bool = False,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> SampleOutput:
        raise NotImplementedError  # pragma: no cover - implemented by subclasses

    def plan(
        self,
        obs: Obs,
        *,
        deterministic: bool = False,
        return_chain: bool = True,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, SampleOutput]:
        """One decision: sample a chunk and return its Te executed actions (B, Te, Da) (env units) + sample."""
        out = self.sample(
            obs, deterministic=deterministic, return_chain=return_chain, generator=generator, noise=noise
        )
        return out.actions[:, self.exec_slice], out


class ActionQueue:
    """Receding-horizon executor: replans with ``policy.plan`` every Te steps and hands out one action.

    ``act(obs) -> (B, Da)`` env-unit actions; ``last`` holds the latest :class:`SampleOutput`;
    ``reset()`` forces a replan at the next call (e.g. after environments reset).
    """

    def __init__(self, policy: PolicyBase, **plan_kwargs: Any) -> None:
        self.policy = policy
        self.plan_kwargs = plan_kwargs
        self.last: SampleOutput | None = None
        self._actions: torch.Tensor | None = None  # (B, Te, Da)
        self._next = 0

    def reset(self) -> None:
        self._actions, self._next = None, 0

    @property
    def needs_plan(self) -> bool:
        """True when the next ``act`` will sample a new chunk."""
        return self._actions is None or self._next >= self._actions.shape[1]

    def act(self, obs: Obs) -> torch.Tensor:
        if self.needs_plan:
            self._actions, self.last = self.policy.plan(obs, **self.plan_kwargs)
            self._next = 0
        action = self._actions[:, self._next]
        self._next += 1
        return action


def to_policy_obs(obs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Batched env observation -> policy observation with a To = 1 history axis.

    ``rgb`` (B, H, W, 3) uint8 -> (B, 1, H, W, 3); ``points`` (B, N, 3) and ``state`` (B, Ds) likewise gain
    the To axis as float32; ``instruction`` becomes a list of B strings.
    """
    out: dict[str, Any] = {}
    for key, value in obs.items():
        if key == "instruction":
            out[key] = [str(s) for s in value]
        elif key in MODALITIES:
            t = torch.as_tensor(np.asarray(value), device=device)
            out[key] = (t if key == "rgb" else t.float()).unsqueeze(1)
    return out


@torch.no_grad()
def act(
    policy: Any,
    obs: dict[str, Any],
    *,
    deterministic: bool = False,
    return_chain: bool = False,
    autocast: Callable[[], Any] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[np.ndarray, Any]:
    """The one sampling path of evaluation and training: observation -> the Te executed actions.

    Args:
        policy: a policy with ``plan(obs, deterministic=, return_chain=) -> (actions (B, Te, Da), out)``.
        obs: policy observation from :func:`to_policy_obs`.
        deterministic: every DDIM step's mean, no noise (the chain's own means under its eta; DDIM eta 0 only
            when the policy's eta is 0), instead of sampling the stochastic fine-tuned steps.
        return_chain: keep the chain (B, K'+1, Ta, Da) and its log-probabilities for PPO.
        autocast: a context factory (the device runtime's ``autocast``) for mixed precision.
        generator: source of the sampling noise (seeded per iteration for reproducible runs).

    Returns:
        ``(actions, out)``: actions (B, Te, Da) float32 numpy in env units, and the policy's sample output.
    """
    ctx = autocast() if autocast is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        actions, out = policy.plan(
            obs, deterministic=deterministic, return_chain=return_chain, generator=generator
        )
    return actions.float().cpu().numpy().astype(np.float32), out
