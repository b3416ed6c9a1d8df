"""``MujocoPick-v0``: put the named cube in the tray, from pixels, points, text and proprioception.

A 6-joint arm with a parallel-jaw gripper stands on a table with three cubes (red, green, blue; 4 cm) and a
tray (14 x 14 cm inner floor). Each episode draws which cube is the target, the cube poses (position and
yaw), the tray position and the wording of the instruction. Only the instruction names the target, so a
policy that ignores the text succeeds about one time in three. The robot base frame is the world frame:
origin on the table top under the arm, x forward, y left, z up; units are metres, radians and seconds.

Control runs at 10 Hz: one ``step`` holds the action for ``N_SUBSTEPS`` = 20 physics steps of 5 ms.

Action, ``Box(-1, 1, (7,), float32)`` (values outside [-1, 1] are clipped; NaN/inf or another shape raise
``ValueError``):

| index | meaning | unit |
|---|---|---|
| 0-5 | change of the joint position targets of joints 1-6, ``MAX_JOINT_DELTA`` = 0.1 rad per unit | rad / 0.1 s |
| 6 | gripper command: -1 fully open (8.4 cm between the jaws) .. +1 closed, absolute, not a delta | - |

The joint targets integrate the deltas, are clipped to the joint ranges and are kept within
``MAX_TARGET_LEAD`` = 0.3 rad of the measured joint positions (no wind-up when the arm is blocked).

Observation, a ``Dict`` space. With ``obs_mode="multimodal"`` (default):

| key | shape | dtype | content |
|---|---|---|---|
| ``rgb`` | (H, W, 3) | uint8 | image of the ``front`` camera, H = W = ``image_size`` (default 84) |
| ``points`` | (N, 3) | float32 | point cloud in the base frame (m), N = ``n_points`` (default 512) |
| ``instruction`` | - | str | e.g. "put the red cube in the tray" (``Text`` space, lowercase letters and spaces) |
| ``state`` | (13,) | float32 | joint positions (6, rad), joint velocities (6, rad/s), gripper opening (1, m) |

``points`` is computed from the depth image of the same camera and its pinhole intrinsics with open3d
(``PointCloud.create_from_depth_image``), cropped to the workspace box ``POINT_BOX_LOW`` .. ``POINT_BOX_HIGH``
(which removes the table plane and background), then down-sampled to exactly N points by random choice
without replacement (the env's seeded generator), or padded by repeating points when fewer than N remain
(an empty crop gives N copies of the box centre).

With ``obs_mode="state"`` (fast, privileged) the Dict holds ``state`` alone, shape (31,): the 13 values
above, then the one-hot of the target cube (3, order red/green/blue), the three cube positions (9, m, same
order), the tray centre (3, m) and the gripper tool point (3, m).

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
``instruction``, ``grasped`` (both jaws touch the target cube) and ``obs_age``. Episodes truncate after 120
steps (``max_episode_steps`` of the registration); the scripted expert needs 45-85 (mean about 63).
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Any

# Headless rendering by default; MuJoCo reads MUJOCO_GL when it is first imported, so an explicit setting
# (or an earlier ``import mujoco``) wins.
os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium import spaces

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
DEFAULT_REWARD_WEIGHTS = {"success": 5.0, "distance_improvement": 0.8, "smoothness": 0.2}
OBS_MODES = ("multimodal", "state")
ARM_JOINTS = ("j1", "j2", "j3", "j4", "j5", "j6")
STATE_DIM = {"multimodal": 13, "state": 31}


def _asset_path(name: str) -> str:
    return str(resources.files("diffpolicy_envs") / "assets" / name)


class MujocoPickEnv(gym.Env):
    """Language-conditioned pick-and-place with a 6-joint arm; see the module docstring for the spaces.

    Args:
        obs_mode: "multimodal" (rgb, points, instruction, state) or "state" (privileged state vector only).
        image_size: height and width (pixels) of ``rgb`` and of the depth image behind ``points``.
        n_points: number of points N in ``points``.
        render_mode: None or "rgb_array" (``render()`` returns a ``render_size`` square image, uint8).
        render_size: side (pixels) of the ``render()`` image.
        obs_every: render ``rgb``/``points`` on every k-th step only, repeating them in between.
        target_color: None (drawn per episode) or one of "red", "green", "blue" (fixed target).
        reward_weights: weights of the reward terms; missing names keep their default weight.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    def __init__(
        self,
        obs_mode: str = "multimodal",
        image_size: int = 84,
        n_points: int = 512,
        render_mode: str | None = None,
        render_size: int = 256,
        obs_every: int = 1,
        target_color: str | None = None,
        reward_weights: dict[str, float] | None = None,
    ) -> None:
        if obs_mode not in OBS_MODES:
            raise ValueError(f"obs_mode must be one of {OBS_MODES}, got {obs_mode!r}")
        if int(image_size) != image_size or image_size < 1:
            raise ValueError(f"image_size must be a positive integer, got {image_size!r}")
        if int(n_points) != n_points or n_points < 1:
            raise ValueError(f"n_points must be a positive integer, got {n_points!r}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        if int(render_size) != render_size or render_size < 1:
            raise ValueError(f"render_size must be a positive integer, got {render_size!r}")
        if int(obs_every) != obs_every or obs_every < 1:
            raise ValueError(f"obs_every must be a positive integer, got {obs_every!r}")
        if target_color is not None and target_color not in COLORS:
            raise ValueError(f"target_color must be None or one of {COLORS}, got {target_color!r}")
        weights = dict(DEFAULT_REWARD_WEIGHTS)
        for name, value in (reward_weights or {}).items():
            if name not in DEFAULT_REWARD_WEIGHTS:
                raise ValueError(f"unknown reward term {name!r}; known: {tuple(DEFAULT_REWARD_WEIGHTS)}")
            weights[name] = float(value)

        self.obs_mode = obs_mode
        self.image_size = int(image_size)
        self.n_points = int(n_points)
        self.render_mode = render_mode
        self.render_size = int(render_size)
        self.obs_every = int(obs_every)
        self.target_color = target_color
        self.reward_weights = weights

        self.model = mujoco.MjModel.from_xml_path(_asset_path("pick.xml"))
        self.data = mujoco.MjData(self.model)
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

        obs_spaces: dict[str, spaces.Space] = {
            "state": spaces.Box(-np.inf, np.inf, (STATE_DIM[obs_mode],), np.float32),
        }
        if obs_mode == "multimodal":
            h = w = self.image_size
            obs_spaces["rgb"] = spaces.Box(0, 255, (h, w, 3), np.uint8)
            low = np.broadcast_to(POINT_BOX_LOW.astype(np.float32), (self.n_points, 3))
            high = np.broadcast_to(POINT_BOX_HIGH.astype(np.float32), (self.n_points, 3))
            obs_spaces["points"] = spaces.Box(low, high, (self.n_points, 3), np.float32)
            obs_spaces["instruction"] = spaces.Text(max_length=64, min_length=1, charset=CHARSET)
        self.observation_space = spaces.Dict(obs_spaces)
        self.action_space = spaces.Box(-1.0, 1.0, (7,), np.float32)

        # Episode state.
        self.target_id = 0
        self.instruction = ""
        self.tray_pos = np.zeros(3)
        self.q_target = HOME_QPOS.copy()
        self.episode_id = 0
        self.elapsed_steps = 0
        self._prev_action = np.zeros(7)
        self._prev_ee = np.zeros(3)
        self._prev_cube = np.zeros(3)
        self._obs_age = 0
        self._force_obs = False

        # Rendering: one renderer for observations, created lazily (state mode never renders), one for videos.
        self._renderer: mujoco.Renderer | None = None
        self._video_renderer: mujoco.Renderer | None = None
        self._rgb = np.zeros((self.image_size, self.image_size, 3), np.uint8)
        self._depth = np.zeros((self.image_size, self.image_size), np.float32)
        self._points = np.zeros((self.n_points, 3), np.float32)
        self._o3d = None
        self._intrinsic = None
        self._extrinsic = np.eye(4)

    # ------------------------------------------------------------------------------------------ gym API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Draw a new scene. The same ``seed`` gives the same target, poses, instruction and observation."""
        super().reset(seed=seed)
        rng = self.np_random
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)

        self.target_id = (
            COLORS.index(self.target_color) if self.target_color is not None else int(rng.integers(3))
        )
        self.instruction = TEMPLATES[int(rng.integers(len(TEMPLATES)))].format(COLORS[self.target_id])
        self.tray_pos = np.array([rng.uniform(*TRAY_X_RANGE), rng.uniform(*TRAY_Y_RANGE), 0.0])
        m.body_pos[self.tray_body] = self.tray_pos
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
        if self.obs_mode == "multimodal":
            self._update_camera_pose()
            self._render_obs()
        info = {
            "is_success": False,
            "target_id": self.target_id,
            "target_color": COLORS[self.target_id],
            "instruction": self.instruction,
            "obs_age": 0,
        }
        return self._get_obs(), info

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        """Apply one 7-D action for 0.1 s; see the module docstring for units, reward and info."""
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (7,):
            raise ValueError(f"MujocoPick action must have shape (7,), got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"MujocoPick action must be finite, got {a.tolist()}")
        a = np.clip(a, -1.0, 1.0)
        m, d = self.model, self.data

        q = d.qpos[self.arm_qpos_adr]
        target = np.clip(self.q_target + MAX_JOINT_DELTA * a[:6], self.joint_low, self.joint_high)
        self.q_target = np.clip(target, q - MAX_TARGET_LEAD, q + MAX_TARGET_LEAD)
        d.ctrl[:6] = self.q_target
        d.ctrl[6:8] = FINGER_OPEN * 0.5 * (1.0 - a[6])
        mujoco.mj_step(m, d, nstep=N_SUBSTEPS)
        self.elapsed_steps += 1

        grasped = self.target_grasped()
        success = self._target_in_tray()
        ee = d.site_xpos[self.grip_site]
        cube = d.xpos[self.cube_bodies[self.target_id]]
        if grasped:
            goal_prev = goal_now = self.tray_pos + np.array([0.0, 0.0, TRAY_FLOOR_Z + 0.06])
        else:
            goal_prev, goal_now = self._prev_cube, cube
        terms = {
            "success": float(success),
            "distance_improvement": float(
                np.linalg.norm(self._prev_ee - goal_prev) - np.linalg.norm(ee - goal_now)
            ),
            "smoothness": -float(np.linalg.norm(a - self._prev_action)),
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
            "instruction": self.instruction,
            "grasped": grasped,
            "obs_age": self._obs_age,
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

    # ------------------------------------------------------------------------------------ extra controls
    def set_obs_every(self, k: int) -> None:
        """Render ``rgb``/``points`` on every k-th step after a reset only (k >= 1)."""
        if int(k) != k or k < 1:
            raise ValueError(f"obs_every must be a positive integer, got {k!r}")
        self.obs_every = int(k)

    def request_obs(self) -> None:
        """Render ``rgb``/``points`` on the next step whatever ``obs_every`` says."""
        self._force_obs = True

    # ------------------------------------------------------------------------- privileged scene queries
    def cube_pos(self, i: int) -> np.ndarray:
        """Position (3,) of cube i (m, base frame)."""
        return self.data.xpos[self.cube_bodies[i]].copy()

    def cube_yaw(self, i: int) -> float:
        """Yaw (rad) of cube i about the vertical axis."""
        mat = self.data.xmat[self.cube_bodies[i]].reshape(3, 3)
        return float(np.arctan2(mat[1, 0], mat[0, 0]))

    def ee_pos(self) -> np.ndarray:
        """Position (3,) of the gripper tool point between the jaws (m, base frame)."""
        return self.data.site_xpos[self.grip_site].copy()

    def gripper_opening(self) -> float:
        """Distance (m) between the jaws."""
        return float(self.data.qpos[self.finger_qpos_adr].sum())

    # ----------------------------------------------------------------------------------------- internals
    def _sample_cube_xy(self, rng: np.random.Generator) -> np.ndarray:
        xy = np.zeros((3, 2))
        i = 0
        while i < 3:
            cand = np.array([rng.uniform(*CUBE_X_RANGE), rng.uniform(*CUBE_Y_RANGE)])
            if all(np.linalg.norm(cand - xy[j]) >= CUBE_MIN_SEPARATION for j in range(i)):
                xy[i] = cand
                i += 1
        return xy

    def _contacts_with(self, geom: int) -> set[int]:
        n = self.data.ncon
        if n == 0:
            return set()
        pairs = self.data.contact.geom[:n]
        other = np.where(pairs[:, 0] == geom, pairs[:, 1], np.where(pairs[:, 1] == geom, pairs[:, 0], -1))
        return set(other[other >= 0].tolist())

    def target_grasped(self) -> bool:
        """Whether both jaws touch the target cube."""
        touching = self._contacts_with(int(self.cube_geoms[self.target_id]))
        return self.finger_geoms[0] in touching and self.finger_geoms[1] in touching

    def _target_in_tray(self) -> bool:
        i = self.target_id
        rel = self.data.xpos[self.cube_bodies[i]] - self.tray_pos
        adr = self.cube_dof_adr[i]
        speed = np.linalg.norm(self.data.qvel[adr : adr + 3])
        inside = abs(rel[0]) < TRAY_INNER_HALF - 0.005 and abs(rel[1]) < TRAY_INNER_HALF - 0.005
        resting = rel[2] < TRAY_FLOOR_Z + CUBE_HALF + 0.015 and speed < 0.05
        touched = self._contacts_with(int(self.cube_geoms[i]))
        released = self.finger_geoms[0] not in touched and self.finger_geoms[1] not in touched
        return bool(inside and resting and released)

    def _state(self) -> np.ndarray:
        d = self.data
        parts = [
            d.qpos[self.arm_qpos_adr],
            d.qvel[self.arm_dof_adr],
            [d.qpos[self.finger_qpos_adr].sum()],
        ]
        if self.obs_mode == "state":
            parts += [
                np.eye(3)[self.target_id],
                d.xpos[self.cube_bodies].ravel(),
                self.tray_pos,
                d.site_xpos[self.grip_site],
            ]
        return np.concatenate(parts).astype(np.float32)

    def _get_obs(self) -> dict[str, Any]:
        obs: dict[str, Any] = {"state": self._state()}
        if self.obs_mode == "multimodal":
            obs["rgb"] = self._rgb.copy()
            obs["points"] = self._points.copy()
            obs["instruction"] = self.instruction
        return obs

    def _update_camera_pose(self) -> None:
        """Open3d extrinsic (base frame -> camera with x right, y down, z forward) and intrinsics."""
        if self._o3d is None:
            import open3d as o3d  # heavy import, only needed for point clouds

            self._o3d = o3d
            size = self.image_size
            fovy = np.deg2rad(self.model.cam_fovy[self.camera])
            f = 0.5 * size / np.tan(0.5 * fovy)
            c = 0.5 * (size - 1)
            self._intrinsic = o3d.camera.PinholeCameraIntrinsic(size, size, f, f, c, c)
            self._renderer = mujoco.Renderer(self.model, size, size)
        d = self.data
        world_from_cam = np.eye(4)
        world_from_cam[:3, :3] = d.cam_xmat[self.camera].reshape(3, 3) @ np.diag([1.0, -1.0, -1.0])
        world_from_cam[:3, 3] = d.cam_xpos[self.camera]
        world_from_base = np.eye(4)
        world_from_base[:3, :3] = d.xmat[self.base_body].reshape(3, 3)
        world_from_base[:3, 3] = d.xpos[self.base_body]
        self._extrinsic = np.linalg.inv(np.linalg.inv(world_from_base) @ world_from_cam)

    def _render_obs(self) -> None:
        """Render ``rgb`` and depth with the one renderer, then build ``points`` (all into cached arrays)."""
        r = self._renderer
        r.update_scene(self.data, self.camera)
        r.render(out=self._rgb)
        r.enable_depth_rendering()
        r.render(out=self._depth)
        r.disable_depth_rendering()
        o3d = self._o3d
        pcd = o3d.geometry.PointCloud.create_from_depth_image(
            o3d.geometry.Image(self._depth),
            self._intrinsic,
            self._extrinsic,
            depth_scale=1.0,
            depth_trunc=3.0,
        )
        pts = np.asarray(pcd.points)  # (M, 3) float64, base frame
        keep = np.all((pts >= POINT_BOX_LOW) & (pts <= POINT_BOX_HIGH), axis=1)
        pts = pts[keep]
        n, count = self.n_points, len(pts)
        if count == 0:
            self._points[:] = 0.5 * (POINT_BOX_LOW + POINT_BOX_HIGH)
        elif count >= n:
            self._points[:] = pts[self.np_random.choice(count, n, replace=False)]
        else:
            self._points[:count] = pts
            self._points[count:] = pts[np.arange(n - count) % count]
        self._obs_age = 0
        self._force_obs = False
