"""The entry points' command-line faces: --cfg job, one-line errors, exit codes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": ""}
    env.pop("HYDRA_FULL_ERROR")
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=env
    )


def test_cfg_job_prints_config_from_any_directory(tmp_path) -> None:
    out = _run("diffpolicy.train", "--cfg", "job", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "mujoco_pick" in out.stdout and "down_dims" in out.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["algo=dppo", "--cfg", "job"], "noise_clip: 3.0"),
        (["env=obstacle_reach", "+env.expert.side=1", "~env.expert.side", "--cfg", "job"], "expert: {}"),
    ],
)
def test_cfg_job_around_overrides_shows_them(args: list[str], needle: str, tmp_path) -> None:
    out = _run("diffpolicy.train", *args, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert needle in out.stdout


def test_run_directory_is_named_after_the_entry_point(tmp_path) -> None:
    out = _run("diffpolicy.collect", "env=obstacle_reach", "n_episodes=1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [p.parent.parent.name for p in (tmp_path / "runs").glob("*/*/summary.json")] == ["collect"]


@pytest.mark.parametrize(
    ("override", "needle"),
    [("device=npu", "torch_npu"), ("env.nonexistent=1", "env.nonexistent"), ("algo.lr=-1", "algo.lr")],
)
def test_bad_input_is_one_line(override: str, needle: str, tmp_path) -> None:
    if override == "device=npu" and os.environ.get("ASCEND_HOME_PATH"):
        pytest.skip("an Ascend toolkit is present")
    out = _run("diffpolicy.train", override, cwd=tmp_path)
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error:"), out.stderr


def test_bench_rejects_unknown_name(tmp_path) -> None:
    out = _run("diffpolicy.bench", "warp_drive", cwd=tmp_path)
    assert out.returncode == 2 and "unknown benchmark" in out.stderr
