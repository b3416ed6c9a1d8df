"""``make quick`` (``python -m diffpolicy.train +experiment=quick``): the preset is small, and it runs."""

from __future__ import annotations

import json
from pathlib import Path

from diffpolicy import checkpoint
from diffpolicy.cli import compose

ROOT = Path(__file__).resolve().parents[1]


def test_make_quick_runs_the_quick_preset() -> None:
    """The Makefile's verb is the command this file tests, and the preset keeps every budget small."""
    assert "-m diffpolicy.train +experiment=quick" in (ROOT / "Makefile").read_text()
    cfg = compose("train", ["+experiment=quick"])
    assert cfg.env.name == "mujoco_pick" and cfg.env.obs_mode == "state" and cfg.algo.name == "ppo_anchor"
    assert cfg.bc.n_demos <= 20 and cfg.bc.epochs <= 100 and max(cfg.policy.down_dims) <= 64
    steps = cfg.algo.iterations * cfg.algo.n_steps * cfg.env.num_envs * cfg.policy.n_action_steps
    assert steps <= 4_000 and cfg.algo.critic_warmup < cfg.algo.iterations  # env steps; PPO updates once
    assert cfg.algo.iterations * cfg.algo.anchor_steps <= 100
    assert cfg.eval_episodes <= 16 and cfg.video_episodes == 0


def test_quick_run_end_to_end(tmp_path: Path) -> None:
    """The quick preset from an empty cache, in process, with its BC and PPO budgets cut further: collect,
    clone, one round of the main job's learner (PPO + GAE with the anchor; no critic warm-up), evaluate before
    and after."""
    from diffpolicy.train import main

    cfg = compose(
        "train",
        [
            "+experiment=quick",
            "bc.n_demos=2",
            "bc.epochs=2",
            "algo.iterations=1",
            "algo.critic_warmup=0",
            "algo.n_steps=4",
            "algo.anchor_steps=3",
            "env.num_envs=2",
            "eval_episodes=2",
            "log.progress=false",
            "device=cpu",
            f"cache_dir={tmp_path / 'cache'}",
        ],
    )
    summary = main(cfg, tmp_path / "run")
    assert summary is not None and summary["learner"] == "chain"
    assert 0 < summary["env_steps"] <= 2 * 4 * 8 and summary["eval_episodes"] == 2
    assert 0.0 <= summary["bc_success_rate"] <= 1.0 and 0.0 <= summary["ppo_success_rate"] <= 1.0
    assert checkpoint.load(tmp_path / "run" / "checkpoints").step == 1
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    updated = [r for r in rows if "losses/policy" in r]
    assert len(updated) == 1 and all(k in updated[0] for k in ("losses/value", "losses/anchor"))
    assert list((tmp_path / "cache" / "bc").iterdir()), "the BC checkpoint was not cached"
