"""Environments (issue 3): registry, spaces, reward terms, bad input, seeding, vector autoreset, experts."""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import warnings

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import diffpolicy_envs
from diffpolicy_envs.adapters import BoxEnvAdapter, make_env
from diffpolicy_envs.experts import evaluate_expert, make_expert, run_episode
from diffpolicy_envs.mujoco_pick import (
    COLORS,
    HOME_YAW,
    MAX_TOOL_STEP,
    TOOL_HIGH,
    TOOL_LOW,
    MujocoPickEnv,
    pose_action,
    rotation_error,
    tool_rotation,
)
from diffpolicy_envs.vector import make_vec_env

ENVS_DIR = pathlib.Path(diffpolicy_envs.__file__).parent

# (id, kwargs): every registered environment, MujocoPick in both observation modes.
CONFIGS = [
    ("MujocoPick-v0", {}),
    ("MujocoPick-v0", {"obs_mode": "state"}),
    ("MujocoDialogue-v0", {}),
    ("MujocoDialogue-v0", {"obs_mode": "state"}),
    ("ObstacleReach-v0", {}),
    ("MetaWorld-v0", {"task": "pick-place", "image_size": 48, "n_points": 128}),  # the metaworld extra (dev)
    ("MetaWorld-v0", {"task": "pick-place", "obs_mode": "state"}),
]
CONFIG_IDS = [
    "pick-multimodal",
    "pick-state",
    "dialogue-multimodal",
    "dialogue-state",
    "obstacle-reach",
    "metaworld-multimodal",
    "metaworld-state",
]


def _make(env_id: str, **kwargs) -> gym.Env:
    return gym.make(f"diffpolicy_envs:{env_id}", **kwargs)


def test_registry_covers_all_configs():
    assert {c[0] for c in CONFIGS} == set(diffpolicy_envs.ENV_IDS)
    for env_id in diffpolicy_envs.ENV_IDS:
        assert env_id in gym.registry


@pytest.mark.parametrize("env_id,kwargs", CONFIGS, ids=CONFIG_IDS)
def test_check_env(env_id, kwargs):
    env = _make(env_id, render_mode="rgb_array", **kwargs)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*infinity.*")  # unbounded joint velocities
        check_env(env.unwrapped)
    env.close()


@pytest.mark.parametrize(
    "env_id,kwargs", [*CONFIGS, ("Pendulum-v1", {})], ids=[*CONFIG_IDS, "pendulum-adapted"]
)
def test_reset_and_step_shapes_dtypes_finite(env_id, kwargs):
    env = make_env(env_id, **kwargs)
    space = env.observation_space
    assert isinstance(space, gym.spaces.Dict) and "state" in space.spaces
    assert env.action_space.dtype == np.float32
    assert np.all(env.action_space.low == -1) and np.all(env.action_space.high == 1)
    obs, info = env.reset(seed=0)
    env.action_space.seed(0)
    for _ in range(3):
        assert obs in space
        for key, value in obs.items():
            if key == "instruction":
                assert isinstance(value, str) and value
                continue
            assert value.shape == space[key].shape and value.dtype == space[key].dtype, key
            assert np.all(np.isfinite(value)), key
        obs, reward, terminated, truncated, info = env.step(env.action_space.sample())
        assert isinstance(reward, float) and np.isfinite(reward)
        assert isinstance(terminated, bool) and isinstance(truncated, bool)
    env.close()


def test_pick_observation_layout():
    env = _make("MujocoPick-v0", image_size=32, n_points=100)
    obs, info = env.reset(seed=1)
    assert obs["rgb"].shape == (32, 32, 3) and obs["points"].shape == (100, 6)
    assert obs["state"].shape == (10,)
    np.testing.assert_allclose(
        obs["state"][7:10], env.unwrapped.data.site_xpos[env.unwrapped.grip_site], atol=1e-6
    )
    assert 0.0 <= obs["points"][:, 3:].min() and obs["points"][:, 3:].max() <= 1.0
    assert COLORS[info["target_id"]] in obs["instruction"] and info["target_color"] in obs["instruction"]
    state = _make("MujocoPick-v0", obs_mode="state")
    s_obs, s_info = state.reset(seed=1)
    assert set(s_obs) == {"state"} and s_obs["state"].shape == (34,)
    np.testing.assert_array_equal(s_obs["state"][13:16], np.eye(3)[s_info["target_id"]])
    target = s_info["target_id"]
    np.testing.assert_allclose(s_obs["state"][16:19], state.unwrapped.cube_pos(target), atol=1e-6)
    np.testing.assert_array_equal(s_obs["state"][16:19], s_obs["state"][19 + 3 * target : 22 + 3 * target])


