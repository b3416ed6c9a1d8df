"""env=hopper (issue #23): the committed medium-quality demonstrator, its numpy actor, demonstrations without a
success notion, and a tiny BC -> chain PPO -> evaluation run through the command line from an empty cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from diffpolicy_envs.experts import ASSETS, POLICY_EXPERTS, MLPExpert, make_expert, run_episode


@pytest.mark.parametrize("name", ["hopper", "walker2d"])
def test_committed_demonstrator_is_medium_in_its_mean(name: str) -> None:
    """The committed actor's noise-free return lies in the medium band its file states (D4RL's medium datasets
    are medium in the mean), and the demonstrations' small noise keeps it there."""
    from diffpolicy.cli import compose

    env_cfg = compose("train", [f"env={name}", "device=cpu"]).env
    env = gym.make(env_cfg.id)
    assert (ASSETS / POLICY_EXPERTS[type(env.unwrapped).__name__]).is_file()
    mean = make_expert(env, seed=0, stochastic=False)
    assert isinstance(mean, MLPExpert) and mean.meta["stop_on"] == "mean"
    low, high = mean.meta["return_band"]
    returns = [run_episode(env, mean, seed=50_000 + i)["return"] for i in range(8)]
    assert low <= float(np.mean(returns)) <= high, returns
    demonstrator = make_expert(env, seed=0, **env_cfg.expert)
    assert demonstrator.stochastic and demonstrator.noise_scale == env_cfg.expert["noise_scale"] < 1
    returns = [run_episode(env, demonstrator, seed=50_000 + i)["return"] for i in range(8)]
    assert 0.6 * low <= float(np.mean(returns)) <= 1.4 * high, returns


def test_numpy_actor_matches_torch() -> None:
    """SAC's actor form (ReLU layers, tanh-squashed mean) against torch's Linear/ReLU/tanh (mean action)."""
    rng = np.random.default_rng(0)
    weights = {"w0": rng.normal(size=(16, 11)), "b0": rng.normal(size=16), "w1": rng.normal(size=(16, 16)),
               "b1": rng.normal(size=16), "mu_w": rng.normal(size=(3, 16)), "mu_b": rng.normal(size=3),
               "log_std_w": rng.normal(size=(3, 16)), "log_std_b": rng.normal(size=3)}  # fmt: skip
    expert = MLPExpert(weights, stochastic=False)
    obs = rng.normal(size=(7, 11))
    h = torch.as_tensor(obs, dtype=torch.float64)
    for i in range(2):
        h = torch.relu(h @ torch.as_tensor(weights[f"w{i}"]).T + torch.as_tensor(weights[f"b{i}"]))
    mu = h @ torch.as_tensor(weights["mu_w"]).T + torch.as_tensor(weights["mu_b"])
    np.testing.assert_allclose(expert.policy(obs), torch.tanh(mu).numpy(), atol=1e-6)


def test_numpy_ppo_actor_matches_torch() -> None:
    """PPO's actor form (tanh layers, state-independent log-std, actions clipped to the box) against torch,
    for the mean action and for a sampled one with the same noise."""
    rng = np.random.default_rng(1)
    weights = {"w0": rng.normal(size=(8, 5)), "b0": rng.normal(size=8), "w1": rng.normal(size=(8, 8)),
               "b1": rng.normal(size=8), "mu_w": rng.normal(size=(3, 8)), "mu_b": rng.normal(size=3),
               "log_std": np.array([-1.0, 0.0, 0.5]),
               "meta": np.array(json.dumps({"activation": "tanh", "squash": "clip"}))}  # fmt: skip
    obs = rng.normal(size=(6, 5))
    h = torch.as_tensor(obs)
    for i in range(2):
        h = torch.tanh(h @ torch.as_tensor(weights[f"w{i}"]).T + torch.as_tensor(weights[f"b{i}"]))
    mu = h @ torch.as_tensor(weights["mu_w"]).T + torch.as_tensor(weights["mu_b"])
    np.testing.assert_allclose(MLPExpert(weights, stochastic=False).policy(obs), mu.clamp(-1, 1), atol=1e-6)
    z = np.random.default_rng(7).standard_normal((6, 3))
    sampled = mu + torch.exp(torch.as_tensor(weights["log_std"])) * torch.as_tensor(z)
    np.testing.assert_allclose(MLPExpert(weights, seed=7).policy(obs), sampled.clamp(-1, 1), atol=1e-6)
    small = mu + 0.2 * torch.exp(torch.as_tensor(weights["log_std"])) * torch.as_tensor(z)  # a small noise
    np.testing.assert_allclose(MLPExpert(weights, seed=7, noise_scale=0.2).policy(obs), small.clamp(-1, 1),
                               atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="noise_scale"):
        MLPExpert(weights, noise_scale=-1.0)
    with pytest.raises(ValueError, match="activation"):
        MLPExpert({**weights, "meta": np.array(json.dumps({"activation": "gelu"}))})


