"""bc.demos: demonstrations from a robomimic-style HDF5 file, a Minari dataset or this project's format, matched
to the environment by observation key; one-line errors that leave the cache as it was; export to
robomimic-style HDF5 and back to identical windows."""

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

from diffpolicy.config import BCConfig, DeviceConfig, EncoderConfig, EnvConfig, PolicyConfig
from diffpolicy.data.dataset import DemoReader
from diffpolicy.data.windows import DemoWindows
from diffpolicy.demos import collect_demos, export_robomimic, import_demos

h5py = pytest.importorskip("h5py", reason='HDF5 datasets need the `data` extra: pip install -e ".[data]"')

ROOT = Path(__file__).resolve().parents[1]
REACH = EnvConfig(name="obstacle_reach", id="diffpolicy_envs:ObstacleReach-v0", obs_mode="state", num_envs=2)
PICK = EnvConfig(image_size=32, n_points=64)
PENDULUM = EnvConfig(name="gym", id="InvertedPendulum-v5", obs_mode="state", max_episode_steps=40, num_envs=2)
"""Gymnasium's MuJoCo InvertedPendulum: 4-D observation, 1-D force in [-3, 3]; the project owns neither."""
GAINS = np.array([1.0, 10.0, 1.0, 1.0])
"""A linear controller that balances InvertedPendulum: force = GAINS . (x, theta, x_dot, theta_dot)."""
SMALL = PolicyConfig(encoder=EncoderConfig(state_hidden=16, token_dim=16, fusion_heads=2), cond_dim=16,
                     down_dims=[16, 32], step_embed_dim=16, horizon=16, train_timesteps=20, ddim_steps=4)  # fmt: skip


def pendulum_episodes(n: int, seed: int = 0, steps: int = 40) -> list[dict]:
    """``n`` episodes of :data:`GAINS` on InvertedPendulum-v5, in the env's own units: ``obs`` {"state"}
    (L, 4), ``actions`` (L, 1) in [-3, 3], ``rewards`` (L,), ``final`` the observation after the last step."""
    env = gym.make("InvertedPendulum-v5", max_episode_steps=steps)
    episodes = []
    for i in range(n):
        obs, _ = env.reset(seed=seed + i)
        states, actions, rewards, done = [], [], [], False
        while not done:
            action = np.clip(GAINS @ obs, -3.0, 3.0)[None]  # (1,)
            states.append(obs)
            actions.append(action)
            obs, reward, terminated, truncated, _ = env.step(action.astype(np.float32))
            rewards.append(reward)
            done = terminated or truncated
        episodes.append({"obs": {"state": np.array(states)}, "actions": np.array(actions),
                         "rewards": np.array(rewards), "final": obs})  # fmt: skip
    env.close()
    return episodes


def write_robomimic_file(path: Path, episodes: list[dict]) -> Path:
    """The episodes as a robomimic-style file (``data/demo_N/{obs/<key>, actions, rewards, dones}``), written
    with plain h5py as another tool would."""
    with h5py.File(path, "w") as f:
        data = f.create_group("data")
        for i, ep in enumerate(episodes):
            demo = data.create_group(f"demo_{i}")
            demo.attrs["num_samples"] = len(ep["actions"])
            demo.create_dataset("actions", data=ep["actions"])
            demo.create_dataset("rewards", data=ep["rewards"])
            demo.create_dataset("dones", data=np.eye(1, len(ep["actions"]), len(ep["actions"]) - 1)[0])
            for key, value in ep["obs"].items():
                demo.create_dataset(f"obs/{key}", data=value)
        data.attrs["total"] = sum(len(ep["actions"]) for ep in episodes)
    return path


def _tree(root: Path) -> dict[str, tuple[int, int] | None]:
    """Every path under ``root`` -> (size, mtime_ns) of a file, None for a directory: what "the cache is
    untouched" compares (a directory's own mtime moves when a temporary entry comes and goes)."""
    return {
        str(p.relative_to(root)): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
    }


