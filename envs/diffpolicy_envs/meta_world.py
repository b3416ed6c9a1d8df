"""Meta-World's v3 tasks (``MetaWorld-v0``) with the observations of the diffpolicy environments.

Meta-World (Yu et al. 2019; PyPI ``metaworld`` 3.x, the ``metaworld`` extra) is a Sawyer arm on a table with
50 manipulation tasks, each with its own scripted expert (``metaworld.policies``). This adapter builds one
task's goal-observable environment (the object and goal placement randomised on every reset, as DP3 and
IBRL use it) and gives it this package's conventions:

| key | shape | dtype | meaning |
|---|---|---|---|
| ``rgb`` | (H, W, 3) | uint8 | image of ``camera`` (default ``corner2``), H = W = ``image_size`` (default 84) |
| ``points`` | (N, 6) | float32 | coloured point cloud from the same camera's depth: x, y, z world frame (m), r, g, b in [0, 1] (zeros with ``point_colors=False``) |
| ``instruction`` | - | str | one sentence per task (:data:`INSTRUCTIONS`) |
| ``state`` | (9,) | float32 | proprioception only (DP3's ``agent_pos``): hand position, right and left finger pad positions (m) |

With ``obs_mode="state"`` the Dict holds ``state`` alone: Meta-World's own 39-D vector (hand position and
gripper opening, two objects' positions and quaternions, the same 18 values one step earlier, the goal),
which carries the object poses (privileged: the state-only row of a table, not the multimodal policy's).

``points`` back-projects the depth image through the camera's pinhole intrinsics and pose
(:func:`diffpolicy_envs.mujoco_pick.depth_to_points`), crops it to the workspace box
:data:`POINT_BOX_LOW` .. :data:`POINT_BOX_HIGH` (which removes the table top, the floor and the walls),
voxelises it (``point_voxel``, default 1 cm) and draws exactly N points by farthest-point sampling from a
start the env's seeded generator picks (``point_sampling``; :func:`farthest_points`, run by its C twin in
:mod:`diffpolicy_envs.native` where a C compiler is found), padding by repetition when fewer remain. As DP3 does, ``corner2`` is moved to (0.6, 0.295, 0.8) so the table fills the
view (``camera_pos``; null keeps the model's pose). The camera is mounted upside down in Meta-World's model:
``rgb`` is rotated by 180 degrees so the table is at the bottom of the image (the points do not depend on it).

Rendering is what costs (84 x 84 on one core, Mesa's software rasteriser: an RGB frame through
``mujoco.Renderer`` 80 ms with shadows, reflections and multisampling; depth another 6 ms; a step ~0.6 ms).
One offscreen context (:class:`_Camera`) draws each frame once, without them, and reads image and depth
from that one draw; what it draws is the Sawyer's ~66 k mesh faces, so the camera's copy of the robot's
meshes can be simplified (``robot_mesh_cell``, 0.01 in ``env=metaworld``: vertices merged on a 1 cm grid,
~16 k faces, about half the frame's time; physics keeps the exact model, and the task's objects are drawn
exactly); and with ``obs_every = k`` the camera is rendered only on every k-th step after a reset (at the
steps where a policy executing k actions per decision looks), the last ``rgb``/``points`` repeated in
between (``info["obs_age"]``; ``request_obs()`` forces a render on the next step).

Episodes: at most ``time_limit`` (200, DP3's protocol) control steps; ``info["is_success"]`` is
Meta-World's ``info["success"]``, and the episode terminates on the first success. ``info["outcome"]`` names
how the episode would end now: ``success``; ``never_reached`` (the hand never came near the object),
``never_grasped`` (near it, but Meta-World never reported a grasp), ``timed_out`` (the rest) -- from
Meta-World's own ``near_object`` and ``grasp_success`` flags. ``info["target_pos"]`` (3,) m is the
position of the object the task moves (the first object of Meta-World's vector; ``label="goal"``: the goal's;
``label="both"``: (6,), the object's then the goal's): privileged, a training-time label only (BC's
auxiliary target loss), never an observation of the multimodal policy. The reward is Meta-World's (v3 reward
functions), whose terms Meta-World reports in ``info`` (``grasp_reward``, ``in_place_reward``, ...).
Actions: 4-D in [-1, 1], the hand's displacement (x, y, z, scaled by 1 cm) and the gripper's effort.
"""

