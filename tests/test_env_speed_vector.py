"""Episodes per hour (issue 16): the fast state-mode step keeps its results, the sharded vector env matches sync.

The IK, rotation error and tool rotation are checked against direct numpy formulas (``np.cross``,
``np.linalg.solve``, matrix products); :class:`ShardedVectorEnv` and ``make_envs(vectorization="async")``
against gymnasium's ``SyncVectorEnv`` with the same seeds and actions, autoresets included.
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import math

import mujoco
import numpy as np
import pytest

from diffpolicy_envs.experts import evaluate_expert
from diffpolicy_envs.mujoco_pick import (
    IK_DAMPING,
    MujocoPickEnv,
    rotation_error,
    step_toward,
    tool_rotation,
)
from diffpolicy_envs.vector import ShardedVectorEnv, make_vec_env


def _rot(axis: int, angle: float) -> np.ndarray:
    c, s = math.cos(angle), math.sin(angle)
    i, j = [k for k in range(3) if k != axis]
    r = np.eye(3)
    r[i, i], r[i, j], r[j, i], r[j, j] = c, -s, s, c
    return r if axis != 1 else r.T  # about y the sine terms swap sides


def _reference_ik(env: MujocoPickEnv, pos, rot, q_start, iterations: int) -> np.ndarray:
    """Damped least squares written plainly: mj_forward, np.cross, np.linalg.solve."""
    m = env.model
    d = mujoco.MjData(m)
    jacp, jacr = np.zeros((3, m.nv)), np.zeros((3, m.nv))
    q = np.array(q_start, dtype=np.float64)
    for _ in range(iterations):
        d.qpos[env.arm_qpos_adr] = q
        mujoco.mj_forward(m, d)
        mujoco.mj_jacSite(m, d, jacp, jacr, env.grip_site)
        mat = d.site_xmat[env.grip_site].reshape(3, 3)
        rot_err = 0.5 * sum(np.cross(mat[:, i], rot[:, i]) for i in range(3))
        err = np.concatenate([pos - d.site_xpos[env.grip_site], rot_err])
        jac = np.vstack([jacp[:, env.arm_dof_adr], jacr[:, env.arm_dof_adr]])
        dq = jac.T @ np.linalg.solve(jac @ jac.T + IK_DAMPING**2 * np.eye(6), err)
        q = np.clip(q + dq, env.joint_low, env.joint_high)
    return q


def test_tool_rotation_and_rotation_error_match_direct_formulas():
    rng = np.random.default_rng(0)
    for _ in range(200):
        yaw, roll, pitch = rng.uniform(-3.0, 3.0, 3)
        down = np.array(
            [[0.0, math.cos(yaw), math.sin(yaw)], [0.0, math.sin(yaw), -math.cos(yaw)], [-1, 0, 0]]
        )
        np.testing.assert_allclose(tool_rotation(yaw), down, atol=1e-15)
        expected = down @ _rot(0, roll) @ _rot(1, pitch)
        np.testing.assert_allclose(tool_rotation(yaw, roll, pitch), expected, atol=1e-14)
        other = tool_rotation(*rng.uniform(-3.0, 3.0, 3))
        direct = 0.5 * sum(np.cross(expected[:, i], other[:, i]) for i in range(3))
        np.testing.assert_allclose(rotation_error(expected, other), direct, atol=1e-14)
        start, goal = rng.normal(size=3), rng.normal(size=3)
        step = step_toward(start, goal, 0.5)
        dist = np.linalg.norm(goal - start)
        want = goal if dist <= 0.5 else start + (goal - start) * 0.5 / dist
        np.testing.assert_allclose(step, want, atol=1e-15)


def test_solve_ik_matches_plain_damped_least_squares():
    env = MujocoPickEnv(obs_mode="state")
    env.reset(seed=0)
    qpos = env.data.qpos.copy()
    rng = np.random.default_rng(1)
    for k in range(50):
        pos = rng.uniform([0.2, -0.4, 0.0], [0.7, 0.4, 0.4])
        rot = tool_rotation(*rng.uniform(-1.5, 1.5, 3))
        q0 = rng.uniform(env.joint_low, env.joint_high)
        iterations = 1 + k % 4
        np.testing.assert_allclose(
            env.solve_ik(pos, rot, q0, iterations), _reference_ik(env, pos, rot, q0, iterations), atol=1e-9
        )
        assert np.all(env.solve_ik(pos, rot, q0) >= env.joint_low)
    np.testing.assert_array_equal(env.data.qpos, qpos)  # the IK works on scratch data, not the simulation


def test_pick_expert_succeeds_on_seeds_0_to_99_in_state_mode():
    assert evaluate_expert("MujocoPick-v0", n_episodes=100, seed=0, obs_mode="state") == 1.0


def test_bench_state_over_physics_fields():
    from diffpolicy.benchmarks.env import _state_and_physics

    out = _state_and_physics(steps=130, repeats=1, seed=0)  # crosses one 120-step time limit
    assert set(out) == {"state_sps", "physics_sps", "state_over_physics"}
    assert all(math.isfinite(v) and v > 0 for v in out.values())
    assert out["state_over_physics"] == pytest.approx(out["physics_sps"] / out["state_sps"])


# ----------------------------------------------------------------------------------------- vector envs
def _assert_same(a, b, path: str = "") -> None:
    """Recursive equality of observations / infos: same keys, dtypes, shapes and values."""
    if isinstance(a, dict):
        assert set(a) == set(b), (path, set(a) ^ set(b))
        for key in a:
            _assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, (tuple, list)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and (a.dtype, a.shape) == (b.dtype, b.shape), path
        if a.dtype == object:
            for i, (x, y) in enumerate(zip(a, b)):
                _assert_same(x, y, f"{path}[{i}]")
        else:
            np.testing.assert_array_equal(a, b, err_msg=path)
    else:
        assert type(a) is type(b) and a == b, (path, a, b)


def _run(venv, steps: int, seed: int = 0, reset_seed: int | None = None) -> list:
    """reset + ``steps`` random steps; every returned value, in order."""
    rng = np.random.default_rng(seed)
    out = [venv.reset(seed=reset_seed)]
    for _ in range(steps):
        action = rng.uniform(-1.0, 1.0, venv.action_space.shape).astype(np.float32)
        out.append(venv.step(action))
    venv.close()
    return out


@pytest.mark.parametrize(
    "env_id,kwargs",
    [
        ("MujocoPick-v0", {"obs_mode": "state", "max_episode_steps": 12}),
        ("ObstacleReach-v0", {"max_episode_steps": 15}),
    ],
    ids=["pick-state", "obstacle-reach"],
)
def test_sharded_vector_env_matches_sync(env_id, kwargs):
    """Same seeds and actions -> identical observations, rewards, terminations, truncations and infos
    (``final_obs`` / ``final_info`` of the autoresets included), for 5 envs over 2 uneven shards."""
    runs = {
        mode: _run(make_vec_env(env_id, num_envs=5, seed=3, vectorization_mode=mode, workers=2, **kwargs), 40)
        for mode in ("sync", "sharded")
    }
    sync, sharded = runs["sync"], runs["sharded"]
    ended = sum(int(np.sum(r[2] | r[3])) for r in sync[1:])
    assert ended >= 5  # the comparison covers same-step autoresets
    assert any("final_info" in r[4] for r in sync[1:])
    for a, b in zip(sync, sharded, strict=True):
        _assert_same(a, b)


def test_sharded_multimodal_observations_and_attributes():
    kwargs = {"image_size": 16, "n_points": 32, "max_episode_steps": 3}
    sync = _run(make_vec_env("MujocoPick-v0", num_envs=3, seed=5, **kwargs), 4)
    venv = make_vec_env(
        "MujocoPick-v0", num_envs=3, seed=5, vectorization_mode="sharded", workers=2, **kwargs
    )
    inner = venv.unwrapped
    assert isinstance(inner, ShardedVectorEnv) and inner.shards == [(0, 2), (2, 3)]
    assert inner.get_attr("obs_every") == (1, 1, 1)
    inner.set_attr("obs_every", [1, 2, 3])
    assert inner.call("set_obs_every", 1) == (None, None, None)
    assert inner.get_attr("obs_every") == (1, 1, 1)
    sharded = _run(venv, 4)
    assert isinstance(sharded[1][0]["instruction"], tuple)
    for a, b in zip(sync, sharded, strict=True):
        _assert_same(a, b)


def test_sharded_vector_env_errors_and_sizes():
    with pytest.raises(ValueError, match="workers"):
        ShardedVectorEnv([lambda: None], workers=0)
    venv = make_vec_env("ObstacleReach-v0", num_envs=2, seed=0, vectorization_mode="sharded", workers=8)
    assert venv.unwrapped.shards == [(0, 1), (1, 2)]  # never more workers than envs
    venv.reset()
    with pytest.raises(RuntimeError, match="action must have shape"):
        venv.step(np.zeros((2, 5), np.float32))  # the workers' envs reject it; the traceback comes back
    obs, *_ = venv.step(np.zeros((2, 2), np.float32))  # and the workers keep serving
    assert obs["state"].shape[0] == 2
    venv.close()
    assert all(not p.is_alive() for p in venv.unwrapped._processes)


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "per-step"])
def test_make_envs_async_matches_sync(chunked):
    """``make_envs``: async (sharded over 2 workers) and sync give the same stream; ``chunked=False`` gives
    control-step envs with (B, Da) actions."""
    from diffpolicy.config import EnvConfig
    from diffpolicy.env_factory import make_envs

    runs = {}
    for mode in ("sync", "async"):
        cfg = EnvConfig(obs_mode="state", num_envs=3, vectorization=mode, workers=2, max_episode_steps=20)
        venv = make_envs(cfg, n_action_steps=4, num_envs=3, seed=7, chunked=chunked)
        assert venv.action_space.shape == ((3, 4, 7) if chunked else (3, 7))
        runs[mode] = _run(venv, 12 if chunked else 30)
    for a, b in zip(runs["sync"], runs["async"], strict=True):
        _assert_same(a, b)
    assert any("final_obs" in r[4] for r in runs["sync"][1:])


def test_env_config_workers():
    from diffpolicy.config import EnvConfig

    assert EnvConfig().workers == 0
    with pytest.raises(ValueError, match="env.workers"):
        EnvConfig(workers=-1)
