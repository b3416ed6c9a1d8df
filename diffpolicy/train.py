"""``python -m diffpolicy.train env=mujoco_pick``: collect (cached), pre-train by BC (cached), PPO, evaluate.

Reads top to bottom: device and process group -> the pre-trained policy (``policy.init`` or the cached BC
checkpoint, trained on first use) -> held-out evaluation of BC -> PPO iterations (seeded rollout into the
preallocated buffer, GAE or group-relative advantages, clipped update of the last K' denoising steps,
checkpoints, rollback guard) -> the same held-out evaluation after PPO -> PNG, mp4 and the JSON summary
(``bc_success_rate``, ``ppo_success_rate``, ``bc_return``, ``ppo_return`` with their 95 % intervals,
``env_steps``, ``wall_time_s``), printed last on stdout.

Every PPO iteration starts from environments reset with seeds derived from (seed, rank, iteration) and
draws its sampling noise and minibatch order from generators seeded the same way, so the state at an
iteration boundary is only what a checkpoint holds: ``resume=true`` continues a killed run and ends with
exactly the metrics of an uninterrupted one on the CPU.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpolicy import checkpoint
from diffpolicy.cli import launch
from diffpolicy.config import SamplingConfig, TrainConfig
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
from diffpolicy.evaluation import (
    EvalResult,
    failure_counts,
    held_out,
    mean_interval,
    protocol_of,
    record_video,
)
from diffpolicy.logger import Logger
from diffpolicy.policy_io import load_policy, sampling_of, save_policy
from diffpolicy.rl.learner import Learner, make_learner
from diffpolicy.rl.stability import RollbackGuard


# ------------------------------------------------------------------------------------------------ helpers
def iteration_seed(cfg: TrainConfig, info: DistInfo, iteration: int) -> int:
    """Seed of everything random in one PPO iteration of one rank (env resets, noise, minibatches)."""
    return seed_for_rank(cfg.seed, info.rank) * 1_000_003 + 7919 * (iteration + 1)


def initial_policy(
    cfg: TrainConfig, rt: Runtime, info: DistInfo, run_dir: Path, timings: dict[str, float] | None = None
) -> tuple[Any, Path]:
    """The policy PPO starts from: ``policy.init`` or the cached BC checkpoint (rank 0 trains it once).
    ``timings`` receives this process's seconds of demonstration collection and BC (``collect``, ``bc``),
    when it ran them.

    On first use of a cache, rank 0 alone collects the demonstrations and trains BC, which can take far
    longer than ``dist.timeout_s``; the other ranks wait in :func:`diffpolicy.distributed.main_rank_first`
    (bounded by rank 0's liveness, not by the collective timeout) and then read the cached checkpoint. BC
    is not trained data-parallel: its result would then depend on the world size, yet it is cached under a
    key without it and shared with single-process runs and ``diffpolicy.pretrain``.
    """
    if cfg.policy.init:
        path = Path(cfg.policy.init)
    else:
        from diffpolicy.bc import pretrained_checkpoint
        from diffpolicy.distributed import main_rank_first

        def cached() -> Path:
            return pretrained_checkpoint(
                cfg.env,
                cfg.policy,
                cfg.bc,
                rt,
                cfg.cache_dir,
                seed=cfg.seed,
                run_dir=run_dir / "bc",
                progress=cfg.log.progress,
                timings=timings,
            )

        path = main_rank_first(  # rank 0 collects and trains on first use; the others then hit the cache
            cached,
            info,
            rt.device,
            Path(cfg.cache_dir) / "bc",
            stall_s=cfg.dist.timeout_s,
            what="demonstration collection and behaviour cloning",
        )
    policy, _, _ = load_policy(path, rt.device)
    if isinstance(cfg.algo, SamplingConfig):  # the learner's K', eta, std floor, whatever the checkpoint used
        policy.set_sampling(**cfg.algo.sampling())
    policy.sampler_backend = "compiled" if cfg.policy.compile else "auto"
    policy.set_freeze_encoders(
        cfg.policy.freeze_encoders or not getattr(cfg.algo, "finetune_encoders", False)
    )
    return policy.train(), path


def truncate_metrics(run_dir: Path, env_steps: int) -> None:
    """On resume, drop metric lines written after the checkpoint so the file reads like one clean run."""
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        lines = [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= env_steps]
        path.write_text("".join(ln + "\n" for ln in lines))


# ----------------------------------------------------------------------------------------------- the job
def main(cfg: TrainConfig, run_dir: Path) -> dict:
    """Run the whole pipeline for ``cfg`` inside ``run_dir``."""
    start = time.perf_counter()
    apply_visible_devices(cfg.dist, cfg.device.type)
    rt = Runtime.from_config(cfg.device)
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


@dataclass
class Progress:
    """Where a fine-tuning run stands: what a checkpoint restores, and what this process has timed."""

    iteration: int = 0
    env_steps: int = 0
    bc: dict[str, Any] | None = None
    """The BC policy's evaluation (test, and ``val``), measured once and carried in every checkpoint."""
    guard_steps: int = 0
    """Env steps of the rollback guard's validation episodes (``algo.rollback_episodes``)."""
    deployed: int = 0
    """The iteration whose weights the policy holds: the last one, the stable one after a rollback, or with
    ``algo.keep_best`` the one the guard judged best on validation (0: the pre-trained policy)."""
    seconds: float = 0.0
    """This process's seconds of fine-tuning iterations, and the env steps they took (``env_sps``)."""
    steps_timed: int = 0
    split: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    """This process's seconds of env stepping, policy sampling and updates."""
    stages: dict[str, float] = field(default_factory=dict)
    """This process's seconds outside the iterations: ``collect`` and ``bc`` (when the BC was not cached),
    ``bc_eval`` (BC's held-out evaluation, when not restored from a checkpoint), ``guard`` (the rollback guard's
    validation episodes), ``eval`` (the final one)."""


def fine_tune(
    cfg: TrainConfig, run_dir: Path, rt: Runtime, info: DistInfo, logger: Logger, start: float
) -> tuple[dict | None, Learner]:
    """BC evaluation, iterations of the learner ``algo=`` chose (chain, residual, fpo, filtered_bc), evaluation;
    -> (summary, learner)."""
    rt.manual_seed(seed_for_rank(cfg.seed, info.rank))
    stages: dict[str, float] = {}
    policy, init_path = initial_policy(cfg, rt, info, run_dir, stages)
    # again: BC trained here (an empty cache) draws from the global RNG streams, BC read from the cache does
    # not; fine-tuning must start from the same streams either way (a run is a function of config and seed)
    rt.manual_seed(seed_for_rank(cfg.seed, info.rank))
    learner = make_learner(cfg, rt, info, policy, logger)
    guard = RollbackGuard(cfg.algo.rollback_drop, logger=logger)
    progress = resume(cfg, run_dir, rt, info, logger, learner, guard)
    progress.stages.update(stages)
    broadcast_parameters(learner.modules(), info)
    if progress.bc is None:
        t0 = time.perf_counter()
        progress.bc = evaluate_bc(cfg, rt, info, logger, learner)
        progress.stages["bc_eval"] = time.perf_counter() - t0
    # an env without a success notion (Hopper) gets no success metrics, curve or summary fields: None, not 0.0
    goal = bool(progress.bc.get("reports_success", True))
    guard.relative = not goal  # without success the guard judges the mean return
    if progress.iteration == 0 and info.is_main:
        guard_baseline(cfg, run_dir, learner, guard, progress.bc, goal)
    learner.begin()
    try:
        iterate(cfg, run_dir, rt, info, logger, learner, guard, progress, init_path, goal)
    finally:
        learner.close()
    summary = (
        summarize(cfg, run_dir, rt, info, logger, learner, progress, goal, start) if info.is_main else None
    )
    barrier(info)
    return summary, learner


def resume(
    cfg: TrainConfig, run_dir: Path, rt: Runtime, info: DistInfo, logger: Logger, learner: Learner,
    guard: RollbackGuard,
) -> Progress:  # fmt: skip
    """With ``resume=true`` and a checkpoint: the learner, guard, RNG and progress it holds; else a fresh start."""
    ckpt_root = run_dir / "checkpoints"
    if not (cfg.resume and checkpoint.exists(ckpt_root)):
        return Progress()
    ckpt = checkpoint.load(ckpt_root, map_location=rt.device)
    recorded, now = sampling_of(ckpt), getattr(learner.policy, "sampling", None)
    # the config's settings must match; a noise scale the learner measured comes back with its state
    recorded.pop("noise_scale", None)
    now = None if now is None else {k: v for k, v in now.items() if k != "noise_scale"}
    if recorded and now is not None and recorded != now:  # the run's chains would change mid-run
        raise ValueError(
            f"resume: {ckpt.path} sampled its chains with {recorded}, this config with {now}; give the run's "
            "algo.ft_steps / algo.eta / algo.min_std, or a new run directory"
        )
    learner.load_state(ckpt.state)
    guard.best, guard.best_step = ckpt.state["guard"]["best"], ckpt.state["guard"]["best_step"]
    guard.stable_step = ckpt.state["guard"]["stable_step"]
    checkpoint.set_rng_state(ckpt.state["rng"])
    progress = Progress(
        iteration=ckpt.step, env_steps=int(ckpt.extra["env_steps"]), bc=ckpt.extra["bc_eval"],
        guard_steps=int(ckpt.extra.get("guard_env_steps", 0)), deployed=int(ckpt.extra.get("deployed", ckpt.step)),
    )  # fmt: skip
    if info.is_main:
        truncate_metrics(run_dir, progress.env_steps)
        logger.event("resume", f"resumed from {ckpt.path.name}", progress.env_steps, iteration=ckpt.step)
    return progress


def guard_baseline(
    cfg: TrainConfig, run_dir: Path, learner: Learner, guard: RollbackGuard, bc: dict, goal: bool
) -> None:
    """When the guard judges validation episodes (``algo.rollback_episodes``), the pre-trained policy is its
    first verdict: BC's figure on those same episodes (the first n of its validation evaluation) sets the best,
    and the policy is written as the stable checkpoint of step 0, so a first update that harms the deployed
    policy is rolled back to BC itself; with ``algo.keep_best`` it is also the first best checkpoint."""
    n = cfg.algo.rollback_episodes
    val = bc.get("val")
    if not n or val is None or len(val["returns"]) < n:
        return
    first = val["successes"][:n] if goal else val["returns"][:n]
    guard.update(float(np.mean(first)), 0)
    save_weights(learner, cfg, run_dir / "checkpoints" / "stable", 0)
    if cfg.algo.keep_best:
        save_weights(learner, cfg, run_dir / "checkpoints" / "best", 0)


def evaluate_bc(cfg: TrainConfig, rt: Runtime, info: DistInfo, logger: Logger, learner: Learner) -> dict:
    """The BC policy on both splits (rank 0): validation (choices) and test (the reported figure), logged at
    step 0; the other ranks hold an empty record (they never report)."""
    bc = {"successes": [], "outcomes": [], "returns": [], "reports_success": True, "val": None}
    if not info.is_main:
        return bc
    before = held_out(learner.policy, cfg, rt, "test")
    val = eval_record(held_out(learner.policy, cfg, rt, "val")) if cfg.val_episodes else None
    bc = {**eval_record(before), "val": val}
    bc["protocols"] = {  # the test figure under each further protocol the summary reports
        name: eval_record(held_out(learner.policy, cfg, rt, "test", protocol=name))
        for name in cfg.report_protocols
    }
    first = {"eval/mean_return": float(np.mean(bc["returns"]))}
    if before.reports_success:
        first["eval/success_rate"] = sum(bc["successes"]) / len(bc["successes"])
    if val is not None:
        first.update(val_scalars(val))
    logger.log(first, step=0)
    return bc


def iterate(
    cfg: TrainConfig, run_dir: Path, rt: Runtime, info: DistInfo, logger: Logger, learner: Learner,
    guard: RollbackGuard, progress: Progress, init_path: Path, goal: bool,
) -> None:  # fmt: skip
    """The fine-tuning iterations from ``progress.iteration``: seeded rollout, update, sums over ranks,
    metrics, and at every checkpoint the rollback guard's verdict and the checkpoints (``progress`` moves).
    With ``algo.keep_best`` the validation-best weights are kept apart and restored after the last iteration."""
    algo = cfg.algo
    ckpt_root, stable_root = run_dir / "checkpoints", run_dir / "checkpoints" / "stable"
    best_root = ckpt_root / "best"
    window = [0.0, 0.0, 0.0]  # successes, episodes, summed returns since the last checkpoint (restart: new)
    iterations = logger.progress(
        range(progress.iteration, algo.iterations), total=algo.iterations - progress.iteration, desc="ppo"
    )
    for it in iterations:
        t_it = time.perf_counter()
        seed = iteration_seed(cfg, info, it)
        stats = learner.rollout(seed)
        t_roll = time.perf_counter() - t_it
        losses = learner.update(seed, progress.env_steps, it)
        counts = sum_metrics(
            {"n": stats.env_steps, "ep": stats.episodes, "ok": stats.successes, "ret": sum(stats.returns)},
            info, rt.device,
        )  # fmt: skip
        progress.env_steps += int(counts["n"])
        window = [window[0] + counts["ok"], window[1] + counts["ep"], window[2] + counts["ret"]]
        t_total = time.perf_counter() - t_it
        progress.seconds, progress.steps_timed = (
            progress.seconds + t_total,
            progress.steps_timed + int(counts["n"]),
        )
        split = progress.split
        progress.split = [split[0] + stats.env_s, split[1] + stats.policy_s, split[2] + t_total - t_roll]
        metrics = mean_metrics(losses, info, rt.device)
        if goal:
            metrics["rollout/success_rate"] = counts["ok"] / counts["ep"] if counts["ep"] else float("nan")
        metrics.update({
            "rollout/episodes": counts["ep"],
            "rollout/mean_return": sum(stats.returns) / max(len(stats.returns), 1),
            "time/rollout_s": t_roll,
            "time/policy_s": stats.policy_s,
            "time/env_s": stats.env_s,
            "time/update_s": t_total - t_roll,
            "time/iteration_s": t_total,
            "time/sps": counts["n"] / t_total,
            "train/iteration": it + 1,
        })  # fmt: skip
        if (it + 1) % cfg.log.every == 0 or it + 1 == algo.iterations:
            logger.log(metrics, step=progress.env_steps)
        if (it + 1) % cfg.checkpoint_every == 0 or it + 1 == algo.iterations:
            # the guard judges validation episodes (algo.rollback_episodes), or else the training
            # episodes since the last checkpoint (none ended: no verdict); success, or the mean return
            rollback = False
            if info.is_main and algo.rollback_episodes:
                t_guard = time.perf_counter()
                judged = held_out(learner.policy, cfg, rt, "val", algo.rollback_episodes)
                progress.guard_steps += judged.env_steps
                progress.stages["guard"] = progress.stages.get("guard", 0.0) + time.perf_counter() - t_guard
                value = judged.success_rate if goal else judged.mean_return
                logger.log(
                    {f"val/guard_{'success_rate' if goal else 'return'}": value}, step=progress.env_steps
                )
                rollback = guard.update(value, it + 1).rollback
            elif info.is_main and window[1] > 0:
                rollback = guard.update(window[0 if goal else 2] / window[1], it + 1).rollback
            window = [0.0, 0.0, 0.0]
            progress.deployed = it + 1
            if broadcast_flag(rollback, info, rt.device) and checkpoint.exists(stable_root):
                progress.deployed = restore_weights(stable_root, learner, rt, logger, progress.env_steps)
            if algo.keep_best and info.is_main and guard.best_step == it + 1:  # a new best never rolls back
                save_weights(learner, cfg, best_root, it + 1)
            if algo.keep_best and it + 1 == algo.iterations:  # early stopping: deploy the validation best
                if broadcast_flag(guard.best_step != progress.deployed, info, rt.device):
                    progress.deployed = restore_weights(
                        best_root, learner, rt, logger, progress.env_steps, event="keep_best"
                    )
            if info.is_main:
                save(learner, cfg, ckpt_root, stable_root, it + 1, guard, metrics, rollback,
                     extra={"env_steps": progress.env_steps, "bc_eval": progress.bc, "init": str(init_path),
                            "guard_env_steps": progress.guard_steps, "protocol": protocol_of(cfg),
                            "deployed": progress.deployed})  # fmt: skip
            barrier(info)


def summarize(
    cfg: TrainConfig, run_dir: Path, rt: Runtime, info: DistInfo, logger: Logger, learner: Learner,
    progress: Progress, goal: bool, start: float,
) -> dict[str, Any]:  # fmt: skip
    """After fine-tuning (rank 0): the same held-out seeds as BC's, curves and a video; -> the summary."""
    t0 = time.perf_counter()
    after_val = eval_record(held_out(learner.policy, cfg, rt, "val")) if cfg.val_episodes else None
    after = held_out(learner.policy, cfg, rt, "test")  # once, at the end: the reported figure
    protocols = {
        name: protocol_row(
            progress.bc.get("protocols", {}).get(name),
            eval_record(held_out(learner.policy, cfg, rt, "test", protocol=name)),
            goal,
        )
        for name in cfg.report_protocols
    }
    progress.stages["eval"] = time.perf_counter() - t0
    goal = goal and after.reports_success
    last = {"eval/mean_return": after.mean_return}
    if goal:
        last["eval/success_rate"] = after.success_rate
    if after_val is not None:
        last.update(val_scalars(after_val))
    logger.log(last, step=progress.env_steps)
    artifacts(cfg, run_dir, learner.policy, rt, success=goal)
    bc = progress.bc
    n_bc, bc_returns = len(bc["successes"]), bc.get("returns", [])
    bc_rate = sum(bc["successes"]) / n_bc
    return {
        "bc_success_rate": bc_rate if goal else None,
        "ppo_success_rate": after.success_rate if goal else None,
        "bc_ci": [round(v, 3) for v in EvalResult(bc_rate, 0.0, n_bc, 0, bc["successes"]).wilson()]
        if goal
        else None,
        "ppo_ci": [round(v, 3) for v in after.wilson()] if goal else None,
        # mean episode return with its 95 % Student-t interval (checkpoints before returns: none)
        "bc_return": round(float(np.mean(bc_returns)), 2) if bc_returns else None,
        "ppo_return": round(after.mean_return, 2),
        "bc_return_ci": [round(v, 2) for v in mean_interval(bc_returns)] if bc_returns else None,
        "ppo_return_ci": [round(v, 2) for v in after.return_ci()],
        "eval_episodes": after.episodes,
        "protocol": protocol_of(cfg),  # how both figures were sampled; the checkpoints carry it
        "protocols": protocols,  # report_protocols: the same test seeds under further protocols
        # which seeds each figure comes from: the top-level figures are the test split's
        "splits": {
            "test": {"first_seed": cfg.eval_seed, "episodes": after.episodes, "use": "reported figure"},
            "val": {"first_seed": cfg.val_seed, "episodes": cfg.val_episodes, "use": "every choice"},
        },
        "val": split_summary(bc.get("val"), after_val, goal),
        "failures": {
            "bc": failure_counts(bc["successes"], bc.get("outcomes", [])),
            "ppo": after.failures(),
        }
        if goal
        else None,
        "drops": after.drops(),  # the fine-tuned policy's drops by how the grasp was lost
        "by_kind": after.by_kind() or None,  # MujocoDialogue: the test figure per episode kind
        "learner": cfg.algo.learner,
        # the chain learner's measured exploration (algo.explore_tolerance: scale and curve), else None
        "exploration": getattr(learner, "exploration", None),
        "env_steps": progress.env_steps,
        "guard_env_steps": progress.guard_steps,  # the rollback guard's validation episodes
        "deployed_iteration": progress.deployed,  # whose weights were evaluated (0: the pre-trained policy)
        "env_sps": round(progress.steps_timed / progress.seconds, 1) if progress.seconds > 0 else None,
        # this process's seconds by stage (collect and bc: 0 when the BC came from the cache)
        "time_split_s": {
            **{k: round(progress.stages.get(k, 0.0), 1) for k in ("collect", "bc", "bc_eval")},
            "env": round(progress.split[0], 1),
            "policy": round(progress.split[1], 1),
            "update": round(progress.split[2], 1),
            # the guard's validation episodes in this process (a resumed run counts from its restart)
            "guard": round(progress.stages.get("guard", 0.0), 1),
            "eval": round(progress.stages.get("eval", 0.0), 1),
        },
        "iterations": cfg.algo.iterations,
        "world_size": info.world_size,
        "checkpoint": str(run_dir / "checkpoints" / "latest"),
        "wall_time_s": round(time.perf_counter() - start, 1),
    }


def eval_record(result: EvalResult) -> dict[str, Any]:
    """What a checkpoint keeps of an evaluation: per-episode successes, outcomes and returns."""
    return {"successes": result.successes, "outcomes": result.outcomes, "returns": result.returns,
            "reports_success": result.reports_success}  # fmt: skip


def protocol_row(bc: dict[str, Any] | None, after: dict[str, Any], goal: bool) -> dict[str, Any]:
    """One further protocol's test figures (``report_protocols``): the mean return with its 95 % interval, and
    the success rate where the env has one, for BC (None when its record predates the protocol) and after."""
    row: dict[str, Any] = {}
    for who, rec in (("bc", bc), ("ppo", after)):
        returns = rec["returns"] if rec else []
        row[f"{who}_return"] = round(float(np.mean(returns)), 2) if returns else None
        row[f"{who}_return_ci"] = [round(v, 2) for v in mean_interval(returns)] if returns else None
        if goal:
            row[f"{who}_success_rate"] = sum(rec["successes"]) / len(rec["successes"]) if rec else None
    return row


def val_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The validation metrics logged beside the test ones (``val/success_rate``, ``val/mean_return``)."""
    out = {"val/mean_return": float(np.mean(record["returns"]))}
    if record["reports_success"]:
        out["val/success_rate"] = sum(record["successes"]) / len(record["successes"])
    return out


def split_summary(
    bc: dict[str, Any] | None, after: dict[str, Any] | None, goal: bool
) -> dict[str, Any] | None:
    """The validation split's figures, BC and after fine-tuning (None when it was skipped, or the BC
    evaluation comes from a checkpoint written before the split existed)."""
    if after is None:
        return None

    def rates(record: dict[str, Any] | None) -> tuple[float | None, float | None]:
        if record is None:
            return None, None
        rate = sum(record["successes"]) / len(record["successes"]) if goal else None
        return rate, round(float(np.mean(record["returns"])), 2)

    (bc_rate, bc_ret), (rate, ret) = rates(bc), rates(after)
    return {"bc_success_rate": bc_rate, "ppo_success_rate": rate, "bc_return": bc_ret, "ppo_return": ret,
            "episodes": len(after["successes"])}  # fmt: skip


def save(
    learner: Learner,
    cfg: TrainConfig,
    ckpt_root: Path,
    stable_root: Path,
    iteration: int,
    guard: RollbackGuard,
    metrics: dict[str, float],
    rollback: bool,
    extra: dict[str, Any],
) -> None:
    """Write the PPO checkpoint (policy + everything to resume) and, unless rolled back, the stable one."""
    art_state, art_extra = learner.artifact()
    state = {
        **learner.state(),
        **art_state,
        "guard": {"best": guard.best, "best_step": guard.best_step, "stable_step": guard.stable_step},
        "rng": checkpoint.rng_state(),
    }
    policy = learner.saved_policy()
    save_policy(
        ckpt_root, iteration, policy, env_cfg=cfg.env, policy_cfg=cfg.policy, extra_state=state,
        metrics=metrics, extra={**extra, **art_extra},
    )  # fmt: skip
    if not rollback:
        save_weights(learner, cfg, stable_root, iteration)


def save_weights(learner: Learner, cfg: TrainConfig, root: Path, iteration: int) -> None:
    """Write the policy alone (what a rollback or ``keep_best`` restores) as the one checkpoint under ``root``."""
    art_state, art_extra = learner.artifact()
    save_policy(
        root, iteration, learner.saved_policy(), env_cfg=cfg.env, policy_cfg=cfg.policy, extra_state=art_state,
        extra={**art_extra, "protocol": protocol_of(cfg)}, keep=1,
    )  # fmt: skip


def restore_weights(
    root: Path, learner: Learner, rt: Runtime, logger: Logger, step: int, event: str = "rollback"
) -> int:
    """Load the trained weights of the checkpoint under ``root`` (``stable``: a rollback; ``best``: the
    validation best, event ``keep_best``) on every rank; -> its iteration."""
    ckpt = checkpoint.load(root, map_location=rt.device)
    learner.load_weights(ckpt.state)
    learner.on_rollback()
    logger.event(
        event, f"policy restored from {root.name} checkpoint {ckpt.path.name}", step, to_step=ckpt.step
    )
    return ckpt.step


def artifacts(cfg: TrainConfig, run_dir: Path, policy: Any, rt: Runtime, success: bool = True) -> None:
    """Success rate (when the env reports success) and return against environment steps (PNG), and an mp4 of a
    few held-out episodes."""
    from diffpolicy.plots import plot_curve

    curves = [("rollout/mean_return", "return.png")]
    if success:
        curves.insert(0, ("rollout/success_rate", "success_rate.png"))
    for key, name in curves:
        try:
            plot_curve(run_dir / "metrics.jsonl", key, run_dir / name)
        except ValueError as exc:  # no episode ended during the rollouts: nothing to draw
            print(f"no {key} curve: {exc}", flush=True)
    if cfg.video_episodes:
        record_video(
            policy, cfg.env, str(run_dir / "ppo.mp4"), n_action_steps=policy.n_action_steps,
            n_episodes=cfg.video_episodes, seed=cfg.eval_seed, device=rt.device,
        )  # fmt: skip


if __name__ == "__main__":
    launch("train", main)
