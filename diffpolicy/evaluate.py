"""``python -m diffpolicy.evaluate checkpoint=PATH n_episodes=100``: success rate of a checkpoint.

Loads the policy with :func:`diffpolicy.policy_io.load_policy`, runs :func:`diffpolicy.evaluation.evaluate`
(the sampling path training rollouts use too) on the seeds of ``split``: ``test`` (the default, 1 000 000 + i:
the seeds ``train`` reports its figure on) or ``val`` (100 000 + i: the seeds every choice is made on;
demonstrations use seeds from 0), records ``video_episodes`` episodes to ``eval.mp4`` and, when the checkpoint's run directory holds
a ``metrics.jsonl``, plots its training curve into the run directory. The policy samples under the protocol
its checkpoint records (``train`` writes the one its figure was reported under; ``protocol=noise_free |
exploration | dppo`` or ``deterministic=true|false`` override it; :data:`diffpolicy.config.PROTOCOLS`), so
evaluate says what train said. Prints one
JSON line last:
``{"success_rate", "success_ci", "failures", "n_episodes", "mean_return", ...}`` (``failures``: reason ->
count of the failed episodes, from the env's ``info["outcome"]``).

``split=val reachability_tries=16`` adds the reachability of the failed scenes (a measurement that chooses
exploration settings, so it runs on validation seeds only): for each validation scene the policy
failed, ``reachability_tries`` exploratory episodes (the stochastic chain; ``explore_std`` adds action noise
held per ``explore_hold`` = step | chunk on top of the deterministic chain) and the fraction of those scenes
where at least one succeeded (:func:`diffpolicy.evaluation.reachability`).
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path
from typing import Any

from diffpolicy import evaluation
from diffpolicy.cli import launch
from diffpolicy.config import EvaluateConfig
from diffpolicy.device import Runtime
from diffpolicy.policy_io import apply_protocol, load_policy, sampling_protocol

CURVE_KEYS = ("losses/bc", "rollout/success_rate", "losses/policy")
"""Metrics plotted (when present) from the checkpoint's run directory."""


def find_metrics(checkpoint_path: str | Path) -> Path | None:
    """The ``metrics.jsonl`` of the run that wrote a checkpoint: next to the checkpoint root or above it.

    Checkpoints live in ``<run_dir>/checkpoints/step_*`` (or ``<run_dir>/checkpoints`` is given), so the
    search walks up at most three directories from ``checkpoint_path``.
    """
    path = Path(checkpoint_path).resolve()
    for parent in [path, *path.parents][:4]:
        candidate = parent / "metrics.jsonl"
        if candidate.is_file():
            return candidate
    return None


def training_curves(metrics: Path, out_dir: Path) -> list[str]:
    """Plot every metric of :data:`CURVE_KEYS` present in ``metrics`` into ``out_dir``; copy existing PNGs."""
    from diffpolicy.plots import plot_curve

    written: list[str] = []
    for png in sorted(metrics.parent.glob("*.png")):  # curves the training run already drew
        if png.parent.resolve() == out_dir.resolve():
            continue
        shutil.copy2(png, out_dir / png.name)
        written.append(str(out_dir / png.name))
    for key in CURVE_KEYS:
        name = f"curve_{key.replace('/', '_')}.png"
        if str(out_dir / name) in written:
            continue
        try:
            written.append(str(plot_curve(metrics, key, out_dir / name)))
        except ValueError:  # the run did not log this metric
            continue
    return written


