"""PPO training throughput with 1 and 2 processes (torchrun, gloo on the CPU).

Each configuration is a real ``python -m diffpolicy.train dist=ddp`` job under torchrun, started from the
same untrained policy checkpoint (so no BC run is needed), every process with one torch thread and its
own environments. Throughput is environment steps of all ranks divided by the time spent in PPO iterations
(rollout + update, from ``metrics.jsonl``; start-up, evaluation and the first, warm-up iteration excluded).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from diffpolicy.logger import read_metrics


def _init_checkpoint(root: Path, overrides: list[str]) -> Path:
    from diffpolicy.cli import compose
    from diffpolicy.policy_io import build_policy, env_spec, save_policy

    cfg = compose("train", overrides)
    spec, da = env_spec(cfg.env)
    torch.manual_seed(0)
    save_policy(root, 0, build_policy(cfg.policy, spec, da), env_cfg=cfg.env, policy_cfg=cfg.policy)
    return root


def _run(nproc: int, threads: int, overrides: list[str], run_dir: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0"]
    cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "-m", "diffpolicy.train"]
    cmd += [*overrides, "dist=ddp", f"device.threads={threads}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(
            f"scaling run with {nproc} process(es) failed: {out.stderr.strip().splitlines()[-1:]}"
        )
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/iteration_s" in r]
    # the first (warm-up) iteration is left out: its steps and its time
    return (rows[-1]["step"] - rows[0]["step"]) / sum(r["time/iteration_s"] for r in rows[1:])


def run(
    repeats: int = 1,
    iterations: int = 8,
    env: str = "mujoco_pick",
    num_envs: int = 4,
    n_steps: int = 4,
    **_: Any,
) -> dict[str, Any]:
    """Environment steps per second of PPO with 1 and 2 processes (medians over ``repeats``)."""
    overrides = [
        f"env={env}",
        f"env.num_envs={num_envs}",
        f"algo.iterations={iterations}",
        f"algo.n_steps={n_steps}",
        "algo.update_epochs=1",
        "eval_episodes=1",
        "video_episodes=0",
        "checkpoint_every=1000",
        "log.progress=false",
        "log.tensorboard=false",
        "device=cpu",
    ]
    results: dict[str, list[float]] = {"sps_1": [], "sps_2": [], "sps_1_2threads": []}
    with tempfile.TemporaryDirectory(prefix="diffpolicy-scaling-") as tmp:
        init = _init_checkpoint(Path(tmp) / "init", overrides)
        overrides.append(f"policy.init={init}")
        for r in range(repeats):
            results["sps_1"].append(_run(1, 1, overrides, Path(tmp) / f"p1_{r}"))
            results["sps_2"].append(_run(2, 1, overrides, Path(tmp) / f"p2_{r}"))
            results["sps_1_2threads"].append(_run(1, 2, overrides, Path(tmp) / f"p1t2_{r}"))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in results.items()}
    out["speedup_2_vs_1"] = out["sps_2"] / out["sps_1"]
    out.update(
        env=env, num_envs_per_rank=num_envs, n_steps=n_steps, iterations=iterations, threads_per_rank=1
    )
    return out
