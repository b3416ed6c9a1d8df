"""Value head on the observation conditioning vector (fp32, outside autocast)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class Critic(nn.Module):
    """V(obs) from cond (B, cond_dim) -> (B,) float32.

    An MLP (Linear-Mish per hidden width, then Linear to 1). It always runs in float32 with autocast
    disabled (DESIGN: the value head stays fp32). Feed it ``cond.detach()`` to keep value gradients out of
    the policy's encoders.
    """

    def __init__(self, cond_dim: int, hidden: Sequence[int] = (256, 256)) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        d = cond_dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.Mish()]
            d = h
        self.net = nn.Sequential(*layers, nn.Linear(d, 1))

    def forward(self, cond: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=cond.device.type, enabled=False):
            return self.net(cond.float()).squeeze(-1)
