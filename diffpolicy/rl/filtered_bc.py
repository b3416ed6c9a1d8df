"""Success-filtered self-imitation (``algo=filtered_bc``): roll out, keep the successes (or the best returns),
continue BC on them.

One round (one iteration of the loop in ``train.py``):

1. **Rollout.** ``algo.round_episodes`` episodes on fresh training scenes (seeds disjoint from the
   demonstrations' and the held-out ones), in waves of ``env.num_envs`` decision-level environments, with the
   policy that is evaluated (the EMA weights), sampled as ``algo.explore`` says: ``deterministic`` (every
   DDIM step's mean, the held-out protocol: the scene alone decides the outcome), ``chain`` (the stochastic
   chain) or ``chunk`` (the deterministic chain, its executed actions offset by Gaussian noise of std
   ``algo.explore_std`` held over each decision's steps: :class:`diffpolicy.evaluation.Exploration`). The
   actions kept are the ones executed, noise included.
2. **Filter.** Every decision of a kept episode becomes a training window: its observation (To = 1)
   and the Ta actions executed from there on (the following decisions' executed actions; the last one
   repeated past the episode's end), exactly the windows a demonstration gives at the steps where the policy
   replans. ``algo.keep`` chooses the episodes: the successful ones, or, for an env without a success notion
   (Hopper), the ``algo.keep_fraction`` of the round with the highest return (%BC, Chen et al. 2021). The
   others are dropped. The windows accumulate over rounds.
3. **Update.** The trained weights restart from the EMA weights and take ``algo.bc_steps`` AdamW steps
   (``algo.lr``) of the BC loss on batches of ``algo.batch_size`` (default ``bc.batch_size``) windows drawn
   from the demonstrations and every kept window (uniformly; ``keep=advantage``: in proportion to their
   weights); the EMA (``bc.ema_decay``) follows, and is what is rolled out, evaluated and saved. The whole
   policy learns, observation encoders included, as in BC (``policy.freeze_encoders=true``: the denoiser
   alone). A predict-then-act policy (``policy.encoder.predict_positions``) is trained as BC trains it where
   the demonstrations and the environment both carry the privileged ``target_pos`` label (recorded at every
   decision of the rollouts): the condition on the labelled positions plus ``position_noise``, the position
   head on the label (weight ``bc.target_aux_weight``); without the label the condition reads the policy's
   own prediction and the head is not trained. Every window is seen from a scene shifted as BC shifts it
   (``bc.translate``, :func:`diffpolicy.bc.shifted_scenes`): without it, the continuation would fit the
   demonstrations' few placements again, which the augmentation kept BC from.

It is behaviour cloning on a dataset that grows with the policy's own successes (self-imitation learning,
Oh et al. 2018; the filtered-BC baseline of offline RL): every update is a BC step toward actions that
succeeded, so it cannot follow a wrong critic, and it cannot fix a scene it never solves -- the scenes its
rollouts reach (``python -m diffpolicy.evaluate ... reachability_tries=16``) bound what it learns.
Under torchrun each rank keeps its own episodes and the gradients are averaged.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import numpy as np
import torch

from diffpolicy import checkpoint
from diffpolicy.bc import adamw, ema_update
from diffpolicy.config import FilteredBCConfig, TrainConfig
from diffpolicy.data.dataset import TARGET_KEY
from diffpolicy.data.windows import DemoWindows
from diffpolicy.device import Runtime
from diffpolicy.distributed import DistInfo, seed_for_rank
from diffpolicy.env_factory import make_envs, step_info
from diffpolicy.evaluation import EpisodeRecord, Exploration
from diffpolicy.policies.base import act, to_policy_obs
from diffpolicy.rl.imitation import WindowStore, imitation_steps, loss_summary
from diffpolicy.rl.learner import PolicyLearner, RolloutStats, register

TRAIN_SEED_BASE = 10_000_000
"""Training scenes start here: far from the demonstration seeds (0, 1, ...) and the held-out ones
(``eval_seed`` = 100 000 + i)."""


@register(FilteredBCConfig)
class FilteredBCLearner(PolicyLearner):
    """Success-filtered self-imitation on the whole diffusion policy (module docstring)."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, info: DistInfo, policy: Any, logger: Any) -> None:
        from diffpolicy.demos import demonstrations

        if cfg.policy.n_obs_steps != 1:
            raise ValueError(
                f"algo=filtered_bc keeps one observation per decision; policy.n_obs_steps={cfg.policy.n_obs_steps} needs 1"
            )
        if not hasattr(policy, "bc_loss"):
            raise ValueError(
                "algo=filtered_bc needs a policy trained by behaviour cloning (policy.kind=diffusion or gaussian)"
            )
        self.cfg, self.rt, self.info, self.logger = cfg, rt, info, logger
        self.policy = policy.eval()  # the EMA weights: rolled out, evaluated, saved
        self.model = copy.deepcopy(policy).train()  # the weights the optimiser moves
        self.model.set_freeze_encoders(cfg.policy.freeze_encoders)
        self.policy.requires_grad_(False)
        demos, _ = demonstrations(cfg.env, cfg.bc, cfg.seed, cfg.cache_dir)  # the ones BC was cloned from
        self.keys = list(policy.obs_spec)  # the observation fields the policy reads
        self.demos = DemoWindows(demos, 1, policy.horizon, obs_keys=self.keys)
        # predict-then-act trained as BC trains it, where the label exists (settled at the first rollout)
        self.labelled = (
            bool(getattr(getattr(policy, "obs_encoder", None), "position_points", 0))
            and self.demos.has_target
        )
        self.kept = WindowStore(policy.horizon)
        self._added = 0  # windows the last rollout kept
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optim = adamw(self.params, cfg.algo.lr, fused=cfg.policy.train_kernels)
        self.venv = make_envs(
            cfg.env, policy.n_action_steps, cfg.env.num_envs, seed_for_rank(cfg.seed, info.rank)
        )

    # ------------------------------------------------------------------------------------------ rollout
    def rollout(self, seed: int) -> RolloutStats:
        """``algo.round_episodes`` episodes on fresh scenes; the windows of those ``algo.keep`` chooses are kept."""
        algo, n, device = self.cfg.algo, self.cfg.env.num_envs, self.rt.device
        deterministic = algo.explore != "chain"
        noise = Exploration(algo.explore_std if algo.explore == "chunk" else 0.0, hold="chunk")
        rng = np.random.default_rng(seed)
        gen = torch.Generator(device=device).manual_seed(seed)
        stats, record = RolloutStats(), EpisodeRecord(n)
        base = TRAIN_SEED_BASE + seed % (2**31 - 2 * TRAIN_SEED_BASE)
        self.policy.eval()
        played: list[list[tuple[dict[str, Any], np.ndarray]]] = []  # every finished episode, in record order
        for start in range(0, algo.round_episodes, n):
            live = np.arange(n) < min(n, algo.round_episodes - start)
            # algo.scene_tries consecutive episodes share a scene (its seed)
            obs, reset_info = self.venv.reset(seed=[base + (start + i) // algo.scene_tries for i in range(n)])
            if self.labelled and TARGET_KEY not in reset_info:
                self.labelled = False  # the env reports no label: the condition reads the prediction
            label = reset_info.get(TARGET_KEY)  # (n, 3 k) m: the labelled positions of obs
            record.begin(live)
            episodes: list[list[tuple[dict[str, Any], np.ndarray]]] = [[] for _ in range(n)]
            while not record.wave_done:
                t0 = time.perf_counter()
                actions, _ = act(
                    self.policy, to_policy_obs(obs, device), deterministic=deterministic,
                    autocast=self.rt.autocast, generator=gen,
                )  # fmt: skip
                actions = noise.apply(actions, rng)  # (n, Te, Da): what is executed and, on success, kept
                t1 = time.perf_counter()
                obs_next, reward, term, trunc, info = self.venv.step(actions)
                stats.policy_s, stats.env_s = stats.policy_s + t1 - t0, stats.env_s + time.perf_counter() - t1
                executed = step_info(info, "executed", n, actions.shape[1])
                for i in np.flatnonzero(~record.done):
                    seen = {
                        k: (str(obs[k][i]) if k == "instruction" else np.array(obs[k][i])) for k in self.keys
                    }
                    if self.labelled:
                        seen[TARGET_KEY] = np.asarray(label[i], dtype=np.float32)
                    episodes[i].append((seen, actions[i, : int(executed[i])]))
                record.step(reward, term, trunc, info, executed)
                obs, label = obs_next, info.get(TARGET_KEY)
            # a failed episode is never imitated under the success filter: hold only what may be kept
            rule = self.keep_rule(record.reports_success)
            by_success = rule in ("success", "advantage")
            played += [episodes[i] if record.succ[i] or not by_success else [] for i in np.flatnonzero(live)]
            record.end()
        chosen = self.choose(record.successes, record.returns, record.reports_success)
        weights = self.advantages(record.successes) if rule == "advantage" else [1.0] * len(played)
        self._added = sum(self.kept.add_episode(played[i], weights[i]) for i in chosen)
        stats.env_steps, stats.episodes = record.env_steps, len(record.successes)
        stats.successes, stats.returns = int(sum(record.successes)), record.returns
        return stats

    def keep_rule(self, reports_success: bool) -> str:
        """``algo.keep`` with ``auto`` resolved: success where the env reports success, else top."""
        keep = self.cfg.algo.keep
        if keep == "auto":
            return "success" if reports_success else "top"
        return keep

    def advantages(self, successes: list[bool]) -> list[float]:
        """Each episode's scene advantage (``algo.keep=advantage``): 1 - the success fraction of the
        ``algo.scene_tries`` episodes on its scene (a scene's tries are consecutive); 0 where every try
        succeeded (nothing there to learn), and more the rarer the success."""
        tries = self.cfg.algo.scene_tries
        ok = np.asarray(successes, dtype=np.float64)
        rate = np.array([ok[(i // tries) * tries : (i // tries + 1) * tries].mean() for i in range(len(ok))])
        return (1.0 - rate).tolist()

    def choose(self, successes: list[bool], returns: list[float], reports_success: bool) -> list[int]:
        """The indices of a round's episodes to imitate (``algo.keep``): the successes; the successes on scenes
        that not every try solved (``advantage``); or the top ``algo.keep_fraction`` by return (ties broken by
        order); ``auto`` is ``success`` where the env reports success and ``top`` where it does not."""
        rule = self.keep_rule(reports_success)
        if rule in ("success", "advantage"):
            if not reports_success:
                raise ValueError(
                    f"algo.keep={rule}, but this env reports no success (no info['is_success']): "
                    "use algo.keep=top (or auto) to keep the highest-return episodes"
                )
            if rule == "advantage":
                adv = self.advantages(successes)
                return [i for i, ok in enumerate(successes) if ok and adv[i] > 0]
            return [i for i, ok in enumerate(successes) if ok]
        n = max(1, math.ceil(self.cfg.algo.keep_fraction * len(returns)))
        order = sorted(range(len(returns)), key=lambda i: (-returns[i], i))
        return sorted(order[:n])

    # ------------------------------------------------------------------------------------------- update
    def update(self, seed: int, step: int, iteration: int) -> dict[str, float]:
        """``algo.bc_steps`` BC steps from the EMA weights on demonstrations + kept windows."""
        algo = self.cfg.algo
        self.model.load_state_dict(self.policy.state_dict())
        self.model.train()
        n_demo, n_kept = len(self.demos), len(self.kept)
        batch = min(algo.batch_size or self.cfg.bc.batch_size, n_demo + n_kept)
        values = imitation_steps(
            self.model, self.optim, self.params, self.demos, self.kept, steps=algo.bc_steps, lr=algo.lr,
            batch_size=batch, labelled=self.labelled, bc_cfg=self.cfg.bc, runtime=self.rt, info=self.info,
            generator=torch.Generator().manual_seed(seed), max_grad_norm=algo.max_grad_norm,
            after_step=lambda: ema_update(self.policy, self.model, self.cfg.bc.ema_decay),
        )  # fmt: skip
        self.policy.eval()
        summary = loss_summary(values)
        return {
            "losses/bc": summary["mean"],
            "losses/bc_first": summary["first"],  # is the round's continuation still learning?
            "losses/bc_last": summary["last"],
            "train/batch_windows": float(batch),
            "train/kept_windows": float(n_kept),
            "train/added_windows": float(self._added),
            "train/demo_fraction": n_demo / max(1, n_demo + n_kept),
        }

    # ------------------------------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict(), "kept": self.kept.state()}

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_weights(state)
        checkpoint.load_state(self.model, state["model"], name="model")
        self.optim.load_state_dict(state["optim"])
        self.kept.load(state["kept"])

    def modules(self) -> list[torch.nn.Module]:
        return [self.policy, self.model]