def main(cfg: EvaluateConfig, run_dir: Path) -> dict[str, Any]:
    """Evaluate ``cfg.checkpoint`` on ``cfg.n_episodes`` held-out episodes; returns the summary."""
    t0 = time.perf_counter()
    runtime = Runtime.from_config(cfg.device)
    overrides = {} if cfg.num_envs is None else {"num_envs": cfg.num_envs}
    policy, env_cfg, ckpt = load_policy(cfg.checkpoint, runtime.device, env_overrides=overrides)
    if cfg.env_kwargs:
        env_cfg = dataclasses.replace(env_cfg, kwargs={**env_cfg.kwargs, **cfg.env_kwargs})
    if cfg.n_action_steps is not None:
        room = policy.horizon - policy.n_obs_steps + 1  # a chunk's rows from the current observation on
        if cfg.n_action_steps > room:
            raise ValueError(
                f"n_action_steps={cfg.n_action_steps} exceeds the {room} rows a chunk has to execute"
            )
        policy.n_action_steps = cfg.n_action_steps
    deterministic, protocol, source = sampling_protocol(ckpt, cfg.deterministic, cfg.protocol)
    apply_protocol(policy, protocol)
    if cfg.selector:  # a multi-stage task's hierarchy: the selector names the sub-task the policy acts on
        from diffpolicy.hierarchy import hierarchy

        policy = hierarchy(policy, cfg.selector, person=cfg.correct)
    runtime.manual_seed(cfg.eval_seed)
    num_envs = min(env_cfg.num_envs, cfg.n_episodes)  # the waves: the order sampled noise is drawn in
    result = evaluation.evaluate(
        policy,
        env_cfg,
        n_action_steps=policy.n_action_steps,
        n_episodes=cfg.n_episodes,
        seed=cfg.eval_seed,
        num_envs=num_envs,
        device=runtime.device,
        deterministic=deterministic,
        autocast=runtime.autocast,
    )
    summary: dict[str, Any] = {
        **result.success_fields(),  # success_rate, success_ci, failures (None without a success notion)
        "drops": result.drops(),  # dropped / missed_tray by how the grasp was lost: released | slipped
        "n_episodes": result.episodes,
        "mean_return": result.mean_return,
        "return_ci": [round(v, 2) for v in result.return_ci()],  # 95 % Student-t interval of the mean
        "env_steps": result.env_steps,
        "checkpoint": str(ckpt.path),
        "step": ckpt.step,
        # whose weights these are: a train checkpoint of algo.keep_best deploys an earlier iteration's (0: BC)
        "deployed_iteration": int(ckpt.extra.get("deployed", ckpt.step)),
        "split": cfg.split,  # test: the seeds of train's reported figure; val: the seeds choices are made on
        "first_seed": cfg.eval_seed,
        "num_envs": num_envs,
        # noise_free | exploration, and whence: the checkpoint's own (what train reported), override, default
        "protocol": protocol,
        "protocol_from": source,
        **({"env_kwargs": dict(cfg.env_kwargs)} if cfg.env_kwargs else {}),  # changed for this evaluation
        **({"selector": cfg.selector} if cfg.selector else {}),  # the hierarchy's high level
        **({"n_action_steps": cfg.n_action_steps} if cfg.n_action_steps is not None else {}),
    }
    if cfg.correct:  # the success above had a person correcting the selector: say so, keep what was said
        from diffpolicy.hierarchy import write_corrections

        path = write_corrections(policy.corrections, run_dir / "corrections", env_cfg)
        summary["person"] = {"decisions": policy.decisions, "corrected": len(policy.corrections),
                             "corrections": None if path is None else str(path)}  # fmt: skip
    if cfg.reachability_tries > 0:
        failed_at = [i for i, ok in enumerate(result.successes) if not ok]
        failed = [cfg.eval_seed + i for i in failed_at]
        reasons = [result.outcomes[i] for i in failed_at]
        explore = cfg.explore_std > 0
        summary["reachability"] = evaluation.reachability(
            policy, env_cfg, failed, tries=cfg.reachability_tries, n_action_steps=policy.n_action_steps,
            num_envs=min(env_cfg.num_envs, max(1, len(failed) * cfg.reachability_tries)), device=runtime.device,
            deterministic=explore, seed=cfg.eval_seed + 1,
            exploration=evaluation.Exploration(cfg.explore_std, cfg.explore_hold) if explore else None,
            autocast=runtime.autocast, reasons=reasons,
        )  # fmt: skip
    if cfg.video_episodes > 0:
        video = run_dir / f"eval.{cfg.video_format}"
        frames = evaluation.record_video(
            policy,
            env_cfg,
            str(video),
            n_action_steps=policy.n_action_steps,
            n_episodes=cfg.video_episodes,
            seed=cfg.eval_seed,
            device=runtime.device,
        )
        summary["video"] = str(video) if frames else None
    metrics = find_metrics(cfg.checkpoint)
    summary["curves"] = training_curves(metrics, run_dir) if metrics is not None else []
    summary["wall_time_s"] = round(time.perf_counter() - t0, 2)
    return summary


if __name__ == "__main__":
    launch("evaluate", main)
