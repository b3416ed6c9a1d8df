"""The chain learner (``algo=ppo | grpo | dppo | dppo_gym``): PPO on the last K' denoising steps of
the diffusion policy (DPPO, Ren et al. 2024).

A rollout (:mod:`.rollout`) stores one entry per decision (observation, the K' + 1 chain states, their
log-probs); advantages are GAE over decisions or group-relative; :func:`.update.ppo_update` updates the
denoiser with the clipped surrogate per (decision, denoising step). The chain's sampling settings (K', eta,
the std floor, the log-prob options) are set on the policy here, by the learner that reads them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from diffpolicy import checkpoint
from diffpolicy.bc import adamw, ema_update
from diffpolicy.config import ChainConfig, TrainConfig
from diffpolicy.device import Runtime
from diffpolicy.distributed import DistInfo, rank_mean, seed_for_rank
from diffpolicy.env_factory import make_envs
from diffpolicy.evaluation import EvalResult, held_out
from diffpolicy.modalities import MODALITIES
from diffpolicy.models.critic import make_critic
from diffpolicy.rl.advantages import RunningRewardScaler, gae_advantages, grpo_advantages
from diffpolicy.rl.buffer import TEXT, RolloutBuffer, ppo_specs
from diffpolicy.rl.chain.rollout import collect_rollout
from diffpolicy.rl.chain.update import ChainModules, ppo_update
from diffpolicy.rl.exploration import tolerated
from diffpolicy.rl.imitation import WindowStore, imitation_steps, loss_summary, successful_episodes
from diffpolicy.rl.learner import PolicyLearner, RolloutStats, env_seeds, register
from diffpolicy.rl.ppo import clip_schedule
from diffpolicy.rl.self_imitation import SelfImitation
from diffpolicy.rl.stability import GradMonitor, StateSnapshot


def chain_specs(policy: Any, cond_dim: int) -> dict[str, Any]:
    """Preallocated rollout fields of the chain learner: every observation modality, the chain, log-probs,
    values, rewards, dones, ``valid``, the stored condition (reused when the encoders are frozen) and, for
    the imitation anchor, ``success`` and ``executed`` per decision."""
    obs = {
        k: ((), TEXT) if k == "instruction" else (tuple(v), MODALITIES[k].dtype)
        for k, v in policy.obs_spec.items()
    }
    specs = ppo_specs(obs, ft_steps=policy.ft_steps, horizon=policy.horizon, action_dim=policy.action_dim)
    specs["valid"] = ((), torch.float32)
    specs["cond"] = ((cond_dim,), torch.float32)
    specs["success"] = ((), torch.float32)
    specs["executed"] = ((), torch.float32)
    return specs


def set_chain_options(policy: Any, algo: ChainConfig) -> None:
    """Set the chain's log-prob options (DPPO's floor, clamp and noise clip; the truncated gradient), which
    only the chain learner reads, on a diffusion policy; a policy without them (Gaussian) is left as it is."""
    if not hasattr(policy, "logprob_clamp"):
        return
    if algo.grad_steps > policy.schedule.ddim_steps:
        raise ValueError(
            f"algo.grad_steps={algo.grad_steps} is more than the chain's "
            f"{policy.schedule.ddim_steps} denoising steps (policy.ddim_steps)"
        )
    policy.logprob_min_std = algo.logprob_min_std
    policy.logprob_clamp = list(algo.logprob_clamp)
    policy.noise_clip = algo.noise_clip
    policy.grad_steps = algo.grad_steps


@register(ChainConfig)
class ChainLearner(PolicyLearner):
    """PPO on the denoising chain of ``policy`` (a diffusion or Gaussian policy)."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, info: DistInfo, policy: Any, logger: Any) -> None:
        algo = cfg.algo
        self.cfg, self.rt, self.info, self.policy, self.logger = cfg, rt, info, policy, logger
        set_chain_options(policy, algo)
        self.grpo = algo.advantage == "grpo"
        reference = (  # the frozen pre-trained policy the regulariser pulls toward
            copy.deepcopy(policy).eval().requires_grad_(False)
            if algo.reg != "none" and algo.reg_coef > 0
            else None
        )
        self.critic = make_critic(policy, cfg.policy.cond_dim, algo.critic_input, algo.critic_hidden).to(
            rt.device
        )
        actor_params = [p for p in policy.parameters() if p.requires_grad]
        self.learner = ChainModules(
            policy=policy,
            critic=self.critic,
            actor_optim=torch.optim.AdamW(actor_params, lr=algo.lr, weight_decay=algo.weight_decay),
            critic_optim=torch.optim.AdamW(self.critic.parameters(), lr=algo.critic_lr),
            scaler=rt.grad_scaler(),
            reference=reference,
            kept=SelfImitation(
                algo.sil_capacity,
                cfg.policy.cond_dim,
                (policy.ft_steps + 1, policy.horizon, policy.action_dim),
                int(policy.obs_spec["state"][-1]) if algo.critic_input == "state" else None,
                rt.device,
            )
            if algo.sil_coef > 0
            else None,
        )
        self._build_anchor(actor_params)
        self.monitor = GradMonitor(algo.grad_monitor_window, algo.grad_spike_sigma, logger=logger)
        optims = [self.learner.actor_optim, self.learner.critic_optim]
        self.snapshot = StateSnapshot(
            {"policy": policy, "critic": self.critic},
            optims if self.anchor_optim is None else [*optims, self.anchor_optim],
        )
        self.venv = make_envs(
            cfg.env, policy.n_action_steps, cfg.env.num_envs, seed_for_rank(cfg.seed, info.rank)
        )
        self.buffer = RolloutBuffer(
            algo.n_steps, cfg.env.num_envs, chain_specs(policy, cfg.policy.cond_dim), rt.device
        )
        self.clip_eps = clip_schedule(algo.clip_eps, algo.clip_eps_final, policy.ft_steps, rt.device)
        self._last: tuple[torch.Tensor, torch.Tensor] | None = None
        self.reward_scaler = (  # DPPO's running scaler keeps its own discount of 0.99, whatever algo.gamma
            RunningRewardScaler(cfg.env.num_envs) if algo.reward_scale == "running" else None
        )
        if algo.sil_coef > 0 and algo.sil_loss == "denoise" and not hasattr(policy, "chain_bc_loss"):
            raise ValueError(
                "algo.sil_loss=denoise imitates through a diffusion policy's BC loss; this policy has none"
            )
        if algo.explore_tolerance > 0 and not hasattr(policy, "schedule"):
            raise ValueError("algo.explore_tolerance scales a diffusion chain's noise; this policy has none")
        self.exploration: dict[str, Any] | None = None
        """What ``algo.explore_tolerance`` measured: the noise scale explored with, the curve it was chosen on
        ([scale, validation figure], scale 0 the noise-free policy), the tolerance, episodes and env steps."""
        self._explore_steps = 0

    def _build_anchor(self, params: list[torch.Tensor]) -> None:
        """The imitation anchor's demonstrations, kept windows and optimiser (``algo.anchor_steps`` > 0)."""
        cfg, policy = self.cfg, self.policy
        self.anchor_optim: torch.optim.Optimizer | None = None
        self.anchor_model: Any = None
        self.anchor_kept = WindowStore(policy.horizon)
        self._anchor_added = 0
        if cfg.algo.anchor_steps <= 0:
            return
        if not hasattr(policy, "bc_loss"):
            raise ValueError("algo.anchor_steps imitates through a BC loss; this policy has none")
        if getattr(policy, "base_denoiser", None) is not None:
            raise ValueError(
                "algo.anchor_steps trains the denoiser at every noise level, but the first denoising steps "
                "run a frozen base here: set algo.action_std > 0 or algo.ft_fraction=1"
            )
        from diffpolicy.data.windows import DemoWindows
        from diffpolicy.demos import demonstrations

        demos, _ = demonstrations(cfg.env, cfg.bc, cfg.seed, cfg.cache_dir)  # the ones BC was cloned from
        self.anchor_demos = DemoWindows(demos, 1, policy.horizon, obs_keys=list(policy.obs_spec))
        decay = cfg.bc.ema_decay if cfg.algo.anchor_ema is None else cfg.algo.anchor_ema
        self.anchor_decay = float(decay)
        if self.anchor_decay > 0:  # a training copy; the deployed policy follows it as an EMA
            self.anchor_model = copy.deepcopy(policy)
            if cfg.algo.anchor_encoders:
                self.anchor_model.set_freeze_encoders(False)
            params = [p for p in self.anchor_model.parameters() if p.requires_grad]
        self.anchor_optim = adamw(params, cfg.algo.anchor_lr, fused=cfg.policy.train_kernels)

    def _keep_successes(self) -> None:
        """Add the windows of the rollout's successful episodes to the anchor's store."""
        data = self.buffer.get()
        chunks = self.policy.action_normalizer.unnormalize(data["chains"][:, :, -1].float())  # (T, N, Ta, Da)
        episodes = successful_episodes(
            data, list(self.policy.obs_spec), chunks.cpu().numpy(), self.buffer.decode
        )
        self._anchor_added = sum(self.anchor_kept.add_episode(e) for e in episodes)

    def _anchor_steps(self, seed: int) -> list[float]:
        """``algo.anchor_steps`` BC steps on the demonstrations + kept windows: on a copy restarted from the
        deployed weights, which follow it as an EMA (``algo.anchor_ema``), or on the deployed weights."""
        algo, policy = self.cfg.algo, self.policy
        model = policy if self.anchor_model is None else self.anchor_model
        after = None
        if self.anchor_model is not None:
            model.load_state_dict(policy.state_dict())

            def after() -> None:
                with torch.no_grad():
                    ema_update(policy, model, self.anchor_decay)

        model.train()
        return imitation_steps(
            model, self.anchor_optim, [p for p in model.parameters() if p.requires_grad], self.anchor_demos,
            self.anchor_kept, steps=algo.anchor_steps, lr=algo.anchor_lr,
            batch_size=algo.anchor_batch or self.cfg.bc.batch_size, labelled=False, bc_cfg=self.cfg.bc,
            runtime=self.rt, info=self.info, generator=torch.Generator().manual_seed(seed + 1),
            max_grad_norm=algo.max_grad_norm, after_step=after,
        )  # fmt: skip

    def begin(self) -> None:
        """Called once the starting weights are in place (fresh or resumed): the NaN guard's first snapshot
        and, with ``algo.explore_tolerance``, the noise the task tolerates (a resumed run keeps its own)."""
        self.snapshot.capture()
        if self.cfg.algo.explore_tolerance > 0 and self.exploration is None:
            self.exploration = self._measure_exploration()

    def _measure_exploration(self) -> dict[str, Any]:
        """Scale the K' sampled steps' stds by the largest of 1, 1/2, ... whose validation figure keeps
        (1 - ``algo.explore_tolerance``) of the noise-free policy's on the same episodes. The means, and so
        the deployed noise-free policy, stay as they are; only how far the rollouts stray from it changes."""
        algo, cfg, policy = self.cfg.algo, self.cfg, self.policy
        configured = {**policy.sampling, "noise_scale": 1.0}
        policy.eval()

        def score(scale: float) -> EvalResult:
            if scale == 0:
                return held_out(policy, cfg, self.rt, "val", algo.explore_episodes, protocol="noise_free")
            policy.set_sampling(**{**configured, "noise_scale": scale}, freeze=False)
            return held_out(policy, cfg, self.rt, "val", algo.explore_episodes, protocol="exploration")

        scale, seen, steps = tolerated(
            score, 1.0, algo.explore_tolerance, levels=algo.explore_levels, share=True
        )
        scale = rank_mean(scale, self.info, self.rt.device)  # one scale on every rank
        policy.set_sampling(**{**configured, "noise_scale": scale}, freeze=False)
        self._explore_steps = steps
        curve = [[float(k), round(float(v), 4)] for k, v in sorted(seen.items())]
        if self.logger is not None:
            levels = ", ".join(f"{k:.3g}: {v:.3g}" for k, v in curve)
            self.logger.event(
                "explore_scale",
                f"sampled chain's validation figure by noise scale (scale: figure) {levels}; "
                f"exploring with {scale:.3g} (keeps {1 - algo.explore_tolerance:.0%} of the noise-free figure)",
                0, noise_scale=scale, env_steps=steps,
            )  # fmt: skip
        return {
            "noise_scale": scale,
            "curve": curve,
            "tolerance": algo.explore_tolerance,
            "episodes": algo.explore_episodes,
            "env_steps": steps,
        }

    def rollout(self, seed: int) -> RolloutStats:
        """Fill the buffer with T decisions per environment and compute their advantages."""
        algo = self.cfg.algo
        self.policy.eval()  # sampling: no augmentation
        last_value, stats = collect_rollout(
            self.policy, self.critic, self.venv, self.buffer, n_steps=algo.n_steps,
            seeds=env_seeds(self.cfg, seed), gamma=algo.gamma, device=self.rt.device,
            generator=torch.Generator(device=self.rt.device).manual_seed(seed), autocast=self.rt.autocast,
            first_episode_only=self.grpo, bootstrap=not self.grpo, reward_source=algo.reward,
            stage_potential=dict(algo.stage_potential),
        )  # fmt: skip
        stats.env_steps += self._explore_steps  # the measurement's episodes: once, in the first iteration
        self._explore_steps = 0
        self._last = self._advantages(last_value)
        if self.anchor_optim is not None:
            self._keep_successes()
        if self.learner.kept is not None:  # decisions whose return beat their value, kept for self-imitation
            data = self.buffer.get()
            self.learner.kept.add(
                data["cond"], data["chains"], self._last[1], data["values"], data["valid"], data.get("state")
            )
        return stats

    def _advantages(self, last_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, N) advantages and value targets: GAE over decisions, or group-relative episode returns."""
        data, algo = self.buffer.get(), self.cfg.algo
        if not self.grpo:
            rewards = data["rewards"]
            if self.reward_scaler is not None:  # the env's rewards scaled; a cut's bootstrap V is so already
                boot = data["bootstraps"]
                scaled = self.reward_scaler(rewards - boot, data["dones"])
                rewards = scaled.to(rewards.device, rewards.dtype) + boot
            return gae_advantages(
                rewards, data["values"], data["dones"], last_value, algo.gamma, algo.gae_lambda
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
        if self.anchor_optim is not None:
            values = self._anchor_steps(seed)
            summary = loss_summary(values)
            losses["losses/anchor"], losses["losses/anchor_last"] = summary["mean"], summary["last"]
            losses["train/anchor_windows"] = float(len(self.anchor_kept))
            losses["train/anchor_added"] = float(self._anchor_added)
        if self.learner.kept is not None:
            losses["rollout/sil_kept"] = float(self.learner.kept.size)
        return losses

    def state(self) -> dict[str, Any]:
        learner, monitor = self.learner, self.monitor
        return {
            **({"reward_scaler": self.reward_scaler.state_dict()} if self.reward_scaler is not None else {}),
            **({"exploration": self.exploration} if self.exploration is not None else {}),
            **({"kept": learner.kept.state_dict()} if learner.kept is not None else {}),
            **(
                {"anchor": {"kept": self.anchor_kept.state(), "optim": self.anchor_optim.state_dict()}}
                if self.anchor_optim is not None
                else {}
            ),
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
        if self.reward_scaler is not None and "reward_scaler" in state:
            self.reward_scaler.load_state_dict(state["reward_scaler"])
        if learner.kept is not None and "kept" in state:
            learner.kept.load_state_dict(state["kept"])
        if self.anchor_optim is not None and "anchor" in state:
            self.anchor_kept.load(state["anchor"]["kept"])
            self.anchor_optim.load_state_dict(state["anchor"]["optim"])
        if "exploration" in state:  # the measured noise scale, explored with since the run's start
            self.exploration = dict(state["exploration"])
            scale = float(self.exploration["noise_scale"])
            self.policy.set_sampling(**{**self.policy.sampling, "noise_scale": scale}, freeze=False)
        monitor.history.clear()
        monitor.history.extend(float(v) for v in state["monitor"]["history"])
        monitor.spikes, monitor.updates = state["monitor"]["spikes"], state["monitor"]["updates"]

    def modules(self) -> list[torch.nn.Module]:
        """Modules rank 0 broadcasts at the start."""
        return [self.policy, self.critic]