def test_hopper_demos_keep_every_episode(tmp_path: Path) -> None:
    """Hopper reports no success: every episode is stored (success unknown) with its rewards."""
    from diffpolicy.config import EnvConfig
    from diffpolicy.data.dataset import read_meta
    from diffpolicy.demos import collect_demos

    env = EnvConfig(name="hopper", id="Hopper-v5", obs_mode="state", max_episode_steps=60, num_envs=1)
    out = collect_demos(env, 2, seed=3, out=tmp_path / "d")
    assert out["n_kept"] == 2 and out["success_rate"] is None and out["mean_return"] > 0
    assert read_meta(tmp_path / "d")["success"] == [None, None]


def _summary_of(cmd: list[str]) -> dict:
    """Run an entry point on one thread; its summary (the last stdout line), after a zero exit."""
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


TINY_LEARNER = {
    "dppo_gym": ["algo.n_steps=8", "algo.minibatch_size=16"],
    # Hopper has no success: algo.keep=auto imitates each round's best-return quarter
    "filtered_bc": ["algo.round_episodes=4", "algo.bc_steps=3"],
}


@pytest.mark.parametrize("algo", sorted(TINY_LEARNER))
def test_tiny_hopper_run(tmp_path: Path, algo: str) -> None:
    """env=hopper with tiny sizes from an empty cache: demonstrations -> BC -> two fine-tuning
    iterations -> held-out returns with intervals, and the return curve in the run directory."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "diffpolicy.train", "env=hopper", f"algo={algo}", "video_episodes=0",
           "env.num_envs=2", "env.max_episode_steps=100", "bc.n_demos=2", "bc.epochs=2",
           "policy.mlp_dims=[32,32]", "algo.iterations=2", *TINY_LEARNER[algo],
           "eval_episodes=2", "log.progress=false", "log.tensorboard=false",
           f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}"]  # fmt: skip
    summary = _summary_of(cmd)
    for key in ("bc_return", "ppo_return", "bc_return_ci", "ppo_return_ci", "eval_episodes", "env_steps"):
        assert summary[key] is not None, key
    for key in ("bc_success_rate", "ppo_success_rate", "bc_ci", "ppo_ci", "failures"):
        assert summary[key] is None, key  # Hopper reports no success: no 0.0 that reads as "always fails"
    assert summary["eval_episodes"] == 2 and summary["env_steps"] > 0
    # env=hopper reports the deployed (noise-free) policy, and the same test seeds under DPPO's protocol and
    # the sampled chain; the checkpoints carry the reported one
    assert summary["protocol"] == "noise_free" and sorted(summary["protocols"]) == ["dppo", "exploration"]
    for row in summary["protocols"].values():
        assert row["bc_return"] is not None and row["ppo_return"] is not None and "bc_success_rate" not in row
    lo, hi = summary["ppo_return_ci"]
    assert lo <= summary["ppo_return"] <= hi
    assert (run / "return.png").is_file()
    assert not (run / "success_rate.png").exists()  # nor a success curve of zeros
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not any("rollout/success_rate" in r or "eval/success_rate" in r for r in rows)
    assert any("eval/mean_return" in r for r in rows)
    # the guard judges the deployed (noise-free) policy on validation episodes at every iteration (train_preset)
    assert len([r for r in rows if "val/guard_return" in r]) == 2
    if algo == "filtered_bc":  # one of each round's 4 episodes kept: its windows are in the data
        kept = [r["train/kept_windows"] for r in rows if "train/kept_windows" in r]
        added = [r["train/added_windows"] for r in rows if "train/added_windows" in r]
        assert added and min(added) > 0 and kept[-1] > 0, (kept, added)
        return
    # algo=dppo_gym sets max_grad_norm 0 (DPPO: no clipping); "0 disables" once clipped every gradient to zero
    kls = [r["losses/approx_kl"] for r in rows if "losses/approx_kl" in r]
    assert kls and max(kls) > 1e-9, kls  # the actor moved


@pytest.mark.parametrize("env", ["hopper", "walker2d"])
def test_tiny_hopper_pretrain_logs_returns_not_success(tmp_path: Path, env: str) -> None:
    """pretrain on Hopper (and Walker2d) logs the held-out return and no eval/success_rate of zeros, as train
    does."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "diffpolicy.pretrain", f"env={env}", "env.num_envs=2",
           "env.max_episode_steps=50", "bc.n_demos=2", "bc.epochs=1", "policy.mlp_dims=[16,16]",
           "eval_episodes=2", "log.progress=false", "log.tensorboard=false",
           f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}"]  # fmt: skip
    summary = _summary_of(cmd)
    assert summary["success_rate"] is None and summary["mean_return"] > 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not any("eval/success_rate" in r for r in rows)
    assert any(r.get("eval/mean_return", 0) > 0 for r in rows)
