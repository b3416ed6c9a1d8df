"""``MujocoPick-v0``: put the named cube in the tray, from pixels, points, text and proprioception.

A 6-joint arm with a parallel-jaw gripper stands on a table with three cubes (red, green, blue; 4 cm) and a
tray (14 x 14 cm inner floor). Each episode draws which cube is the target, the cube poses (position and
yaw), the tray position and the wording of the instruction. Only the instruction names the target, so a
policy that ignores the text succeeds about one time in three. The robot base frame is the world frame:
origin on the table top under the arm, x forward, y left, z up; units are metres, radians and seconds.

Control runs at 10 Hz: one ``step`` holds the action for ``N_SUBSTEPS`` = 20 physics steps of 5 ms.

Action, ``Box(-1, 1, (7,), float32)`` (values outside [-1, 1] are clipped; NaN/inf or another shape raise
``ValueError``). With ``action_mode="pose"`` (default) the action is a target pose of the tool, every component
mapped linearly from [-1, 1]:

| index | meaning | range |
|---|---|---|
| 0-2 | tool point position x, y, z (m, base frame) | ``TOOL_LOW`` .. ``TOOL_HIGH`` |
| 3-4 | roll, pitch of the tool about its own x, y axes, from pointing straight down (rad) | +-``TILT_RANGE`` |
| 5 | yaw of the jaw axis in the table plane (rad) | ``HOME_YAW`` +- pi/2 |
| 6 | gripper command: -1 fully open (8.4 cm between the jaws) .. +1 closed | - |

Each step the commanded tool position moves toward the action's position by at most ``MAX_TOOL_STEP``
(1.2 cm, from the tool position at the current joint targets), and three damped least-squares IK iterations
from the current joint targets turn that pose into joint targets (:meth:`MujocoPickEnv.solve_ik`); an
action is therefore a waypoint the tool travels to, and the same action repeated gets there. With ``action_mode="absolute"`` indices 0-5 are joint position
targets (-1 .. +1 onto each joint's range), with ``action_mode="delta"`` changes of the joint targets,
``MAX_JOINT_DELTA`` = 0.1 rad per unit. In every mode the joint targets are clipped to the joint ranges and
kept within ``MAX_TARGET_LEAD`` = 0.3 rad of the measured joint positions (no wind-up when the arm is
blocked).

Why pose targets by default: a policy cloned from 100 demonstrations has to generalise from where the cube is
to what to command. With waypoints in tool space that map is close to the identity (the cube's position plus
an offset); in joint space it is the arm's inverse kinematics, and cloned policies (joint deltas or joint
targets alike) stopped 4-7 cm short of the cube. Chi et al. report the same preference for position over
velocity control.

Observation, a ``Dict`` space. With ``obs_mode="multimodal"`` (default):

| key | shape | dtype | content |
|---|---|---|---|
| ``rgb`` | (H, W, 3) | uint8 | image of the ``front`` camera, H = W = ``image_size`` (default 84) |
| ``points`` | (N, 6) | float32 | coloured point cloud: x, y, z in the base frame (m), then r, g, b in [0, 1]; N = ``n_points`` (default 512) |
| ``instruction`` | - | str | e.g. "put the red cube in the tray" (``Text`` space, lowercase letters and spaces) |
| ``state`` | (10,) | float32 | proprioception: joint positions (6, rad), gripper opening (1, m), gripper tool point (3, m, base frame) |

``points`` is computed from the depth image of the same camera and its pinhole intrinsics
(:func:`depth_to_points`: every pixel closer than ``DEPTH_TRUNC`` back-projected, in numpy), each point
carrying the colour of the RGB pixel it came from (colour is what tells the red cube from the blue one). The
cloud is cropped to the workspace box ``POINT_BOX_LOW`` .. ``POINT_BOX_HIGH`` (which removes the table plane
and background), voxelised (:func:`voxel_downsample`: one point per occupied ``point_voxel`` cube, default
1 cm, at the mean position and colour of the points in it), then brought to exactly N points by random
choice without replacement (the env's seeded generator), or padded by repeating points when fewer than N
remain (an empty crop gives N copies of the box centre, coloured black). No object position is in ``state``:
where the cubes and the tray are is read from ``points`` and ``rgb``. Nor are the joint velocities: they reveal
the last action, and policies cloned with them copied the motion in progress instead of locating the cube
(the copycat problem of imitation from proprioceptive history; docs/experiments.md).

With ``obs_mode="state"`` (fast, privileged) the Dict holds ``state`` alone, shape (34,): joint positions (6),
joint velocities (6), gripper opening (1), then the one-hot of the target cube (3, order red/green/blue), the target cube's position (3, m), the
three cube positions (9, m, same order), the tray centre (3, m) and the gripper tool point (3, m). The
target's position is given on its own (goal-conditioned state, as in robosuite's or ManiSkill's state
observations): with only the one-hot and the three positions, policies cloned from 100 demonstrations
failed to *select* the cube (2/32 held-out, against 32/32 when every episode had the same target colour).

With ``obs_every = k > 1`` the camera (``rgb`` and ``points``) is rendered only on every k-th step after a
reset (and at the reset itself); on the other steps the last rendered ``rgb``/``points`` are returned again
(the same cached arrays' values; ``state`` and ``instruction`` are always current). ``request_obs()`` forces
a render on the next step, e.g. after an episode ended in the middle of an action chunk.
``info["obs_age"]`` is the number of steps since the camera data was rendered (0 = fresh).

Reward, named and weighted (``info["reward_terms"]``, ``info["reward_weights"]``; the reward is their
weighted sum), default ``5.0 * success + 0.8 * distance_improvement + 0.2 * smoothness``:

| term | definition |
|---|---|
| ``success`` | 1 when the target cube rests in the tray (the episode then terminates), else 0 |
| ``distance_improvement`` | decrease (m) since the last step of the distance from the gripper tool point to the current goal: the target cube before it is grasped, a point 6 cm above the tray floor centre while it is grasped (both distances of one step use the same goal) |
| ``smoothness`` | minus the Euclidean norm of the change of the (clipped) action since the last step |

``info`` also holds ``is_success`` (bool), ``target_id`` (0 red, 1 green, 2 blue), ``target_color``,
``target_pos`` (3,) m (the named cube's centre in the base frame: privileged, a training-time label only),
``instruction``, ``grasped`` (both jaws touch the target cube), ``obs_age``, and what the episode would be
called if it ended now, ``outcome`` (one of :data:`OUTCOMES`):

| outcome | when |
|---|---|
| ``success`` | the target cube rests in the tray, released |
| ``wrong_cube`` | the target was never grasped, another cube was (held between both jaws) |
| ``never_grasped`` | the target was never grasped though the gripper closed; ``grasp_miss`` says by how far |
| ``dropped`` | the grasp on the target was lost with the tool point away from the tray |
| ``missed_tray`` | the target was let go above or beside the tray, and does not rest in it |
| ``timed_out`` | the time ran out first: the gripper never closed, the cube is still held, or it lies in the tray unreleased or still moving |

``grasp_miss`` (m) is the least distance between the tool point and the target cube's centre over the steps
on which the gripper was commanded closed before the first grasp (NaN until it closes). ``lost_grip`` says how
the last grasp on the target was lost: ``released`` (the jaws were commanded open on that step: the policy
let go), ``slipped`` (they were still commanded closed: the cube slid out), '' while it was never lost. Episodes truncate after 120
steps (``max_episode_steps`` of the registration); the scripted expert needs 45-85 (mean about 63).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from importlib import resources
from typing import Any

# Headless rendering by default; MuJoCo reads MUJOCO_GL when it is first imported, so an explicit setting
# (or an earlier ``import mujoco``) wins.
os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium import spaces

OUTCOMES = ("success", "wrong_cube", "never_grasped", "dropped", "missed_tray", "timed_out")
"""Values of ``info["outcome"]``: how the episode would end if it ended on this step."""
NEAR_TRAY = 0.03
"""Margin (m) beyond the tray's inner half width within which a lost grasp counts as ``missed_tray``."""
COLORS = ("red", "green", "blue")
"""Cube colours; the index is the ``target_id``."""
TEMPLATES = (
    "put the {} cube in the tray",
    "place the {} cube into the tray",
    "move the {} block to the tray",
    "pick up the {} cube and drop it in the tray",
    "the {} cube goes in the tray",
    "put the {} block inside the tray",
)
"""Instruction templates; ``{}`` is the colour of the target cube."""
CHARSET = "abcdefghijklmnopqrstuvwxyz "
"""Characters an instruction may contain."""