from __future__ import annotations

import copy
import os
from typing import Any

os.environ.setdefault("MUJOCO_GL", "egl")

import gymnasium as gym
import mujoco
import numpy as np
from gymnasium import spaces

from diffpolicy_envs import native
from diffpolicy_envs.mujoco_pick import (
    CameraSchedule,
    camera_pose,
    depth_to_points,
    fill_cloud,
    pinhole_rays,
)

POINT_BOX_LOW = np.array([-0.7, 0.2, 0.005])
"""Workspace crop, world frame (m): the table top lies at z = 0, just below the box."""
POINT_BOX_HIGH = np.array([0.7, 1.2, 0.7])
POINT_BOXES = {
    "table": (POINT_BOX_LOW, POINT_BOX_HIGH),
    "reach": (np.array([-0.5, 0.35, 0.005]), np.array([0.5, 0.95, 0.5])),
}
"""``point_box`` crops (low, high), world frame (m). ``table``: the whole table top and what stands on it (the
Sawyer's pedestal and the table's far edge included). ``reach``: about the box the hand can reach (Meta-World's
mocap limits, x +-0.525, y 0.35 .. 1.025), which keeps 8 of 512 points within 5 cm of coffee-push's mug
instead of 5 and 27 on peg-insert-side's peg instead of 7: the same for every task, and ``env=metaworld``'s
(chosen on the validation seeds of the ten tasks of DP3's table: mean success 0.53 -> 0.56, docs/experiments.md).
The env's own default stays ``table``, the crop older checkpoints were trained with."""
DEPTH_TRUNC = 1.5
"""Largest kept depth (m); the far wall and the floor lie beyond or outside the box anyway."""
DP3_CAMERA_POS = {"corner2": (0.6, 0.295, 0.8)}
"""Camera positions DP3 (Ze et al. 2024) moves Meta-World's cameras to."""
OUTCOMES = ("success", "never_reached", "never_grasped", "timed_out")
"""Values of ``info["outcome"]``."""
STATE_DIM = {"multimodal": 9, "state": 39}
LABELS = {"object": [4, 5, 6], "goal": [36, 37, 38], "both": [4, 5, 6, 36, 37, 38]}
"""``label`` -> the indices of Meta-World's 39-D vector that ``info["target_pos"]`` holds (BC's privileged
training label): the first object's position, the goal's, or both."""
STATE_POSITIONS = {"object": (4, 22), "second object": (11, 29), "goal": (36,)}
"""Where each position (x, y, z) starts in the 39-D state: the objects' in this frame and the previous one
(their quaternions are not positions), the goal's once."""
NOISED_POSITIONS = {"objects": ("object", "second object"), "all": tuple(STATE_POSITIONS)}
"""Which positions ``state_noise`` offsets: the objects only (a goal whose training range is millimetres, such
as coffee-push's height, would otherwise be pushed far outside it by the normaliser), or the goal too."""

