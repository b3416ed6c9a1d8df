"""Tiny end-to-end PPO runs: losses finite, checkpoints written, metrics logged, resume is exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffpolicy import checkpoint
from diffpolicy.cli import compose
from diffpolicy.config import PolicyConfig
from diffpolicy.logger import read_metrics
from diffpolicy.policy_io import build_policy, env_spec, save_policy

TINY_POLICY = [
    "policy.down_dims=[16,32]",
    "policy.cond_dim=32",
    "policy.step_embed_dim=16",
    "policy.horizon=16",
    "policy.n_action_steps=8",
    "policy.ddim_steps=4",
    "policy.ft_steps=2",
    "policy.encoder.state_hidden=32",
    "policy.encoder.token_dim=32",
]
TINY_RUN = [
    "env=obstacle_reach",
    "env.num_envs=2",
    "algo.iterations=3",
    "algo.n_steps=3",
    "algo.minibatch_size=4",
    "algo.update_epochs=2",
    "eval_episodes=4",
    "checkpoint_every=1",
    "video_episodes=0",
    "log.progress=false",
    "device=cpu",
]


@pytest.fixture(scope="module")
def init_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An (untrained) tiny policy checkpoint to start PPO from, so the tests need no BC run."""
    cfg = compose("train", [*TINY_RUN, *TINY_POLICY])
    spec, da = env_spec(cfg.env)
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, spec, da)
    root = tmp_path_factory.mktemp("init")
    save_policy(root, 0, policy, env_cfg=cfg.env, policy_cfg=cfg.policy)
    return root


def _train(
    run_dir: Path, init: Path, *extra: str, wait: bool = True
) -> subprocess.CompletedProcess | subprocess.Popen:
    args = [*TINY_RUN, *TINY_POLICY, f"policy.init={init}", f"hydra.run.dir={run_dir}", *extra]
    cmd = [sys.executable, "-m", "diffpolicy.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _summary(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_tiny_run_end_to_end_then_resume_is_exact(tmp_path: Path, init_ckpt: Path) -> None:
    full = _train(tmp_path / "full", init_ckpt)
    assert full.returncode == 0, full.stderr[-3000:]
    summary = _summary(full.stdout)
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps", "wall_time_s"):
        assert key in summary
    assert summary["env_steps"] > 0
    rows = read_metrics(tmp_path / "full" / "metrics.jsonl")
    losses = [r["losses/policy"] for r in rows if "losses/policy" in r]
    assert len(losses) == 3 and all(v is not None for v in losses)
    assert (tmp_path / "full" / "summary.json").is_file()
    assert list((tmp_path / "full" / "tb").glob("events.*"))
    assert checkpoint.load(tmp_path / "full" / "checkpoints").step == 3

    # interrupted after 2 iterations (a clean stop), then resumed to 3
    part = tmp_path / "part"
    first = _train(part, init_ckpt, "algo.iterations=2")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _train(part, init_ckpt, "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _summary(resumed.stdout)
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps"):
        assert again[key] == summary[key], key
    a = checkpoint.load(tmp_path / "full" / "checkpoints").state["policy"]
    b = checkpoint.load(part / "checkpoints").state["policy"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sigkill_mid_run_then_resume_matches(tmp_path: Path, init_ckpt: Path) -> None:
    ref = _train(tmp_path / "ref", init_ckpt)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "killed"
    proc = _train(run, init_ckpt, wait=False)
    deadline = time.monotonic() + 240
    while not checkpoint.exists(run / "checkpoints") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    resumed = _train(run, init_ckpt, "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = _summary(resumed.stdout), _summary(ref.stdout)
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps"):
        assert got[key] == want[key], key


@pytest.mark.parametrize(
    "options",
    [
        ["algo=grpo", "algo.group_size=2", "algo.n_steps=6"],
        ["algo.clip=unconditional", "algo.normalize=self"],
        ["algo.reg=kl", "algo.reg_coef=0.1", "algo.denoise_gamma=0.9", "algo.clip_eps_final=0.05"],
        ["device.precision=bf16"],
    ],
    ids=["grpo", "stabledrl", "kl-reg", "bf16"],
)
def test_options_run_in_process(tmp_path: Path, init_ckpt: Path, options: list[str]) -> None:
    from diffpolicy.train import main

    cfg = compose(
        "train", [*TINY_RUN, *TINY_POLICY, f"policy.init={init_ckpt}", "algo.iterations=2", *options]
    )
    summary = main(cfg, tmp_path)
    assert summary is not None and summary["env_steps"] > 0
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert all(r["losses/policy"] is not None for r in rows if "losses/policy" in r)


def test_grpo_needs_whole_groups(tmp_path: Path, init_ckpt: Path) -> None:
    from diffpolicy.train import main

    cfg = compose("train", [*TINY_RUN, "algo=grpo", "algo.group_size=3", f"policy.init={init_ckpt}"])
    with pytest.raises(ValueError, match="group_size"):
        main(cfg, tmp_path)


def test_tiny_policy_config_is_valid() -> None:
    cfg = compose("train", [*TINY_RUN, *TINY_POLICY])
    assert isinstance(cfg.policy, PolicyConfig) and cfg.policy.ft_steps == 2
