"""The residual learner (``algo=residual``): the diffusion policy frozen, a Gaussian MLP correcting every control
step's action, PPO over control steps with GAE.

The update (:mod:`.update`) scales its step by the measured evidence (``losses/signal_drift``) and bounds it
by a trust region. What is deployed is :class:`diffpolicy.policies.residual.ResidualPolicy` (base + head);
the head's module is :class:`diffpolicy.models.residual.ResidualHead`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from diffpolicy import checkpoint
from diffpolicy.config import ResidualConfig, TrainConfig
from diffpolicy.device import Runtime
from diffpolicy.distributed import DistInfo, rank_mean, seed_for_rank
from diffpolicy.env_factory import make_envs
from diffpolicy.evaluation import EvalResult, Exploration, evaluate
from diffpolicy.models.residual import ResidualCritic, ResidualHead
from diffpolicy.ops import gae
from diffpolicy.policies.residual import ResidualPolicy, StepActor
from diffpolicy.rl.buffer import RolloutBuffer
from diffpolicy.rl.exploration import tolerated
from diffpolicy.rl.learner import RolloutStats, env_seeds, register
from diffpolicy.rl.residual.update import ResidualModules, collect_steps, residual_specs, residual_update


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


@register(ResidualConfig)
class ResidualLearner:
    """Residual PPO over control steps on top of the frozen ``base`` policy."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, info: DistInfo, base: Any, logger: Any) -> None:
        algo = cfg.algo
        self.cfg, self.rt, self.info, self.logger = cfg, rt, info, logger
        self.head = residual_head_for(base, cfg).to(rt.device)
        self.policy = ResidualPolicy(base, self.head)
        self.critic = ResidualCritic(self.head.input_dim, tuple(algo.residual_hidden)).to(rt.device)
        self.learner = ResidualModules(
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
        self._tolerance_steps = 0

    def begin(self) -> None:
        """Bound the head's exploration by what the base tolerates (``algo.noise_tolerance``), once per run: a
        base cloned from noiseless demonstrations can lose half its return to noise it has never seen, and
        PPO would then learn a correction for the noisy policy that harms the deployed one. A resumed run
        keeps the bound its checkpoint holds."""
        algo, cfg = self.cfg.algo, self.cfg
        self._tolerance_steps = 0
        if algo.noise_tolerance <= 0 or not math.isinf(self.head.max_std):
            return
        base = self.policy.base
        n = algo.tolerance_episodes

        def score(std: float) -> EvalResult:
            return evaluate(
                base, cfg.env, n_action_steps=base.n_action_steps, n_episodes=n, seed=cfg.val_seed,
                num_envs=min(cfg.env.num_envs, n), device=self.rt.device, deterministic=True,
                autocast=self.rt.autocast, exploration=Exploration(std, "step") if std > 0 else None,
            )  # fmt: skip

        start = algo.residual_alpha * algo.residual_init_std
        std, seen, self._tolerance_steps = tolerated(score, start, algo.noise_tolerance)
        std = rank_mean(std, self.info, self.rt.device)  # one bound on every rank
        self.head.max_std = std / algo.residual_alpha
        if self.logger is not None:
            levels = ", ".join(f"{k:.3g}: {v:.3g}" for k, v in seen.items())
            self.logger.event(
                "residual_std_bound",
                f"base's figure under per-step action noise (std: figure) {levels}; the head explores with "
                f"at most {std:.3g} env units (sigma of u <= {self.head.max_std:.3g})",
                0, action_std=std, sigma_max=self.head.max_std,
            )  # fmt: skip

    def rollout(self, seed: int) -> RolloutStats:
        """Fill the buffer with T control steps per environment and compute GAE over them."""
        algo = self.cfg.algo
        self.head.eval()
        last_value, stats = collect_steps(
            self.actor, self.critic, self.venv, self.buffer, n_steps=algo.n_steps,
            seeds=env_seeds(self.cfg, seed), gamma=algo.gamma, max_episode_steps=self.cfg.env.max_episode_steps,
            generator=torch.Generator(device=self.rt.device).manual_seed(seed),
        )  # fmt: skip
        stats.env_steps += self._tolerance_steps  # the bound's episodes count once, in the first iteration
        self._tolerance_steps = 0
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
            "max_std": self.head.max_std,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_weights(state)
        checkpoint.load_state(self.critic, state["critic"], name="critic")
        self.learner.actor_optim.load_state_dict(state["actor_optim"])
        self.learner.critic_optim.load_state_dict(state["critic_optim"])
        self.learner.evidence.load(state["evidence"])
        self.learner.trust = float(state["trust"])
        self.head.max_std = float(state.get("max_std", math.inf))  # checkpoints before the bound: none

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