INSTRUCTIONS: dict[str, str] = {
    "assembly": "put the ring onto the peg",
    "basketball": "dunk the ball into the basket",
    "bin-picking": "move the cube from one bin into the other",
    "box-close": "put the lid on the box",
    "button-press-topdown": "press the button from the top",
    "button-press-topdown-wall": "press the button from the top behind the wall",
    "button-press": "press the button",
    "button-press-wall": "press the button behind the wall",
    "coffee-button": "press the button on the coffee machine",
    "coffee-pull": "pull the mug from the coffee machine",
    "coffee-push": "push the mug under the coffee machine",
    "dial-turn": "turn the dial",
    "disassemble": "pick the ring off the peg",
    "door-close": "close the door",
    "door-lock": "lock the door by turning the lock",
    "door-open": "open the door",
    "door-unlock": "unlock the door by turning the lock",
    "hand-insert": "insert the hand into the hole",
    "drawer-close": "push the drawer closed",
    "drawer-open": "pull the drawer open",
    "faucet-open": "turn the faucet on",
    "faucet-close": "turn the faucet off",
    "hammer": "hammer the nail into the wall",
    "handle-press-side": "press the handle down from the side",
    "handle-press": "press the handle down",
    "handle-pull-side": "pull the handle up from the side",
    "handle-pull": "pull the handle up",
    "lever-pull": "pull the lever up",
    "pick-place-wall": "pick up the puck and place it at the goal behind the wall",
    "pick-out-of-hole": "pick the peg out of the hole",
    "pick-place": "pick up the puck and place it at the goal",
    "plate-slide": "slide the plate into the cabinet",
    "plate-slide-side": "slide the plate into the cabinet from the side",
    "plate-slide-back": "slide the plate out of the cabinet",
    "plate-slide-back-side": "slide the plate out of the cabinet to the side",
    "peg-insert-side": "insert the peg into the hole from the side",
    "peg-unplug-side": "unplug the peg from the side",
    "soccer": "kick the ball into the goal",
    "stick-push": "grasp the stick and push the box with it",
    "stick-pull": "grasp the stick and pull the box with it",
    "push": "push the puck to the goal",
    "push-wall": "push the puck to the goal behind the wall",
    "push-back": "push the puck back to the goal",
    "reach": "reach the goal position",
    "reach-wall": "reach the goal position behind the wall",
    "shelf-place": "pick up the puck and place it on the shelf",
    "sweep-into": "sweep the puck into the hole",
    "sweep": "sweep the puck off the table",
    "window-open": "slide the window open",
    "window-close": "slide the window closed",
}
"""The instruction of every v3 task, keyed by its name without the version."""
TASKS = tuple(INSTRUCTIONS)


def farthest_points(xyz: np.ndarray, n: int, start: int) -> np.ndarray:
    """Indices of ``n`` farthest-point samples of ``xyz`` (M, 3), M >= n, from row ``start``: each next point
    is the one farthest from those chosen so far. Returns (n,) int64."""
    x, y, z = np.ascontiguousarray(xyz.T, dtype=np.float64)  # (M,) each: in-place ops on contiguous columns
    chosen = np.empty(n, np.int64)
    chosen[0] = start
    dist = np.full(len(xyz), np.inf)
    d2, t = np.empty(len(xyz)), np.empty(len(xyz))
    for i in range(1, n):
        j = chosen[i - 1]
        np.subtract(x, x[j], out=t)
        np.multiply(t, t, out=d2)
        for col in (y, z):
            np.subtract(col, col[j], out=t)
            np.multiply(t, t, out=t)
            d2 += t
        np.minimum(dist, d2, out=dist)
        chosen[i] = dist.argmax()
    return chosen


def task_name(task: str) -> str:
    """``"stick-pull"`` or ``"stick-pull-v3"`` -> ``"stick-pull"``; ValueError naming the choices otherwise."""
    name = task[:-3] if task.endswith("-v3") else task
    if name not in INSTRUCTIONS:
        raise ValueError(
            f"unknown Meta-World task {task!r}; choose one of the 50 v3 tasks, e.g. {', '.join(TASKS[:6])}, ..."
        )
    return name


def import_metaworld() -> Any:
    """The ``metaworld`` package, or ImportError naming the extra that installs it."""
    try:
        import metaworld  # noqa: F401
        from metaworld import env_dict
    except ImportError as err:
        raise ImportError(
            "Meta-World is not installed: pip install -e '.[metaworld]' (the metaworld extra; it pins mujoco==3.3.0)"
        ) from err
    return env_dict


