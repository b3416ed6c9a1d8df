"""Bimodal benchmark on ``ObstacleReach-v0``: a diffusion policy keeps both expert modes, a Gaussian averages them.

The expert passes the obstacle on the left or on the right at random, so the demonstrations are bimodal. A
diffusion policy (state observations, small 1-D U-Net) and the Gaussian MLP baseline (``kind=gaussian``,
same encoders) are behaviour-cloned on the same demonstrations with the same budget (epochs, batch size,
learning rate) by :func:`diffpolicy.bc.behaviour_cloning`, then evaluated with
:func:`diffpolicy.evaluation.evaluate` on held-out seeds (noise-free sampling: every DDIM step's mean for the
diffusion policy, which still draws its initial noise, and the mean chunk for the Gaussian).

``run(repeats=1, threads=2, **kw) -> dict`` with keys ``diffusion_success``, ``gaussian_success``, wall
times and the settings. Expected: diffusion >= 0.95, Gaussian <= 0.60.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpolicy.config import BCConfig, DeviceConfig, EncoderConfig, EnvConfig, PolicyConfig
from diffpolicy.device import Runtime
from diffpolicy.logger import Logger

ENV = EnvConfig(
    name="obstacle_reach",
    id="diffpolicy_envs:ObstacleReach-v0",
    obs_mode="state",
    num_envs=25,
    max_episode_steps=50,
)
"""ObstacleReach-v0 as in ``conf/env/obstacle_reach.yaml`` (50-step episodes), 25 evaluation environments."""

DEFAULTS: dict[str, Any] = {
    "n_demos": 200,
    "epochs": 100,
    "batch_size": 128,
    "lr": 1e-3,
    "eval_episodes": 100,
    "eval_seed": 100_000,
    "down_dims": [32, 64],
    "horizon": 16,
    "n_action_steps": 4,
    "deterministic": True,
    "seed": 0,
}
"""Benchmark settings; any can be overridden through ``run(**kw)``."""


def policy_config(kind: str, s: dict[str, Any]) -> PolicyConfig:
    """The small state-only policy of the benchmark (diffusion U-Net or Gaussian MLP of similar size)."""
    encoder = EncoderConfig(use_rgb=False, use_points=False, use_text=False, state_hidden=64, token_dim=64)
    return PolicyConfig(
        name=f"bimodal_{kind}",
        kind=kind,
        encoder=encoder,
        cond_dim=64,
        down_dims=list(s["down_dims"]),
        n_groups=8,
        step_embed_dim=64,
        horizon=int(s["horizon"]),
        n_action_steps=int(s["n_action_steps"]),
        gaussian_hidden=[256, 256],
    )


def train_and_evaluate(
    kind: str, demos: Path, s: dict[str, Any], work: Path, runtime: Runtime
) -> dict[str, Any]:
    """Behaviour-clone one policy kind on ``demos`` and evaluate it on held-out seeds."""
    from diffpolicy import evaluation
    from diffpolicy.bc import behaviour_cloning

    cfg = policy_config(kind, s)
    bc_cfg = BCConfig(epochs=int(s["epochs"]), batch_size=int(s["batch_size"]), lr=float(s["lr"]))
    run_dir = work / kind
    t0 = time.perf_counter()
    with Logger(run_dir, tensorboard=False, progress=False) as log:
        policy, metrics = behaviour_cloning(
            ENV, cfg, bc_cfg, demos, runtime, log, run_dir, int(s["seed"]), text_backend="hash", checkpoints=0
        )
    t1 = time.perf_counter()
    result = evaluation.evaluate(
        policy,
        ENV,
        n_action_steps=cfg.n_action_steps,
        n_episodes=int(s["eval_episodes"]),
        seed=int(s["eval_seed"]),
        num_envs=min(ENV.num_envs, int(s["eval_episodes"])),
        device=runtime.device,
        deterministic=bool(s["deterministic"]),
    )
    return {
        "success": result.success_rate,
        "final_loss": metrics["final_loss"],
        "steps": metrics["steps"],
        "train_s": round(t1 - t0, 2),
        "eval_s": round(time.perf_counter() - t1, 2),
        "params": sum(p.numel() for p in policy.parameters()),
    }


def run(repeats: int = 1, threads: int = 2, **kw: Any) -> dict[str, Any]:
    """Collect demonstrations, train both policies ``repeats`` times (seeds ``seed + r``), evaluate them.

    Args:
        repeats: independent trainings per policy kind; success rates are averaged.
        threads: torch intra-op threads.
        **kw: overrides of :data:`DEFAULTS` (e.g. ``epochs=5, eval_episodes=20``) and ``work_dir``.

    Returns:
        ``diffusion_success``, ``gaussian_success`` (means over repeats), ``*_runs`` (per repeat: success,
        final loss, steps, train / eval seconds, parameters), ``expert_success_rate``, ``wall_time_s`` and
        ``settings``.
    """
    from diffpolicy.demos import collect_demos

    unknown = sorted(set(kw) - set(DEFAULTS) - {"work_dir"})
    if unknown:
        raise ValueError(f"unknown bimodal benchmark options {unknown}; known: {sorted(DEFAULTS)}, work_dir")
    settings = {**DEFAULTS, **{k: v for k, v in kw.items() if k != "work_dir"}}
    torch.set_num_threads(threads)
    runtime = Runtime.from_config(DeviceConfig(type="cpu"))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bimodal-") as tmp:
        work = Path(kw.get("work_dir") or tmp)
        demos = collect_demos(ENV, int(settings["n_demos"]), 0, work / "demos")
        runs: dict[str, list[dict[str, Any]]] = {"diffusion": [], "gaussian": []}
        for r in range(repeats):
            s = {**settings, "seed": int(settings["seed"]) + r}
            for kind in runs:
                runs[kind].append(train_and_evaluate(kind, Path(demos["path"]), s, work / f"r{r}", runtime))
    return {
        "diffusion_success": float(np.mean([x["success"] for x in runs["diffusion"]])),
        "gaussian_success": float(np.mean([x["success"] for x in runs["gaussian"]])),
        "diffusion_runs": runs["diffusion"],
        "gaussian_runs": runs["gaussian"],
        "expert_success_rate": demos["success_rate"],
        "n_windows_steps": demos["steps"],
        "wall_time_s": round(time.perf_counter() - t0, 2),
        "settings": {**settings, "repeats": repeats, "threads": threads, "env": dataclasses.asdict(ENV)},
    }


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(**{k: json.loads(v) for k, v in (a.split("=", 1) for a in sys.argv[1:])})))
