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
