"""``ObstacleReach-v0``: a 2-D point mass reaches a goal that lies behind a circular obstacle (pure numpy).

The agent starts below a fixed disc obstacle and the goal lies above it, so every path passes the obstacle
on the left or on the right. The expert (:class:`diffpolicy_envs.experts.ReachExpert`) picks a side at
random per episode; a policy that averages the two modes drives into the obstacle. Units are metres and
seconds; the arena is the square [-1, 1]^2 (walls stop the agent), time step ``DT`` = 0.1 s, episodes
truncate after 50 steps (registration).

Action, ``Box(-1, 1, (2,), float32)``: acceleration command in units of ``max_accel`` = 2 m/s^2 per axis.
Values outside [-1, 1] are clipped; NaN/inf or another shape raise ``ValueError``. The speed is capped at
``max_speed`` = 1 m/s.

Observation, ``Dict``:

| key | shape | dtype | content |
|---|---|---|---|
| ``state`` | (6,) | float32 | position (2, m), velocity (2, m/s), goal position (2, m); all in [-1, 1] |

The obstacle is fixed: centre (0, 0), radius 0.25 m; the agent is a disc of radius 0.05 m. Start positions
are drawn in x in [-0.15, 0.15], y in [-0.85, -0.7]; goals in x in [-0.15, 0.15], y in [0.7, 0.85].

Reward, named and weighted (``info["reward_terms"]``, ``info["reward_weights"]``), default
``5.0 * success - 5.0 * collision + 1.0 * distance_improvement``:

| term | definition |
|---|---|
| ``success`` | 1 when the agent centre is within 0.08 m of the goal (terminates), else 0 |
| ``collision`` | 1 when the agent touches the obstacle (terminates, failure), else 0 |
| ``distance_improvement`` | decrease of the distance to the goal since the last step (m) |

``info`` holds ``is_success`` and ``collision`` (bools) besides the reward terms.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

DT = 0.1
"""Control period (s)."""
DEFAULT_REWARD_WEIGHTS = {"success": 5.0, "collision": -5.0, "distance_improvement": 1.0}
GOAL_TOLERANCE = 0.08
"""Distance (m) to the goal that counts as reached."""


class ObstacleReachEnv(gym.Env):
    """Bimodal 2-D reaching around an obstacle; see the module docstring for spaces and reward.

    Args:
        render_mode: None or "rgb_array" (a ``render_size`` square top view, uint8).
        render_size: side of the rendered image (pixels).
        reward_weights: weights of the reward terms; missing names keep their default weight.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 10}

    max_accel = 2.0
    """Acceleration (m/s^2) for an action component of 1."""
    max_speed = 1.0
    """Speed cap (m/s)."""
    obstacle_center = np.zeros(2)
    obstacle_radius = 0.25
    agent_radius = 0.05

    def __init__(
        self,
        render_mode: str | None = None,
        render_size: int = 128,
        reward_weights: dict[str, float] | None = None,
    ) -> None:
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode must be None or 'rgb_array', got {render_mode!r}")
        if int(render_size) != render_size or render_size < 1:
            raise ValueError(f"render_size must be a positive integer, got {render_size!r}")
        weights = dict(DEFAULT_REWARD_WEIGHTS)
        for name, value in (reward_weights or {}).items():
            if name not in DEFAULT_REWARD_WEIGHTS:
                raise ValueError(f"unknown reward term {name!r}; known: {tuple(DEFAULT_REWARD_WEIGHTS)}")
            weights[name] = float(value)
        self.render_mode = render_mode
        self.render_size = int(render_size)
        self.reward_weights = weights
        self.observation_space = spaces.Dict({"state": spaces.Box(-1.0, 1.0, (6,), np.float32)})
        self.action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)
        self.pos = np.zeros(2)
        self.vel = np.zeros(2)
        self.start = np.zeros(2)
        self.goal = np.zeros(2)
        self.episode_id = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Draw a start below and a goal above the obstacle; the same ``seed`` gives the same episode."""
        super().reset(seed=seed)
        rng = self.np_random
        self.start = np.array([rng.uniform(-0.15, 0.15), rng.uniform(-0.85, -0.7)])
        self.goal = np.array([rng.uniform(-0.15, 0.15), rng.uniform(0.7, 0.85)])
        self.pos = self.start.copy()
        self.vel = np.zeros(2)
        self.episode_id += 1
        return self._obs(), {"is_success": False, "collision": False}

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        """Integrate one 0.1 s step of the point mass under the clipped acceleration command."""
        a = np.asarray(action, dtype=np.float64)
        if a.shape != (2,):
            raise ValueError(f"ObstacleReach action must have shape (2,), got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"ObstacleReach action must be finite, got {a.tolist()}")
        a = np.clip(a, -1.0, 1.0)
        prev_dist = np.linalg.norm(self.goal - self.pos)
        vel = self.vel + self.max_accel * DT * a
        speed = np.linalg.norm(vel)
        if speed > self.max_speed:
            vel *= self.max_speed / speed
        pos = self.pos + DT * vel
        hit_wall = np.abs(pos) > 1.0
        vel[hit_wall] = 0.0
        self.pos, self.vel = np.clip(pos, -1.0, 1.0), vel
        dist = np.linalg.norm(self.goal - self.pos)
        collision = bool(
            np.linalg.norm(self.pos - self.obstacle_center) < self.obstacle_radius + self.agent_radius
        )
        success = bool(dist < GOAL_TOLERANCE and not collision)
        terms = {
            "success": float(success),
            "collision": float(collision),
            "distance_improvement": float(prev_dist - dist),
        }
        reward = float(sum(self.reward_weights[k] * v for k, v in terms.items()))
        info = {
            "reward_terms": terms,
            "reward_weights": dict(self.reward_weights),
            "is_success": success,
            "collision": collision,
        }
        return self._obs(), reward, success or collision, False, info

    def render(self) -> np.ndarray | None:
        """Top view (render_size, render_size, 3) uint8: obstacle grey, goal green, agent blue."""
        if self.render_mode != "rgb_array":
            return None
        n = self.render_size
        coords = (np.arange(n) + 0.5) / n * 2.0 - 1.0
        x, y = np.meshgrid(coords, -coords)  # row 0 is the top (y = +1)
        img = np.full((n, n, 3), 245, np.uint8)
        discs = (
            (self.obstacle_center, self.obstacle_radius, (120, 120, 120)),
            (self.goal, GOAL_TOLERANCE, (40, 180, 60)),
            (self.pos, self.agent_radius, (40, 80, 220)),
        )
        for centre, radius, colour in discs:
            img[(x - centre[0]) ** 2 + (y - centre[1]) ** 2 < radius**2] = colour
        return img

    def _obs(self) -> dict[str, np.ndarray]:
        return {"state": np.concatenate([self.pos, self.vel, self.goal]).astype(np.float32)}
