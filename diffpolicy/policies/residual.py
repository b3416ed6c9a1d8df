"""Base + residual: a frozen chunking policy corrected at every control step by a :class:`ResidualHead`.

:class:`ResidualPolicy` is the trained artifact of ``algo=residual`` (what ``evaluate``, ``export`` and
``serve`` load): the cloned policy, frozen, proposes a chunk of Te actions per decision noise-free (every
DDIM step's mean: its stochastic sampling was the largest source of return variance in residual rollouts), and
the head adds ``alpha * tanh(u)`` to each of those actions as it is executed.

:class:`StepActor` drives it over N environments that step one control step at a time: it keeps each
environment's current chunk and position, replans (for those environments only) when a chunk is used up or
an episode restarted, and builds the head's input. Training rollouts (:func:`diffpolicy.rl.residual.update
.collect_steps`) and evaluation (:func:`diffpolicy.evaluation.evaluate_steps`) both act through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from diffpolicy.models.residual import ResidualHead
from diffpolicy.policies.base import to_policy_obs


class ResidualPolicy(nn.Module):
    """A frozen base policy (``PolicyBase``) plus a trainable :class:`ResidualHead`.

    The base never receives gradients and stays in eval mode; ``parameters()`` of this module include the
    base's (frozen) ones, so optimisers should be given ``head.parameters()``.
    """

    acts_per_step = True
    """Acts one control step at a time (evaluation uses :func:`evaluate_steps`, not decision-level envs)."""

    def __init__(self, base: nn.Module, head: ResidualHead) -> None:
        super().__init__()
        self.base = base.eval().requires_grad_(False)
        self.head = head
        self.n_action_steps = base.n_action_steps
        self.action_dim = base.action_dim

    def train(self, mode: bool = True) -> ResidualPolicy:
        """Only the head changes mode; the base is always sampled in eval mode (no augmentation)."""
        self.training = mode
        self.head.train(mode)
        return self

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def uses_cond(self) -> bool:
        return self.head.cond_dim > 0

    def state_input(self, state: torch.Tensor) -> torch.Tensor:
        """(B, Ds) raw state -> (B, Ds) normalised with the base policy's state normaliser."""
        return self.base.obs_encoder.state_normalizer.normalize(state.float())

    @torch.no_grad()
    def plan(
        self, obs: dict[str, Any], generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Base chunk of one decision: obs (B, To, ...) -> actions (B, Te, Da) env units, cond (B, cond_dim).
        ``generator`` draws the chain's starting point x_K (the only randomness of deterministic DDIM)."""
        actions, out = self.base.plan(obs, deterministic=True, return_chain=False, generator=generator)
        return actions.float(), out.cond.float()


def _subset(obs: dict[str, Any], idx: np.ndarray) -> dict[str, Any]:
    """Rows ``idx`` of a batched env observation (numpy arrays, or a list for ``instruction``)."""
    return {k: [v[i] for i in idx] if k == "instruction" else np.asarray(v)[idx] for k, v in obs.items()}


class StepActor:
    """Per-environment chunk queues of a :class:`ResidualPolicy` over N control-step environments.

    Args:
        policy: the base + residual policy.
        num_envs: N.
        device: where the policy runs.
        autocast: context factory for the base's sampling (the runtime's ``autocast``).
    """

    def __init__(
        self,
        policy: ResidualPolicy,
        num_envs: int,
        device: torch.device,
        autocast: Callable[[], Any] | None = None,
    ) -> None:
        self.policy, self.num_envs, self.device = policy, num_envs, torch.device(device)
        self.autocast = autocast
        te, da = policy.n_action_steps, policy.action_dim
        self.chunk = torch.zeros(num_envs, te, da, device=self.device)  # (N, Te, Da) env units
        cond_dim = policy.head.cond_dim
        self.cond = torch.zeros(num_envs, cond_dim, device=self.device) if cond_dim else None
        self.pos = torch.full((num_envs,), te, dtype=torch.long, device=self.device)  # Te = needs a plan

    def reset(self, mask: np.ndarray | None = None) -> None:
        """Forget the chunks of the environments in ``mask`` (all when None): they replan on the next step."""
        te = self.policy.n_action_steps
        if mask is None:
            self.pos.fill_(te)
        else:
            self.pos[torch.as_tensor(np.asarray(mask, dtype=bool), device=self.device)] = te

    def _plan(
        self, obs: dict[str, Any], idx: np.ndarray, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = self.autocast() if self.autocast is not None else torch.autocast("cpu", enabled=False)
        with ctx:
            return self.policy.plan(to_policy_obs(_subset(obs, idx), self.device), generator)

    @torch.no_grad()
    def inputs(
        self, obs: dict[str, Any], generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Plan where needed and build the head's input: -> x (N, input_dim), base action (N, Da)."""
        need = np.flatnonzero((self.pos >= self.policy.n_action_steps).cpu().numpy())
        if need.size:
            actions, cond = self._plan(obs, need, generator)
            rows = torch.as_tensor(need, device=self.device)
            self.chunk[rows] = actions
            if self.cond is not None:
                self.cond[rows] = cond
            self.pos[rows] = 0
        base = self.chunk[torch.arange(self.num_envs, device=self.device), self.pos]  # (N, Da)
        state = torch.as_tensor(np.asarray(obs["state"]), device=self.device, dtype=torch.float32)
        x = self.policy.head.inputs(self.policy.state_input(state), base, self.pos, self.cond)
        return x, base

    @torch.no_grad()
    def peek(
        self, obs: dict[str, Any], idx: np.ndarray, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Head input for observations ``obs`` of environments ``idx`` (e.g. their final observation before a
        time-limit cut) as the actor would act on them next, without changing any queue: -> (len(idx), F)."""
        idx = np.asarray(idx)
        rows = torch.as_tensor(idx, device=self.device)
        pos = self.pos[rows].clone()
        base = self.chunk[rows, pos.clamp(max=self.policy.n_action_steps - 1)].clone()  # (n, Da)
        cond = self.cond[rows].clone() if self.cond is not None else None
        fresh = np.flatnonzero((pos >= self.policy.n_action_steps).cpu().numpy())
        if fresh.size:
            actions, new_cond = self._plan(obs, fresh, generator)
            base[fresh] = actions[:, 0]
            if cond is not None:
                cond[fresh] = new_cond
            pos[fresh] = 0
        state = torch.as_tensor(np.asarray(obs["state"]), device=self.device, dtype=torch.float32)
        return self.policy.head.inputs(self.policy.state_input(state), base, pos, cond)

    @torch.no_grad()
    def act(
        self,
        obs: dict[str, Any],
        *,
        deterministic: bool = False,
        generator: torch.Generator | None = None,
    ) -> tuple[np.ndarray, dict[str, torch.Tensor]]:
        """One control step for every environment.

        Returns:
            ``(actions, record)``: actions (N, Da) float32 numpy, env units; record holds ``x`` (N, F),
            ``u`` (N, Da), ``logprobs`` (N,) and ``base`` (N, Da) for the rollout buffer.
        """
        x, base = self.inputs(obs, generator)
        u, logp = self.policy.head.sample(x, deterministic=deterministic, generator=generator)
        actions = self.policy.head.correct(base, u)
        self.pos += 1
        return actions.cpu().numpy().astype(np.float32), {"x": x, "u": u, "logprobs": logp, "base": base}