def test_points_are_in_the_base_frame():
    """Depth -> points geometry: every cube has points on its surface at its simulated position."""
    env = _make("MujocoPick-v0", n_points=2048)
    obs, _ = env.reset(seed=3)
    u = env.unwrapped
    for i in range(3):
        dist = np.linalg.norm(obs["points"][:, :3] - u.cube_pos(i), axis=1)
        near = dist < 0.04
        assert near.sum() >= 5, COLORS[i]
        assert dist[near].max() <= np.sqrt(3) * 0.02 + 0.005  # on the cube, within a half diagonal
        # and coloured like it: the cube's own channel is the brightest of its points' colour
        assert (obs["points"][near, 3:].argmax(axis=1) == i).mean() > 0.8, COLORS[i]


OWN_REWARDS = [(c, i) for c, i in zip(CONFIGS, CONFIG_IDS) if c[0] != "MetaWorld-v0"]
"""Configs whose reward is this package's named, weighted terms (Meta-World's is its own v3 reward function,
its parts passed through in ``info["terms"]``)."""


@pytest.mark.parametrize("env_id,kwargs", [c for c, _ in OWN_REWARDS], ids=[i for _, i in OWN_REWARDS])
def test_reward_is_weighted_sum_of_terms(env_id, kwargs):
    env = _make(env_id, **kwargs)
    env.reset(seed=0)
    expert = make_expert(env, seed=0)
    for t in range(30):
        action = expert.act(env) if t % 2 else env.action_space.sample()
        _, reward, terminated, truncated, info = env.step(action)
        terms, weights = info["reward_terms"], info["reward_weights"]
        assert set(terms) == set(weights)
        assert reward == pytest.approx(sum(weights[k] * terms[k] for k in terms), abs=1e-9)
        if terminated or truncated:
            env.reset()


def test_pick_default_reward_weights_and_custom():
    env = _make("MujocoPick-v0", obs_mode="state", reward_weights={"smoothness": 0.0})
    env.reset(seed=0)
    _, _, _, _, info = env.step(np.ones(7, np.float32))
    assert info["reward_weights"] == {"success": 5.0, "distance_improvement": 0.8, "smoothness": 0.0}
    assert info["reward_terms"]["smoothness"] == pytest.approx(-np.sqrt(7))  # first change from zeros


@pytest.mark.parametrize("env_id,dim", [("MujocoPick-v0", 7), ("ObstacleReach-v0", 2), ("Pendulum-v1", 1)])
def test_bad_actions(env_id, dim):
    env = make_env(env_id, **({"obs_mode": "state"} if env_id == "MujocoPick-v0" else {}))
    env.reset(seed=0)
    with pytest.raises(ValueError, match="shape"):
        env.step(np.zeros(dim + 1))
    with pytest.raises(ValueError, match="finite"):
        env.step(np.full(dim, np.nan))
    # out-of-range actions are clipped: same outcome as the clipped action
    big = np.linspace(-3.0, 3.0, dim)
    obs_big = env.step(big)[0]
    env.reset(seed=0)
    obs_clipped = env.step(np.clip(big, -1, 1))[0]
    np.testing.assert_array_equal(obs_big["state"], obs_clipped["state"])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"image_size": 0}, "image_size"),
        ({"n_points": 0}, "n_points"),
        ({"target_color": "purple"}, "target_color"),
        ({"obs_mode": "pixels"}, "obs_mode"),
        ({"obs_every": 0}, "obs_every"),
        ({"reward_weights": {"speed": 1.0}}, "reward term"),
        ({"action_mode": "torque"}, "action_mode"),
    ],
)
def test_invalid_options_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        MujocoPickEnv(**kwargs)
    assert "\n" not in str(err.value)


def test_adapter_rescales_actions_and_rejects_non_box():
    env = make_env("Pendulum-v1")
    assert isinstance(env, BoxEnvAdapter)
    env.reset(seed=0)
    env.step(np.array([1.0], np.float32))
    assert env.unwrapped.last_u == pytest.approx(2.0)  # Pendulum's max torque
    env.step(np.array([0.0], np.float32))
    assert env.unwrapped.last_u == pytest.approx(0.0)
    assert not isinstance(make_env("ObstacleReach-v0"), BoxEnvAdapter)
    with pytest.raises(ValueError, match="Box"):
        make_env("CartPole-v1")  # Discrete actions


