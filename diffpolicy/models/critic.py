"""Value head on the observation conditioning vector or on the normalised state (fp32, outside autocast)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import nn

CRITIC_INPUTS = ("cond", "state")


class Critic(nn.Module):
    """V(obs) -> (B,) float32 from the policy's condition or from the normalised state.

    ``source="cond"``: reads cond (B, cond_dim), the policy's fused observation vector (feed it
    ``cond.detach()`` to keep value gradients out of the policy's encoders). ``source="state"``: reads the
    latest state (B, Ds), or (B, To, Ds) of which the last step, in env units through a copy of the policy's
    state normaliser - DPPO's Gym critic (cond_steps 1), which sees the raw normalised observation rather
    than features trained for imitation. An MLP (Linear-Mish per hidden width, then Linear to 1) that always runs in float32 with
    autocast disabled (DESIGN: the value head stays fp32).
    """

    def __init__(
        self,
        in_dim: int,
        hidden: Sequence[int] = (256, 256),
        *,
        source: str = "cond",
        state_normalizer: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if source not in CRITIC_INPUTS:
            raise ValueError(f"critic input {source!r} is not one of {CRITIC_INPUTS}")
        if source == "state" and state_normalizer is None:
            raise ValueError("a critic on the state needs the policy's state normaliser")
        self.source = source
        self.state_normalizer = copy.deepcopy(state_normalizer) if source == "state" else None
        layers: list[nn.Module] = []
        d = in_dim
        for h in hidden:
            layers += [nn.Linear(d, h), nn.Mish()]
            d = h
        self.net = nn.Sequential(*layers, nn.Linear(d, 1))

    def forward(self, cond: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        with torch.autocast(device_type=cond.device.type, enabled=False):
            if self.state_normalizer is None:
                x = cond
            else:
                if state is None:
                    raise ValueError("this critic reads the state: pass it")
                x = self.state_normalizer.normalize(state[:, -1] if state.dim() == 3 else state)
            return self.net(x.float()).squeeze(-1)


def make_critic(policy: nn.Module, cond_dim: int, source: str, hidden: Sequence[int]) -> Critic:
    """The critic of ``policy`` reading ``source`` (one of :data:`CRITIC_INPUTS`)."""
    if source == "cond":
        return Critic(cond_dim, hidden)
    enc = policy.obs_encoder
    if not getattr(enc, "state_dim", 0):
        raise ValueError("algo.critic_input=state needs a policy with a state observation")
    return Critic(enc.state_dim, hidden, source="state", state_normalizer=enc.state_normalizer)
