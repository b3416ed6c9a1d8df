"""Collecting the summaries of a Hydra multirun into one table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from diffpolicy.sweep import collect, table


def _job(root: Path, name: str, overrides: list[str], summary: dict | None) -> None:
    job = root / name
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if summary is not None:
        (job / "summary.json").write_text(json.dumps(summary))


def test_collects_rows_and_marks_missing(tmp_path: Path) -> None:
    _job(tmp_path, "0_lr=1e-5", ["algo.lr=1e-5", "seed=0"], {"ppo_success_rate": 0.5, "env_steps": 100})
    _job(tmp_path, "1_lr=3e-5", ["algo.lr=3e-5", "seed=0"], None)
    rows = collect(tmp_path)
    assert [r["status"] for r in rows] == ["done", "missing"]
    assert rows[0]["algo.lr"] == "1e-5" and rows[0]["ppo_success_rate"] == 0.5
    text = table(rows)
    assert text.splitlines()[0].startswith("| job | algo.lr | seed |") and "missing" in text


def test_validation_figures_are_columns_of_their_own(tmp_path: Path) -> None:
    """A sweep chooses on validation: the summary's ``val`` block becomes ``val_*`` columns in the table."""
    for i, (val, test) in enumerate([(0.9, 0.7), (0.6, 0.8)]):
        _job(tmp_path, f"{i}", [f"seed={i}"], {"ppo_success_rate": test, "val": {"ppo_success_rate": val}})
    rows = collect(tmp_path)
    assert [(r["val_ppo_success_rate"], r["ppo_success_rate"]) for r in rows] == [(0.9, 0.7), (0.6, 0.8)]
    assert "val_ppo_success_rate" in table(rows).splitlines()[0]


def test_cli_prints_table_then_json(tmp_path: Path) -> None:
    _job(tmp_path, "0", ["seed=1"], {"ppo_success_rate": 1.0})
    out = subprocess.run(
        [sys.executable, "-m", "diffpolicy.sweep", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert last["jobs"][0]["seed"] == "1"
    bad = subprocess.run(
        [sys.executable, "-m", "diffpolicy.sweep", str(tmp_path / "nope")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error:")


def test_real_multirun_gives_one_directory_and_summary_per_job(tmp_path: Path) -> None:
    import torch
    from test_train import TINY_POLICY, TINY_RUN

    from diffpolicy.cli import compose
    from diffpolicy.policy_io import build_policy, env_spec, save_policy

    cfg = compose("train", [*TINY_RUN, *TINY_POLICY])
    spec, da = env_spec(cfg.env)
    torch.manual_seed(0)
    save_policy(
        tmp_path / "init", 0, build_policy(cfg.policy, spec, da), env_cfg=cfg.env, policy_cfg=cfg.policy
    )
    args = [
        *TINY_RUN,
        *TINY_POLICY,
        f"policy.init={tmp_path / 'init'}",
        "algo.iterations=1",
        "eval_episodes=2",
    ]
    args += ["algo.lr=1e-5,3e-5", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    out = subprocess.run(
        [sys.executable, "-m", "diffpolicy.train", "-m", *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = collect(tmp_path / "sweep")
    assert [r["status"] for r in rows] == ["done", "done"]
    assert sorted(float(r["algo.lr"]) for r in rows) == [1e-5, 3e-5]
    assert all("ppo_success_rate" in r for r in rows)
