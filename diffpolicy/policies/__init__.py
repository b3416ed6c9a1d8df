"""Policies: what acts in an environment and what PPO fine-tunes.

- :class:`DiffusionPolicy` (``policy.kind=diffusion``): encoders + 1-D U-Net denoiser + DDIM sampler.
- :class:`GaussianPolicy` (``policy.kind=gaussian``): a Gaussian MLP baseline with the same encoders.
- :class:`ResidualPolicy`: a frozen policy plus a per-step residual head (``algo=residual``'s artifact).
"""

from __future__ import annotations

from diffpolicy.config import PolicyConfig
from diffpolicy.policies.base import ActionQueue, Obs, PolicyBase, SampleOutput, normal_log_prob
from diffpolicy.policies.diffusion import DiffusionPolicy
from diffpolicy.policies.gaussian import GaussianPolicy
from diffpolicy.policies.residual import ResidualPolicy, StepActor

__all__ = [
    "ActionQueue",
    "DiffusionPolicy",
    "GaussianPolicy",
    "Obs",
    "PolicyBase",
    "ResidualPolicy",
    "SampleOutput",
    "StepActor",
    "make_policy",
    "normal_log_prob",
]


def make_policy(
    cfg: PolicyConfig, obs_spec: Obs, action_dim: int, *, text_backend: str = "minilm"
) -> PolicyBase:
    """Build the policy named by ``cfg.kind``: ``diffusion`` -> DiffusionPolicy, ``gaussian`` -> GaussianPolicy."""
    if cfg.kind == "diffusion":
        return DiffusionPolicy(cfg, obs_spec, action_dim, text_backend=text_backend)
    if cfg.kind == "gaussian":
        return GaussianPolicy(cfg, obs_spec, action_dim, text_backend=text_backend)
    if cfg.kind == "selector":
        raise ValueError(
            "policy.kind=selector is trained by pretrain and loaded by diffpolicy.hierarchy, not built here"
        )
    raise ValueError(f"policy.kind={cfg.kind!r} is not allowed; choose one of diffusion, gaussian")