class MetaWorldEnv(CameraSchedule, gym.Env):
    """One Meta-World v3 task, randomised per seeded reset, with rgb / points / instruction / proprioception.

    Args:
        task: a v3 task name, with or without ``-v3`` (:data:`TASKS`).
        obs_mode: ``multimodal`` (the table above) or ``state`` (Meta-World's 39-D vector alone).
        camera: the MuJoCo camera of ``rgb`` and ``points``.
        camera_pos: where to move that camera (m, world frame); ``"dp3"`` (default) uses DP3's position
            for ``corner2`` (:data:`DP3_CAMERA_POS`) and keeps the model's for the others, null keeps it.
        image_size: side of the square image (pixels).
        n_points: points per cloud (N).
        point_colors: colour the points from ``rgb``; false leaves r, g, b at zero (DP3's xyz-only clouds).
        point_voxel: edge of the down-sampling voxels (m).
        point_sampling: how N points are drawn from the voxels: ``fps`` (farthest-point sampling from a
            seeded random start, as DP3: thin parts such as assembly's peg keep their points) or ``random``.
        point_box: the crop of the cloud, a name of :data:`POINT_BOXES`: ``table`` (the default, so that older
            checkpoints see what they were trained on) or ``reach`` (``env=metaworld`` sets it).
        robot_mesh_cell: grid (m) on which the camera's copy of the robot's meshes merges vertices (vertex
            clustering, :func:`robot_meshes_simplified`); 0 (the default, so that older checkpoints see what they
            were trained on) draws the exact meshes; ``env=metaworld`` sets 0.01.
        label: what ``info["target_pos"]`` holds: ``object`` (the first object's position, (3,)), ``goal``
            (the goal's: where the object must go, e.g. assembly's peg, (3,)) or ``both`` (object then
            goal, (6,)).
        obs_every: render ``rgb``/``points`` on every k-th step only, repeating them in between.
        time_limit: truncate after this many control steps (``gymnasium.make``'s ``max_episode_steps``
            wraps another time limit around it; the registration's is the same 200).
        state_noise: ``obs_mode="state"`` only: std (m, per axis) of an offset drawn once per episode for
            each position of :data:`STATE_POSITIONS` (object, second object, goal) and added to it in every
            observation, as a perception's estimate would be off; what a state policy tolerates of such an
            error. The scripted expert and the success test read the true state. 0 (default) adds none.
        state_noise_on: which positions ``state_noise`` offsets (:data:`NOISED_POSITIONS`): ``objects``
            (default) or ``all`` (the goal too).
        render_mode: ``rgb_array`` for :meth:`render` (the camera image, for videos).
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 80}

    def __init__(
        self,
        task: str = "reach",
        obs_mode: str = "multimodal",
        camera: str = "corner2",
        camera_pos: Any = "dp3",
        image_size: int = 84,
        n_points: int = 512,
        point_colors: bool = True,
        point_voxel: float = 0.01,
        point_sampling: str = "fps",
        point_box: str = "table",
        robot_mesh_cell: float = 0.0,
        label: str = "object",
        obs_every: int = 1,
        time_limit: int = 200,
        state_noise: float = 0.0,
        state_noise_on: str = "objects",
        render_mode: str | None = None,
    ) -> None:
        self.task = task_name(task)
        if obs_mode not in STATE_DIM:
            raise ValueError(f"obs_mode={obs_mode!r} is not allowed; choose multimodal or state")
        for name, value in (("image_size", image_size), ("n_points", n_points), ("obs_every", obs_every)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if time_limit < 1:
            raise ValueError(f"time_limit must be >= 1, got {time_limit}")
        if state_noise < 0 or (state_noise > 0 and obs_mode != "state"):
            raise ValueError(f"state_noise={state_noise} must be >= 0 (m), and is for obs_mode=state only")
        if state_noise_on not in NOISED_POSITIONS:
            raise ValueError(f"state_noise_on={state_noise_on!r} is not allowed; choose objects or all")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode={render_mode!r} is not supported; use rgb_array or None")
        env_dict = import_metaworld()
        self._env = env_dict.ALL_V3_ENVIRONMENTS_GOAL_OBSERVABLE[f"{self.task}-v3-goal-observable"]()
        u = self._env
        u._freeze_rand_vec = False  # a new placement on every reset, drawn from the seeded generator
        u.seeded_rand_vec = True
        u.max_path_length = time_limit + 1  # our time limit truncates first
        self.model, self.data = u.model, u.data
        if camera not in {self.model.camera(i).name for i in range(self.model.ncam)}:
            names = ", ".join(self.model.camera(i).name for i in range(self.model.ncam))
            raise ValueError(f"camera={camera!r} is not in the Meta-World model; choose one of {names}")
        self.camera = self.model.camera(camera).id
        if isinstance(camera_pos, str):
            if camera_pos != "dp3":
                raise ValueError(f"camera_pos={camera_pos!r}: give dp3, null or three numbers (m)")
            camera_pos = DP3_CAMERA_POS.get(camera)
        if camera_pos is not None:
            self.model.cam_pos[self.camera] = np.asarray(camera_pos, dtype=np.float64).reshape(3)
        self.obs_mode = obs_mode
        self.image_size = int(image_size)
        self.n_points = int(n_points)
        self.point_colors = bool(point_colors)
        self.point_voxel = float(point_voxel)
        if point_sampling not in ("fps", "random"):
            raise ValueError(f"point_sampling={point_sampling!r} is not allowed; choose fps or random")
        self.point_sampling = point_sampling
        if point_box not in POINT_BOXES:
            raise ValueError(
                f"point_box={point_box!r} is not allowed; choose one of {', '.join(POINT_BOXES)}"
            )
        self.point_box = POINT_BOXES[point_box]
        if robot_mesh_cell < 0:
            raise ValueError(
                f"robot_mesh_cell must be >= 0 (m; 0 draws the exact meshes), got {robot_mesh_cell}"
            )
        self.robot_mesh_cell = float(robot_mesh_cell)
        if label not in LABELS:
            raise ValueError(f"label={label!r} is not allowed; choose one of {', '.join(LABELS)}")
        self._label = LABELS[label]
        self.obs_every = int(obs_every)
        self.time_limit = int(time_limit)
        self.state_noise = float(state_noise)
        self._noised = [STATE_POSITIONS[name] for name in NOISED_POSITIONS[state_noise_on]]
        self._state_offset = np.zeros(39)
        self.render_mode = render_mode
        self.instruction = INSTRUCTIONS[self.task]
        self.action_space = spaces.Box(-1.0, 1.0, (4,), np.float32)
        obs_spaces: dict[str, spaces.Space] = {
            "state": spaces.Box(-np.inf, np.inf, (STATE_DIM[obs_mode],), np.float32)
        }
        if obs_mode == "multimodal":
            size = self.image_size
            obs_spaces["rgb"] = spaces.Box(0, 255, (size, size, 3), np.uint8)
            obs_spaces["points"] = spaces.Box(-np.inf, np.inf, (self.n_points, 6), np.float32)
            obs_spaces["instruction"] = spaces.Text(max_length=128, charset="abcdefghijklmnopqrstuvwxyz -")
        self.observation_space = spaces.Dict(obs_spaces)
        self._renderer: _Camera | None = None
        self._rgb = np.zeros((self.image_size, self.image_size, 3), np.uint8)
        self._depth = np.zeros((self.image_size, self.image_size), np.float32)
        self._points = np.zeros((self.n_points, 6), np.float32)
        self._full_state = np.zeros(39)
        self._elapsed = 0
        self._obs_age = 0
        self._force_obs = False
        self._near = self._grasped = False

    # ------------------------------------------------------------------------------------------ gym API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        if seed is not None:
            self._env.seed(int(seed))  # Meta-World draws the placement from its own seeded generator
        obs, _ = self._env.reset()
        # Meta-World places some objects by moving their bodies in the model (assembly's peg): without a
        # forward pass the first frame would show them where the last episode had them
        mujoco.mj_forward(self.model, self.data)
        self._full_state = np.asarray(obs, dtype=np.float64)
        self._elapsed, self._near, self._grasped = 0, False, False
        if self.state_noise > 0:  # one offset per position for the whole episode, from the seeded generator
            self._state_offset[:] = 0.0
            for starts in self._noised:
                offset = self.np_random.normal(0.0, self.state_noise, 3)
                for i in starts:
                    self._state_offset[i : i + 3] = offset
        if self.obs_mode == "multimodal":
            self._render_obs()
        return self._get_obs(), self._info(False)

    def step(self, action: np.ndarray) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        a = np.asarray(action, dtype=np.float64).reshape(-1)
        if a.shape != (4,):
            raise ValueError(f"action must have shape (4,), got {np.shape(action)}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"action must be finite, got {a.tolist()}")
        obs, reward, _, _, mw_info = self._env.step(np.clip(a, -1.0, 1.0).astype(np.float32))
        self._full_state = np.asarray(obs, dtype=np.float64)
        self._elapsed += 1
        self._near = self._near or bool(mw_info.get("near_object", 0.0))
        self._grasped = self._grasped or bool(mw_info.get("grasp_success", 0.0))
        success = bool(mw_info.get("success", 0.0))
        truncated = not success and self._elapsed >= self.time_limit
        if self.obs_mode == "multimodal":
            self._obs_age += 1
            if self._force_obs or self._elapsed % self.obs_every == 0:
                self._render_obs()
        info = self._info(success)
        info["terms"] = {k: float(v) for k, v in mw_info.items() if k != "success"}
        return self._get_obs(), float(reward), success, truncated, info

    def render(self) -> np.ndarray | None:
        if self.render_mode != "rgb_array":
            return None
        if self.obs_mode != "multimodal" or self._obs_age:
            self._render_rgb()
        return self._rgb.copy()

    def close(self) -> None:
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
        self._env.close()

    # ---------------------------------------------------------------------------------------- helpers
    @property
    def full_state(self) -> np.ndarray:
        """Meta-World's 39-D observation after the last reset or step (what its scripted experts read)."""
        return self._full_state

    def _choose_points(self, voxels: np.ndarray, n: int) -> np.ndarray:
        """Indices of the ``n`` of the (V, 6) ``voxels`` kept: farthest-point or random sampling."""
        if self.point_sampling == "fps":
            start = int(self.np_random.integers(len(voxels)))
            chosen = native.farthest_points(voxels[:, :3], n, start)  # the C loop: the same indices
            return chosen if chosen is not None else farthest_points(voxels[:, :3], n, start)
        return self.np_random.choice(len(voxels), n, replace=False)

    def _outcome(self, success: bool) -> str:
        if success:
            return "success"
        if not self._near:
            return "never_reached"
        return "timed_out" if self._grasped else "never_grasped"

    def _info(self, success: bool) -> dict[str, Any]:
        return {
            "is_success": success,
            "outcome": self._outcome(success),
            "instruction": self.instruction,
            "obs_age": self._obs_age,
            "target_pos": self._full_state[self._label].astype(np.float32),
        }

    def _proprio(self) -> np.ndarray:
        u = self._env
        out = np.empty(9, np.float32)
        out[0:3] = u.get_endeff_pos()
        out[3:6] = u._get_site_pos("rightEndEffector")
        out[6:9] = u._get_site_pos("leftEndEffector")
        return out

    def _get_obs(self) -> dict[str, Any]:
        if self.obs_mode == "state":
            return {"state": (self._full_state + self._state_offset).astype(np.float32)}
        return {
            "state": self._proprio(),
            "rgb": self._rgb.copy(),
            "points": self._points.copy(),
            "instruction": self.instruction,
        }

    def _camera(self) -> _Camera:
        """The one camera renderer, made on first use, and the pixel ray slopes of its pinhole intrinsics."""
        if self._renderer is None:
            size = self.image_size
            self._ray_x, self._ray_y = pinhole_rays(size, self.model.cam_fovy[self.camera])
            drawn = (
                robot_meshes_simplified(self.model, self.robot_mesh_cell) if self.robot_mesh_cell else None
            )
            self._renderer = _Camera(self.model, self.camera, size, drawn=drawn)
        return self._renderer

    def _render_rgb(self) -> np.ndarray:
        """Render the camera into ``_rgb`` (rotated upright) and ``_depth``; returns the unrotated frame."""
        raw = self._camera().render(self.data, self._depth)
        self._rgb[:] = raw[::-1, ::-1]
        return raw

    def _render_obs(self) -> None:
        """Render ``rgb`` and depth in one pass, then build ``points`` (into cached arrays)."""
        raw = self._render_rgb()
        world_from_cam = camera_pose(self.data, self.camera)
        pts = depth_to_points(
            self._depth, self._ray_x, self._ray_y, world_from_cam, DEPTH_TRUNC, raw
        )  # (M, 6)
        fill_cloud(self._points, pts, *self.point_box, self.point_voxel, self._choose_points)
        if not self.point_colors:
            self._points[:, 3:] = 0.0
        self._obs_age = 0
        self._force_obs = False