def test_collected_demos_record_rewards_which_are_not_observations(tmp_path):
    out = collect_demos(REACH, 2, 0, tmp_path / "d")
    reader = DemoReader(out["path"])
    assert reader.fields["reward"] == {"dtype": "f4", "shape": []}
    assert reader.episode(0)["reward"].sum() != 0
    assert DemoWindows(out["path"], 1, 8).obs_spec == {"state": [6]}  # the reward is no observation


def test_robomimic_export_round_trip(tmp_path):
    """collect (multimodal: image, points, text, state) -> export -> import -> identical windows."""
    native = Path(collect_demos(PICK, 1, 0, tmp_path / "pick")["path"])
    out = export_robomimic(native, tmp_path / "pick.hdf5")
    reader = DemoReader(native)
    episode = reader.episode(0)
    with h5py.File(out["path"]) as f:
        demo = f["data/demo_0"]
        assert set(demo["obs"]) == set(demo["next_obs"]) == {"rgb", "points", "state", "instruction"}
        assert demo.attrs["num_samples"] == len(episode["action"]) and bool(demo.attrs["success"])
        np.testing.assert_array_equal(demo["rewards"][()], episode["reward"])
        assert demo["dones"][-1] == 1 and demo["dones"][:-1].sum() == 0
        np.testing.assert_array_equal(demo["next_obs/state"][:-1], demo["obs/state"][1:])
        assert json.loads(f["data"].attrs["env_args"])["env_name"] == PICK.id
        assert f["data"].attrs["total"] == reader.num_steps
    path, imported = import_demos(out["path"], PICK, tmp_path / "cache")
    assert imported and import_demos(out["path"], PICK, tmp_path / "cache") == (path, False)
    before, after = DemoWindows(native, 2, 16), DemoWindows(path, 2, 16)
    assert after.obs_spec == before.obs_spec and after.instructions == before.instructions
    # robomimic's format has no privileged labels: target_pos (BC's auxiliary target) stays behind
    assert before.has_target and not after.has_target
    assert set(after.data) == set(before.data) - {"target_pos"}
    for key, value in after.data.items():
        assert torch.equal(after.data[key], value), key
    assert torch.equal(after.obs_idx, before.obs_idx) and torch.equal(after.act_idx, before.act_idx)
    assert DemoReader(path).meta["success"] == reader.meta["success"]
    assert DemoReader(path).meta["seeds"] == reader.meta["seeds"]
    np.testing.assert_array_equal(DemoReader(path).episode(0)["reward"], episode["reward"])


def test_collect_format_robomimic(tmp_path, compose):
    from diffpolicy import collect

    cfg = compose("collect", ["env=obstacle_reach", "n_episodes=2", "format=robomimic"])
    summary = collect.main(cfg, tmp_path)
    assert summary["robomimic"] == str(tmp_path / "demos.hdf5") and summary["path"] == str(tmp_path / "demos")
    with h5py.File(summary["robomimic"]) as f:
        assert len(f["data"]) == summary["n_kept"] and f["data"].attrs["total"] == summary["steps"]
    with pytest.raises(ValueError, match="already exists"):
        collect.main(cfg, tmp_path)
    with pytest.raises(ValueError, match="format"):
        compose("collect", ["format=zarr"])


def test_box_env_actions_are_rescaled_and_obs_keys_concatenate(tmp_path):
    """A plain Box env's dataset is in the env's units: force in [-3, 3] becomes the adapter's [-1, 1];
    bc.obs_keys forms ``state`` from the dataset's ``pos`` (x, theta) and ``vel`` keys, in that order; without
    it, robomimic's low-dim keys form it in name order."""
    episodes = pendulum_episodes(2, steps=12)
    split = [
        {**ep, "obs": {"pos": ep["obs"]["state"][:, :2], "vel": ep["obs"]["state"][:, 2:]}} for ep in episodes
    ]
    file = write_robomimic_file(tmp_path / "split.hdf5", split)
    path, _ = import_demos(str(file), PENDULUM, tmp_path / "cache", {"state": ["pos", "vel"]})
    reader = DemoReader(path)
    for i, ep in enumerate(episodes):
        got = reader.episode(i)
        np.testing.assert_allclose(got["state"], ep["obs"]["state"], rtol=1e-6)
        np.testing.assert_allclose(got["action"], ep["actions"] / 3.0, atol=1e-6)
        assert reader.meta["success"][i] is None  # unknown: kept by behaviour cloning
    default, _ = import_demos(str(file), PENDULUM, tmp_path / "cache2")  # robomimic's low-dim keys, by name
    np.testing.assert_array_equal(DemoReader(default).episode(0)["state"], reader.episode(0)["state"])
    with pytest.raises(ValueError, match=r"demo_0: observation pos\+vel\+zeta is \(5,\) per step"):
        extra = [{**ep, "obs": {**ep["obs"], "zeta": ep["obs"]["pos"][:, :1]}} for ep in split]
        import_demos(str(write_robomimic_file(tmp_path / "extra.hdf5", extra)), PENDULUM, tmp_path / "cache")


