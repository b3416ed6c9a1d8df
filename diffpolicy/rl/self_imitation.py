"""Self-imitation beside the PPO loss (Oh et al. 2018, "Self-Imitation Learning"), for the chain learner.

PPO follows an advantage that its clip and KL bounds keep small, and on a sparse task the few decisions that
led to a success are averaged with hundreds of others in every minibatch: on the pick task an iteration held
3-10 successes and the update moved the chain about as far with shuffled advantages as with real ones
(docs/experiments.md, 2026-12-03). Self-imitation keeps what the rollouts found. Every decision whose return
beat the critic's value at rollout time is kept (condition, stored chain, return; a ring of
``algo.sil_capacity``); each PPO minibatch step also draws ``algo.sil_batch`` kept decisions with probability
proportional to their excess (R - V)+ under the current critic and imitates them (``algo.sil_coef``): by
raising their chains' exact log-probability (``algo.sil_loss=chain``) or by the diffusion policy's own BC
loss on the chunks they sampled (``denoise``, at the fine-tuned steps' timesteps), while the critic's value
of them is pulled up to R (``algo.sil_value_coef``, the paper's beta). A decision the critic has caught up
with is no longer drawn. The return R is the GAE value target of the decision (the lambda-return,
bootstrapped where the rollout cut an episode), in the critic's units.

The kept decisions are stored as the condition the frozen encoders gave them (as the rollout buffer stores
it), so the term needs ``algo.finetune_encoders=false``, and a critic (``algo.advantage=gae``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class SelfImitation:
    """A ring of kept decisions: conditions (C, cond_dim), chains (C, K'+1, Ta, Da), returns (C,) and, when
    the critic reads the state, states (C, Ds)."""

    def __init__(
        self,
        capacity: int,
        cond_dim: int,
        chain_shape: tuple[int, ...],
        state_dim: int | None,
        device: torch.device | str = "cpu",
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity={capacity} must be > 0")
        self.capacity = capacity
        self.cond = torch.zeros(capacity, cond_dim, device=device)
        self.chains = torch.zeros(capacity, *chain_shape, device=device)
        self.returns = torch.zeros(capacity, device=device)
        self.state = None if state_dim is None else torch.zeros(capacity, state_dim, device=device)
        self.size = 0
        self.next = 0
        self.kept = 0
        """Decisions kept since the start (the ring holds the last ``capacity`` of them)."""

    def add(
        self,
        cond: Tensor,
        chains: Tensor,
        returns: Tensor,
        values: Tensor,
        valid: Tensor,
        state: Tensor | None = None,
    ) -> int:
        """Keep the valid decisions whose return beat their value. ``returns``, ``values`` and ``valid`` share
        one shape, (T, N) or (M,); the other inputs lead with it. Returns how many were kept."""
        lead = returns.dim()

        def flat(x: Tensor) -> Tensor:  # (T, N, ...) -> (T N, ...)
            return x.reshape(returns.numel(), *x.shape[lead:])

        ret = returns.reshape(-1)
        keep = (valid.reshape(-1) > 0.5) & (ret > values.reshape(-1))  # (M,)
        idx = keep.nonzero().squeeze(1)
        if idx.numel() == 0:
            return 0
        idx = idx[-self.capacity :]  # more than fit: the newest
        n = idx.numel()
        slots = (self.next + torch.arange(n, device=self.returns.device)) % self.capacity  # (n,)
        self.cond[slots] = flat(cond)[idx].float()
        self.chains[slots] = flat(chains)[idx].float()
        self.returns[slots] = ret[idx].float()
        if self.state is not None:
            if state is None:
                raise ValueError(
                    "this self-imitation buffer keeps states (the critic reads them); none given"
                )
            self.state[slots] = flat(state)[idx].float()
        self.next = int((self.next + n) % self.capacity)
        self.size = min(self.capacity, self.size + n)
        self.kept += n
        return n

    @torch.no_grad()
    def excess(self, critic: nn.Module) -> Tensor:
        """(R - V)+ of every kept decision under ``critic`` now: (size,)."""
        state = None if self.state is None else self.state[: self.size]
        values = critic(self.cond[: self.size], state).float().reshape(-1)
        return (self.returns[: self.size] - values).clamp_min(0)

    def draw(self, critic: nn.Module, n: int, generator: torch.Generator) -> dict[str, Tensor] | None:
        """``n`` kept decisions drawn with replacement in proportion to their excess under ``critic``; None
        when nothing is kept or the critic values every kept decision at least at its return."""
        if self.size == 0:
            return None
        weights = self.excess(critic)
        if not bool((weights > 0).any()):
            return None
        idx = torch.multinomial(weights.cpu(), n, replacement=True, generator=generator).to(weights.device)
        batch = {"cond": self.cond[idx], "chains": self.chains[idx], "returns": self.returns[idx]}
        if self.state is not None:
            batch["state"] = self.state[idx]
        return batch

    def state_dict(self) -> dict[str, Any]:
        """The kept decisions (the filled part) and the ring's position, for checkpoints."""
        out: dict[str, Any] = {
            "cond": self.cond[: self.size].clone(),
            "chains": self.chains[: self.size].clone(),
            "returns": self.returns[: self.size].clone(),
            "next": self.next,
            "kept": self.kept,
        }
        if self.state is not None:
            out["state"] = self.state[: self.size].clone()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        size = int(state["returns"].shape[0])
        if size > self.capacity:
            raise ValueError(
                f"a checkpoint keeps {size} decisions, more than algo.sil_capacity={self.capacity}"
            )
        self.size, self.next, self.kept = size, int(state["next"]) % self.capacity, int(state["kept"])
        self.cond[:size] = state["cond"].to(self.cond.device)
        self.chains[:size] = state["chains"].to(self.chains.device)
        self.returns[:size] = state["returns"].to(self.returns.device)
        if self.state is not None:
            self.state[:size] = state["state"].to(self.state.device)


def self_imitation_loss(
    policy: nn.Module,
    critic: nn.Module,
    batch: dict[str, Tensor],
    value_coef: float,
    *,
    form: str = "chain",
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, policy part, value part) on drawn kept decisions; the draw already weighs each decision by its
    excess, so the policy part is the excess-weighted imitation of what was kept.

    The policy part by ``form``: ``chain``, -mean log pi(chain) over the K' transitions (each the executed
    Te x Da average, fp32); ``denoise``, the diffusion policy's BC loss on the kept chunks x0 (the chains'
    last states) at the fine-tuned steps' timesteps (:meth:`DiffusionPolicy.chain_bc_loss`, noise from
    ``generator``). The value part: ``value_coef`` * 0.5 mean (R - V)+^2."""
    if form == "chain":
        pg = (
            -policy.log_prob(batch["chains"], cond=batch["cond"]).float().mean(-1).mean()
        )  # per decision, then all
    elif form == "denoise":
        pg = policy.chain_bc_loss(batch["chains"][:, -1], batch["cond"], generator=generator)
    else:
        raise ValueError(f"self-imitation form {form!r} is not one of ('chain', 'denoise')")
    excess = (batch["returns"] - critic(batch["cond"], batch.get("state")).float().reshape(-1)).clamp_min(0)
    value = 0.5 * (excess**2).mean()
    return pg + value_coef * value, pg, value
