"""Camera data of datasets from elsewhere: images resized to the policy's size, depth maps made into points.
Imports numpy (and PIL for resizing, which matplotlib already brings)."""

from __future__ import annotations

import numpy as np


def resize_frames(frames: np.ndarray, size: int) -> np.ndarray:
    """(L, H, W, 3) uint8 images -> (L, size, size, 3), bilinear (PIL); unchanged when already that size."""
    if frames.shape[1:3] == (size, size):
        return frames
    from PIL import Image

    return np.stack([np.asarray(Image.fromarray(f).resize((size, size), Image.BILINEAR)) for f in frames])


def depth_points(
    depth: np.ndarray, intrinsics: np.ndarray, world_from_cam: np.ndarray, n: int, rgb: np.ndarray | None,
    seed: int,
) -> np.ndarray:  # fmt: skip
    """Back-project one depth image into ``n`` coloured points of the world frame.

    Args:
        depth: (H, W) or (H, W, 1) distance along the optical axis (m), row 0 the image's top.
        intrinsics: (3, 3) pinhole matrix K (fx, fy, cx, cy in pixels of this image).
        world_from_cam: (4, 4) camera pose in the world, camera axes x right, y down, z forward.
        n: points returned: drawn uniformly without replacement from the kept pixels (with replacement when
            fewer), by a generator seeded with ``seed``.
        rgb: (H, W, 3) uint8 image of the same camera (colour), or None (colour 0).

    Returns:
        (n, 6) float32: x, y, z (m), then r, g, b in [0, 1]. Pixels with no depth (<= 0, not finite) and the
        background (depth >= 98 % of the image's largest) give no point; an image with none gives n zeros.
    """
    depth = np.asarray(depth, np.float64).reshape(depth.shape[0], depth.shape[1])
    valid = np.isfinite(depth) & (depth > 0)
    if valid.any() and depth[valid].max() > depth[valid].min():
        valid &= depth < 0.98 * depth[valid].max()
    v, u = np.nonzero(valid)  # (M,) rows and columns of the kept pixels
    if len(v) == 0:
        return np.zeros((n, 6), np.float32)
    pick = np.random.default_rng(seed).choice(len(v), n, replace=len(v) < n)
    v, u = v[pick], u[pick]
    z = depth[v, u]
    fx, fy, cx, cy = intrinsics[0, 0], intrinsics[1, 1], intrinsics[0, 2], intrinsics[1, 2]
    cam = np.stack([(u - cx) / fx * z, (v - cy) / fy * z, z], axis=1)  # (n, 3) camera frame
    xyz = cam @ world_from_cam[:3, :3].T + world_from_cam[:3, 3]
    colour = rgb[v, u] / 255.0 if rgb is not None else np.zeros((n, 3))
    return np.concatenate([xyz, colour], axis=1).astype(np.float32)
