"""A tiny base + residual checkpoint (obstacle_reach) for the export and serve tests, written the way
``algo=residual`` writes one, without training."""

from __future__ import annotations

from pathlib import Path

import torch

from diffpolicy.cli import compose
from diffpolicy.models.residual import ResidualHead
from diffpolicy.policy_io import build_policy, env_spec, save_policy


def residual_checkpoint(root: Path, *, cond: bool = False, alpha: float = 0.3) -> Path:
    """Untrained tiny base (fitted normalisers) + a head with a non-zero last layer; ``cond`` makes the head
    read the base's condition (cond_dim = policy.cond_dim). Returns the checkpoint root."""
    from test_train import TINY_POLICY, TINY_RUN  # the tiny obstacle_reach run of the PPO tests

    cfg = compose("train", [*TINY_RUN, *TINY_POLICY])
    spec, da = env_spec(cfg.env)
    torch.manual_seed(0)
    base = build_policy(cfg.policy, spec, da)
    ds = spec["state"][-1]
    base.fit_normalizers(actions=torch.rand(64, da) * 1.6 - 0.8, state=torch.rand(64, ds) * 1.4 - 0.6)
    cond_dim = cfg.policy.cond_dim if cond else 0
    head = ResidualHead(ds, da, cfg.policy.n_action_steps, cond_dim=cond_dim, hidden=(16, 16), alpha=alpha)
    torch.nn.init.normal_(head.mean_net[-1].weight, std=0.5)
    torch.nn.init.normal_(head.mean_net[-1].bias, std=0.2)
    desc = {"alpha": head.alpha, "hidden": [16, 16], "cond_dim": cond_dim}
    save_policy(
        root, 1, base, env_cfg=cfg.env, policy_cfg=cfg.policy,
        extra_state={"residual": head.state_dict()}, extra={"residual": desc},
    )  # fmt: skip
    return root