ROBOT_ROOT = "base"
"""The Sawyer's root body in Meta-World's models: the meshes of its subtree are the robot's."""


def robot_meshes_simplified(model: mujoco.MjModel, cell: float) -> mujoco.MjModel:
    """A copy of ``model`` whose robot meshes (every geom that uses them hangs below :data:`ROBOT_ROOT`) are
    simplified by vertex clustering, for a render context only: the vertices of each ``cell``-sized grid
    cube merge into their mean, faces that collapse or repeat are dropped, and the survivors are written to
    the front of the mesh's face arrays (with their normals and texture coordinates) and counted in
    ``mesh_facenum``. The scene's geoms still come from ``model`` (``mjv_updateScene`` reads only mesh ids),
    so poses and physics are untouched; only what the rasteriser draws is coarser, by less than ``cell``."""
    out = copy.deepcopy(model)
    root = model.body(ROBOT_ROOT).id
    robot = np.zeros(model.nmesh, bool)
    other = np.zeros(model.nmesh, bool)
    for g in np.flatnonzero(model.geom_type == mujoco.mjtGeom.mjGEOM_MESH):
        mesh = model.geom_dataid[g]
        if model.body_rootid[model.geom_bodyid[g]] == root:
            robot[mesh] = True
        else:
            other[mesh] = True
    for mesh in np.flatnonzero(robot & ~other):
        va, nv = out.mesh_vertadr[mesh], out.mesh_vertnum[mesh]
        fa, nf = out.mesh_faceadr[mesh], out.mesh_facenum[mesh]
        verts = out.mesh_vert[va : va + nv].astype(np.float64)  # (nv, 3)
        _, first, cluster = np.unique(
            np.floor(verts / cell).astype(np.int64), axis=0, return_index=True, return_inverse=True
        )
        cluster = cluster.reshape(-1)  # (nv,) grid cube of each vertex
        sums = np.zeros((len(first), 3))
        np.add.at(sums, cluster, verts)
        out.mesh_vert[va + first] = sums / np.bincount(cluster)[:, None]  # each cube's first vertex: the mean
        faces = first[cluster[out.mesh_face[fa : fa + nf]]]  # (nf, 3) corners moved to their representatives
        whole = (faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2]) & (faces[:, 0] != faces[:, 2])
        _, once = np.unique(np.sort(faces[whole], axis=1), axis=0, return_index=True)
        keep = np.flatnonzero(whole)[np.sort(once)]  # (n,) surviving faces, in their order
        n = len(keep)
        for arr in (out.mesh_facenormal, out.mesh_facetexcoord):
            if arr.shape[0] == out.mesh_face.shape[0]:
                arr[fa : fa + n] = arr[fa : fa + nf][keep].copy()
        out.mesh_face[fa : fa + n] = faces[keep]
        out.mesh_facenum[mesh] = n
    return out


