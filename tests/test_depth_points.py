"""Depth to points in numpy: the same point clouds open3d's ``create_from_depth_image`` gave on fixed frames."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from diffpolicy_envs.mujoco_pick import MujocoPickEnv, depth_to_points

GOLDEN = Path(__file__).parent / "data" / "points_open3d.npz"


def test_points_match_the_open3d_frames() -> None:
    """``points`` after reset and after 5 random steps, seeds 0 and 7, recorded with the open3d version."""
    want = np.load(GOLDEN)["points"]  # (4, 512, 3)
    got = []
    for seed in (0, 7):
        env = MujocoPickEnv(obs_mode="multimodal", n_points=512)
        obs, _ = env.reset(seed=seed)
        got.append(obs["points"])
        rng = np.random.default_rng(seed)
        for _ in range(5):
            obs, *_ = env.step(rng.uniform(-1, 1, 7).astype(np.float32))
        got.append(obs["points"])
        env.close()
    np.testing.assert_allclose(np.stack(got), want, atol=1e-6)


def test_depth_to_points_back_projects_pixels() -> None:
    depth = np.array([[1.0, 0.0], [2.0, 5.0]], dtype=np.float32)  # 0: no return, 5 > trunc
    ray_x = np.array([[-0.5, 0.5], [-0.5, 0.5]])
    ray_y = np.array([[-0.5, -0.5], [0.5, 0.5]])
    pose = np.eye(4)
    pose[:3, 3] = [1.0, 2.0, 3.0]
    pts = depth_to_points(depth, ray_x, ray_y, pose, trunc=3.0)
    np.testing.assert_allclose(pts, [[0.5, 1.5, 4.0], [0.0, 3.0, 5.0]])