def test_minari_dataset_trains_by_behaviour_cloning(tmp_path, monkeypatch):
    """A local Minari dataset (written here with minari itself, nothing downloaded), named by id or by its
    directory, imports to the same data, and behaviour cloning trains from it."""
    minari = pytest.importorskip(
        "minari", reason='Minari datasets need the `data` extra: pip install -e ".[data]"'
    )
    from minari.data_collector.episode_buffer import EpisodeBuffer

    from diffpolicy.bc import pretrained_checkpoint
    from diffpolicy.device import Runtime
    from diffpolicy.policy_io import load_policy

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    episodes = pendulum_episodes(3, steps=20)
    buffers = [
        EpisodeBuffer(
            id=i, observations=np.concatenate([ep["obs"]["state"], ep["final"][None]]),  # (L + 1, 4)
            actions=ep["actions"].astype(np.float32), rewards=list(ep["rewards"]),
            terminations=[False] * len(ep["actions"]), truncations=[False] * (len(ep["actions"]) - 1) + [True],
            infos={"success": np.array([False] * len(ep["actions"]) + [i != 1])},
        )
        for i, ep in enumerate(episodes)
    ]  # fmt: skip
    with pytest.warns(UserWarning):  # minari asks for a description and an eval env
        minari.create_dataset_from_buffers("test/pendulum/ctrl-v0", buffers, env="InvertedPendulum-v5")
    by_id, _ = import_demos("minari:test/pendulum/ctrl-v0", PENDULUM, tmp_path / "cache")
    by_dir, _ = import_demos(
        str(tmp_path / "minari" / "test/pendulum/ctrl-v0"), PENDULUM, tmp_path / "cache2"
    )
    for path in (by_id, by_dir):
        reader = DemoReader(path)
        assert reader.meta["success"] == [True, False, True] and reader.num_episodes == 3
        np.testing.assert_allclose(reader.episode(2)["state"], episodes[2]["obs"]["state"], rtol=1e-6)
        np.testing.assert_allclose(reader.episode(2)["action"], episodes[2]["actions"] / 3.0, atol=1e-6)
    bc = BCConfig(epochs=1, batch_size=16, demos="minari:test/pendulum/ctrl-v0")
    runtime = Runtime.from_config(DeviceConfig(type="cpu"))
    ckpt = pretrained_checkpoint(PENDULUM, SMALL, bc, runtime, tmp_path / "cache", progress=False)
    policy, env_cfg, loaded = load_policy(ckpt)
    assert loaded.extra["obs_spec"] == {"state": [4]} and policy.action_dim == 1 and env_cfg == PENDULUM
    assert loaded.extra["demos"] == str(by_id)
    with pytest.raises(
        FileNotFoundError, match="no local Minari dataset 'test/none-v0'.*nothing is downloaded"
    ):
        import_demos("minari:test/none-v0", PENDULUM, tmp_path / "cache")


