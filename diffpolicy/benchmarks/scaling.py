"""Training throughput with 1 and 2 processes (torchrun, gloo on the CPU).

Each configuration is a real ``python -m diffpolicy.train dist=ddp`` job under torchrun, with the learner
``algo`` (default ``filtered_bc``, the default of ``conf/train.yaml``; ``ppo`` is the chain PPO learner), started
from the same untrained policy checkpoint (so no BC run is needed), every process with one torch thread and
its own environments. A learner that continues BC on demonstrations (filtered_bc) reads ``n_demos`` scripted
ones, collected once into a temporary cache before the timed jobs. Throughput is environment steps of all
ranks divided by the time spent in fine-tuning iterations (rollout + update, from ``metrics.jsonl``; start-up,
evaluation and the first, warm-up iteration excluded).

Each learner's budget per iteration comes from the options it has: ``round_episodes`` (default: one wave of
``num_envs``) and ``bc_steps`` for filtered_bc, ``n_steps`` and ``update_epochs`` for ppo; the result's
``budget`` lists the ones applied.
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


def _prepare(
    root: Path,
    *,
    env: str,
    algo: str,
    num_envs: int,
    iterations: int,
    n_demos: int,
    budget: dict[str, Any],
    overrides: tuple[str, ...] | list[str] = (),
) -> tuple[list[str], dict[str, Any], str]:
    """The ``train`` overrides every timed job shares, with what they need written under ``root``.

    Composes ``train`` once; writes the untrained policy checkpoint (``root/init``, ``policy.init``) and, for
    a learner that continues BC (filtered_bc), collects its demonstrations into ``root/cache`` (``cache_dir``),
    so that no timed job and no two ranks collect them. Of ``budget`` only the entries that are fields of the
    composed learner's config are applied (``algo.<k>=<v>``), before ``overrides``, so that those win.

    Returns:
        ``(overrides, the budget applied, the learner's name)``.
    """
    from diffpolicy.cli import compose
    from diffpolicy.policy_io import build_policy, env_spec, save_policy

    args = [
        f"env={env}",
        f"algo={algo}",
        f"env.num_envs={num_envs}",
        f"algo.iterations={iterations}",
        f"bc.n_demos={n_demos}",
        f"cache_dir={root / 'cache'}",
        "eval_episodes=1",
        "video_episodes=0",
        "checkpoint_every=1000",
        "log.progress=false",
        "log.tensorboard=false",
        "device=cpu",
    ]
    cfg = compose("train", [*args, *overrides])
    applied = {k: v for k, v in budget.items() if hasattr(cfg.algo, k)}
    spec, da = env_spec(cfg.env)
    torch.manual_seed(0)
    init = root / "init"
    save_policy(init, 0, build_policy(cfg.policy, spec, da), env_cfg=cfg.env, policy_cfg=cfg.policy)
    if cfg.algo.learner == "filtered_bc":
        from diffpolicy.demos import demonstrations

        demonstrations(cfg.env, cfg.bc, cfg.seed, cfg.cache_dir)
    args += [*(f"algo.{k}={v}" for k, v in applied.items()), *overrides, f"policy.init={init}"]
    final = compose("train", args).algo  # what the jobs run with, ``overrides`` included
    return args, {k: getattr(final, k) for k in applied}, cfg.algo.learner


def _run(nproc: int, threads: int, overrides: list[str], run_dir: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0"]
    cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", "-m", "diffpolicy.train"]
    cmd += [*overrides, "dist=ddp", f"device.threads={threads}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        # a rank's one-line ``error:`` (diffpolicy.cli.fail) is above torchrun's own report; else the tail
        errors = [ln for ln in lines if ln.startswith("error:")] or lines[-20:]
        raise RuntimeError(f"scaling run with {nproc} process(es) failed:\n" + "\n".join(errors))
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "time/iteration_s" in r]
    # the first (warm-up) iteration is left out: its steps and its time
    return (rows[-1]["step"] - rows[0]["step"]) / sum(r["time/iteration_s"] for r in rows[1:])


def run(
    repeats: int = 1,
    iterations: int = 8,
    env: str = "mujoco_pick",
    num_envs: int = 4,
    algo: str = "filtered_bc",
    round_episodes: int | None = None,
    bc_steps: int = 8,
    n_demos: int = 4,
    n_steps: int = 4,
    update_epochs: int = 1,
    overrides: tuple[str, ...] | list[str] = (),
    **_: Any,
) -> dict[str, Any]:
    """Environment steps per second of training with ``algo`` on 1 and 2 processes (medians over ``repeats``).

    Args:
        repeats: runs of each configuration; the median is reported.
        iterations: fine-tuning iterations per run (at least 2: the first is a warm-up and not timed).
        env: the ``env=`` entry.
        num_envs: environments per rank.
        algo: the ``algo=`` entry (the learner).
        round_episodes: filtered_bc: episodes per round and rank (None: ``num_envs``, one wave).
        bc_steps: filtered_bc: BC steps per round.
        n_demos: demonstrations a BC-continuing learner (filtered_bc) trains on beside its rollouts.
        n_steps: ppo: decisions per environment and iteration.
        update_epochs: ppo: epochs per update.
        overrides: further ``train`` overrides, applied last (e.g. a smaller ``policy.down_dims``).
    """
    if iterations < 2:
        raise ValueError(f"scaling needs iterations >= 2 (the first is not timed), got {iterations}")
    candidates = {
        "round_episodes": num_envs if round_episodes is None else round_episodes,
        "bc_steps": bc_steps,
        "n_steps": n_steps,
        "update_epochs": update_epochs,
    }
    results: dict[str, list[float]] = {"sps_1": [], "sps_2": [], "sps_1_2threads": []}
    with tempfile.TemporaryDirectory(prefix="diffpolicy-scaling-") as tmp:
        args, budget, learner = _prepare(
            Path(tmp), env=env, algo=algo, num_envs=num_envs, iterations=iterations, n_demos=n_demos,
            budget=candidates, overrides=overrides,
        )  # fmt: skip
        for r in range(repeats):
            results["sps_1"].append(_run(1, 1, args, Path(tmp) / f"p1_{r}"))
            results["sps_2"].append(_run(2, 1, args, Path(tmp) / f"p2_{r}"))
            results["sps_1_2threads"].append(_run(1, 2, args, Path(tmp) / f"p1t2_{r}"))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in results.items()}
    out["speedup_2_vs_1"] = out["sps_2"] / out["sps_1"]
    out.update(
        algo=algo, learner=learner, env=env, num_envs_per_rank=num_envs, iterations=iterations,
        budget=budget, threads_per_rank=1,
    )  # fmt: skip
    if learner == "filtered_bc":
        out["n_demos"] = n_demos
    return out
