"""collect: scripted-expert demonstrations through the library function and the CLI, readable by dataset.py."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from diffpolicy.config import EnvConfig
from diffpolicy.data.dataset import DemoReader
from diffpolicy.data.windows import DemoWindows
from diffpolicy.demos import cached_demos, collect_demos, demos_key

ROOT = Path(__file__).resolve().parents[1]
REACH = EnvConfig(name="obstacle_reach", id="diffpolicy_envs:ObstacleReach-v0", obs_mode="state")
PICK = EnvConfig(image_size=32, n_points=64)
KEYS = {"success_rate", "mean_return", "n_episodes", "n_kept", "steps", "path", "wall_time_s"}


def test_collect_reach_function(tmp_path):
    seen = []

    def progress(it, **kw):
        seen.append(kw.get("total"))
        yield from it

    out = collect_demos(REACH, 3, seed=5, out=tmp_path / "d", progress=progress)
    assert set(out) == KEYS and seen == [3]
    assert out["n_episodes"] == 3 and out["n_kept"] == round(3 * out["success_rate"])
    reader = DemoReader(out["path"])
    assert reader.num_episodes == out["n_kept"] and reader.num_steps == out["steps"]
    assert reader.meta["seeds"] == [5, 6, 7][: reader.num_episodes] and all(reader.meta["success"])
    assert reader.fields["state"]["shape"] == [6] and reader.fields["action"]["shape"] == [2]
    ep = reader.episode(0)
    assert np.abs(ep["action"]).max() <= 1.0
    # Same seed, same demonstrations (expert side choices included).
    again = collect_demos(REACH, 3, seed=5, out=tmp_path / "e")
    np.testing.assert_array_equal(DemoReader(again["path"]).episode(2)["action"], reader.episode(2)["action"])
    with pytest.raises(ValueError, match="already exists"):
        collect_demos(REACH, 1, seed=0, out=tmp_path / "d")


def test_collect_pick_multimodal_windows(tmp_path):
    out = collect_demos(PICK, 2, seed=0, out=tmp_path / "pick")
    assert out["n_kept"] >= 1
    reader = DemoReader(out["path"])
    assert reader.fields["rgb"] == {"dtype": "u1", "shape": [32, 32, 3]}
    assert reader.fields["points"]["shape"] == [64, 6] and reader.fields["state"]["shape"] == [10]
    ep = reader.episode(0)
    assert ep["instruction"][0].endswith("tray") and len(set(ep["instruction"])) == 1
    assert ep["rgb"][0].std() > 0 and not np.array_equal(ep["rgb"][0], ep["rgb"][-1])  # rendered every step
    obs, actions = DemoWindows(out["path"], obs_horizon=1, action_horizon=16).batch(torch.tensor([0]))
    assert obs["rgb"].shape == (1, 1, 32, 32, 3) and actions.shape == (1, 16, 7)


def test_collect_failures_and_gym(tmp_path):
    with pytest.raises(ValueError, match="no scripted expert"):
        collect_demos(EnvConfig(name="gym", id="Pendulum-v1", obs_mode="state"), 1, 0, tmp_path / "g")
    short = EnvConfig(name="obstacle_reach", id="diffpolicy_envs:ObstacleReach-v0", max_episode_steps=3)
    with pytest.raises(ValueError, match="failed all"):
        collect_demos(short, 2, 0, tmp_path / "f")
    assert not (tmp_path / "f").exists()
    kept = collect_demos(short, 2, 0, tmp_path / "k", keep_failures=True)
    assert kept["n_kept"] == 2 and kept["success_rate"] == 0.0
    assert DemoReader(kept["path"]).meta["success"] == [False, False]


def test_collect_takes_the_expert_settings_and_failure_policy_from_the_env(tmp_path):
    sloppy = dataclasses.replace(PICK, obs_mode="state", expert={"place_noise": 0.3}, demo_failures=True)
    out = collect_demos(sloppy, 3, seed=1000, out=tmp_path / "s")
    assert out["n_kept"] == 3 and out["success_rate"] < 1.0  # the failures are part of the demonstrations
    assert demos_key(sloppy, 3, 0) != demos_key(dataclasses.replace(sloppy, expert={}), 3, 0)
    assert demos_key(sloppy, 3, 0) != demos_key(dataclasses.replace(sloppy, demo_failures=False), 3, 0)
    with pytest.raises(ValueError, match="env.expert"):
        collect_demos(dataclasses.replace(PICK, expert={"speed": 2}), 1, 0, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_cached_demos_reuses(tmp_path):
    path, collected = cached_demos(REACH, 2, 0, tmp_path)
    assert collected and path == tmp_path / "demos" / demos_key(REACH, 2, 0)
    again, collected = cached_demos(REACH, 2, 0, tmp_path)
    assert again == path and not collected
    assert demos_key(REACH, 2, 0) != demos_key(REACH, 2, 1) != demos_key(REACH, 3, 0)
    assert demos_key(dataclasses.replace(REACH, num_envs=16), 2, 0) == demos_key(REACH, 2, 0)


def _run(args, cwd):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'envs'}"}
    return subprocess.run(
        [sys.executable, "-m", "diffpolicy.collect", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_collect_cli(tmp_path):
    proc = _run(["env=mujoco_pick", "n_episodes=2", "env.image_size=32", "env.n_points=64",
                 f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(summary) == KEYS and summary["path"] == str(tmp_path / "run" / "demos")
    assert DemoReader(summary["path"]).num_steps == summary["steps"]
    assert json.loads((tmp_path / "run" / "summary.json").read_text()) == summary
    from diffpolicy.cli import compose

    assert compose("collect", ["env=mujoco_pick"]).keep_failures is None  # the env's demo_failures decides
    assert compose("collect", ["env=mujoco_pick", "keep_failures=false"]).keep_failures is False
    bad = _run(["env=gym", "n_episodes=1", f"hydra.run.dir={tmp_path / 'g'}"], tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: env=gym")
    assert len([ln for ln in bad.stderr.splitlines() if ln.startswith("error")]) == 1


def test_dialogue_demos_record_each_steps_instruction(tmp_path):
    """A correction changes the instruction mid-episode: the demonstrations hold it step by step, and BC's
    windows read the dialogue of their own step."""
    cfg = EnvConfig(name="mujoco_dialogue", id="diffpolicy_envs:MujocoDialogue-v0", image_size=32, n_points=64,
                    max_episode_steps=180, kwargs={"kinds": ["object"], "correction_steps": [10, 10]})  # fmt: skip
    out = collect_demos(cfg, 2, seed=0, out=tmp_path / "d")
    reader = DemoReader(out["path"])
    texts = reader.episode(0)["instruction"]
    # spoken after the 10th step: the first utterance until then, the dialogue from the observation it returns
    assert texts[0] == texts[9] and "\n" not in texts[0]
    assert texts[10] == texts[-1] and texts[10].startswith(texts[0] + "\n")
    windows = DemoWindows(out["path"], 1, 16)
    obs, _ = windows.batch(torch.tensor([9, 10]))
    assert obs["instruction"] == [texts[9], texts[10]]
    # bc.mask_unheard: a window's chunk steps after the correction its observation has not heard
    heard = windows.heard(torch.tensor([0, 5, 10]))
    expected = torch.ones(3, 16, dtype=torch.bool)
    expected[0, 10:] = expected[1, 5:] = False
    assert torch.equal(heard, expected)
    assert windows.heard(torch.tensor([10, 11])) is None  # all heard


def test_stage_demos_record_the_subtask_label(tmp_path):
    cfg = EnvConfig(name="mujoco_dialogue", id="diffpolicy_envs:MujocoDialogue-v0", obs_mode="state",
                    max_episode_steps=180, kwargs={"task": "stages"})  # fmt: skip
    out = collect_demos(cfg, 1, seed=0, out=tmp_path / "d")
    reader = DemoReader(out["path"])
    labels = reader.episode(0)["subtask"]
    assert len(labels) == reader.num_steps and len(set(labels)) == 2  # one sub-task, then the other
    assert labels[0].startswith("put the") and labels[-1] != labels[0]
    assert "subtask" not in DemoWindows(out["path"], 1, 16).obs_keys  # a label, not an observation