N_SUBSTEPS = 20
"""Physics steps (5 ms each) per control step: control at 10 Hz."""
MAX_JOINT_DELTA = 0.1
"""Joint target change (rad) for an action component of 1."""
MAX_TARGET_LEAD = 0.3
"""Largest allowed distance (rad) between a joint target and the measured joint position."""
FINGER_OPEN = 0.042
"""Finger slide (m) per jaw when fully open; the opening between the jaws is twice this."""
HOME_QPOS = np.array([0.0, 0.3, 0.2, 0.0, 1.07, 0.0])
"""Arm joint positions (rad) at reset, before a uniform +-0.05 rad perturbation."""
CUBE_HALF = 0.02
"""Half edge of a cube (m)."""
TRAY_FLOOR_Z = 0.01
"""Height of the tray floor top above the table (m)."""
TRAY_INNER_HALF = 0.07
"""Half width of the tray's inner floor (m)."""
CUBE_X_RANGE = (0.30, 0.56)
CUBE_Y_RANGE = (-0.26, 0.12)
CUBE_MIN_SEPARATION = 0.10
TRAY_X_RANGE = (0.36, 0.48)
TRAY_Y_RANGE = (0.26, 0.32)
POINT_BOX_LOW = np.array([0.0, -0.45, 0.005])
"""Lower corner (m, base frame) of the workspace box the point cloud is cropped to."""
POINT_BOX_HIGH = np.array([0.85, 0.45, 0.6])
"""Upper corner (m, base frame) of the workspace box the point cloud is cropped to."""
DEPTH_TRUNC = 3.0
"""Depth (m) beyond which pixels give no point (the background)."""
DEFAULT_REWARD_WEIGHTS = {"success": 5.0, "distance_improvement": 0.8, "smoothness": 0.2}
OBS_MODES = ("multimodal", "state")
ACTION_MODES = ("pose", "absolute", "delta")
TOOL_LOW = np.array([0.15, -0.45, 0.0])
"""Tool position (m, base frame) of a pose action component of -1."""
TOOL_HIGH = np.array([0.75, 0.45, 0.45])
"""Tool position (m, base frame) of a pose action component of +1."""
MAX_TOOL_STEP = 0.012
"""Largest move (m) of the commanded tool position per control step in pose mode."""
TILT_RANGE = 0.5
"""Largest roll / pitch (rad) of a pose action."""
HOME_YAW = np.pi / 2
"""Jaw yaw (rad) at ``HOME_QPOS``; pose actions span HOME_YAW +- pi/2."""
IK_DAMPING = 0.03
"""Damping lambda (m or rad) of the damped least-squares IK."""


