"""env=metaworld: the adapter's observations, seeding and time limit, Meta-World's scripted experts as
demonstrators, the config's errors, and a tiny collect -> BC -> fine-tuning -> evaluation run from an empty
cache through the command line (the metaworld extra is in dev, so CI runs all of it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("metaworld", reason="the metaworld extra is not installed")

from diffpolicy_envs.experts import make_expert
from diffpolicy_envs.meta_world import (
    INSTRUCTIONS,
    POINT_BOX_HIGH,
    POINT_BOX_LOW,
    POINT_BOXES,
    TASKS,
    MetaWorldEnv,
    farthest_points,
    robot_meshes_simplified,
    task_name,
)


@pytest.fixture(scope="module")
def env():
    e = MetaWorldEnv("reach", image_size=48, n_points=128)
    yield e
    e.close()


def test_every_v3_task_has_a_sentence_and_an_expert() -> None:
    from metaworld.env_dict import ALL_V3_ENVIRONMENTS
    from metaworld.policies import ENV_POLICY_MAP

    assert {f"{t}-v3" for t in TASKS} == set(ALL_V3_ENVIRONMENTS) and len(TASKS) == 50
    assert {f"{t}-v3" for t in TASKS} <= set(ENV_POLICY_MAP)
    assert len(set(INSTRUCTIONS.values())) == 50  # one sentence per task, no two alike
    assert task_name("stick-pull-v3") == task_name("stick-pull") == "stick-pull"
    with pytest.raises(ValueError, match="unknown Meta-World task 'stick-pul'"):
        task_name("stick-pul")


def test_observations_follow_the_convention(env: MetaWorldEnv) -> None:
    obs, info = env.reset(seed=3)
    assert env.observation_space.contains(obs)
    assert obs["rgb"].shape == (48, 48, 3) and obs["rgb"].dtype == np.uint8 and obs["rgb"].std() > 5
    pts = obs["points"]
    assert pts.shape == (128, 6) and pts.dtype == np.float32
    assert np.all(pts[:, :3] >= POINT_BOX_LOW - 1e-6) and np.all(pts[:, :3] <= POINT_BOX_HIGH + 1e-6)
    assert np.all((pts[:, 3:] >= 0) & (pts[:, 3:] <= 1)) and pts[:, 3:].std() > 0.01  # coloured
    assert obs["instruction"] == INSTRUCTIONS["reach"] == info["instruction"]
    # proprioception only: the hand (Meta-World's own 39-D vector starts with it), no object pose
    assert obs["state"].shape == (9,)
    np.testing.assert_allclose(obs["state"][:3], env.full_state[:3], atol=0.06)
    assert info["outcome"] == "never_reached" and not info["is_success"]


def test_point_box_reach_crops_to_the_hands_reach() -> None:
    """``point_box=reach`` keeps the points the hand can reach (the same box for every task); the default
    ``table`` crop is the one older checkpoints were trained with; an unknown name is one clear error."""
    low, high = POINT_BOXES["reach"]
    e = MetaWorldEnv("coffee-push", image_size=48, n_points=128, point_box="reach")
    try:
        table = MetaWorldEnv("coffee-push", image_size=48, n_points=128)
        try:
            pts = e.reset(seed=5)[0]["points"][:, :3]
            wide = table.reset(seed=5)[0]["points"][:, :3]
        finally:
            table.close()
    finally:
        e.close()
    assert np.all(pts >= low - 1e-6) and np.all(pts <= high + 1e-6)
    outside = (wide < low - 1e-6).any(1) | (wide > high + 1e-6).any(1)
    assert outside.sum() > 10  # the table crop spends points where the reach crop does not
    with pytest.raises(ValueError, match="point_box='room' is not allowed"):
        MetaWorldEnv("reach", point_box="room")


def test_seeded_resets_repeat_and_differ(env: MetaWorldEnv) -> None:
    a, _ = env.reset(seed=11)
    s_a, p_a = env.full_state.copy(), a["points"].copy()
    env.reset(seed=12)
    s_b = env.full_state.copy()
    b, _ = env.reset(seed=11)
    np.testing.assert_array_equal(env.full_state, s_a)
    np.testing.assert_array_equal(b["points"], p_a)
    assert not np.allclose(s_a[-3:], s_b[-3:])  # another goal placement


def test_camera_renders_every_kth_step_only() -> None:
    e = MetaWorldEnv("reach", image_size=32, n_points=64, obs_every=4)
    try:
        e.reset(seed=0)
        ages = [e.step(np.array([0.5, 0.0, 0.0, 0.0]))[4]["obs_age"] for _ in range(8)]
        assert ages == [1, 2, 3, 0, 1, 2, 3, 0]
        e.request_obs()
        assert e.step(np.zeros(4))[4]["obs_age"] == 0
    finally:
        e.close()


def test_state_mode_is_metaworlds_vector_and_time_limit_truncates() -> None:
    e = MetaWorldEnv("reach", obs_mode="state", time_limit=5)
    try:
        obs, _ = e.reset(seed=0)
        assert set(obs) == {"state"} and obs["state"].shape == (39,)
        ends = [e.step(np.zeros(4, np.float32))[2:5] for _ in range(5)]
        assert [(term, trunc) for term, trunc, _ in ends] == [(False, False)] * 4 + [(False, True)]
        assert ends[-1][2]["outcome"] in ("never_reached", "never_grasped", "timed_out")
        with pytest.raises(ValueError, match="shape"):
            e.step(np.zeros(3))
    finally:
        e.close()


def test_state_noise_offsets_each_position_for_the_whole_episode() -> None:
    """``state_noise``: one offset per position (object, second object; the goal with ``state_noise_on=all``)
    for the episode, in this frame and the previous one alike; the hand, gripper and quaternions are
    untouched, the expert reads the truth."""
    clean, noisy = (
        MetaWorldEnv("push", obs_mode="state"),
        MetaWorldEnv("push", obs_mode="state", state_noise=0.02, state_noise_on="all"),
    )
    try:
        a, _ = clean.reset(seed=3)
        clean_state = a["state"].copy()
        b, _ = noisy.reset(seed=3)
        d0 = b["state"] - a["state"]
        moved = [i for i in range(39) if abs(d0[i]) > 1e-7]
        assert set(moved) <= set(range(4, 7)) | set(range(11, 14)) | set(range(22, 25)) | set(
            range(29, 32)
        ) | {36, 37, 38}
        assert len(moved) >= 6 and np.abs(d0).max() < 0.02 * 6
        np.testing.assert_allclose(d0[4:7], d0[22:25], atol=1e-6)  # the same offset in both frames
        act = np.array([0.5, 0.0, 0.0, 0.0], np.float32)
        a, b = clean.step(act)[0], noisy.step(act)[0]
        np.testing.assert_allclose(b["state"] - a["state"], d0, atol=1e-6)  # held over the episode
        np.testing.assert_allclose(noisy.full_state, clean.full_state)  # what the expert reads
        again, _ = noisy.reset(seed=3)
        np.testing.assert_allclose(again["state"] - clean.reset(seed=3)[0]["state"], d0, atol=1e-6)  # seeded
        assert np.abs(noisy.reset(seed=4)[0]["state"] - clean.reset(seed=4)[0]["state"] - d0).max() > 1e-4
    finally:
        clean.close()
        noisy.close()
    objects = MetaWorldEnv("push", obs_mode="state", state_noise=0.02)  # the default leaves the goal true
    try:
        d = objects.reset(seed=3)[0]["state"] - clean_state
        assert np.abs(d[4:7]).max() > 1e-4 and np.abs(d[36:39]).max() == 0.0
    finally:
        objects.close()
    with pytest.raises(ValueError, match="state_noise"):
        MetaWorldEnv("push", obs_mode="multimodal", state_noise=0.01)
    with pytest.raises(ValueError, match="state_noise_on"):
        MetaWorldEnv("push", obs_mode="state", state_noise=0.01, state_noise_on="hand")


@pytest.mark.parametrize("task", ["reach", "button-press"])
def test_scripted_expert_succeeds_and_the_episode_ends_on_success(task: str) -> None:
    env = gym.make("diffpolicy_envs:MetaWorld-v0", task=task, obs_mode="state")
    expert = make_expert(env)
    try:
        for seed in range(2):
            env.reset(seed=seed)
            for _ in range(200):
                _, _, term, trunc, info = env.step(expert.act(env))
                if term or trunc:
                    break
            assert term and info["is_success"] and info["outcome"] == "success", (task, seed)
    finally:
        env.close()


def test_config_needs_a_known_task() -> None:
    from diffpolicy.config import EnvConfig, TrainConfig

    with pytest.raises(ValueError, match=r"env=metaworld needs env.task"):
        EnvConfig(name="metaworld", id="diffpolicy_envs:MetaWorld-v0")
    with pytest.raises(ValueError, match="unknown Meta-World task"):
        EnvConfig(name="metaworld", id="diffpolicy_envs:MetaWorld-v0", task="pick")
    cfg = TrainConfig(env=EnvConfig(name="metaworld", id="diffpolicy_envs:MetaWorld-v0", task="push-v3"))
    # one recipe for every task, derived from env.name: DP3's 10 demonstrations, proprioception, the crop
    assert cfg.env.task == "push" and cfg.bc.n_demos == 10 and cfg.bc.target_aux_weight == 1.0
    assert cfg.policy.encoder.use_state and cfg.policy.encoder.workspace_low == [-0.7, 0.2, 0.0]


def test_demonstrations_count_successes(tmp_path: Path) -> None:
    """Without failures kept, n demonstrations are n successful episodes (seeds tried in order)."""
    from diffpolicy.config import EnvConfig
    from diffpolicy.demos import collect_demos

    cfg = EnvConfig(name="metaworld", id="diffpolicy_envs:MetaWorld-v0", task="reach", obs_mode="state")
    out = collect_demos(cfg, 2, seed=0, out=tmp_path / "demos")
    assert out["n_kept"] == 2 and out["n_episodes"] >= 2 and out["success_rate"] > 0


def test_tiny_metaworld_run(tmp_path: Path) -> None:
    """The user's command with tiny sizes, from an empty cache: Meta-World's expert -> multimodal BC -> one
    iteration of env=metaworld's learner (the chain with the success reward; its guard on validation episodes,
    keep_best) -> validation and test evaluations (noise-free, DPPO's protocol beside), each split named in the
    summary."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "diffpolicy.train", "env=metaworld", "env.task=button-press",
           "env.num_envs=2", "env.vectorization=sync", "env.image_size=32", "env.n_points=64",
           "bc.n_demos=2", "bc.steps=2", "policy.down_dims=[32,64]", "policy.ddim_steps=4",
           "algo.iterations=1", "algo.n_steps=3", "algo.minibatch_size=3", "algo.update_epochs=1",
           "algo.ft_steps=2", "algo.rollback_episodes=2", "eval_episodes=2", "val_episodes=2",
           "video_episodes=0", "log.progress=false", "log.tensorboard=false",
           f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={run}"]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["splits"]["test"] == {"first_seed": 1_000_000, "episodes": 2, "use": "reported figure"}
    assert summary["splits"]["val"]["first_seed"] == 100_000 and summary["val"]["episodes"] == 2
    assert summary["learner"] == "chain" and summary["protocol"] == "noise_free"
    assert "dppo" in summary["protocols"]
    assert 0.0 <= summary["ppo_success_rate"] <= 1.0 and summary["env_steps"] > 0
    assert set(summary["failures"]["ppo"]) <= {"never_reached", "never_grasped", "timed_out"}
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("val/success_rate" in r for r in rows) and any("eval/success_rate" in r for r in rows)
    # the guard judged the deployed policy on validation episodes, and keep_best deployed BC or iteration 1
    assert any("val/guard_success_rate" in r for r in rows) and summary["deployed_iteration"] in (0, 1)


def test_farthest_points_against_a_looped_reference() -> None:
    rng = np.random.default_rng(0)
    xyz = rng.normal(size=(300, 3))
    got = farthest_points(xyz, 40, start=7)
    want = [7]
    for _ in range(39):  # the definition: the point whose nearest chosen point is farthest
        d = [min(np.linalg.norm(xyz[j] - xyz[c]) for c in want) for j in range(len(xyz))]
        want.append(int(np.argmax(d)))
    assert got.tolist() == want and len(set(want)) == 40


def test_the_first_frame_shows_objects_where_this_episode_put_them() -> None:
    """assembly's peg is placed by moving its body in the model: the reset's frame must show it there (the
    frame was once drawn before a forward pass, showing the previous episode's peg)."""
    e = MetaWorldEnv("assembly", image_size=84, n_points=512)
    try:
        for seed in (0, 1, 2):
            obs, _ = e.reset(seed=seed)
            peg = e.full_state[36:38]  # the goal: the peg's x, y
            near = np.linalg.norm(obs["points"][:, :2] - peg, axis=1) < 0.03
            assert near.sum() >= 5, (seed, near.sum())
    finally:
        e.close()


def test_target_label_is_the_object_the_goal_or_both() -> None:
    """``info["target_pos"]`` (BC's auxiliary label, never an observation): the object's position by default,
    the goal's with ``label="goal"``, both (6,) with ``label="both"``; each moves with the seed."""
    for label, part in (("object", [4, 5, 6]), ("goal", [36, 37, 38]), ("both", [4, 5, 6, 36, 37, 38])):
        e = MetaWorldEnv("push", obs_mode="state", label=label)
        try:
            labels = []
            for seed in (0, 1):
                _, info = e.reset(seed=seed)
                np.testing.assert_allclose(info["target_pos"], e.full_state[part], atol=1e-6)
                labels.append(info["target_pos"])
            assert not np.allclose(*labels)
        finally:
            e.close()
    with pytest.raises(ValueError, match="label"):
        MetaWorldEnv("push", label="peg")


def test_the_camera_draws_a_simplified_robot_and_the_same_scene() -> None:
    """robot_mesh_cell: the render copy's robot meshes lose most faces, the task's objects and the physics
    model keep theirs, every merged vertex stays inside its mesh's bounds, and the image and depth differ
    from the exact drawing only in detail (the arm's edges)."""
    env = MetaWorldEnv("assembly", image_size=84, robot_mesh_cell=0.0)
    try:
        m = env.model
        before = (m.mesh_face.copy(), m.mesh_vert.copy(), m.mesh_facenum.copy())
        drawn = robot_meshes_simplified(m, 0.01)
        for a, b in zip(before, (m.mesh_face, m.mesh_vert, m.mesh_facenum), strict=True):
            np.testing.assert_array_equal(a, b)  # the physics model is untouched
        robot = [
            m.mesh(i).name.startswith(("l", "base", "head", "eGripper", "pedestal")) for i in range(m.nmesh)
        ]
        robot = np.array(robot)
        assert drawn.mesh_facenum[robot].sum() < 0.4 * m.mesh_facenum[robot].sum()
        np.testing.assert_array_equal(drawn.mesh_facenum[~robot], m.mesh_facenum[~robot])  # peg, ring: exact
        for i in np.flatnonzero(robot):
            va, fa = m.mesh_vertadr[i], m.mesh_faceadr[i]
            verts = m.mesh_vert[va : va + m.mesh_vertnum[i]]
            used = drawn.mesh_vert[va + drawn.mesh_face[fa : fa + drawn.mesh_facenum[i]]].reshape(-1, 3)
            assert (used >= verts.min(0) - 1e-6).all() and (used <= verts.max(0) + 1e-6).all()
        obs, _ = env.reset(seed=3)
        exact_rgb, exact_pts = obs["rgb"].astype(float), obs["points"]
    finally:
        env.close()
    env = MetaWorldEnv("assembly", image_size=84, robot_mesh_cell=0.01)
    try:
        obs, _ = env.reset(seed=3)
        diff = np.abs(obs["rgb"].astype(float) - exact_rgb)
        assert 0 < diff.mean() < 2.0 and (diff.max(-1) > 60).mean() < 0.02
        # the clouds cover the same scene: every simplified point within 2 cm of an exact one, nearly all
        gap = np.linalg.norm(obs["points"][:, None, :3] - exact_pts[None, :, :3], axis=-1).min(1)
        assert np.median(gap) < 0.01 and (gap < 0.02).mean() > 0.95
    finally:
        env.close()
    with pytest.raises(ValueError, match="robot_mesh_cell"):
        MetaWorldEnv("assembly", robot_mesh_cell=-1)