def _bad(kind: str, tmp_path: Path) -> tuple[str, dict]:
    """A bad source of kind ``kind`` for PENDULUM: (path, obs_keys)."""
    episodes = pendulum_episodes(2, steps=8)
    file = tmp_path / f"{kind}.hdf5"
    if kind == "missing":
        return str(tmp_path / "nowhere.hdf5"), {}
    if kind == "empty_file":
        file.write_bytes(b"")
    elif kind == "not_hdf5":
        file.write_text("step,action\n0,0.1\n")
    elif kind == "no_demos":
        with h5py.File(file, "w") as f:
            f.create_group("data")
    elif kind == "truncated_file":
        write_robomimic_file(file, episodes)
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else:
        ep = episodes[1]  # the second demo: the first has already gone to the writer when it fails
        if kind == "missing_key":
            ep["obs"] = {"qpos": ep["obs"]["state"]}
        elif kind == "wrong_shape":
            ep["obs"]["state"] = ep["obs"]["state"][:, :3]
        elif kind == "action_dim":
            ep["actions"] = np.repeat(ep["actions"], 2, axis=1)
        elif kind == "action_bounds":
            ep["actions"][2, 0] = 5.0
        elif kind == "truncated_episode":
            ep["obs"]["state"] = ep["obs"]["state"][:-1]
        write_robomimic_file(file, episodes)
    return str(file), ({"rgb": ["state"]} if kind == "unknown_obs_key" else {})