def test_seeded_reset_is_reproducible():
    env = _make("MujocoPick-v0", image_size=32, n_points=64)
    u = env.unwrapped

    def snapshot(seed):
        obs, info = env.reset(seed=seed)
        cubes = np.stack([u.cube_pos(i) for i in range(3)])
        return obs, info["target_id"], cubes, u.tray_pos.copy()

    a, b = snapshot(7), snapshot(7)
    for key in ("rgb", "points", "state"):
        np.testing.assert_array_equal(a[0][key], b[0][key])
    assert a[0]["instruction"] == b[0]["instruction"] and a[1] == b[1]
    np.testing.assert_array_equal(a[2], b[2])
    np.testing.assert_array_equal(a[3], b[3])
    targets = {snapshot(s)[1] for s in range(12)}
    assert targets == {0, 1, 2}  # the target changes across episodes


def test_obs_every_caches_camera_data():
    env = _make("MujocoPick-v0", image_size=32, n_points=64, obs_every=4)
    obs, _ = env.reset(seed=0)
    first = obs["points"]
    action = np.full(7, 0.5, np.float32)
    for t in range(1, 5):
        obs, _, _, _, info = env.step(action)
        if t < 4:
            assert info["obs_age"] == t
            np.testing.assert_array_equal(obs["points"], first)
    assert info["obs_age"] == 0 and not np.array_equal(obs["points"], first)
    env.unwrapped.request_obs()
    _, _, _, _, info = env.step(action)
    assert info["obs_age"] == 0


def test_vector_env_same_step_autoreset_and_seeding():
    def rollout():
        venv = make_vec_env("ObstacleReach-v0", num_envs=3, seed=11)
        obs, _ = venv.reset()
        stream, ended = [obs["state"]], 0
        for _ in range(60):
            obs, _, terminated, truncated, info = venv.step(np.ones((3, 2), np.float32))
            stream.append(obs["state"])
            done = terminated | truncated
            if done.any():
                ended += 1
                assert info["_final_obs"].tolist() == done.tolist()
                for i in np.flatnonzero(done):
                    final = info["final_obs"][i]["state"]
                    assert not np.allclose(final[:2], obs["state"][i, :2])  # last obs != new episode's
                    np.testing.assert_array_equal(obs["state"][i, 2:4], 0.0)  # fresh episode: at rest
                    assert obs["state"][i, 1] < -0.6  # and at its start
        venv.close()
        return np.stack(stream), ended

    a, ended = rollout()
    b, _ = rollout()
    assert ended > 0
    np.testing.assert_array_equal(a, b)


def test_async_vector_env_matches_sync():
    kwargs = {"num_envs": 2, "seed": 5, "image_size": 16, "n_points": 32}
    results = []
    for mode in ("sync", "async"):
        venv = make_vec_env("MujocoPick-v0", vectorization_mode=mode, **kwargs)
        obs, _ = venv.reset()
        obs, _, _, _, _ = venv.step(np.zeros((2, 7), np.float32))
        results.append(obs)
        venv.close()
    sync, asyn = results
    assert tuple(sync["instruction"]) == tuple(asyn["instruction"])
    for key in ("rgb", "points", "state"):
        np.testing.assert_allclose(sync[key], asyn[key], atol=1e-6)


@pytest.mark.parametrize("action_mode", ["pose", "absolute", "delta"])
def test_pick_expert_succeeds_in_state_mode(action_mode):
    rate = evaluate_expert(
        "MujocoPick-v0", n_episodes=10, seed=1000, obs_mode="state", action_mode=action_mode
    )
    assert rate == 1.0


def test_imprecise_pick_expert_misses_the_tray_sometimes():
    """place_noise draws one release offset per episode from the expert's own seed (the same seed gives the
    same offsets), place_bias shifts every release; a large error makes the demonstrator fail where the
    precise expert succeeds."""
    env = MujocoPickEnv(obs_mode="state")
    offsets = []
    for _ in range(2):
        expert = make_expert(env, seed=7, place_noise=0.05)
        found = []
        for seed in (1000, 1001):
            env.reset(seed=seed)
            expert.act(env)
            found.append(expert.place_offset.copy())
        offsets.append(found)
    np.testing.assert_array_equal(offsets[0], offsets[1])
    assert not np.allclose(offsets[0][0], offsets[0][1])
    sloppy = evaluate_expert(
        "MujocoPick-v0", 6, seed=1000, expert_kwargs={"place_noise": 0.3}, obs_mode="state"
    )
    assert sloppy <= 0.5
    with pytest.raises(ValueError, match="place_noise"):
        make_expert(env, place_noise=-0.01)
    biased = make_expert(env, place_bias=[0.0, 0.065])
    env.reset(seed=1000)
    biased.act(env)
    np.testing.assert_array_equal(biased.place_offset, [0.0, 0.065])
    with pytest.raises(ValueError, match="place_bias"):
        make_expert(env, place_bias=[0.1])


