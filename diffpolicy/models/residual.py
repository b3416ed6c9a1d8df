"""Residual head: a small Gaussian MLP that corrects a frozen policy's action at every control step.

ResiP (Ankile et al. 2024) and Policy Decorator (Yuan et al. 2024) fine-tune a cloned chunking policy by
learning a per-step correction on top of it instead of its weights. Here the correction is bounded:

    a_t = clip(a_base_t + alpha * tanh(u_t), -1, 1),   u_t ~ N(mu(x_t), diag(sigma^2))

in the environment's action units ([-1, 1] per dimension, Da = 7 for MujocoPick), so the executed action
never leaves an alpha-box around the base action. The mean network's last layer starts at exactly zero, so
at initialisation ``mu = 0`` and the deterministic action (``u = mu``) equals the base action bit for bit.
PPO treats ``u`` (before the tanh) as the action: its log-probability is a diagonal Gaussian's, summed over
Da; the tanh's Jacobian is the same for the old and the new policy and cancels in the ratio.

The input x_t (:meth:`ResidualHead.inputs`) is the normalised proprioceptive/privileged ``state`` (Ds), the
base action of this step (Da, env units), the position of the step in its executed chunk (one-hot, Te) and,
when the base policy sees pixels or points, its observation condition of the chunk's decision (cond_dim).
The value head :class:`ResidualCritic` reads the same input plus the episode's elapsed fraction of its time
limit (a time-limited task's value depends on the time left).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def _mlp(d_in: int, hidden: Sequence[int], d_out: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    d = d_in
    for h in hidden:
        layers += [nn.Linear(d, h), nn.Tanh()]
        d = h
    return nn.Sequential(*layers, nn.Linear(d, d_out))


class ResidualHead(nn.Module):
    """Gaussian correction u ~ N(mu(x), sigma^2) applied as ``alpha * tanh(u)``.

    Args:
        state_dim: Ds, width of the normalised state.
        action_dim: Da.
        n_action_steps: Te, positions within a chunk (one-hot input).
        cond_dim: width of the base policy's condition fed in (0 = none).
        hidden: hidden widths of the mean network (tanh activations).
        alpha: bound of the correction, env action units.
        init_std: initial sigma of u (learnable, per action dimension).

    ``max_std`` (a float attribute, inf by default; the learner sets it from what the base tolerates) caps
    sigma: every use of the std reads ``log_std`` clamped at log(max_std), so exploration never exceeds it
    however the optimiser moves ``log_std``.
    """

    def __init__(
        self,
        state_dim: int,
        action_dim: int,
        n_action_steps: int,
        *,
        cond_dim: int = 0,
        hidden: Sequence[int] = (256, 256),
        alpha: float = 0.1,
        init_std: float = 0.2,
    ) -> None:
        super().__init__()
        self.state_dim, self.action_dim, self.n_action_steps = state_dim, action_dim, n_action_steps
        self.cond_dim, self.alpha = cond_dim, float(alpha)
        self.input_dim = state_dim + action_dim + n_action_steps + cond_dim
        self.mean_net = _mlp(self.input_dim, hidden, action_dim)
        last = self.mean_net[-1]
        nn.init.zeros_(last.weight)  # mu = 0 exactly: the deterministic action is the base action
        nn.init.zeros_(last.bias)
        self.log_std = nn.Parameter(torch.full((action_dim,), math.log(init_std)))
        self.max_std = math.inf

    def inputs(
        self,
        state: torch.Tensor,
        base_action: torch.Tensor,
        phase: torch.Tensor,
        cond: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Concatenate the head's input x (B, input_dim).

        Args:
            state: (B, Ds) normalised state.
            base_action: (B, Da) the base policy's action of this step, env units.
            phase: (B,) int64 position of the step in its chunk, 0 .. Te-1.
            cond: (B, cond_dim) the base policy's condition of the chunk's decision (when cond_dim > 0).
        """
        onehot = torch.nn.functional.one_hot(phase.long(), self.n_action_steps).to(state.dtype)  # (B, Te)
        parts = [state.float(), base_action.float(), onehot]
        if self.cond_dim:
            if cond is None:
                raise ValueError(
                    f"this residual head reads the base condition ({self.cond_dim} wide); give cond"
                )
            parts.append(cond.float())
        return torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, input_dim) -> mean of u (B, Da), float32."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.mean_net(x.float())

    def capped_log_std(self) -> torch.Tensor:
        """(Da,) log sigma of u, clamped at log(``max_std``)."""
        if math.isinf(self.max_std):
            return self.log_std
        return self.log_std.clamp(max=math.log(self.max_std))

    @property
    def std(self) -> torch.Tensor:
        """(Da,) sigma of u (capped at ``max_std``)."""
        return self.capped_log_std().exp()

    def log_prob(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """log N(u; mu(x), sigma^2) summed over Da: x (B, input_dim), u (B, Da) -> (B,) float32."""
        mean, log_std = self(x), self.capped_log_std()
        z = (u.float() - mean) / log_std.exp()
        return (-0.5 * z.square() - log_std - _HALF_LOG_2PI).sum(-1)

    def entropy(self) -> torch.Tensor:
        """Entropy of the Gaussian over u (scalar; independent of x)."""
        return (self.capped_log_std() + 0.5 + _HALF_LOG_2PI).sum()

    def sample(
        self, x: torch.Tensor, *, deterministic: bool = False, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw u (its mean when deterministic) and its log-prob: x (B, input_dim) -> u (B, Da), logp (B,)."""
        mean, log_std = self(x), self.capped_log_std()
        std = log_std.exp()
        if deterministic:
            u = mean
        else:
            eps = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=mean.dtype)
            u = mean + std * eps
        z = (u - mean) / std
        logp = (-0.5 * z.square() - log_std - _HALF_LOG_2PI).sum(-1)
        return u, logp

    def correct(self, base_action: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """The executed action clip(base + alpha * tanh(u), -1, 1), (B, Da) env units."""
        return (base_action.float() + self.alpha * torch.tanh(u.float())).clamp(-1.0, 1.0)


class ResidualCritic(nn.Module):
    """V(x, elapsed): the residual head's input plus the elapsed fraction of the time limit -> (B,) float32."""

    def __init__(self, input_dim: int, hidden: Sequence[int] = (256, 256)) -> None:
        super().__init__()
        self.net = _mlp(input_dim + 1, hidden, 1)

    def forward(self, x: torch.Tensor, elapsed: torch.Tensor) -> torch.Tensor:
        """x (B, input_dim), elapsed (B,) in [0, 1] -> (B,)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.net(torch.cat([x.float(), elapsed.float()[:, None]], dim=-1)).squeeze(-1)
