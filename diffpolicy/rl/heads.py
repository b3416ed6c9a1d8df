"""The two things PPO can train, behind the one face that the training loop in ``train.py`` composes.

- :class:`ChainHead` (``algo.head=chain``): PPO on the last K' denoising steps of the diffusion policy
  (DPPO). A rollout stores one entry per decision (observation, chain, log-probs); advantages are GAE over
  decisions or group-relative; :func:`diffpolicy.rl.update.ppo_update` updates the denoiser.
- :class:`ResidualPPOHead` (``algo.head=residual``): the diffusion policy frozen, a Gaussian MLP correcting
  every control step's action (:mod:`diffpolicy.rl.residual`); GAE over control steps; the update's step is
  scaled by the measured evidence (``losses/signal_drift``) and bounded by a trust region.

Each head owns its environments, rollout buffer, critic and optimisers and exposes: ``policy`` (what is
evaluated, saved and served), ``rollout(seed)``, ``update(seed, step)``, ``state()`` / ``load_state()``
(everything a checkpoint needs to continue bit for bit, besides the RNG), ``weights()`` /
``load_weights()`` (what a rollback restores) and ``artifact()`` (extra state and description stored with
the saved policy). The loop around them (seeding, logging, checkpoints, the rollback guard, torchrun sums)
is shared.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from diffpolicy import checkpoint
from diffpolicy.config import TrainConfig
from diffpolicy.device import Runtime
from diffpolicy.distributed import DistInfo, seed_for_rank
from diffpolicy.env_factory import make_envs
from diffpolicy.modalities import MODALITIES
from diffpolicy.models.critic import Critic
from diffpolicy.models.residual import ResidualCritic, ResidualHead
from diffpolicy.ops import gae
from diffpolicy.policies.residual import ResidualPolicy, StepActor
from diffpolicy.rl.advantages import gae_advantages, grpo_advantages
from diffpolicy.rl.buffer import TEXT, RolloutBuffer, ppo_specs
from diffpolicy.rl.head_base import PolicyHead
from diffpolicy.rl.ppo import clip_schedule
from diffpolicy.rl.residual import ResidualLearner, collect_steps, residual_specs, residual_update
from diffpolicy.rl.rollout import RolloutStats, collect_rollout
from diffpolicy.rl.stability import GradMonitor, StateSnapshot
from diffpolicy.rl.update import Learner, ppo_update


def env_seeds(cfg: TrainConfig, base: int) -> list[int]:
    """Reset seed per environment; GRPO puts G consecutive environments on the same seed (a group)."""
    n, g = cfg.env.num_envs, getattr(cfg.algo, "group_size", 1)
    if getattr(cfg.algo, "advantage", "gae") == "grpo":
        return [base + i // g for i in range(n)]
    return [base + i for i in range(n)]


# ------------------------------------------------------------------------------------------------ chain
def chain_specs(policy: Any, cond_dim: int) -> dict[str, Any]:
    """Preallocated rollout fields of the chain head: every observation modality, the chain, log-probs,
    values, rewards, dones, ``valid`` and the stored condition (reused when the encoders are frozen)."""
    obs = {
        k: ((), TEXT) if k == "instruction" else (tuple(v), MODALITIES[k].dtype)
        for k, v in policy.obs_spec.items()
    }
    specs = ppo_specs(obs, ft_steps=policy.ft_steps, horizon=policy.horizon, action_dim=policy.action_dim)
    specs["valid"] = ((), torch.float32)
    specs["cond"] = ((cond_dim,), torch.float32)
    return specs


class ChainHead(PolicyHead):
    """PPO on the denoising chain of ``policy`` (a diffusion or Gaussian policy)."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, info: DistInfo, policy: Any, logger: Any) -> None:
        algo = cfg.algo
        self.cfg, self.rt, self.info, self.policy, self.logger = cfg, rt, info, policy, logger
        self.grpo = algo.advantage == "grpo"
        reference = (  # the frozen pre-trained policy the regulariser pulls toward
            copy.deepcopy(policy).eval().requires_grad_(False)
            if algo.reg != "none" and algo.reg_coef > 0
            else None
        )
        self.critic = Critic(cfg.policy.cond_dim).to(rt.device)
        actor_params = [p for p in policy.parameters() if p.requires_grad]
        self.learner = Learner(
            policy=policy,
            critic=self.critic,
            actor_optim=torch.optim.AdamW(actor_params, lr=algo.lr, weight_decay=algo.weight_decay),
            critic_optim=torch.optim.AdamW(self.critic.parameters(), lr=algo.critic_lr),
            scaler=rt.grad_scaler(),
            reference=reference,
        )
        self.monitor = GradMonitor(algo.grad_monitor_window, algo.grad_spike_sigma, logger=logger)
        self.snapshot = StateSnapshot(
            {"policy": policy, "critic": self.critic}, [self.learner.actor_optim, self.learner.critic_optim]
        )
        self.venv = make_envs(
            cfg.env, policy.n_action_steps, cfg.env.num_envs, seed_for_rank(cfg.seed, info.rank)
        )
        self.buffer = RolloutBuffer(
            algo.n_steps, cfg.env.num_envs, chain_specs(policy, cfg.policy.cond_dim), rt.device
        )
        self.clip_eps = clip_schedule(algo.clip_eps, algo.clip_eps_final, policy.ft_steps, rt.device)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin(self) -> None:
        """Called once the starting weights are in place (fresh or resumed): the NaN guard's first snapshot."""
        self.snapshot.capture()

    def rollout(self, seed: int) -> RolloutStats:
        """Fill the buffer with T decisions per environment and compute their advantages."""
        algo = self.cfg.algo
        self.policy.eval()  # sampling: no augmentation
        last_value, stats = collect_rollout(
            self.policy, self.critic, self.venv, self.buffer, n_steps=algo.n_steps,
            seeds=env_seeds(self.cfg, seed), gamma=algo.gamma, device=self.rt.device,
            generator=torch.Generator(device=self.rt.device).manual_seed(seed), autocast=self.rt.autocast,
            first_episode_only=self.grpo, bootstrap=not self.grpo,
        )  # fmt: skip
        self._last = self._advantages(last_value)
        return stats

    def _advantages(self, last_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, N) advantages and value targets: GAE over decisions, or group-relative episode returns."""
        data, algo = self.buffer.get(), self.cfg.algo
        if not self.grpo:
            return gae_advantages(
                data["rewards"], data["values"], data["dones"], last_value, algo.gamma, algo.gae_lambda
            )
        first = data["rewards"] * data["valid"]  # (T, N) rewards of each env's first episode
        episode_return = first.sum(0).view(-1, algo.group_size)  # (N / G, G)
        adv = grpo_advantages(episode_return, scale=algo.group_std).view(1, -1).expand_as(first)
        adv = adv * data["valid"]  # (T, N)
        return adv.contiguous(), torch.zeros_like(adv)

    def update(self, seed: int, step: int, iteration: int) -> dict[str, float]:
        adv, ret = self._last
        self.policy.train()
        losses = ppo_update(
            self.learner, self.buffer, adv, ret, self.cfg.algo, clip_eps=self.clip_eps, runtime=self.rt,
            info=self.info, generator=torch.Generator().manual_seed(seed), monitor=self.monitor,
            snapshot=self.snapshot, logger=self.logger, step=step, use_critic=not self.grpo,
            train_actor=self.grpo or iteration >= self.cfg.algo.critic_warmup,
        )  # fmt: skip
        losses["rollout/advantage_std"] = float(adv.std())
        return losses

    def state(self) -> dict[str, Any]:
        learner, monitor = self.learner, self.monitor
        return {
            "critic": learner.critic.state_dict(),
            "actor_optim": learner.actor_optim.state_dict(),
            "critic_optim": learner.critic_optim.state_dict(),
            "scaler": learner.scaler.state_dict(),
            "monitor": {
                "history": list(monitor.history),
                "spikes": monitor.spikes,
                "updates": monitor.updates,
            },
        }

    def load_state(self, state: dict[str, Any]) -> None:
        learner, monitor = self.learner, self.monitor
        checkpoint.load_state(learner.policy, state["policy"], name="policy")
        checkpoint.load_state(learner.critic, state["critic"], name="critic")
        learner.actor_optim.load_state_dict(state["actor_optim"])
        learner.critic_optim.load_state_dict(state["critic_optim"])
        if state.get("scaler"):
            learner.scaler.load_state_dict(state["scaler"])
        monitor.history.clear()
        monitor.history.extend(float(v) for v in state["monitor"]["history"])
        monitor.spikes, monitor.updates = state["monitor"]["spikes"], state["monitor"]["updates"]

    def modules(self) -> list[torch.nn.Module]:
        """Modules rank 0 broadcasts at the start."""
        return [self.policy, self.critic]


# --------------------------------------------------------------------------------------------- residual
def residual_head_for(base: Any, cfg: TrainConfig) -> ResidualHead:
    """A fresh residual head sized for ``base`` (its state, Da, Te; its condition when it sees pixels/points)."""
    spec = base.obs_spec
    cond_dim = cfg.policy.cond_dim if ("rgb" in spec or "points" in spec) else 0
    return ResidualHead(
        int(spec["state"][-1]),
        base.action_dim,
        base.n_action_steps,
        cond_dim=cond_dim,
        hidden=tuple(cfg.algo.residual_hidden),
        alpha=cfg.algo.residual_alpha,
        init_std=cfg.algo.residual_init_std,
    )


def residual_description(head: ResidualHead, hidden: list[int]) -> dict[str, Any]:
    """JSON description stored with a base + residual checkpoint (enough to rebuild the head)."""
    return {"alpha": head.alpha, "hidden": list(hidden), "cond_dim": head.cond_dim}


class ResidualPPOHead:
    """Residual PPO over control steps on top of the frozen ``base`` policy."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, info: DistInfo, base: Any, logger: Any) -> None:
        algo = cfg.algo
        self.cfg, self.rt, self.info, self.logger = cfg, rt, info, logger
        self.head = residual_head_for(base, cfg).to(rt.device)
        self.policy = ResidualPolicy(base, self.head)
        self.critic = ResidualCritic(self.head.input_dim, tuple(algo.residual_hidden)).to(rt.device)
        self.learner = ResidualLearner(
            head=self.head,
            critic=self.critic,
            actor_optim=torch.optim.Adam(self.head.parameters(), lr=algo.lr),
            critic_optim=torch.optim.Adam(self.critic.parameters(), lr=algo.critic_lr),
        )
        n = cfg.env.num_envs
        self.venv = make_envs(
            cfg.env, base.n_action_steps, n, seed_for_rank(cfg.seed, info.rank), chunked=False
        )
        self.actor = StepActor(self.policy, n, rt.device, rt.autocast)
        self.buffer = RolloutBuffer(
            algo.n_steps, n, residual_specs(self.head.input_dim, base.action_dim), rt.device
        )
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None

    def begin(self) -> None:
        """Nothing to prepare: the residual update keeps no snapshot."""

    def rollout(self, seed: int) -> RolloutStats:
        """Fill the buffer with T control steps per environment and compute GAE over them."""
        algo = self.cfg.algo
        self.head.eval()
        last_value, stats = collect_steps(
            self.actor, self.critic, self.venv, self.buffer, n_steps=algo.n_steps,
            seeds=env_seeds(self.cfg, seed), gamma=algo.gamma, max_episode_steps=self.cfg.env.max_episode_steps,
            generator=torch.Generator(device=self.rt.device).manual_seed(seed),
        )  # fmt: skip
        data = self.buffer.get()
        self._last = gae(
            data["rewards"], data["values"], data["dones"], last_value.float(), algo.gamma, algo.gae_lambda
        )
        return stats

    def update(self, seed: int, step: int, iteration: int) -> dict[str, float]:
        adv, ret = self._last
        self.head.train()
        out = residual_update(
            self.learner, self.buffer.get(), adv, ret, self.cfg.algo,
            generator=torch.Generator().manual_seed(seed), info=self.info,
        )  # fmt: skip
        out["rollout/advantage_std"] = float(adv.std())
        return out

    def state(self) -> dict[str, Any]:
        return {
            "critic": self.critic.state_dict(),
            "actor_optim": self.learner.actor_optim.state_dict(),
            "critic_optim": self.learner.critic_optim.state_dict(),
            "evidence": self.learner.evidence.state(),
            "trust": self.learner.trust,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_weights(state)
        checkpoint.load_state(self.critic, state["critic"], name="critic")
        self.learner.actor_optim.load_state_dict(state["actor_optim"])
        self.learner.critic_optim.load_state_dict(state["critic_optim"])
        self.learner.evidence.load(state["evidence"])
        self.learner.trust = float(state["trust"])

    def modules(self) -> list[torch.nn.Module]:
        return [self.head, self.critic]

    def saved_policy(self) -> Any:
        """The base policy: its weights are the checkpoint's ``policy``; the head rides in ``residual``."""
        return self.policy.base

    def artifact(self) -> tuple[dict[str, Any], dict[str, Any]]:
        desc = residual_description(self.head, self.cfg.algo.residual_hidden)
        return {"residual": self.head.state_dict()}, {"residual": desc}

    def load_weights(self, state: dict[str, Any]) -> None:
        checkpoint.load_state(self.head, state["residual"], name="residual")

    def on_rollback(self) -> None:
        """A rollback means steps the evidence earned made the policy worse (consistent is not correct: a
        biased critic or a misleading shaping term point the same way every batch): halve the trust region
        for the rest of the run and start a new evidence pool, so repeated harm shrinks toward no motion."""
        self.learner.trust *= 0.5
        self.learner.evidence.reset()

    def close(self) -> None:
        self.venv.close()


def make_head(cfg: TrainConfig, rt: Runtime, info: DistInfo, policy: Any, logger: Any) -> Any:
    """The head ``cfg.algo.head`` names, around the pre-trained ``policy``."""
    if cfg.algo.head == "residual":
        return ResidualPPOHead(cfg, rt, info, policy, logger)
    if cfg.algo.head == "fpo":
        from diffpolicy.rl.fpo import FPOHead

        return FPOHead(cfg, rt, info, policy, logger)
    if cfg.algo.head == "filtered_bc":
        from diffpolicy.rl.filtered_bc import FilteredBCHead

        return FilteredBCHead(cfg, rt, info, policy, logger)
    return ChainHead(cfg, rt, info, policy, logger)
