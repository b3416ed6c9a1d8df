"""Success-filtered self-imitation (algo=filtered_bc): windows of kept episodes, a tiny run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from diffpolicy.rl.filtered_bc import WindowStore, concat_batches, ema_update


def test_window_store_builds_demo_style_windows() -> None:
    """Decision d's window holds the Ta actions executed from its first step on, the last one repeated."""
    store = WindowStore(horizon=4)
    acts = [np.full((2, 1), v, np.float32) for v in (0.0, 1.0)] + [np.array([[2.0]], np.float32)]
    acts[0][1] = 0.5
    decisions = [({"state": np.array([float(d)], np.float32)}, a) for d, a in enumerate(acts)]
    assert store.add_episode(decisions) == 3
    obs, actions = store.batch(torch.arange(3), torch.device("cpu"))
    assert obs["state"].shape == (3, 1, 1) and obs["state"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert actions[:, :, 0].tolist() == [[0.0, 0.5, 1.0, 1.0], [1.0, 1.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]]
    store.add_episode(decisions[:1])
    assert len(store) == 4
    state = store.state()
    again = WindowStore(horizon=4)
    again.load(state)
    assert torch.equal(
        again.batch(torch.arange(4), torch.device("cpu"))[1],
        store.batch(torch.arange(4), torch.device("cpu"))[1],
    )


def test_concat_batches_joins_text_and_tensors() -> None:
    a = ({"state": torch.zeros(2, 1, 3), "instruction": ["x", "y"]}, torch.zeros(2, 4, 2))
    b = ({"state": torch.ones(1, 1, 3), "instruction": ["z"]}, torch.ones(1, 4, 2))
    obs, actions = concat_batches(
        [a, b, ({"state": torch.zeros(0, 1, 3), "instruction": []}, torch.zeros(0, 4, 2))]
    )
    assert (
        obs["instruction"] == ["x", "y", "z"]
        and obs["state"].shape == (3, 1, 3)
        and actions.shape == (3, 4, 2)
    )


def test_keep_chooses_successes_or_top_returns() -> None:
    """algo.keep: the successes; the top keep_fraction by return (ties by order); auto picks by whether the
    env reports success; success on an env without one is a clear error."""
    from types import SimpleNamespace

    import pytest

    from diffpolicy.config import FilteredBCConfig
    from diffpolicy.rl.filtered_bc import FilteredBCLearner

    def head(**kw: object) -> FilteredBCLearner:
        fake = object.__new__(FilteredBCLearner)
        fake.cfg = SimpleNamespace(algo=FilteredBCConfig(**kw))
        return fake

    succ, rets = [False, True, False, True, False], [5.0, 1.0, 9.0, 2.0, 9.0]
    assert head(keep="success").choose(succ, rets, True) == [1, 3]
    assert head(keep="auto").choose(succ, rets, True) == [1, 3]
    assert head(keep="top", keep_fraction=0.4).choose(succ, rets, True) == [2, 4]
    assert head(keep="auto", keep_fraction=0.4).choose(succ, rets, False) == [2, 4]
    assert head(keep="top", keep_fraction=0.5).choose(succ, rets, False) == [0, 2, 4]  # ceil(2.5) = 3
    assert head(keep="top", keep_fraction=0.01).choose(succ, rets, False) == [2]  # at least one; tie -> first
    with pytest.raises(ValueError, match="reports no success"):
        head(keep="success").choose(succ, rets, False)
    with pytest.raises(ValueError, match="keep_fraction"):
        FilteredBCConfig(keep_fraction=0.0)
    with pytest.raises(ValueError, match="algo.keep"):
        FilteredBCConfig(keep="best")
    with pytest.raises(ValueError, match="algo.batch_size"):
        FilteredBCConfig(batch_size=0)


def test_ema_update_moves_toward_source() -> None:
    t, s = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    before = t.weight.detach().clone()
    ema_update(t, s, 0.75)
    assert torch.allclose(t.weight, 0.75 * before + 0.25 * s.weight)


def test_tiny_filtered_bc_run(tmp_path: Path, init_ckpt: Path) -> None:
    """Two rounds through the command line: kept windows grow, the summary carries the failure map."""
    from test_train import TINY_POLICY, TINY_RUN

    run = [a for a in TINY_RUN if not a.startswith("algo.")] + [
        "algo=filtered_bc", "algo.iterations=2", "algo.round_episodes=4", "algo.bc_steps=3", "bc.n_demos=2",
        "algo.batch_size=8", f"cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    run = [a for a in run if a != "algo=ppo"]
    cmd = [sys.executable, "-m", "diffpolicy.train", *run, *TINY_POLICY, f"policy.init={init_ckpt}",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["learner"] == "filtered_bc" and summary["env_steps"] > 0
    assert set(summary["failures"]) == {"bc", "ppo"}
    assert sum(summary["failures"]["ppo"].values()) == round(
        (1 - summary["ppo_success_rate"]) * summary["eval_episodes"]
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["losses/bc"] for r in rows if "losses/bc" in r and "train/kept_windows" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert {r["train/batch_windows"] for r in rows if "train/batch_windows" in r} == {
        8.0
    }  # not bc.batch_size


def test_fpo_ratio_is_one_on_the_rollout_weights_and_follows_the_loss() -> None:
    """exp(mean(old - new)): 1 when nothing moved; > 1 where the chunk's denoising loss fell."""
    from diffpolicy.rl.fpo import fpo_ratio_loss

    old = torch.tensor([[1.0, 2.0], [1.0, 1.0]])
    loss, stats = fpo_ratio_loss(old.clone(), old, torch.tensor([1.0, -1.0]), 0.2)
    assert float(stats["ratio_max"]) == 1.0 and float(loss) == 0.0
    new = old - torch.tensor([[0.1, 0.1], [0.0, 0.0]])  # the first chunk became likelier
    _, stats = fpo_ratio_loss(new, old, torch.tensor([1.0, -1.0]), 0.2)
    assert abs(float(stats["ratio_max"]) - float(np.exp(0.1))) < 1e-6


def test_denoising_losses_match_the_bc_loss_on_the_same_draws() -> None:
    """The per-draw loss over the whole chunk equals ddpm_loss (BC's loss) for the same t and noise."""
    from diffpolicy.diffusion.schedule import ddpm_loss
    from diffpolicy.rl.fpo import denoising_losses

    class Policy:
        def __init__(self) -> None:
            from diffpolicy.diffusion.schedule import NoiseSchedule

            self.schedule = NoiseSchedule(100)
            self.lin = torch.nn.Linear(2, 2)

        def denoiser(self, x, t, cond):
            return self.lin(x) + cond[:, None, :2] + t.float()[:, None, None] / 100

    p = Policy()
    x0, cond = torch.randn(3, 4, 2), torch.randn(3, 5)
    t, eps = torch.randint(0, 100, (3, 1)), torch.randn(3, 1, 4, 2)
    got = denoising_losses(p, x0, cond, t, eps, n_exec=4)  # (3, 1)
    want = torch.stack(
        [
            ddpm_loss(p.denoiser, x0[i : i + 1], cond[i : i + 1], p.schedule, t=t[i], noise=eps[i])
            for i in range(3)
        ]
    )
    assert torch.allclose(got[:, 0], want, atol=1e-6)


def test_tiny_fpo_run(tmp_path: Path, init_ckpt: Path) -> None:
    """Two FPO iterations through the command line: the denoiser moves, losses are finite."""
    from test_train import TINY_POLICY, TINY_RUN

    run = [a for a in TINY_RUN if not a.startswith("algo")] + [
        "algo=fpo", "algo.iterations=2", "algo.n_steps=3", "algo.minibatch_size=4", "algo.update_epochs=1",
        "algo.mc_draws=2", "algo.lr=1e-3",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "diffpolicy.train", *run, *TINY_POLICY, f"policy.init={init_ckpt}",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["learner"] == "fpo" and summary["env_steps"] > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["losses/approx_kl"] for r in rows if "losses/approx_kl" in r]
    assert len(kl) == 2 and all(np.isfinite(kl))
    from diffpolicy import checkpoint

    moved = checkpoint.load(tmp_path / "run" / "checkpoints").state["policy"]
    start = checkpoint.load(init_ckpt).state["policy"]
    assert any(not torch.equal(moved[k], start[k]) for k in start if "denoiser" in k)


def test_chunk_exploration_keeps_the_executed_noisy_actions(init_ckpt: Path, monkeypatch) -> None:
    """explore=chunk: the deterministic chain's actions plus one noise draw held over each decision's steps,
    and a successful episode's windows hold exactly those executed actions."""
    from test_train import TINY_POLICY, TINY_RUN

    from diffpolicy.cli import compose
    from diffpolicy.device import Runtime
    from diffpolicy.distributed import DistInfo
    from diffpolicy.policy_io import load_policy
    from diffpolicy.rl import filtered_bc

    run = [a for a in TINY_RUN if not a.startswith("algo")] + [
        "algo=filtered_bc", "algo.explore=chunk", "algo.explore_std=0.3", "algo.round_episodes=2",
        "bc.n_demos=2",
    ]  # fmt: skip
    cfg = compose("train", [*run, *TINY_POLICY])
    rt = Runtime(device=torch.device("cpu"))
    policy = load_policy(init_ckpt, rt.device)[0]
    head = filtered_bc.FilteredBCLearner(cfg, rt, DistInfo(), policy, logger=None)
    planned: list[np.ndarray] = []
    real_act = filtered_bc.act

    def spy(*args, **kwargs):
        assert kwargs["deterministic"], "explore=chunk samples the deterministic chain"
        actions, out = real_act(*args, **kwargs)
        planned.append(actions.copy())
        return actions, out

    kept: list[np.ndarray] = []
    monkeypatch.setattr(filtered_bc, "act", spy)
    monkeypatch.setattr(
        head.kept, "add_episode", lambda d: kept.append(np.concatenate([a for _, a in d])) or len(d)
    )

    class AllSucceed(filtered_bc.EpisodeRecord):  # every episode counts as a success, so every one is kept
        def step(self, *args, **kwargs):
            super().step(*args, **kwargs)
            self.succ[:] = True

    monkeypatch.setattr(filtered_bc, "EpisodeRecord", AllSucceed)
    try:
        head.rollout(seed=3)
    finally:
        head.close()
    first = planned[0][0]  # (Te, Da): env 0's first plan, before noise
    executed = kept[0][: len(first)]
    offset = executed - first
    inside = np.abs(executed) < 1.0  # the clip to [-1, 1] did not touch these entries
    assert np.abs(offset[inside]).max() > 0.01, "no noise was added"
    held = np.where(inside, offset, np.nan)
    assert np.allclose(np.nanmax(held, 0), np.nanmin(held, 0), atol=1e-6), "noise changes within a chunk"


def test_bc_step_benchmark_reports_each_batch_against_the_reference() -> None:
    """python -m diffpolicy.bench bc_step: every batch timed, the reference's ratio 1, bad options refused."""
    import pytest

    from diffpolicy.benchmarks.bc_step import run

    out = run(repeats=1, warmup=0, batches=[8], reference=16)
    assert set(out["batches"]) == {"8", "16"} and out["batches"]["16"]["ratio_to_reference"] == 1.0
    assert all(r["s_per_step"] > 0 and r["ms_per_window"] > 0 for r in out["batches"].values())
    with pytest.raises(ValueError, match="bc_step takes"):
        run(repeats=1, batch=8)
