"""Scripted experts that act through the environments' own action interfaces (their actions are demos).

API::

    env = gymnasium.make("diffpolicy_envs:MujocoPick-v0")
    expert = make_expert(env)          # PickExpert or ReachExpert, chosen from the unwrapped env's type
    obs, info = env.reset(seed=0)
    action = expert.act(env)           # (Da,) float32 in [-1, 1]; reads privileged state of env.unwrapped
    evaluate_expert("MujocoPick-v0", n_episodes=100, seed=0, obs_mode="state")  # -> success rate

An expert notices a new episode by itself (the env counts its resets), so ``act`` is all a caller needs;
``reset()`` exists for callers that want to be explicit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

from diffpolicy_envs.meta_world import MetaWorldEnv, MetaWorldExpert
from diffpolicy_envs.mujoco_pick import (
    CUBE_HALF,
    FINGER_OPEN,
    MAX_JOINT_DELTA,
    TRAY_FLOOR_Z,
    MujocoPickEnv,
    pose_action,
    rotation_error,
    step_toward,
    tool_rotation,
)
from diffpolicy_envs.obstacle_reach import ObstacleReachEnv

OPEN, CLOSE = -1.0, 1.0
ASSETS = Path(__file__).resolve().parent / "assets"
"""Model files and trained actors shipped with the package."""


class PickExpert:
    """Pick-and-place state machine over tool poses (the environment's damped least-squares IK does the rest).

    Phases: approach (above the cube, jaws aligned with its faces) -> descend -> grasp (close, wait) ->
    lift -> transport (above the tray) -> lower -> release -> retreat. Each step the tool goal of the phase
    is approached by at most ``step_len`` metres along a straight line from the tool position at the current
    joint targets, and the action is the joint targets the environment's IK gives for that pose
    (``absolute``) or their change divided by ``MAX_JOINT_DELTA``, scaled down
    as a whole vector if any component would exceed 1 (``delta``). With ``action_mode="pose"`` the action is
    the phase's goal pose itself and the environment limits the speed. If the cube slips out of the gripper the
    expert starts again from the approach.

    ``place_bias`` and ``place_noise`` make an imprecise demonstrator, like a teleoperator whose view of the
    tray is miscalibrated: each episode it aims the release at the tray centre plus ``place_bias`` (x, y)
    plus an offset drawn from N(0, place_noise^2) per horizontal axis (the same offset for the whole episode,
    invisible in the observation), so some cubes land on the tray's rim or beside it. The offsets come from
    the expert's own generator (``seed``), never from the environment's.

    ``max_speed`` makes a cautious demonstrator (pose mode only): each step it commands a waypoint at most
    ``max_speed`` metres from the tool position at the current joint targets, instead of the phase goal itself,
    so the tool moves at most that fast (the environment's own limit is ``MAX_TOOL_STEP`` = 1.2 cm per step).
    Its episodes take longer, and with the 120-step limit the slowest ones run out of time.

    Args:
        env: a ``MujocoPick-v0`` env (wrapped or not).
        step_len: largest tool displacement (m) commanded per control step in free space.
        fine_step_len: largest tool displacement (m) per step when descending onto the cube or the tray.
        place_noise: std (m) of the per-episode release offset; 0 (default) is the precise expert.
        place_bias: constant release offset (x, y) in metres; (0, 0) by default.
        seed: seeds the release offsets.
        max_speed: largest tool displacement (m) per control step in pose mode; None (default) is the
            environment's limit.
    """

    def __init__(
        self,
        env: gym.Env,
        step_len: float = 0.016,
        fine_step_len: float = 0.01,
        place_noise: float = 0.0,
        place_bias: tuple[float, float] | list[float] = (0.0, 0.0),
        seed: int | None = None,
        max_speed: float | None = None,
    ):
        u = env.unwrapped
        if not isinstance(u, MujocoPickEnv):
            raise ValueError(f"PickExpert needs a MujocoPickEnv, got {type(u).__name__}")
        if max_speed is not None and not (np.isfinite(max_speed) and max_speed > 0):
            raise ValueError(f"max_speed must be None or a finite speed > 0 (m per step), got {max_speed}")
        self.max_speed = None if max_speed is None else float(max_speed)
        if not np.isfinite(place_noise) or place_noise < 0:
            raise ValueError(f"place_noise must be a finite std >= 0 (m), got {place_noise}")
        self.step_len = step_len
        self.fine_step_len = fine_step_len
        self.place_noise = float(place_noise)
        self.place_bias = np.asarray(place_bias, dtype=np.float64)
        if self.place_bias.shape != (2,) or not np.all(np.isfinite(self.place_bias)):
            raise ValueError(f"place_bias must be two finite numbers (x, y) in metres, got {place_bias}")
        self._rng = np.random.default_rng(seed)
        self._episode = -1
        self.reset()

    def reset(self) -> None:
        """Forget the current episode; the next ``act`` starts with the approach."""
        self.phase = "approach"
        self._counter = 0
        self._yaw = None
        self._lift_xy = None
        self._put_xy = None

    def _new_episode(self, u: MujocoPickEnv) -> None:
        self.reset()
        noise = self._rng.normal(0.0, self.place_noise, 2) if self.place_noise > 0 else np.zeros(2)
        self.place_offset = self.place_bias + noise
        self._target, self._tray = u.target_id, u.tray_pos.copy()

    def _follow_correction(self, u: MujocoPickEnv) -> None:
        """Follow a meaning that changed mid-episode (MujocoDialogue; never on MujocoPick): a new object means
        putting a cube already in the jaws back where it lay, then fetching the new one; a new place redirects
        a cube being carried."""
        if u.target_id != self._target:
            self._target = u.target_id
            if self.phase in ("lift", "transport", "lower"):
                self.phase, self._put_xy = "put_back", self._lift_xy
            elif self.phase == "grasp":  # closing on it where it lies: set it down again there
                self.phase, self._put_xy, self._counter = "let_go", u.ee_pos()[:2], 0
            elif self.phase not in ("put_back", "set_down", "let_go", "clear"):
                self.reset()
        if not np.array_equal(u.tray_pos, self._tray):
            self._tray = u.tray_pos.copy()
            if self.phase == "lower":
                self.phase = "transport"
            elif self.phase in ("release", "retreat"):  # already let go in the other tray: pick it up again
                self.reset()

    def act(self, env: gym.Env) -> np.ndarray:
        """Next action (7,) float32 in [-1, 1] for the current state of ``env``."""
        u: MujocoPickEnv = env.unwrapped
        if u.episode_id != self._episode:
            self._episode = u.episode_id
            self._new_episode(u)
        self._follow_correction(u)
        cube = u.cube_pos(u.target_id)
        ee = u.ee_pos()
        carrying = self.phase in ("lift", "transport", "lower")
        if carrying and not u.target_grasped() and cube[2] < CUBE_HALF + 0.01:
            self.reset()  # the cube slipped out and lies on the table: start again
        if self._yaw is None:
            self._yaw = self._grasp_yaw(u)
        grip = OPEN
        fine = False
        above = 0.16  # tool height (m) when carrying
        place = u.tray_pos[:2] + self.place_offset  # where the release is aimed
        if self.phase in ("put_back", "set_down", "let_go", "clear"):
            goal, grip, fine = self._put_back(u, above)
        if self.phase == "approach":
            goal = cube + np.array([0.0, 0.0, 0.09])
            if np.linalg.norm(ee - goal) < 0.012 and self._orientation_error(u) < 0.08:
                self.phase = "descend"
        if self.phase == "descend":
            goal = cube + np.array([0.0, 0.0, 0.002])
            fine = True
            if np.linalg.norm(ee - goal) < 0.008:
                self.phase, self._counter = "grasp", 0
        if self.phase == "grasp":
            goal, grip, fine = cube + np.array([0.0, 0.0, 0.002]), CLOSE, True
            self._counter += 1
            if self._counter > 2 and u.gripper_opening() < 2 * CUBE_HALF + 0.004:
                self.phase, self._lift_xy = "lift", cube[:2].copy()
        if self.phase == "lift":
            goal, grip = np.array([*self._lift_xy, above]), CLOSE
            if ee[2] > above - 0.02:
                self.phase = "transport"
        if self.phase == "transport":
            goal, grip = np.array([*place, above]), CLOSE
            if np.linalg.norm(ee - goal) < 0.02:
                self.phase = "lower"
        if self.phase == "lower":
            goal, grip, fine = np.array([*place, TRAY_FLOOR_Z + 0.07]), CLOSE, True
            if np.linalg.norm(ee - goal) < 0.012:
                self.phase, self._counter = "release", 0
        if self.phase == "release":
            goal, grip = np.array([*place, TRAY_FLOOR_Z + 0.07]), OPEN
            self._counter += 1
            if self._counter > 2 and u.gripper_opening() > 2 * FINGER_OPEN - 0.02:
                self.phase = "retreat"
        if self.phase == "retreat":
            goal, grip = np.array([*place, above + 0.04]), OPEN

        if u.action_mode == "pose":  # the phase's goal itself: the environment limits the tool's speed
            if self.max_speed is not None:
                goal = step_toward(u.tool_pos_at(u.q_target), goal, self.max_speed)
            return pose_action(goal, self._yaw, grip)
        step = self.fine_step_len if fine else self.step_len
        target = step_toward(u.tool_pos_at(u.q_target), goal, step)
        q_goal = u.solve_ik(target, tool_rotation(self._yaw), u.q_target)
        dq = (q_goal - u.q_target) / MAX_JOINT_DELTA
        dq /= max(1.0, float(np.abs(dq).max()))
        if u.action_mode == "absolute":  # the same rate-limited target, expressed in the joint ranges
            joint = np.clip(u.q_target + MAX_JOINT_DELTA * dq, u.joint_low, u.joint_high)
            dq = 2.0 * (joint - u.joint_low) / (u.joint_high - u.joint_low) - 1.0
        return np.append(dq, grip).astype(np.float32)

    # ------------------------------------------------------------------------------------------ helpers
    def _put_back(self, u: MujocoPickEnv, above: float) -> tuple[np.ndarray, float, bool]:
        """(goal, grip, fine) of the phases that return a cube no longer meant to ``_put_xy``: carry it
        there, lower it to the table, open, rise clear; then the approach to the new target begins."""
        ee, spot = u.ee_pos(), self._put_xy
        if self.phase == "put_back":
            goal = np.array([*spot, above])
            if np.linalg.norm(ee - goal) < 0.02:
                self.phase = "set_down"
            else:
                return goal, CLOSE, False
        low = np.array([*spot, CUBE_HALF + 0.004])
        if self.phase == "set_down":
            if np.linalg.norm(ee - low) < 0.008:
                self.phase, self._counter = "let_go", 0
            else:
                return low, CLOSE, True
        if self.phase == "let_go":
            self._counter += 1
            if not (self._counter > 2 and u.gripper_opening() > 2 * FINGER_OPEN - 0.02):
                return low, OPEN, True
            self.phase = "clear"
        goal = np.array([*spot, CUBE_HALF + 0.09])
        if ee[2] < goal[2] - 0.01:
            return goal, OPEN, False
        self.reset()
        self._yaw = self._grasp_yaw(u)
        return u.cube_pos(u.target_id) + np.array([0.0, 0.0, 0.09]), OPEN, False

    def _grasp_yaw(self, u: MujocoPickEnv) -> float:
        """Jaw yaw (rad) aligned with the target cube's faces, the closest one to the current jaw yaw."""
        mat = u.data.site_xmat[u.grip_site].reshape(3, 3)
        current = float(np.arctan2(mat[1, 1], mat[0, 1]))
        diff = u.cube_yaw(u.target_id) - current
        diff = (diff + np.pi / 4) % (np.pi / 2) - np.pi / 4
        return current + diff

    def _orientation_error(self, u: MujocoPickEnv) -> float:
        mat = u.data.site_xmat[u.grip_site].reshape(3, 3)
        return float(np.linalg.norm(rotation_error(mat, tool_rotation(self._yaw))))


class ReachExpert:
    """Expert of ``ObstacleReach-v0``: pass the obstacle on a side drawn per episode, then go to the goal.

    The side (left or right of the line from start to goal, probability 1/2 each) is drawn from the
    expert's own generator, seeded by ``seed``, once per episode, so demonstrations are bimodal and
    reproducible. A PD law on a via point beside the obstacle, then on the goal, gives the accelerations.

    Args:
        env: an ``ObstacleReach-v0`` env (wrapped or not).
        seed: seed of the side choices.
    """

    def __init__(self, env: gym.Env, seed: int | None = None):
        u = env.unwrapped
        if not isinstance(u, ObstacleReachEnv):
            raise ValueError(f"ReachExpert needs an ObstacleReachEnv, got {type(u).__name__}")
        self.rng = np.random.default_rng(seed)
        self._episode = -1
        self.side = 1.0
        self._via_done = False

    def reset(self) -> None:
        """Draw the side of the next episode."""
        self.side = float(self.rng.choice([-1.0, 1.0]))
        self._via_done = False

    def act(self, env: gym.Env) -> np.ndarray:
        """Next action (2,) float32 in [-1, 1] (acceleration command)."""
        u: ObstacleReachEnv = env.unwrapped
        if u.episode_id != self._episode:
            self._episode = u.episode_id
            self.reset()
        pos, vel, goal = u.pos, u.vel, u.goal
        axis = goal - u.start
        axis /= np.linalg.norm(axis)
        normal = np.array([-axis[1], axis[0]])
        via = u.obstacle_center + self.side * normal * (u.obstacle_radius + u.agent_radius + 0.12)
        if not self._via_done and (
            np.linalg.norm(pos - via) < 0.12 or np.dot(pos - u.obstacle_center, axis) > 0.0
        ):
            self._via_done = True
        target = goal if self._via_done else via
        acc = 3.0 * (target - pos) - 1.5 * vel
        return np.clip(acc / u.max_accel, -1.0, 1.0).astype(np.float32)


class MLPExpert:
    """A trained Gaussian MLP actor (stable-baselines3's SAC or PPO) run in numpy: the demonstrator of plain
    gymnasium tasks.

    The weights file (``.npz``, written by ``scripts/hopper_medium_policy.py``) holds hidden layers
    ``w{i}`` (out, in) and ``b{i}``, the Gaussian's mean ``mu_w``/``mu_b``, its log-std and a JSON ``meta``
    string. Two actor forms, told apart by the arrays and ``meta``:

    - SAC's (the default): ReLU hidden layers, a state-dependent log-std ``log_std_w``/``log_std_b`` clipped to
      [-20, 2] (as stable-baselines3 does), action ``tanh(mu + std * z)``;
    - PPO's (``meta["activation"] == "tanh"``, ``meta["squash"] == "clip"``): tanh hidden layers, a
      state-independent log-std vector ``log_std`` (Da,), action ``clip(mu + std * z, -1, 1)`` (what
      stable-baselines3 sends to a Box env whose bounds are [-1, 1]).

    z ~ N(0, I) comes from the expert's own generator (``stochastic``, how D4RL's medium data was sampled);
    without it the action is the squashed mean. The action lies in [-1, 1], which is the adapter's action
    (:class:`diffpolicy_envs.adapters.BoxEnvAdapter`). The observation is read from the unwrapped env
    (``_get_obs()``), like the scripted experts' privileged state.

    Args:
        weights: dict of the arrays above.
        seed: seeds the action noise.
        stochastic: sample from the Gaussian (default) rather than take its mean.
        noise_scale: the sampled noise's std as a multiple of the actor's own (1: its Gaussian, as D4RL
            sampled; a D4RL-like demonstrator medium in its mean samples with a small one).
    """

    ACTIVATIONS = ("relu", "tanh")
    SQUASHES = ("tanh", "clip")

    def __init__(
        self, weights: dict[str, np.ndarray], seed: int | None = None, stochastic: bool = True,
        noise_scale: float = 1.0,
    ):  # fmt: skip
        n_hidden = sum(1 for k in weights if k.startswith("w") and k[1:].isdigit())
        has_std = "log_std_w" in weights or "log_std" in weights
        if n_hidden == 0 or "mu_w" not in weights or not has_std:
            raise ValueError(
                "MLPExpert weights need w0/b0.., mu_w/mu_b and log_std_w/log_std_b (or log_std) arrays"
            )
        self.meta: dict[str, Any] = {}
        if "meta" in weights and str(weights["meta"]):
            import json

            self.meta = json.loads(str(weights["meta"]))
        self.activation = self.meta.get("activation", "relu")
        self.squash = self.meta.get("squash", "tanh")
        if self.activation not in self.ACTIVATIONS or self.squash not in self.SQUASHES:
            raise ValueError(
                f"MLPExpert meta: activation {self.activation!r} not in {self.ACTIVATIONS} or squash "
                f"{self.squash!r} not in {self.SQUASHES}"
            )
        self.layers = [(np.asarray(weights[f"w{i}"], np.float64), np.asarray(weights[f"b{i}"], np.float64))
                       for i in range(n_hidden)]  # fmt: skip
        self.mu = (np.asarray(weights["mu_w"], np.float64), np.asarray(weights["mu_b"], np.float64))
        if "log_std_w" in weights:
            self.log_std: tuple[np.ndarray, np.ndarray] | np.ndarray = (
                np.asarray(weights["log_std_w"], np.float64),
                np.asarray(weights["log_std_b"], np.float64),
            )
        else:
            self.log_std = np.asarray(weights["log_std"], np.float64)
        self.stochastic = bool(stochastic)
        if not noise_scale >= 0:
            raise ValueError(f"noise_scale={noise_scale} must be >= 0")
        self.noise_scale = float(noise_scale)
        self.rng = np.random.default_rng(seed)

    @classmethod
    def load(
        cls, path: str | Path, seed: int | None = None, stochastic: bool = True, noise_scale: float = 1.0
    ) -> MLPExpert:
        """The expert whose weights are the ``.npz`` at ``path``."""
        with np.load(path, allow_pickle=False) as data:
            return cls(
                {k: data[k] for k in data.files}, seed=seed, stochastic=stochastic, noise_scale=noise_scale
            )

    def reset(self) -> None:
        """Nothing to reset: the actor is memoryless."""

    def policy(self, obs: np.ndarray) -> np.ndarray:
        """Observations (Do,) or (B, Do) -> actions (Da,) or (B, Da) float32 in [-1, 1]."""
        h = np.asarray(obs, np.float64)
        for w, b in self.layers:
            h = h @ w.T + b
            h = np.maximum(h, 0.0) if self.activation == "relu" else np.tanh(h)
        mu = h @ self.mu[0].T + self.mu[1]
        if self.stochastic:
            if isinstance(self.log_std, tuple):
                std = np.exp(np.clip(h @ self.log_std[0].T + self.log_std[1], -20.0, 2.0))
            else:
                std = np.exp(self.log_std)
            mu = mu + self.noise_scale * std * self.rng.standard_normal(mu.shape)
        out = np.tanh(mu) if self.squash == "tanh" else np.clip(mu, -1.0, 1.0)
        return out.astype(np.float32)

    def act(self, env: gym.Env) -> np.ndarray:
        """Next action (Da,) float32 in [-1, 1] for the unwrapped env's current observation."""
        return self.policy(env.unwrapped._get_obs())


POLICY_EXPERTS: dict[str, str] = {"HopperEnv": "hopper_medium.npz", "Walker2dEnv": "walker2d_medium.npz"}
"""Unwrapped env class name -> the trained actor (``assets/``) that demonstrates it: stable-baselines3 PPO agents
(``scripts/hopper_medium_policy.py``, seed 0) stopped at the first evaluation whose noise-free return lay in a
medium band, as D4RL's medium datasets (Hopper-v5: 73 728 steps, 1386 over 10 episodes; Walker2d-v5: 1 941 504
steps, 2720). Each file's ``meta`` states the band the test holds it to."""


def make_expert(
    env: gym.Env, seed: int | None = None, **kwargs: Any
) -> PickExpert | ReachExpert | MLPExpert | MetaWorldExpert:
    """The expert of ``env``: scripted for ``MujocoPick-v0`` and ``ObstacleReach-v0``, Meta-World's own
    scripted policy for ``MetaWorld-v0`` (:class:`~diffpolicy_envs.meta_world.MetaWorldExpert`), a trained actor
    (:data:`POLICY_EXPERTS`, :class:`MLPExpert`) for ``Hopper-v5``; wrapped or not.

    ``seed`` seeds the expert's own random choices (ObstacleReach's side, the actor's action noise); extra
    kwargs go to the expert (``weights=PATH`` gives any env an :class:`MLPExpert` from that file).
    """
    u = env.unwrapped
    if isinstance(u, MujocoPickEnv):
        return PickExpert(env, seed=seed, **kwargs)
    if isinstance(u, ObstacleReachEnv):
        return ReachExpert(env, seed=seed, **kwargs)
    if isinstance(u, MetaWorldEnv):
        return MetaWorldExpert(env, seed=seed, **kwargs)
    kwargs = dict(kwargs)
    weights = kwargs.pop("weights", None) or POLICY_EXPERTS.get(type(u).__name__)
    if weights is not None:
        path = Path(weights) if Path(weights).is_file() else ASSETS / weights
        return MLPExpert.load(path, seed=seed, **kwargs)
    raise ValueError(
        f"no expert for {type(u).__name__}; known: MujocoPickEnv, ObstacleReachEnv, "
        f"{', '.join(POLICY_EXPERTS)} (or give weights=PATH of an MLPExpert .npz)"
    )


def run_episode(
    env: gym.Env, expert: PickExpert | ReachExpert | MLPExpert, seed: int | None = None
) -> dict[str, Any]:
    """Roll out one expert episode; returns ``{"success": bool, "length": int, "return": float}``."""
    env.reset(seed=seed)
    total, length, success = 0.0, 0, False
    while True:
        _, reward, terminated, truncated, info = env.step(expert.act(env))
        total += float(reward)
        length += 1
        success = success or bool(info.get("is_success", False))
        if terminated or truncated:
            return {"success": success, "length": length, "return": total}


def evaluate_expert(
    env_id: str,
    n_episodes: int = 100,
    seed: int = 0,
    expert_kwargs: dict[str, Any] | None = None,
    **env_kwargs: Any,
) -> float:
    """Success rate of the scripted expert over ``n_episodes`` episodes seeded ``seed, seed + 1, ...``.

    ``env_id`` may omit the ``diffpolicy_envs:`` prefix; ``expert_kwargs`` go to :func:`make_expert`,
    ``env_kwargs`` to ``gymnasium.make``.
    """
    if ":" not in env_id:
        env_id = f"diffpolicy_envs:{env_id}"
    env = gym.make(env_id, **env_kwargs)
    expert = make_expert(env, seed=seed, **(expert_kwargs or {}))
    try:
        results = [run_episode(env, expert, seed=seed + i) for i in range(n_episodes)]
    finally:
        env.close()
    return float(np.mean([r["success"] for r in results]))


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Success rate of a scripted expert.")
    parser.add_argument("env_id", nargs="?", default="MujocoPick-v0")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--obs-mode", default=None, help="MujocoPick only: multimodal or state")
    parser.add_argument(
        "--place-noise", type=float, default=0.0, help="MujocoPick only: release offset std (m)"
    )
    parser.add_argument(
        "--place-bias", type=float, nargs=2, default=(0.0, 0.0), help="MujocoPick only: x y (m)"
    )
    args = parser.parse_args()
    kwargs = {} if args.obs_mode is None else {"obs_mode": args.obs_mode}
    expert_kwargs = {"place_noise": args.place_noise} if args.place_noise else {}
    if any(args.place_bias):
        expert_kwargs["place_bias"] = args.place_bias
    rate = evaluate_expert(args.env_id, args.episodes, args.seed, expert_kwargs, **kwargs)
    print(json.dumps({"env_id": args.env_id, "episodes": args.episodes, "success_rate": rate}))