class _Camera:
    """One camera's RGB and depth from a single offscreen render (MuJoCo's public ``mjr_*`` API).

    ``mujoco.Renderer`` draws the scene once for the image and once more for depth; reading both buffers of
    one draw halves the cost, which is the mesh count (Meta-World's Sawyer: ~68 k faces), not the pixels.
    Multisampling, shadows and reflections are off (84 x 84 in Mesa's software rasteriser: ~18 ms -> ~8 ms an
    image); ``drawn``, a copy of ``model`` with simplified meshes (:func:`robot_meshes_simplified`), is what the
    context uploads. ``render`` returns (H, W, 3) uint8 with the top row first and writes metric depth (m) into
    ``depth``.
    """

    def __init__(
        self, model: mujoco.MjModel, camera: int, size: int, drawn: mujoco.MjModel | None = None
    ) -> None:
        uploaded = model if drawn is None else drawn  # its meshes are drawn; geoms and poses come from model
        uploaded.vis.quality.offsamples = 0  # no multisampling (read when the context is made)
        self.model = model
        self.gl = mujoco.GLContext(size, size)
        self.gl.make_current()
        self.context = mujoco.MjrContext(uploaded, mujoco.mjtFontScale.mjFONTSCALE_150)
        mujoco.mjr_setBuffer(mujoco.mjtFramebuffer.mjFB_OFFSCREEN, self.context)
        self.scene = mujoco.MjvScene(model, maxgeom=2000)
        self.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = False
        self.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = False
        self.cam = mujoco.MjvCamera()
        self.cam.type = mujoco.mjtCamera.mjCAMERA_FIXED
        self.cam.fixedcamid = camera
        self.option, self.perturb = mujoco.MjvOption(), mujoco.MjvPerturb()
        self.rect = mujoco.MjrRect(0, 0, size, size)
        self._rgb = np.zeros((size, size, 3), np.uint8)  # bottom row first, as OpenGL reads
        self._z = np.zeros((size, size), np.float32)  # depth buffer in [0, 1]
        extent = model.stat.extent
        self.near, self.far = model.vis.map.znear * extent, model.vis.map.zfar * extent

    def render(self, data: mujoco.MjData, depth: np.ndarray) -> np.ndarray:
        self.gl.make_current()
        mujoco.mjv_updateScene(
            self.model, data, self.option, self.perturb, self.cam, mujoco.mjtCatBit.mjCAT_ALL, self.scene
        )
        mujoco.mjr_render(self.rect, self.scene, self.context)
        mujoco.mjr_readPixels(self._rgb, self._z, self.rect, self.context)
        z = self._z[::-1]  # (H, W) top row first
        depth[:] = self.near / (1.0 - z * (1.0 - self.near / self.far))  # the z-buffer -> distance (m)
        return self._rgb[::-1]

    def close(self) -> None:
        if self.gl is not None:
            self.context.free()
            self.gl.free()
            self.gl = None


class MetaWorldExpert:
    """Meta-World's own scripted policy for the env's task (``metaworld.policies``), reading its 39-D state.

    Its actions are in [-1, 1] (clipped); ``seed`` is accepted for the common expert interface and unused
    (the scripted policies are deterministic).
    """

    def __init__(self, env: gym.Env, seed: int | None = None) -> None:
        import_metaworld()
        from metaworld.policies import ENV_POLICY_MAP

        self.env = env.unwrapped
        self.policy = ENV_POLICY_MAP[f"{self.env.task}-v3"]()

    def act(self, env: gym.Env | None = None) -> np.ndarray:
        """The expert's action (4,) float32 for the env's current state."""
        import warnings

        with warnings.catch_warnings():  # "Constant(s) may be too high": the env clips, as the policy says
            warnings.simplefilter("ignore", UserWarning)
            action = self.policy.get_action(self.env.full_state)
        return np.clip(np.asarray(action, dtype=np.float32), -1.0, 1.0)
