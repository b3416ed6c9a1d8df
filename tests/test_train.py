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
    "algo=ppo",  # GAE with a critic (the train default is grpo, covered below)
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


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory, init_ckpt: Path) -> tuple[Path, dict]:
    """One uninterrupted tiny run through the command line: (run directory, summary)."""
    run_dir = tmp_path_factory.mktemp("reference")
    out = _train(run_dir, init_ckpt)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, _summary(out.stdout)


def test_tiny_run_end_to_end(reference_run: tuple[Path, dict]) -> None:
    run_dir, summary = reference_run
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps", "wall_time_s"):
        assert key in summary
    assert summary["env_steps"] > 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["losses/policy"] for r in rows if "losses/policy" in r]
    assert len(losses) == 3 and all(v is not None for v in losses)
    assert (run_dir / "summary.json").is_file()
    assert list((run_dir / "tb").glob("events.*"))
    assert checkpoint.load(run_dir / "checkpoints").step == 3


def test_resume_after_a_stop_is_exact(
    tmp_path: Path, init_ckpt: Path, reference_run: tuple[Path, dict]
) -> None:
    ref_dir, summary = reference_run
    first = _train(tmp_path, init_ckpt, "algo.iterations=2")  # stops after 2 of the 3 iterations
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _train(tmp_path, init_ckpt, "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _summary(resumed.stdout)
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps"):
        assert again[key] == summary[key], key
    a = checkpoint.load(ref_dir / "checkpoints").state["policy"]
    b = checkpoint.load(tmp_path / "checkpoints").state["policy"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "losses/policy" in r]
    assert steps == sorted(set(steps)) and len(steps) == 3  # no duplicated iterations after the resume


def test_sigkill_mid_run_then_resume_matches(
    tmp_path: Path, init_ckpt: Path, reference_run: tuple[Path, dict]
) -> None:
    proc = _train(tmp_path, init_ckpt, wait=False)
    deadline = time.monotonic() + 240
    while (
        not checkpoint.exists(tmp_path / "checkpoints")
        and time.monotonic() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    resumed = _train(tmp_path, init_ckpt, "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = _summary(resumed.stdout), reference_run[1]
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps"):
        assert got[key] == want[key], key


@pytest.mark.parametrize(
    "options",
    [
        ["algo.advantage=grpo", "algo.group_size=2", "algo.n_steps=6"],
        ["algo.clip=unconditional", "algo.normalize=self", "algo.logprob_min_std=0.1"],
        [
            "algo.reg=kl",
            "algo.reg_coef=0.1",
            "algo.denoise_gamma=0.9",
            "algo.clip_eps_final=0.05",
            "policy.min_std=0.05",
        ],  # fmt: skip
        ["device.precision=bf16", "algo.finetune_encoders=true"],
        ["algo.reg=bc", "algo.reg_coef=1.0", "algo.lr=1e-3", "algo.target_kl=0"],  # no KL undo of the step
    ],
    ids=["grpo", "stabledrl", "kl-reg", "bf16", "bc-reg"],
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
    if any(o.startswith("algo.reg=") for o in options):  # the policy moved: the regulariser pulls it back
        assert max(r["losses/regularizer"] for r in rows if "losses/regularizer" in r) > 0
    agreement = [r["losses/grad_agreement"] for r in rows if "losses/grad_agreement" in r]
    assert agreement and all(-1.0 <= a <= 1.0 for a in agreement)
    # the run's sampling settings apply to the loaded policy, whatever the init checkpoint recorded
    saved = checkpoint.load(tmp_path / "checkpoints").config["policy"]
    assert saved["min_std"] == cfg.policy.min_std and saved["ft_steps"] == cfg.policy.ft_steps


def test_critic_warmup_trains_only_the_critic(tmp_path: Path, init_ckpt: Path) -> None:
    from diffpolicy.train import main

    cfg = compose(
        "train",
        [*TINY_RUN, *TINY_POLICY, f"policy.init={init_ckpt}", "algo.iterations=2", "algo.critic_warmup=2"],
    )
    main(cfg, tmp_path)
    before = checkpoint.load(init_ckpt).state["policy"]
    after = checkpoint.load(tmp_path / "checkpoints").state["policy"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "losses/value" in r]
    assert rows and all(r["losses/value"] > 0 for r in rows)
    with pytest.raises(ValueError, match="critic_warmup"):
        compose("train", ["algo.critic_warmup=-1"])


def test_grpo_needs_whole_groups(init_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="group_size"):  # rejected when the config is built, before any work
        compose("train", [*TINY_RUN, "algo.advantage=grpo", "algo.group_size=3", f"policy.init={init_ckpt}"])


def test_tiny_policy_config_is_valid() -> None:
    cfg = compose("train", [*TINY_RUN, *TINY_POLICY])
    assert isinstance(cfg.policy, PolicyConfig) and cfg.policy.ft_steps == 2


def test_default_run_is_the_cpu_mission() -> None:
    """What ``python -m diffpolicy.train env=mujoco_pick`` composes to (the README's mission settings)."""
    cfg = compose("train", ["env=mujoco_pick"])
    assert cfg.env.obs_mode == "state" and cfg.env.demo_failures and cfg.env.expert == {"max_speed": 0.008}
    assert cfg.algo.head == "residual" and cfg.algo.advantage == "gae" and cfg.algo.signal_scaled_lr
    assert cfg.algo.iterations * cfg.algo.n_steps * cfg.env.num_envs <= 1_000_000  # env-step budget
    assert cfg.policy.horizon == 16 and cfg.eval_episodes >= 200
