"""Gaussian MLP baseline with the same encoders and public methods as the diffusion policy.

The head maps cond (B, cond_dim) to the mean of a whole (Ta, Da) chunk in normalised units; the std is a
learned, state-independent parameter per chunk element, floored at ``min_std``. To share the PPO code path
with :class:`~diffpolicy.policies.diffusion.DiffusionPolicy`, a sample is exposed as a one-transition "chain" (K' = 1):
``chain[:, 0]`` is zeros (a placeholder) and ``chain[:, 1]`` is the sampled normalised chunk.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from diffpolicy.config import PolicyConfig, SamplingConfig
from diffpolicy.policies.base import Obs, PolicyBase, SampleOutput, normal_log_prob


class GaussianPolicy(PolicyBase):
    """Encoders + MLP head -> N(mean(obs), diag(std^2)) over the normalised (Ta, Da) chunk."""

    ft_steps = 1

    def __init__(
        self,
        cfg: PolicyConfig,
        obs_spec: Obs,
        action_dim: int,
        *,
        text_backend: str = "minilm",
        init_std: float = 0.5,
    ) -> None:
        super().__init__(cfg, obs_spec, action_dim, text_backend=text_backend)
        layers: list[nn.Module] = []
        d = cfg.cond_dim
        for h in cfg.gaussian_hidden:
            layers += [nn.Linear(d, h), nn.Mish()]
            d = h
        self.head = nn.Sequential(*layers, nn.Linear(d, cfg.horizon * action_dim))
        self.log_std = nn.Parameter(torch.full((cfg.horizon, action_dim), math.log(init_std)))
        self.min_std = SamplingConfig().min_std

    def set_sampling(self, *, ft_steps: int, eta: float, min_std: float, freeze: bool = True) -> None:
        """The learner's std floor (``algo.min_std``); a Gaussian has one transition (K' = 1) and no eta,
        so ``ft_steps``, ``eta`` and ``freeze`` are accepted for the diffusion policy's signature only."""
        del ft_steps, eta, freeze
        self.min_std = float(min_std)

    @property
    def sampling(self) -> dict[str, float | int]:
        """How chunks are sampled now: ``{"ft_steps": 1, "eta": 1.0, "min_std": ...}``."""
        return {"ft_steps": 1, "eta": 1.0, "min_std": float(self.min_std)}

    def mean_std(self, cond: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cond (B, cond_dim) -> mean (B, Ta, Da) fp32, std (Ta, Da) fp32 (>= min_std)."""
        mean = self.head(cond).float().view(-1, self.horizon, self.action_dim)
        return mean, self.log_std.float().exp().clamp_min(self.min_std)

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
        """Sample one chunk per observation; ``noise`` (B, Ta, Da) replaces the standard-normal draw."""
        with torch.no_grad():
            if cond is None:
                cond = self.encode(obs, augment=False)
            mean, std = self.mean_std(cond)
            if deterministic:
                x = mean
            else:
                if noise is None:
                    noise = torch.randn(mean.shape, generator=generator, device=mean.device)
                x = mean + std * noise.to(mean)
            out = SampleOutput(
                actions=self.action_normalizer.unnormalize(x), normalized=x, chain=None, means=None,
                stds=None, log_probs=None, cond=cond,
            )  # fmt: skip
            if return_chain:
                out.chain = torch.stack([torch.zeros_like(x), x], dim=1)  # (B, 2, Ta, Da)
                out.means = mean.unsqueeze(1)  # (B, 1, Ta, Da)
                out.stds = std.view(1, 1, *std.shape)
                out.log_probs = self.reduce_executed(normal_log_prob(x, mean, std)).unsqueeze(1)  # (B, 1)
        return out

    def log_prob(
        self, chain: torch.Tensor, obs: Obs | None = None, *, cond: torch.Tensor | None = None
    ) -> torch.Tensor:
        """chain (B, 2, Ta, Da) from :meth:`sample` -> (B, 1), averaged over the executed Te x Da part."""
        if cond is None:
            cond = self.encode(obs, augment=False)
        mean, std = self.mean_std(cond)
        return self.reduce_executed(normal_log_prob(chain[:, 1].float(), mean, std)).unsqueeze(1)

    def bc_loss(
        self,
        obs: Obs,
        actions: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
        draws: int = 1,
        return_cond: bool = False,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Negative log-likelihood of the normalised demonstration chunk (B, Ta, Da), averaged with its steps
        weighted by :meth:`chunk_loss`; scalar fp32 (and the condition (B, cond_dim) with ``return_cond``).
        The likelihood is exact: ``draws`` must be 1. ``positions``, ``mask``: as :meth:`DiffusionPolicy.bc_loss`."""
        if draws != 1:
            raise ValueError(f"draws={draws}: the Gaussian policy's loss has no noise to draw again; use 1")
        cond = self.encode(obs, positions=positions)
        mean, std = self.mean_std(cond)
        x = self.action_normalizer.normalize(actions.to(self.device, torch.float32))
        loss = self.chunk_loss(-normal_log_prob(x, mean, std), mask)
        return (loss, cond) if return_cond else loss