def tool_rotation(yaw: float, roll: float = 0.0, pitch: float = 0.0) -> np.ndarray:
    """Tool orientation (3, 3): pointing down with the jaw axis at ``yaw`` (rad), then tilted by ``roll`` and
    ``pitch`` (rad) about the tool's own x and y axes. Columns are the tool axes in the base frame: x = approach
    (down), y = jaw opening direction.

    The product ``R0(yaw) @ Rx(roll) @ Ry(pitch)`` is written out with ``math`` on Python floats: it runs in
    every pose-mode step, and on 3 x 3 matrices numpy's per-call overhead would cost more than the arithmetic.
    """
    c, s = math.cos(yaw), math.sin(yaw)
    if not (roll or pitch):
        return np.array([[0.0, c, s], [0.0, s, -c], [-1.0, 0.0, 0.0]])
    cr, sr, cp, sp = math.cos(roll), math.sin(roll), math.cos(pitch), math.sin(pitch)
    # R0 @ Rx(roll): column x stays (0, 0, -1); columns y, z rotate in the plane of (c, s, 0) and (s, -c, 0).
    y0, y1 = c * cr + s * sr, s * cr - c * sr
    z0, z1 = -c * sr + s * cr, -s * sr - c * cr
    # ... @ Ry(pitch): columns x, z rotate into each other, y stays.
    return np.array(
        [
            [-sp * z0, y0, cp * z0],
            [-sp * z1, y1, cp * z1],
            [-cp, 0.0, -sp],
        ]
    )


def rotation_error(mat: np.ndarray, mat_goal: np.ndarray) -> np.ndarray:
    """Rotation vector (3,) (rad, base frame), small-angle form, that turns ``mat`` toward ``mat_goal``.

    It is half the sum over the columns i of ``cross(mat[:, i], mat_goal[:, i])``, computed as the vee of the
    skew-symmetric part of ``mat @ mat_goal.T`` (one 3 x 3 product instead of three ``np.cross`` calls).
    """
    c = (mat @ mat_goal.T).ravel().tolist()  # c[3j + k] = sum_i mat[j, i] * mat_goal[k, i]
    return np.array([0.5 * (c[5] - c[7]), 0.5 * (c[6] - c[2]), 0.5 * (c[1] - c[3])])


def step_toward(start: np.ndarray, goal: np.ndarray, max_step: float) -> np.ndarray:
    """The point on the segment from ``start`` to ``goal`` (3,) at most ``max_step`` (m) from ``start``."""
    diff = goal - start
    dist = math.sqrt(diff @ diff)
    return goal if dist <= max_step else start + diff * (max_step / dist)


def pose_action(
    pos: np.ndarray, yaw: float, grip: float, roll: float = 0.0, pitch: float = 0.0
) -> np.ndarray:
    """A pose-mode action (7,) float32 for tool position ``pos`` (m), jaw ``yaw`` (rad), gripper command."""
    xyz = 2.0 * (np.asarray(pos) - TOOL_LOW) / (TOOL_HIGH - TOOL_LOW) - 1.0
    y = (yaw - HOME_YAW) / (np.pi / 2)
    return np.array([*xyz, roll / TILT_RANGE, pitch / TILT_RANGE, y, grip], dtype=np.float32)


ARM_JOINTS = ("j1", "j2", "j3", "j4", "j5", "j6")
STATE_DIM = {"multimodal": 10, "state": 34}


_TOOL_SPAN = TOOL_HIGH - TOOL_LOW
_ONE_HOT = np.eye(3)


def _norm(v: np.ndarray) -> float:
    """Euclidean norm of a 1-D float64 array, as ``np.linalg.norm`` computes it, without its dispatch."""
    return math.sqrt(v @ v)


def _as_index(adr: np.ndarray) -> slice | np.ndarray:
    """A slice for consecutive addresses (a view, cheaper than fancy indexing), else the addresses."""
    if len(adr) and np.array_equal(adr, np.arange(adr[0], adr[0] + len(adr))):
        return slice(int(adr[0]), int(adr[0]) + len(adr))
    return adr


def depth_to_points(
    depth: np.ndarray,
    ray_x: np.ndarray,
    ray_y: np.ndarray,
    base_from_cam: np.ndarray,
    trunc: float,
    rgb: np.ndarray | None = None,
) -> np.ndarray:
    """Back-project a pinhole depth image into points of the base frame.

    Args:
        depth: (H, W) float32 distance along the optical axis (m); pixels <= 0 or > ``trunc`` give no point.
        ray_x, ray_y: (H, W) (u - cx) / fx and (v - cy) / fy of every pixel (u column, v row).
        base_from_cam: (4, 4) pose of the camera (x right, y down, z forward) in the base frame.
        trunc: largest kept depth (m).
        rgb: optional (H, W, 3) uint8 image of the same camera: each point then carries its pixel's colour.

    Returns:
        (M, 3) float64 points, row-major over the kept pixels (the order open3d's
        ``PointCloud.create_from_depth_image`` gives, which this replaces); (M, 6) with ``rgb``: xyz, then
        the pixel's r, g, b in [0, 1].
    """
    keep = (depth > 0) & (depth <= trunc)
    z = depth[keep].astype(np.float64)  # (M,)
    cam = np.stack([ray_x[keep] * z, ray_y[keep] * z, z], axis=1)  # (M, 3) camera frame
    xyz = cam @ base_from_cam[:3, :3].T + base_from_cam[:3, 3]
    return xyz if rgb is None else np.concatenate([xyz, rgb[keep] / 255.0], axis=1)


