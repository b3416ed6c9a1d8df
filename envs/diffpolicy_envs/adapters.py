"""Use any gymnasium environment with Box observations and Box actions like the diffpolicy environments.

The framework expects every environment to speak one convention: a ``Dict`` observation with at least a
``state`` entry (float32) and a ``Box(-1, 1)`` action space. :class:`BoxEnvAdapter` brings a plain Box/Box
environment to it; :func:`make_env` builds an environment and applies the adapter only when needed.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

PACKAGE_PREFIX = "diffpolicy_envs:"


class BoxEnvAdapter(gym.Wrapper):
    """Box observation -> ``{"state": obs.astype(float32)}``; actions in [-1, 1] -> the env's action bounds.

    An action a in [-1, 1]^Da (clipped first) is sent as ``low + (a + 1) / 2 * (high - low)``. The
    observation keeps its shape; ``state`` has the observation's shape, flattened to 1-D when it is not.

    Raises:
        ValueError: if the observation or action space is not a Box, or the action bounds are not finite.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        obs_space, act_space = env.observation_space, env.action_space
        if not isinstance(obs_space, spaces.Box) or not isinstance(act_space, spaces.Box):
            raise ValueError(
                f"BoxEnvAdapter needs Box observation and action spaces, got "
                f"{type(obs_space).__name__} and {type(act_space).__name__}"
            )
        if not (np.all(np.isfinite(act_space.low)) and np.all(np.isfinite(act_space.high))):
            raise ValueError("BoxEnvAdapter needs finite action bounds to rescale [-1, 1] to them")
        self._low = act_space.low.astype(np.float64)
        self._high = act_space.high.astype(np.float64)
        low = obs_space.low.astype(np.float32).reshape(-1)
        high = obs_space.high.astype(np.float32).reshape(-1)
        self.observation_space = spaces.Dict({"state": spaces.Box(low, high, low.shape, np.float32)})
        self.action_space = spaces.Box(-1.0, 1.0, act_space.shape, np.float32)

    @property
    def source_action_space(self) -> spaces.Box:
        """The wrapped environment's own action space (its units), which [-1, 1] is rescaled to."""
        return self.env.action_space

    def to_unit_action(self, action: np.ndarray) -> np.ndarray:
        """Actions (..., Da) in the wrapped environment's units -> this adapter's [-1, 1] (the inverse of the
        rescaling in :meth:`step`; not clipped)."""
        a = np.asarray(action, dtype=np.float64)
        return 2.0 * (a - self._low) / (self._high - self._low) - 1.0

    def _obs(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        return {"state": np.asarray(obs, dtype=np.float32).reshape(-1)}

    def reset(self, **kwargs: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        obs, info = self.env.reset(**kwargs)
        return self._obs(obs), info

    def step(self, action: np.ndarray) -> tuple[dict[str, np.ndarray], float, bool, bool, dict[str, Any]]:
        a = np.asarray(action, dtype=np.float64)
        if a.shape != self.action_space.shape:
            raise ValueError(f"action must have shape {self.action_space.shape}, got {a.shape}")
        if not np.all(np.isfinite(a)):
            raise ValueError(f"action must be finite, got {a.tolist()}")
        a = np.clip(a, -1.0, 1.0)
        scaled = self._low + 0.5 * (a + 1.0) * (self._high - self._low)
        obs, reward, terminated, truncated, info = self.env.step(scaled.astype(self.env.action_space.dtype))
        return self._obs(obs), float(reward), terminated, truncated, info


def follows_convention(env: gym.Env) -> bool:
    """True when ``env`` already has a Dict observation with ``state`` and a Box(-1, 1) action space."""
    obs_space, act_space = env.observation_space, env.action_space
    return (
        isinstance(obs_space, spaces.Dict)
        and "state" in obs_space.spaces
        and isinstance(act_space, spaces.Box)
        and bool(np.all(act_space.low == -1.0) and np.all(act_space.high == 1.0))
    )


def resolve_env_id(env_id: str) -> str:
    """``"MujocoPick-v0"`` -> ``"diffpolicy_envs:MujocoPick-v0"`` for this package's ids; others unchanged."""
    from diffpolicy_envs import ENV_IDS

    return PACKAGE_PREFIX + env_id if env_id in ENV_IDS else env_id


def make_env(env_id: str, **kwargs: Any) -> gym.Env:
    """``gymnasium.make(env_id, **kwargs)``, wrapped in :class:`BoxEnvAdapter` when it does not already
    follow the Dict-``state`` / Box(-1, 1) convention (e.g. ``"Pendulum-v1"``).

    This package's ids may be given with or without the ``diffpolicy_envs:`` prefix.
    """
    env = gym.make(resolve_env_id(env_id), **kwargs)
    if follows_convention(env):
        return env
    try:
        return BoxEnvAdapter(env)
    except ValueError:
        env.close()
        raise