BAD = {
    "missing": r"nowhere\.hdf5: no such file or directory",
    "empty_file": r"is an empty file \(0 bytes\)",
    "not_hdf5": r"not a readable HDF5 file",
    "no_demos": r"holds no demonstrations",
    "truncated_file": r"not a readable HDF5 file: empty, truncated",
    "missing_key": r"demo_1 has no observation 'state', which InvertedPendulum-v5 observes \(it has: qpos",
    "wrong_shape": r"demo_1: observation 'state' is \(3,\) per step, InvertedPendulum-v5 observes 'state' as \(4,\)",
    "action_dim": r"demo_1 has 2-D actions, InvertedPendulum-v5 takes 1-D actions",
    "action_bounds": r"demo_1 step 2: action\[0\]=5 lies outside InvertedPendulum-v5's action bounds \[-3, 3\]",
    "truncated_episode": r"demo_1 is truncated: \d+ actions but \d+ steps of obs/state",
    "unknown_obs_key": r"bc.obs_keys names 'rgb', which InvertedPendulum-v5 does not observe",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_sources_fail_in_one_line_and_leave_the_cache_untouched(kind, tmp_path):
    cache = tmp_path / "cache"
    good = write_robomimic_file(tmp_path / "good.hdf5", pendulum_episodes(1, steps=8))
    import_demos(str(good), PENDULUM, cache)  # a cache that already holds an import
    before = _tree(cache)
    source, obs_keys = _bad(kind, tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=BAD[kind]) as info:
        import_demos(source, PENDULUM, cache, obs_keys)
    assert "\n" not in str(info.value) and str(info.value).startswith(source)
    assert _tree(cache) == before


def test_a_failed_first_import_leaves_no_cache_behind(tmp_path):
    source, _ = _bad("action_bounds", tmp_path)  # fails after the first demo was written
    with pytest.raises(ValueError, match="outside"):
        import_demos(source, PENDULUM, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_bad_demos_on_the_command_line_is_one_line(tmp_path):
    source, _ = _bad("wrong_shape", tmp_path)
    args = ["env=gym", "env.id=InvertedPendulum-v5", "device=cpu", f"bc.demos={source}", "log.progress=false",
            f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'envs'}"}
    proc = subprocess.run([sys.executable, "-m", "diffpolicy.pretrain", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(f"error: bc.demos={source}: demo_1: observation 'state'")
    assert not list((tmp_path / "cache").rglob("*.npy"))


def test_pretrain_demos_is_bc_demos(compose):
    assert compose("pretrain", ["demos=mine.hdf5"]).bc.demos == "mine.hdf5"
    assert compose("train", ["bc.demos=mine.hdf5"]).bc.demos == "mine.hdf5"
    with pytest.raises(ValueError, match="give only bc.demos"):
        compose("pretrain", ["demos=a.hdf5", "bc.demos=b.hdf5"])
    with pytest.raises(ValueError, match=r"bc\.obs_keys\.state is empty"):
        compose("train", ["+bc.obs_keys.state=[]"])


def _robomimic_images(path: Path, episode: dict, camera_info: dict | None, cameras=("agentview",)) -> Path:
    """One MujocoPick episode as robomimic's image datasets hold it: ``<camera>_image`` (L, 64, 64, 3), its
    ``<camera>_depth`` (L, 64, 64, 1) m, low-dim ``robot0_*`` keys that together are the 10-D state."""
    length = len(episode["action"])
    rgb = np.repeat(np.repeat(episode["rgb"], 2, axis=1), 2, axis=2)  # (L, 64, 64, 3) from 32 x 32
    depth = np.ones((length, 64, 64, 1))
    depth[:, :8] = 5.0  # a far background band: no points
    with h5py.File(path, "w") as f:
        demo = f.create_group("data/demo_0")
        demo.create_dataset("actions", data=episode["action"])
        for camera in cameras:
            demo.create_dataset(f"obs/{camera}_image", data=rgb)
            demo.create_dataset(f"obs/{camera}_depth", data=depth)
        state = episode["state"]
        for key, part in (("robot0_eef_pos", state[:, :3]), ("robot0_eef_quat", state[:, 3:7]),
                          ("robot0_gripper_qpos", state[:, 7:])):  # fmt: skip
            demo.create_dataset(f"obs/{key}", data=part)
        if camera_info is not None:
            demo.attrs["camera_info"] = json.dumps(camera_info)
    return path


def test_robomimic_images_depth_and_low_dim_keys(tmp_path):
    collect_demos(PICK, 1, 0, tmp_path / "native")
    episode = DemoReader(tmp_path / "native").episode(0)
    K = np.array([[40.0, 0, 31.5], [0, 40.0, 31.5], [0, 0, 1]])
    E = np.eye(4)
    E[:3, 3] = [0.1, 0.2, 0.3]
    info = {"agentview": {"intrinsics": K.tolist(), "extrinsics": E.tolist()}}
    path, _ = import_demos(str(_robomimic_images(tmp_path / "img.hdf5", episode, info)), PICK, tmp_path / "c")
    reader = DemoReader(path)
    assert reader.meta["attrs"]["modalities"] == ["points", "rgb", "state"]  # no text in the file
    got = reader.episode(0)
    np.testing.assert_array_equal(got["state"], episode["state"])  # eef_pos, eef_quat, gripper_qpos in order
    assert (
        got["rgb"].shape[1:] == (32, 32, 3) and np.abs(got["rgb"].astype(float) - episode["rgb"]).mean() < 8
    )
    points = got["points"].astype(
        np.float64
    )  # (L, 64, 6): every point on the plane 1 m in front, none behind
    np.testing.assert_allclose(points[..., 2], 1.3, atol=1e-6)
    u = (points[..., 0] - 0.1) * 40.0 + 31.5  # the pixel each point came from, by inverting the projection
    v = (points[..., 1] - 0.2) * 40.0 + 31.5
    np.testing.assert_allclose(u, np.round(u), atol=1e-3)
    np.testing.assert_allclose(v, np.round(v), atol=1e-3)
    assert v.min() >= 8 - 1e-3 and v.max() <= 63 + 1e-3  # the background rows gave no point
    t = np.arange(len(points))[:, None]
    colour = np.repeat(np.repeat(episode["rgb"], 2, 1), 2, 2)[
        t, np.round(v).astype(int), np.round(u).astype(int)
    ]
    np.testing.assert_allclose(points[..., 3:], colour / 255.0, atol=1e-6)

    bare = _robomimic_images(tmp_path / "bare.hdf5", episode, None)
    with pytest.warns(UserWarning, match="no camera parameters .*goes without points"):
        path, _ = import_demos(str(bare), PICK, tmp_path / "c")
    assert DemoReader(path).meta["attrs"]["modalities"] == ["rgb", "state"]
    two = _robomimic_images(tmp_path / "two.hdf5", episode, info, cameras=("agentview", "wrist"))
    with pytest.raises(ValueError, match=r"holds 2 cameras .*\+bc\.obs_keys\.rgb=\[agentview_image\]"):
        import_demos(str(two), PICK, tmp_path / "c")
    path, _ = import_demos(
        str(two), PICK, tmp_path / "c", {"rgb": ["wrist_image"], "points": ["agentview_points"]}
    )
    assert DemoReader(path).meta["attrs"]["modalities"] == ["points", "rgb", "state"]