def voxel_downsample(points: np.ndarray, voxel: float) -> np.ndarray:
    """One point per occupied voxel: the mean of the rows that fall into each ``voxel``-sided cube.

    Args:
        points: (M, C) array whose first 3 columns are x, y, z (m); the others (e.g. colour) are averaged too.
        voxel: edge of the voxel grid's cubes (m), anchored at the origin.

    Returns:
        (V, C) float64, V <= M the number of occupied voxels, sorted by voxel index (x, then y, then z): the
        same set of voxels in the same order whatever the order of the input rows.
    """
    if len(points) == 0:
        return np.zeros((0, points.shape[1]))
    cells = np.floor(points[:, :3] / voxel).astype(np.int64)  # (M, 3)
    cells -= cells.min(axis=0)
    span = cells.max(axis=0) + 1  # (3,) cells along x, y, z
    if float(span[0]) * float(span[1]) * float(span[2]) < 2.0**62:
        # One int64 per cell, ordered as the (x, y, z) rows are: a 1-D sort instead of a sort of rows.
        key = (cells[:, 0] * span[1] + cells[:, 1]) * span[2] + cells[:, 2]  # (M,)
        _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    else:  # a cloud too wide for one int64 key
        _, inverse, counts = np.unique(cells, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    # bincount adds each column's rows in input order, as np.add.at does: the same sums to the bit.
    sums = np.stack(
        [np.bincount(inverse, weights=points[:, c], minlength=len(counts)) for c in range(points.shape[1])], 1
    )
    return sums / counts[:, None]


def pinhole_rays(size: int, fovy_deg: float) -> tuple[np.ndarray, np.ndarray]:
    """``(ray_x, ray_y)``, each (H, W) with H = W = ``size``: (u - cx) / fx and (v - cy) / fy of every pixel
    of a square pinhole camera with vertical field of view ``fovy_deg`` (degrees), u column, v row."""
    f = 0.5 * size / np.tan(0.5 * np.deg2rad(fovy_deg))
    c = 0.5 * (size - 1)
    v, u = np.mgrid[0:size, 0:size].astype(np.float64)  # (H, W) row and column of every pixel
    return (u - c) / f, (v - c) / f


def camera_pose(data: mujoco.MjData, camera: int) -> np.ndarray:
    """(4, 4) pose in the world of MuJoCo camera ``camera`` as a pinhole frame (x right, y down, z forward;
    MuJoCo's camera looks along -z with y up)."""
    world_from_cam = np.eye(4)
    world_from_cam[:3, :3] = data.cam_xmat[camera].reshape(3, 3) @ np.diag([1.0, -1.0, -1.0])
    world_from_cam[:3, 3] = data.cam_xpos[camera]
    return world_from_cam


def fill_cloud(
    out: np.ndarray,
    points: np.ndarray,
    low: np.ndarray,
    high: np.ndarray,
    voxel: float,
    choose: Callable[[np.ndarray, int], np.ndarray],
) -> None:
    """Crop ``points`` (M, C) to the box ``low`` .. ``high``, voxelise them (:func:`voxel_downsample`) and
    write exactly N = len(``out``) of them into ``out`` (N, C): ``choose(voxels (V, C), N)`` picks the row
    indices when V >= N; fewer are padded by repetition; none give N copies of the box centre, coloured black."""
    keep = np.all((points[:, :3] >= low) & (points[:, :3] <= high), axis=1)
    pts = voxel_downsample(points[keep], voxel)  # (V, C)
    n, count = len(out), len(pts)
    if count == 0:
        out[:, :3] = 0.5 * (low + high)
        out[:, 3:] = 0.0
    elif count >= n:
        out[:] = pts[choose(pts, n)]
    else:
        out[:count] = pts
        out[count:] = pts[np.arange(n - count) % count]


class CameraSchedule:
    """``obs_every`` / ``request_obs`` of an environment that renders its camera on every k-th step only
    (its step renders when ``elapsed % obs_every == 0`` or ``_force_obs`` is set)."""

    obs_every: int = 1
    _force_obs: bool = False

    def set_obs_every(self, k: int) -> None:
        """Render ``rgb``/``points`` on every k-th step after a reset only (k >= 1)."""
        if int(k) != k or k < 1:
            raise ValueError(f"obs_every must be a positive integer, got {k!r}")
        self.obs_every = int(k)

    def request_obs(self) -> None:
        """Render ``rgb``/``points`` on the next step whatever ``obs_every`` says."""
        self._force_obs = True


def _asset_path(name: str) -> str:
    return str(resources.files("diffpolicy_envs") / "assets" / name)


def _checked_arguments(
    obs_mode: str, image_size: int, n_points: int, point_voxel: float, render_mode: str | None,
    render_size: int, obs_every: int, action_mode: str, target_color: str | None,
    reward_weights: dict[str, float] | None,
) -> dict[str, float]:  # fmt: skip
    """Check :class:`MujocoPickEnv`'s arguments (one clear error each); -> the reward weights, the defaults
    updated by ``reward_weights``."""
    if obs_mode not in OBS_MODES:
        raise ValueError(f"obs_mode must be one of {OBS_MODES}, got {obs_mode!r}")
    if int(image_size) != image_size or image_size < 1:
        raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
    if int(n_points) != n_points or n_points < 1:
        raise ValueError(f"n_points must be a positive integer, got {n_points!r}")
    if not point_voxel > 0:
        raise ValueError(f"point_voxel must be a positive length in m, got {point_voxel!r}")
    if render_mode not in (None, "rgb_array"):
        raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
    if int(render_size) != render_size or render_size < 1:
        raise ValueError(f"render_size must be a positive integer, got {render_size!r}")
    if int(obs_every) != obs_every or obs_every < 1:
        raise ValueError(f"obs_every must be a positive integer, got {obs_every!r}")
    if action_mode not in ACTION_MODES:
        raise ValueError(f"action_mode must be one of {ACTION_MODES}, got {action_mode!r}")
    if target_color is not None and target_color not in COLORS:
        raise ValueError(f"target_color must be None or one of {COLORS}, got {target_color!r}")
    weights = dict(DEFAULT_REWARD_WEIGHTS)
    for name, value in (reward_weights or {}).items():
        if name not in DEFAULT_REWARD_WEIGHTS:
            raise ValueError(f"unknown reward term {name!r}; known: {tuple(DEFAULT_REWARD_WEIGHTS)}")
        weights[name] = float(value)
    return weights


class MujocoPickEnv(CameraSchedule, gym.Env):
    """Language-conditioned pick-and-place with a 6-joint arm; see the module docstring for the spaces.

    Args:
        obs_mode: "multimodal" (rgb, points, instruction, state) or "state" (privileged state vector only).
        image_size: height and width (pixels) of ``rgb`` and of the depth image behind ``points``.
        n_points: number of points N in ``points``.
        point_voxel: edge (m) of the voxels ``points`` is down-sampled on (one point per occupied voxel).
        render_mode: None or "rgb_array" (``render()`` returns a ``render_size`` square image, uint8).
        render_size: side (pixels) of the ``render()`` image.
        obs_every: render ``rgb``/``points`` on every k-th step only, repeating them in between.
        target_color: None (drawn per episode) or one of "red", "green", "blue" (fixed target).
        reward_weights: weights of the reward terms; missing names keep their default weight.
        action_mode: "pose" (tool pose targets), "absolute" (joint targets) or "delta" (joint target changes);
            see the module docstring.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(
        self,
        obs_mode: str = "multimodal",
        image_size: int = 84,
        n_points: int = 512,
        point_voxel: float = 0.01,
        render_mode: str | None = None,
        render_size: int = 256,
        obs_every: int = 1,
        target_color: str | None = None,
        reward_weights: dict[str, float] | None = None,
        action_mode: str = "pose",
    ) -> None:
        weights = _checked_arguments(
            obs_mode, image_size, n_points, point_voxel, render_mode, render_size, obs_every, action_mode,
            target_color, reward_weights,
        )  # fmt: skip
        self.obs_mode = obs_mode
        self.image_size = int(image_size)
        self.n_points = int(n_points)
        self.point_voxel = float(point_voxel)
        self.render_mode = render_mode
        self.render_size = int(render_size)
        self.obs_every = int(obs_every)
        self.target_color = target_color
        self.reward_weights = weights
        self.action_mode = action_mode

        self.model = self._load_model()
        self.data = mujoco.MjData(self.model)
        self._index_model()
        self.observation_space = self._observation_space()
        self.action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)

        # Episode state.
        self.target_id = 0
        self.instruction = ""
        self.tray_pos = np.zeros(3)
        self._place_goal = np.zeros(3)  # distance_improvement's goal while the cube is grasped
        self.q_target = HOME_QPOS.copy()
        self.episode_id = 0
        self.elapsed_steps = 0
        self._prev_action = np.zeros(7)
        self._prev_ee = np.zeros(3)
        self._prev_cube = np.zeros(3)
        self._obs_age = 0
        self._force_obs = False
        self._reset_outcome()

        # Rendering: one renderer for observations, created lazily (state mode never renders), one for videos.
        self._renderer: mujoco.Renderer | None = None
        self._video_renderer: mujoco.Renderer | None = None
        self._rgb = np.zeros((self.image_size, self.image_size, 3), np.uint8)
        self._depth = np.zeros((self.image_size, self.image_size), np.float32)
        self._points = np.zeros((self.n_points, 6), np.float32)

    def _load_model(self) -> mujoco.MjModel:
        """The scene's compiled model (``assets/pick.xml``); variants of the task add to it."""
        return mujoco.MjModel.from_xml_path(_asset_path("pick.xml"))

    def _index_model(self) -> None:
        """Ids and addresses of the joints, bodies, geoms and sites the env reads, and the IK's scratch buffers
        (a state-mode step costs little more than its physics only if nothing on the hot path allocates)."""
        m = self.model
        m.vis.global_.offwidth = max(m.vis.global_.offwidth, self.image_size, self.render_size)
        m.vis.global_.offheight = max(m.vis.global_.offheight, self.image_size, self.render_size)
        self.arm_qpos_adr = np.array([m.joint(j).qposadr[0] for j in ARM_JOINTS])
        self.arm_dof_adr = np.array([m.joint(j).dofadr[0] for j in ARM_JOINTS])
        self.joint_low = m.jnt_range[[m.joint(j).id for j in ARM_JOINTS], 0].copy()
        self.joint_high = m.jnt_range[[m.joint(j).id for j in ARM_JOINTS], 1].copy()
        self.finger_qpos_adr = np.array([m.joint(j).qposadr[0] for j in ("finger_left", "finger_right")])
        self.finger_geoms = (m.geom("finger_left").id, m.geom("finger_right").id)
        self.grip_site = m.site("grip").id
        self.base_body = m.body("base").id
        self.tray_body = m.body("tray").id
        self.cube_bodies = np.array([m.body(f"cube_{c}").id for c in COLORS])
        self.cube_geoms = np.array([m.geom(f"cube_{c}").id for c in COLORS])
        self.cube_qpos_adr = np.array([m.joint(f"cube_{c}").qposadr[0] for c in COLORS])
        self.cube_dof_adr = np.array([m.joint(f"cube_{c}").dofadr[0] for c in COLORS])
        self.camera = m.camera("front").id
        # Hot-path indices and scratch buffers: a state-mode step costs little more than its physics only if
        # the IK and the observation avoid numpy fancy indexing, small-array allocations and per-call setup.
        self._arm_q = _as_index(self.arm_qpos_adr)
        self._arm_v = _as_index(self.arm_dof_adr)
        self._cube_x = _as_index(self.cube_bodies)
        self._ik_data = mujoco.MjData(m)
        self._jac = np.zeros((6, m.nv))  # grip-site Jacobian: rows 0-2 translation, 3-5 rotation
        self._jacp, self._jacr = self._jac[:3], self._jac[3:]  # C-contiguous views, as mj_jacSite needs
        self._ik_err = np.zeros(6)  # position (m) and rotation (rad) error of one IK iteration
        self._ik_gram = np.zeros((6, 6))  # J J^T + lambda^2 I, factorised in place
        self._ik_y = np.zeros(6)
        self._ik_damping = IK_DAMPING**2 * np.eye(6)

    def _observation_space(self) -> spaces.Dict:
        """state (Ds,), and in multimodal mode rgb (H, W, 3) uint8, points (N, 6) within the crop box and the
        instruction."""
        obs_spaces: dict[str, spaces.Space] = {
            "state": spaces.Box(-np.inf, np.inf, (STATE_DIM[self.obs_mode],), np.float32),
        }
        if self.obs_mode == "multimodal":
            h = w = self.image_size
            obs_spaces["rgb"] = spaces.Box(0, 255, (h, w, 3), np.uint8)
            low = np.broadcast_to(np.r_[POINT_BOX_LOW, 0, 0, 0].astype(np.float32), (self.n_points, 6))
            high = np.broadcast_to(np.r_[POINT_BOX_HIGH, 1, 1, 1].astype(np.float32), (self.n_points, 6))
            obs_spaces["points"] = spaces.Box(low, high, (self.n_points, 6), np.float32)
            obs_spaces["instruction"] = spaces.Text(max_length=64, min_length=1, charset=CHARSET)
        return spaces.Dict(obs_spaces)

    # ------------------------------------------------------------------------------------------ gym API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Draw a new scene. The same ``seed`` gives the same target, poses, instruction and observation."""
        super().reset(seed=seed)
        rng = self.np_random
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)

        self._draw_task(rng)
        xy = self._sample_cube_xy(rng)
        for i in range(3):
            yaw = rng.uniform(-np.pi, np.pi)
            adr = self.cube_qpos_adr[i]
            d.qpos[adr : adr + 3] = (xy[i, 0], xy[i, 1], CUBE_HALF)
            d.qpos[adr + 3 : adr + 7] = (np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2))
        q0 = HOME_QPOS + rng.uniform(-0.05, 0.05, size=6)
        d.qpos[self.arm_qpos_adr] = q0
        d.qpos[self.finger_qpos_adr] = FINGER_OPEN
        self.q_target = q0.copy()
        d.ctrl[:6] = q0
        d.ctrl[6:8] = FINGER_OPEN
        mujoco.mj_forward(m, d)

        self.episode_id += 1
        self.elapsed_steps = 0
        self._prev_action = np.zeros(7)
        self._prev_ee = d.site_xpos[self.grip_site].copy()
        self._prev_cube = d.xpos[self.cube_bodies[self.target_id]].copy()
        self._reset_outcome()
        if self.obs_mode == "multimodal":
            self._update_camera_pose()
            self._render_obs()
        info = {
            "is_success": False,
            "target_id": self.target_id,
            "target_color": COLORS[self.target_id],
            "target_pos": self._prev_cube.copy(),
            "instruction": self.instruction,
            "obs_age": 0,
            "outcome": "timed_out",
            "grasp_miss": float("nan"),
            "lost_grip": "",
        }
        return self._get_obs(), info

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Apply one 7-D action for 0.1 s; see the module docstring for units, reward and info."""
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (7,):
            raise ValueError(f"MujocoPick action must have shape (7,), got {a.shape}")
        if not np.isfinite(a).all():
            raise ValueError(f"MujocoPick action must be finite, got {a.tolist()}")
        a = a.clip(-1.0, 1.0)
        m, d = self.model, self.data

        q = d.qpos[self._arm_q].copy()
        if self.action_mode == "pose":
            pos = TOOL_LOW + 0.5 * (a[:3] + 1.0) * _TOOL_SPAN
            pos = step_toward(self.tool_pos_at(self.q_target), pos, MAX_TOOL_STEP)
            roll, pitch, yaw = a[3:6].tolist()
            rot = tool_rotation(HOME_YAW + yaw * np.pi / 2, roll * TILT_RANGE, pitch * TILT_RANGE)
            target = self.solve_ik(pos, rot, self.q_target)
        elif self.action_mode == "absolute":
            target = self.joint_low + 0.5 * (a[:6] + 1.0) * (self.joint_high - self.joint_low)
        else:
            target = np.clip(self.q_target + MAX_JOINT_DELTA * a[:6], self.joint_low, self.joint_high)
        self.q_target = np.minimum(np.maximum(target, q - MAX_TARGET_LEAD), q + MAX_TARGET_LEAD)
        d.ctrl[:6] = self.q_target
        d.ctrl[6:8] = FINGER_OPEN * 0.5 * (1.0 - a[6])
        mujoco.mj_step(m, d, nstep=N_SUBSTEPS)
        self.elapsed_steps += 1

        touching = self._contacts_with(int(self.cube_geoms[self.target_id]))
        left, right = self.finger_geoms
        grasped = left in touching and right in touching
        success = self._target_in_tray(touching)
        ee = d.site_xpos[self.grip_site]
        cube = d.xpos[self.cube_bodies[self.target_id]]
        outcome = self._track_outcome(a[6] > 0.0, grasped, success, ee, cube)
        if grasped:
            goal_prev = goal_now = self._place_goal
        else:
            goal_prev, goal_now = self._prev_cube, cube
        terms = {
            "success": float(success),
            "distance_improvement": _norm(self._prev_ee - goal_prev) - _norm(ee - goal_now),
            "smoothness": -_norm(a - self._prev_action),
        }
        reward = float(sum(self.reward_weights[k] * v for k, v in terms.items()))
        self._prev_action = a
        self._prev_ee = ee.copy()
        self._prev_cube = cube.copy()

        if self.obs_mode == "multimodal":
            if self._force_obs or self.elapsed_steps % self.obs_every == 0:
                self._render_obs()
            else:
                self._obs_age += 1
        info = {
            "reward_terms": terms,
            "reward_weights": dict(self.reward_weights),
            "is_success": success,
            "target_id": self.target_id,
            "target_color": COLORS[self.target_id],
            "target_pos": cube.copy(),
            "instruction": self.instruction,
            "grasped": grasped,
            "obs_age": self._obs_age,
            "outcome": outcome,
            "grasp_miss": self._grasp_miss,
            "lost_grip": self._lost_grip,
        }
        return self._get_obs(), reward, success, False, info

    def render(self) -> np.ndarray | None:
        """A ``render_size`` square RGB frame (uint8) of the ``overview`` camera, for videos."""
        if self.render_mode != "rgb_array":
            return None
        if self._video_renderer is None:
            self._video_renderer = mujoco.Renderer(self.model, self.render_size, self.render_size)
        self._video_renderer.update_scene(self.data, "overview")
        return self._video_renderer.render()

    def close(self) -> None:
        for r in (self._renderer, self._video_renderer):
            if r is not None:
                r.close()
        self._renderer = self._video_renderer = None

    # ------------------------------------------------------------------------- privileged scene queries
    def cube_pos(self, i: int) -> np.ndarray:
        """Position (3,) of cube i (m, base frame)."""
        return self.data.xpos[self.cube_bodies[i]].copy()

    def cube_yaw(self, i: int) -> float:
        """Yaw (rad) of cube i about the vertical axis."""
        mat = self.data.xmat[self.cube_bodies[i]].reshape(3, 3)
        return float(np.arctan2(mat[1, 0], mat[0, 0]))

    def solve_ik(
        self, pos: np.ndarray, rot: np.ndarray, q_start: np.ndarray, iterations: int = 3
    ) -> np.ndarray:
        """Joint targets (6,) rad that put the tool at ``pos`` (3,) m with orientation ``rot`` (3, 3).

        ``iterations`` damped least-squares steps (``IK_DAMPING``) on a scratch MjData from ``q_start``, each
        clipped to the joint ranges; far goals are therefore approached, not reached, in one call. One step is
        ``dq = J^T (J J^T + lambda^2 I)^-1 err`` with J (6, 6) the arm columns of the grip site's Jacobian and
        err (6,) the position and rotation errors. It runs on every pose-mode step, so it reuses preallocated
        buffers, updates only the kinematics and the com-based quantities the Jacobian needs
        (``mj_kinematics`` + ``mj_comPos``, not ``mj_forward``) and solves the SPD 6 x 6 system with MuJoCo's
        Cholesky routines.
        """
        m, s, site = self.model, self._ik_data, self.grip_site
        err, gram, y = self._ik_err, self._ik_gram, self._ik_y
        q = np.array(q_start, dtype=np.float64)
        for _ in range(iterations):
            s.qpos[self._arm_q] = q
            mujoco.mj_kinematics(m, s)
            mujoco.mj_comPos(m, s)
            mujoco.mj_jacSite(m, s, self._jacp, self._jacr, site)
            np.subtract(pos, s.site_xpos[site], out=err[:3])
            err[3:] = rotation_error(s.site_xmat[site].reshape(3, 3), rot)
            jac = self._jac[:, self._arm_v]  # (6, 6)
            np.matmul(jac, jac.T, out=gram)
            gram += self._ik_damping
            mujoco.mju_cholFactor(gram, 0.0)
            mujoco.mju_cholSolve(y, gram, err)
            q += jac.T @ y
            np.minimum(np.maximum(q, self.joint_low, out=q), self.joint_high, out=q)
        return q

    def tool_pos_at(self, q: np.ndarray) -> np.ndarray:
        """Tool point position (3,) m for arm joint positions ``q`` (6,), by forward kinematics."""
        s = self._ik_data
        s.qpos[self._arm_q] = q
        mujoco.mj_kinematics(self.model, s)
        return s.site_xpos[self.grip_site].copy()

    def ee_pos(self) -> np.ndarray:
        """Position (3,) of the gripper tool point between the jaws (m, base frame)."""
        return self.data.site_xpos[self.grip_site].copy()

    def gripper_opening(self) -> float:
        """Distance (m) between the jaws."""
        return float(self.data.qpos[self.finger_qpos_adr].sum())

    # ----------------------------------------------------------------------------------------- internals
    cube_y_range: tuple[float, float] = CUBE_Y_RANGE
    """Range (m) of the cubes' y at reset (``CUBE_Y_RANGE``; a variant with trays on both sides narrows it)."""

    def _draw_task(self, rng: np.random.Generator) -> None:
        """Draw the target cube, the instruction and the tray's position (placing the tray body)."""
        self.target_id = (
            COLORS.index(self.target_color) if self.target_color is not None else int(rng.integers(3))
        )
        self.instruction = TEMPLATES[int(rng.integers(len(TEMPLATES)))].format(COLORS[self.target_id])
        self.set_place(np.array([rng.uniform(*TRAY_X_RANGE), rng.uniform(*TRAY_Y_RANGE), 0.0]))
        self.model.body_pos[self.tray_body] = self.tray_pos

    def set_place(self, tray_pos: np.ndarray) -> None:
        """Make the tray centred at ``tray_pos`` (3,) m the place the target goes to (success, outcome, reward)."""
        self.tray_pos = np.asarray(tray_pos, dtype=np.float64).copy()
        self._place_goal = self.tray_pos + np.array([0.0, 0.0, TRAY_FLOOR_Z + 0.06])

    def _sample_cube_xy(self, rng: np.random.Generator) -> np.ndarray:
        xy = np.zeros((3, 2))
        i = 0
        while i < 3:
            cand = np.array([rng.uniform(*CUBE_X_RANGE), rng.uniform(*self.cube_y_range)])
            if all(np.linalg.norm(cand - xy[j]) >= CUBE_MIN_SEPARATION for j in range(i)):
                xy[i] = cand
                i += 1
        return xy

    def _contacts_with(self, geom: int) -> set[int]:
        """Ids of the geoms in contact with ``geom``."""
        d = self.data
        n = d.ncon
        if n == 0:
            return set()
        pairs = d.contact.geom[:n].tolist()  # n is small: a Python loop beats numpy's per-call overhead
        return {g2 if g1 == geom else g1 for g1, g2 in pairs if g1 == geom or g2 == geom}

    def target_grasped(self) -> bool:
        """Whether both jaws touch the target cube."""
        touching = self._contacts_with(int(self.cube_geoms[self.target_id]))
        return self.finger_geoms[0] in touching and self.finger_geoms[1] in touching

    def _reset_outcome(self) -> None:
        self._ever_grasped = False
        self._wrong_grasp = False
        self._grasp_miss = float("nan")
        self._lost_near_tray = False
        self._was_grasped = False
        self._lost_grip = ""

    def _track_outcome(
        self, closing: bool, grasped: bool, success: bool, ee: np.ndarray, cube: np.ndarray
    ) -> str:
        """Update the episode's outcome record after a step and return ``info["outcome"]`` (module docstring)."""
        if grasped:
            self._ever_grasped = True
        elif not self._ever_grasped:
            if closing:
                self._grasp_miss = float(np.fmin(self._grasp_miss, _norm(ee - cube)))  # NaN until the first
                self._wrong_grasp = self._wrong_grasp or self._other_cube_held()
        elif self._was_grasped:  # the grasp was lost on this step: where?
            rel = ee[:2] - self.tray_pos[:2]
            self._lost_near_tray = bool(np.all(np.abs(rel) < TRAY_INNER_HALF + NEAR_TRAY))
            self._lost_grip = "slipped" if closing else "released"
        self._was_grasped = grasped
        if success:
            return "success"
        if not self._ever_grasped:
            if self._wrong_grasp:
                return "wrong_cube"
            return "timed_out" if math.isnan(self._grasp_miss) else "never_grasped"
        rel = cube - self.tray_pos
        in_tray = abs(rel[0]) < TRAY_INNER_HALF and abs(rel[1]) < TRAY_INNER_HALF and rel[2] < 0.08
        if grasped or in_tray:
            return "timed_out"
        return "missed_tray" if self._lost_near_tray else "dropped"

    def _other_cube_held(self) -> bool:
        """Whether a cube other than the target is held between both jaws."""
        left, right = self.finger_geoms
        for i, geom in enumerate(self.cube_geoms):
            if i != self.target_id:
                touching = self._contacts_with(int(geom))
                if left in touching and right in touching:
                    return True
        return False

    def _target_in_tray(self, touching: set[int]) -> bool:
        """Whether the target cube rests in the tray, released; ``touching``: the geoms in contact with it."""
        return self._rests_in(self.target_id, self.tray_pos, touching)

    def _rests_in(self, i: int, tray_pos: np.ndarray, touching: set[int]) -> bool:
        """Whether cube ``i`` rests, released, in the tray centred at ``tray_pos``; ``touching``: the geoms in
        contact with it."""
        rel = self.data.xpos[self.cube_bodies[i]] - tray_pos
        adr = self.cube_dof_adr[i]
        speed = _norm(self.data.qvel[adr : adr + 3])
        inside = abs(rel[0]) < TRAY_INNER_HALF - 0.005 and abs(rel[1]) < TRAY_INNER_HALF - 0.005
        resting = rel[2] < TRAY_FLOOR_Z + CUBE_HALF + 0.015 and speed < 0.05
        released = self.finger_geoms[0] not in touching and self.finger_geoms[1] not in touching
        return bool(inside and resting and released)

    def _state(self) -> np.ndarray:
        """The ``state`` observation (10,) or (34,) float32, filled slice by slice into one new array."""
        d = self.data
        out = np.empty(STATE_DIM[self.obs_mode], np.float32)
        out[0:6] = d.qpos[self._arm_q]
        if self.obs_mode == "multimodal":
            out[6] = d.qpos[self.finger_qpos_adr].sum()
            out[7:10] = d.site_xpos[self.grip_site]
        else:
            out[6:12] = d.qvel[self._arm_v]
            out[12] = d.qpos[self.finger_qpos_adr].sum()
            out[13:16] = _ONE_HOT[self.target_id]
            out[16:19] = d.xpos[self.cube_bodies[self.target_id]]
            out[19:28] = d.xpos[self._cube_x].ravel()
            out[28:31] = self.tray_pos
            out[31:34] = d.site_xpos[self.grip_site]
        return out

    def _get_obs(self) -> dict[str, Any]:
        obs: dict[str, Any] = {"state": self._state()}
        if self.obs_mode == "multimodal":
            obs["rgb"] = self._rgb.copy()
            obs["points"] = self._points.copy()
            obs["instruction"] = self.instruction
        return obs

    def _update_camera_pose(self) -> None:
        """The camera's pose in the base frame (``_base_from_cam``, x right, y down, z forward) and, once,
        the renderer and the per-pixel ray slopes of its pinhole intrinsics (``_ray_x``, ``_ray_y``)."""
        if self._renderer is None:
            size = self.image_size
            self._ray_x, self._ray_y = pinhole_rays(size, self.model.cam_fovy[self.camera])
            self._renderer = mujoco.Renderer(self.model, size, size)
        d = self.data
        world_from_cam = camera_pose(d, self.camera)
        world_from_base = np.eye(4)
        world_from_base[:3, :3] = d.xmat[self.base_body].reshape(3, 3)
        world_from_base[:3, 3] = d.xpos[self.base_body]
        self._base_from_cam = np.linalg.inv(world_from_base) @ world_from_cam

    def _render_obs(self) -> None:
        """Render ``rgb`` and depth with the one renderer, then build ``points`` (all into cached arrays)."""
        r = self._renderer
        r.update_scene(self.data, self.camera)
        r.render(out=self._rgb)
        r.enable_depth_rendering()
        r.render(out=self._depth)
        r.disable_depth_rendering()
        pts = depth_to_points(
            self._depth, self._ray_x, self._ray_y, self._base_from_cam, DEPTH_TRUNC, self._rgb
        )  # (M, 6) xyz + colour
        fill_cloud(
            self._points, pts, POINT_BOX_LOW, POINT_BOX_HIGH, self.point_voxel,
            lambda voxels, n: self.np_random.choice(len(voxels), n, replace=False),
        )  # fmt: skip
        self._obs_age = 0
        self._force_obs = False
