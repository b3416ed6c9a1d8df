"""``python -m diffpolicy.train env=mujoco_pick``: collect (cached), pre-train by BC (cached), PPO, evaluate.

Reads top to bottom: device and process group -> the pre-trained policy (``policy.init`` or the cached BC
checkpoint, trained on first use) -> held-out evaluation of BC -> PPO iterations (seeded rollout into the
preallocated buffer, GAE or group-relative advantages, clipped update of the last K' denoising steps,
checkpoints, rollback guard) -> the same held-out evaluation after PPO -> PNG, mp4 and the JSON summary
(``bc_success_rate``, ``ppo_success_rate``, ``env_steps``, ``wall_time_s``), printed last on stdout.

Every PPO iteration starts from environments reset with seeds derived from (seed, rank, iteration) and
draws its sampling noise and minibatch order from generators seeded the same way, so the state at an
iteration boundary is only what a checkpoint holds: ``resume=true`` continues a killed run and ends with
exactly the metrics of an uninterrupted one on the CPU.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from diffpolicy import checkpoint
from diffpolicy.cli import launch
from diffpolicy.config import TrainConfig
from diffpolicy.device import Runtime
from diffpolicy.distributed import (
    DistInfo,
    apply_visible_devices,
    barrier,
    broadcast_flag,
    broadcast_parameters,
    mean_metrics,
    process_group,
    seed_for_rank,
    sum_metrics,
)
from diffpolicy.logger import Logger
from diffpolicy.models.critic import Critic
from diffpolicy.policy_io import load_policy, save_policy
from diffpolicy.rl.advantages import gae_advantages, grpo_advantages
from diffpolicy.rl.buffer import TEXT, RolloutBuffer, ppo_specs
from diffpolicy.rl.ppo import clip_schedule
from diffpolicy.rl.stability import GradMonitor, RollbackGuard, StateSnapshot
from diffpolicy.rl.update import Learner, ppo_update
from diffpolicy.rollout import collect_rollout, evaluate, make_envs, record_video

_DTYPES = {"rgb": torch.uint8, "points": torch.float32, "state": torch.float32}


# ------------------------------------------------------------------------------------------------ helpers
def iteration_seed(cfg: TrainConfig, info: DistInfo, iteration: int) -> int:
    """Seed of everything random in one PPO iteration of one rank (env resets, noise, minibatches)."""
    return seed_for_rank(cfg.seed, info.rank) * 1_000_003 + 7919 * (iteration + 1)


def env_seeds(cfg: TrainConfig, base: int) -> list[int]:
    """Reset seed per environment; GRPO puts G consecutive environments on the same seed (a group)."""
    n, g = cfg.env.num_envs, cfg.algo.group_size
    if cfg.algo.advantage == "grpo":
        return [base + i // g for i in range(n)]
    return [base + i for i in range(n)]


def initial_policy(cfg: TrainConfig, rt: Runtime, info: DistInfo, run_dir: Path) -> tuple[Any, Path]:
    """The policy PPO starts from: ``policy.init`` or the cached BC checkpoint (rank 0 trains it once)."""
    if cfg.policy.init:
        path = Path(cfg.policy.init)
    else:
        from diffpolicy.pretrain import pretrained_checkpoint

        def cached() -> Path:
            return pretrained_checkpoint(
                cfg.env,
                cfg.policy,
                cfg.algo,
                rt,
                cfg.cache_dir,
                seed=cfg.seed,
                run_dir=run_dir / "bc",
                progress=cfg.log.progress,
            )

        if info.is_main:
            path = cached()  # collects demonstrations and trains BC on first use, then reuses the cache
        barrier(info)
        if not info.is_main:
            path = cached()
    policy, _, _ = load_policy(path, rt.device)
    if hasattr(policy, "set_sampling"):  # this run's K', eta and std floor, whatever the checkpoint used
        p = cfg.policy
        policy.set_sampling(ft_steps=p.ft_steps, eta=p.eta, min_std=p.min_std)
        policy.logprob_min_std = cfg.algo.logprob_min_std
    policy.sampler_backend = "compiled" if cfg.policy.compile else "auto"
    policy.set_freeze_encoders(cfg.policy.freeze_encoders or not cfg.algo.finetune_encoders)
    return policy.train(), path


def held_out(policy: Any, cfg: TrainConfig, rt: Runtime) -> float:
    """Success rate over ``cfg.eval_episodes`` held-out seeds (the same seeds before and after PPO)."""
    result = evaluate(
        policy,
        cfg.env,
        n_action_steps=policy.n_action_steps,
        n_episodes=cfg.eval_episodes,
        seed=cfg.eval_seed,
        num_envs=cfg.env.num_envs,
        device=rt.device,
        deterministic=cfg.eval_deterministic,
        autocast=rt.autocast,
    )
    return result.success_rate


def training_state(learner: Learner, monitor: GradMonitor, guard: RollbackGuard) -> dict[str, Any]:
    """Everything a checkpoint needs beyond the policy weights to continue bit-for-bit."""
    return {
        "critic": learner.critic.state_dict(),
        "actor_optim": learner.actor_optim.state_dict(),
        "critic_optim": learner.critic_optim.state_dict(),
        "scaler": learner.scaler.state_dict(),
        "monitor": {"history": list(monitor.history), "spikes": monitor.spikes, "updates": monitor.updates},
        "guard": {"best": guard.best, "best_step": guard.best_step, "stable_step": guard.stable_step},
        "rng": checkpoint.rng_state(),
    }


def restore(
    ckpt: checkpoint.Checkpoint, learner: Learner, monitor: GradMonitor, guard: RollbackGuard
) -> None:
    """Load a PPO checkpoint into the learner and the guards (shapes checked before anything changes)."""
    checkpoint.load_state(learner.policy, ckpt.state["policy"], name="policy")
    checkpoint.load_state(learner.critic, ckpt.state["critic"], name="critic")
    learner.actor_optim.load_state_dict(ckpt.state["actor_optim"])
    learner.critic_optim.load_state_dict(ckpt.state["critic_optim"])
    if ckpt.state.get("scaler"):
        learner.scaler.load_state_dict(ckpt.state["scaler"])
    monitor.history.clear()
    monitor.history.extend(float(v) for v in ckpt.state["monitor"]["history"])
    monitor.spikes, monitor.updates = ckpt.state["monitor"]["spikes"], ckpt.state["monitor"]["updates"]
    guard.best, guard.best_step = ckpt.state["guard"]["best"], ckpt.state["guard"]["best_step"]
    guard.stable_step = ckpt.state["guard"]["stable_step"]
    checkpoint.set_rng_state(ckpt.state["rng"])


def truncate_metrics(run_dir: Path, env_steps: int) -> None:
    """On resume, drop metric lines written after the checkpoint so the file reads like one clean run."""
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= env_steps]
        path.write_text("".join(ln + "\n" for ln in lines))


def buffer_specs(policy: Any, cfg: TrainConfig) -> dict[str, Any]:
    """Preallocated rollout fields: every observation modality, the chain, log-probs, values, ..."""
    obs = {
        k: ((), TEXT) if k == "instruction" else (tuple(v), _DTYPES[k]) for k, v in policy.obs_spec.items()
    }
    specs = ppo_specs(obs, ft_steps=policy.ft_steps, horizon=policy.horizon, action_dim=policy.action_dim)
    specs["valid"] = ((), torch.float32)
    specs["cond"] = ((cfg.policy.cond_dim,), torch.float32)  # reused by the update when encoders are frozen
    return specs


def advantages_for(buffer: RolloutBuffer, last_value: torch.Tensor, cfg: TrainConfig, g: int) -> tuple:
    """(T, N) advantages and value targets: GAE over decisions, or group-relative episode returns."""
    data = buffer.get()
    if cfg.algo.advantage == "gae":
        return gae_advantages(
            data["rewards"], data["values"], data["dones"], last_value, cfg.algo.gamma, cfg.algo.gae_lambda
        )
    first = data["rewards"] * data["valid"]  # (T, N) rewards of each env's first episode
    episode_return = first.sum(0).view(-1, g)  # (N / G, G)
    adv = (
        grpo_advantages(episode_return, scale=cfg.algo.group_std).view(1, -1).expand_as(first) * data["valid"]
    )  # (T, N)
    return adv.contiguous(), torch.zeros_like(adv)


# ----------------------------------------------------------------------------------------------- the job
def main(cfg: TrainConfig, run_dir: Path) -> dict:
    """Run the whole pipeline for ``cfg`` inside ``run_dir``."""
    start = time.perf_counter()
    apply_visible_devices(cfg.dist, cfg.device.type)
    rt = Runtime.from_config(cfg.device)
    if cfg.algo.advantage == "grpo" and cfg.env.num_envs % cfg.algo.group_size:
        raise ValueError(f"env.num_envs={cfg.env.num_envs} must be a multiple of algo.group_size")
    with process_group(cfg.dist, rt.dist_backend, rt.device) as info:
        if rt.type == "cpu" and cfg.device.threads == 0 and info.world_size > 1:
            # ranks on one host share its cores; oversubscribed OpenMP threads spin against each other
            local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
        logger = Logger(run_dir, rank=info.rank, tensorboard=cfg.log.tensorboard, progress=cfg.log.progress)
        try:
            summary, _ = fine_tune(cfg, run_dir, rt, info, logger, start)
            return summary
        finally:
            logger.close()


def fine_tune(
    cfg: TrainConfig, run_dir: Path, rt: Runtime, info: DistInfo, logger: Logger, start: float
) -> dict:
    algo, device = cfg.algo, rt.device
    rt.manual_seed(seed_for_rank(cfg.seed, info.rank))
    policy, init_path = initial_policy(cfg, rt, info, run_dir)
    reference = (  # the frozen pre-trained policy the regulariser pulls toward
        copy.deepcopy(policy).eval().requires_grad_(False)
        if algo.reg != "none" and algo.reg_coef > 0
        else None
    )
    critic = Critic(cfg.policy.cond_dim).to(device)
    actor_params = [p for p in policy.parameters() if p.requires_grad]
    learner = Learner(
        policy=policy,
        critic=critic,
        actor_optim=torch.optim.AdamW(actor_params, lr=algo.lr, weight_decay=algo.weight_decay),
        critic_optim=torch.optim.AdamW(critic.parameters(), lr=algo.critic_lr),
        scaler=rt.grad_scaler(),
        reference=reference,
    )
    monitor = GradMonitor(algo.grad_monitor_window, algo.grad_spike_sigma, logger=logger)
    guard = RollbackGuard(algo.rollback_drop, logger=logger)
    snapshot = StateSnapshot(
        {"policy": policy, "critic": critic}, [learner.actor_optim, learner.critic_optim]
    )
    ckpt_root, stable_root = run_dir / "checkpoints", run_dir / "checkpoints" / "stable"

    # ---- resume or start: the BC success rate is measured once and carried in every checkpoint
    first_it, env_steps, bc_success = 0, 0, None
    if cfg.resume and checkpoint.exists(ckpt_root):
        ckpt = checkpoint.load(ckpt_root, map_location=device)
        restore(ckpt, learner, monitor, guard)
        first_it, env_steps = ckpt.step, int(ckpt.extra["env_steps"])
        bc_success = ckpt.extra["bc_success_rate"]
        if info.is_main:
            truncate_metrics(run_dir, env_steps)
            logger.event("resume", f"resumed from {ckpt.path.name}", env_steps, iteration=first_it)
    broadcast_parameters([policy, critic], info)
    if bc_success is None:
        bc_success = held_out(policy, cfg, rt) if info.is_main else float("nan")
        logger.log({"eval/success_rate": bc_success}, step=0)
    snapshot.capture()

    # ---- PPO
    venv = make_envs(cfg.env, policy.n_action_steps, cfg.env.num_envs, seed_for_rank(cfg.seed, info.rank))
    buffer = RolloutBuffer(algo.n_steps, cfg.env.num_envs, buffer_specs(policy, cfg), device)
    clip_eps = clip_schedule(algo.clip_eps, algo.clip_eps_final, policy.ft_steps, device)
    grpo = algo.advantage == "grpo"
    window = [0.0, 0.0]  # successes and episodes since the last checkpoint (a restart begins a new window)
    try:
        iterations = logger.progress(
            range(first_it, algo.iterations), total=algo.iterations - first_it, desc="ppo"
        )
        for it in iterations:
            t_it = time.perf_counter()
            seed = iteration_seed(cfg, info, it)
            gen = torch.Generator(device=device).manual_seed(seed)
            policy.eval()  # sampling: no augmentation
            last_value, stats = collect_rollout(
                policy, critic, venv, buffer, n_steps=algo.n_steps, seeds=env_seeds(cfg, seed), gamma=algo.gamma,
                device=device, generator=gen, autocast=rt.autocast, first_episode_only=grpo,
            )  # fmt: skip
            t_roll = time.perf_counter() - t_it
            adv, ret = advantages_for(buffer, last_value, cfg, algo.group_size)
            policy.train()
            losses = ppo_update(
                learner, buffer, adv, ret, algo, clip_eps=clip_eps, runtime=rt, info=info,
                generator=torch.Generator().manual_seed(seed), monitor=monitor, snapshot=snapshot,
                logger=logger, step=env_steps, use_critic=not grpo,
                train_actor=grpo or it >= algo.critic_warmup,
            )  # fmt: skip
            counts = sum_metrics(
                {"n": stats.env_steps, "ep": stats.episodes, "ok": stats.successes}, info, device
            )
            env_steps += int(counts["n"])
            rollout_success = counts["ok"] / counts["ep"] if counts["ep"] else float("nan")
            window[0] += counts["ok"]
            window[1] += counts["ep"]
            metrics = mean_metrics(losses, info, device)
            metrics.update({
                "rollout/success_rate": rollout_success,
                "rollout/episodes": counts["ep"],
                "rollout/mean_return": sum(stats.returns) / max(len(stats.returns), 1),
                "rollout/advantage_std": float(adv.std()),
                "time/rollout_s": t_roll,
                "time/iteration_s": time.perf_counter() - t_it,
                "time/sps": counts["n"] / (time.perf_counter() - t_it),
                "train/iteration": it + 1,
            })  # fmt: skip
            if (it + 1) % cfg.log.every == 0 or it + 1 == algo.iterations:
                logger.log(metrics, step=env_steps)
            if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == algo.iterations:
                # the guard judges the training episodes since the last checkpoint (none ended: no verdict)
                rollback = False
                if info.is_main and window[1] > 0:
                    rollback = guard.update(window[0] / window[1], it + 1).rollback
                window = [0.0, 0.0]
                if broadcast_flag(rollback, info, device) and checkpoint.exists(stable_root):
                    restore_stable(stable_root, learner, rt, logger, env_steps)
                if info.is_main:
                    extra = {"env_steps": env_steps, "bc_success_rate": bc_success, "init": str(init_path)}
                    save_policy(
                        ckpt_root, it + 1, policy, env_cfg=cfg.env, policy_cfg=cfg.policy,
                        extra_state=training_state(learner, monitor, guard), metrics=metrics, extra=extra,
                    )  # fmt: skip
                    if not rollback:
                        save_policy(
                            stable_root, it + 1, policy, env_cfg=cfg.env, policy_cfg=cfg.policy, keep=1
                        )
                barrier(info)
    finally:
        venv.close()

    # ---- after PPO: the same held-out seeds, a curve and a video
    summary: dict[str, Any] = {}
    if info.is_main:
        ppo_success = held_out(policy, cfg, rt)
        logger.log({"eval/success_rate": ppo_success}, step=env_steps)
        artifacts(cfg, run_dir, policy, rt)
        summary = {
            "bc_success_rate": bc_success,
            "ppo_success_rate": ppo_success,
            "env_steps": env_steps,
            "iterations": algo.iterations,
            "world_size": info.world_size,
            "checkpoint": str(ckpt_root / "latest"),
            "wall_time_s": round(time.perf_counter() - start, 1),
        }
    barrier(info)
    return (summary if info.is_main else None), learner


def restore_stable(stable_root: Path, learner: Learner, rt: Runtime, logger: Logger, step: int) -> None:
    """Roll the policy back to the last stable checkpoint (every rank loads the same weights)."""
    ckpt = checkpoint.load(stable_root, map_location=rt.device)
    checkpoint.load_state(learner.policy, ckpt.state["policy"], name="policy")
    logger.event("rollback", f"policy restored from stable checkpoint {ckpt.path.name}", step)


def artifacts(cfg: TrainConfig, run_dir: Path, policy: Any, rt: Runtime) -> None:
    """Success rate against environment steps (PNG) and an mp4 of a few held-out episodes."""
    from diffpolicy.plots import plot_curve

    try:
        plot_curve(run_dir / "metrics.jsonl", "rollout/success_rate", run_dir / "success_rate.png")
    except ValueError as exc:  # no episode ended during the rollouts: nothing to draw
        print(f"no success-rate curve: {exc}", flush=True)
    if cfg.video_episodes:
        record_video(
            policy, cfg.env, str(run_dir / "ppo.mp4"), n_action_steps=policy.n_action_steps,
            n_episodes=cfg.video_episodes, seed=cfg.eval_seed, device=rt.device,
        )  # fmt: skip


if __name__ == "__main__":
    launch("train", main)