def test_cautious_pick_expert_is_slower_and_still_succeeds():
    """max_speed caps the waypoint the expert commands to that distance (m) from the tool position at the
    current joint targets; the same scene then takes more steps, and the cube still ends in the tray."""
    env = gym.make("diffpolicy_envs:MujocoPick-v0", obs_mode="state", max_episode_steps=300)
    u = env.unwrapped
    lengths = {}
    for speed in (None, 0.008):
        expert = make_expert(env, max_speed=speed)
        env.reset(seed=1003)
        steps = 0
        while steps < 300:
            steps += 1
            start = u.tool_pos_at(u.q_target)
            action = expert.act(env)
            commanded = TOOL_LOW + 0.5 * (action[:3] + 1.0) * (TOOL_HIGH - TOOL_LOW)
            if speed is not None:
                assert np.linalg.norm(commanded - start) <= speed + 1e-6
            _, _, terminated, truncated, info = env.step(action)
            if terminated or truncated:
                break
        assert info["is_success"]
        lengths[speed] = steps
    assert lengths[0.008] > 1.2 * lengths[None]
    for bad in (0.0, -0.01, float("nan")):
        with pytest.raises(ValueError, match="max_speed"):
            make_expert(env, max_speed=bad)


def test_pose_action_is_a_waypoint_reached_at_limited_speed():
    """Repeating one pose action moves the tool there at <= MAX_TOOL_STEP per step (plus tracking lag) and
    holds it within a few millimetres, jaws at the commanded yaw."""
    env = MujocoPickEnv(obs_mode="state")
    env.reset(seed=3)
    goal, yaw = np.array([0.5, -0.1, 0.12]), HOME_YAW + 0.4
    action = pose_action(goal, yaw, grip=-1.0)
    assert action.shape == (7,) and np.all(np.abs(action) <= 1)
    prev = env.ee_pos()
    for _ in range(60):
        env.step(action)
        commanded = env.tool_pos_at(env.q_target)
        assert np.linalg.norm(commanded - prev) <= MAX_TOOL_STEP + 1e-9
        prev = commanded
    assert np.linalg.norm(env.ee_pos() - goal) < 0.005
    mat = env.data.site_xmat[env.grip_site].reshape(3, 3)
    assert np.linalg.norm(rotation_error(mat, tool_rotation(yaw))) < 0.02


def test_pick_expert_succeeds_with_multimodal_obs():
    env = _make("MujocoPick-v0", image_size=32, n_points=64, obs_every=8)
    result = run_episode(env, make_expert(env), seed=2024)
    assert result["success"] and result["length"] < 120


def test_obstacle_reach_expert_is_bimodal_and_succeeds():
    env = _make("ObstacleReach-v0")
    expert = make_expert(env, seed=0)
    sides = []
    for seed in range(20):
        assert run_episode(env, expert, seed=seed)["success"]
        sides.append(expert.side)
    assert set(sides) == {-1.0, 1.0}
    # averaging the two modes drives straight into the obstacle
    obs, _ = env.reset(seed=0)
    for _ in range(50):
        obs, _, terminated, _, info = env.step(np.array([0.0, 1.0]))
        if terminated:
            break
    assert info["collision"] and not info["is_success"]


def test_render_rgb_array():
    frame = _make("MujocoPick-v0", render_mode="rgb_array", render_size=64, obs_mode="state")
    frame.reset(seed=0)
    img = frame.render()
    assert img.shape == (64, 64, 3) and img.dtype == np.uint8 and img.std() > 0


def test_envs_never_import_diffpolicy():
    for path in ENVS_DIR.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not any(n == "diffpolicy" or n.startswith("diffpolicy.") for n in names), path
    code = "import sys, gymnasium as g; g.make('diffpolicy_envs:ObstacleReach-v0'); print('diffpolicy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
