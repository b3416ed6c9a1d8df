"""Depth to coloured points in numpy: open3d's back-projection on fixed frames, colours from the same pixels,
and the voxel down-sampling."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from diffpolicy_envs.mujoco_pick import (
    DEPTH_TRUNC,
    POINT_BOX_HIGH,
    POINT_BOX_LOW,
    MujocoPickEnv,
    depth_to_points,
    voxel_downsample,
)

GOLDEN = Path(__file__).parent / "data" / "points_open3d.npz"


def _cropped_cloud(env: MujocoPickEnv) -> np.ndarray:
    """The cropped, not yet down-sampled cloud of the env's last rendered depth image: (M, 3)."""
    pts = depth_to_points(env._depth, env._ray_x, env._ray_y, env._base_from_cam, DEPTH_TRUNC)
    return pts[np.all((pts >= POINT_BOX_LOW) & (pts <= POINT_BOX_HIGH), axis=1)]


def test_points_match_the_open3d_frames() -> None:
    """After reset and after 5 random steps, seeds 0 and 7, open3d's ``create_from_depth_image`` gave a random
    512-point sample of the cropped cloud; every one of those points is in the numpy cloud of the same frame."""
    want = np.load(GOLDEN)["points"]  # (4, 512, 3)
    frames = []
    for seed in (0, 7):
        env = MujocoPickEnv(obs_mode="multimodal", n_points=512)
        env.reset(seed=seed)
        frames.append(_cropped_cloud(env))
        rng = np.random.default_rng(seed)
        for _ in range(5):
            env.step(rng.uniform(-1, 1, 7).astype(np.float32))
        frames.append(_cropped_cloud(env))
        env.close()
    for cloud, golden in zip(frames, want):
        nearest = np.linalg.norm(golden[:, None, :] - cloud[None, :, :], axis=-1).min(axis=1)  # (512,)
        # MuJoCo releases' depth buffers differ by up to ~4e-5 m here (3.3.0, which the metaworld extra pins,
        # against the release the frames were recorded with); a wrong intrinsic or pose is off by millimetres
        assert nearest.max() < 1e-4


def test_depth_to_points_back_projects_pixels() -> None:
    depth = np.array([[1.0, 0.0], [2.0, 5.0]], dtype=np.float32)  # 0: no return, 5 > trunc
    ray_x = np.array([[-0.5, 0.5], [-0.5, 0.5]])
    ray_y = np.array([[-0.5, -0.5], [0.5, 0.5]])
    pose = np.eye(4)
    pose[:3, 3] = [1.0, 2.0, 3.0]
    pts = depth_to_points(depth, ray_x, ray_y, pose, trunc=3.0)
    np.testing.assert_allclose(pts, [[0.5, 1.5, 4.0], [0.0, 3.0, 5.0]])


def test_coloured_points_match_the_pixels_they_came_from() -> None:
    """With voxels far smaller than a pixel's footprint every point is one pixel: projecting it back through
    the camera lands on a pixel whose RGB value is the point's colour."""
    env = MujocoPickEnv(obs_mode="multimodal", image_size=48, n_points=256, point_voxel=1e-5)
    obs, _ = env.reset(seed=2)
    for _ in range(3):
        obs, *_ = env.step(env.action_space.sample())
    pts = obs["points"].astype(np.float64)
    cam_from_base = np.linalg.inv(env._base_from_cam)
    cam = pts[:, :3] @ cam_from_base[:3, :3].T + cam_from_base[:3, 3]  # (N, 3), z forward
    size = env.image_size
    f = 1.0 / (env._ray_x[0, 1] - env._ray_x[0, 0])
    c = 0.5 * (size - 1)
    u = np.rint(cam[:, 0] / cam[:, 2] * f + c).astype(int)
    v = np.rint(cam[:, 1] / cam[:, 2] * f + c).astype(int)
    assert ((u >= 0) & (u < size) & (v >= 0) & (v < size)).all()
    np.testing.assert_allclose(pts[:, 3:], obs["rgb"][v, u] / 255.0, atol=1e-6)
    assert len(np.unique(obs["rgb"][v, u], axis=0)) >= 3  # cubes, tray and arm: not one flat colour
    env.close()


def _voxel_reference(points: np.ndarray, voxel: float) -> dict[tuple[int, ...], np.ndarray]:
    cells: dict[tuple[int, ...], list[np.ndarray]] = {}
    for p in points:
        cells.setdefault(tuple(int(np.floor(x / voxel)) for x in p[:3]), []).append(p)
    return {k: np.mean(v, axis=0) for k, v in cells.items()}


def test_voxel_downsample_against_a_loop_order_invariant_and_bounded() -> None:
    rng = np.random.default_rng(0)
    pts = np.concatenate([rng.uniform(-0.05, 0.05, (300, 3)), rng.uniform(0, 1, (300, 3))], axis=1)
    out = voxel_downsample(pts, 0.02)
    ref = _voxel_reference(pts, 0.02)
    assert len(out) == len(ref) <= len(pts)
    got = {tuple(int(np.floor(x / 0.02)) for x in p[:3]): p for p in out}
    assert got.keys() == ref.keys()
    for key, mean in ref.items():
        np.testing.assert_allclose(got[key], mean, atol=1e-12)
    for perm_seed in range(3):  # the same voxels, in the same order, whatever the order of the rows
        perm = np.random.default_rng(perm_seed).permutation(len(pts))
        np.testing.assert_allclose(voxel_downsample(pts[perm], 0.02), out, atol=1e-12)
    cells = [tuple(int(np.floor(x / 0.02)) for x in p[:3]) for p in out]
    assert cells == sorted(cells)  # ordered by voxel index: x, then y, then z
    assert len(voxel_downsample(pts, 10.0)) <= 8  # a few big voxels around the origin
    assert voxel_downsample(pts[:0], 0.02).shape == (0, 6)


def test_voxel_downsample_of_a_cloud_too_wide_for_one_key() -> None:
    """Cells spanning more than an int64 key holds take the row-sort path: the same voxels, the same order."""
    rng = np.random.default_rng(1)
    pts = np.concatenate([rng.uniform(-1e6, 1e6, (200, 3)), rng.uniform(0, 1, (200, 3))], axis=1)
    pts[100:] = pts[:100]  # every voxel holds two rows
    out = voxel_downsample(pts, 1e-4)
    ref = _voxel_reference(pts, 1e-4)
    assert len(out) == len(ref) == 100
    cells = [tuple(int(np.floor(x / 1e-4)) for x in p[:3]) for p in out]
    assert cells == sorted(cells)
    for cell, p in zip(cells, out):
        np.testing.assert_allclose(p, ref[cell], rtol=1e-12)


def test_env_points_are_bounded_and_one_per_voxel() -> None:
    env = MujocoPickEnv(obs_mode="multimodal", n_points=4096, point_voxel=0.01)
    obs, _ = env.reset(seed=4)
    pts = obs["points"]
    assert pts.shape == (4096, 6)  # padded by repeats: far fewer voxels are occupied
    distinct = np.unique(pts, axis=0)
    cells = np.unique(np.floor(distinct[:, :3] / 0.01), axis=0)
    assert len(cells) == len(distinct) < 4096
    with pytest.raises(ValueError, match="point_voxel"):
        MujocoPickEnv(obs_mode="multimodal", point_voxel=0.0)
    env.close()
