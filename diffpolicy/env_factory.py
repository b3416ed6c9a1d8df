"""Environments as the policy sees them: building them from an :class:`EnvConfig`, and reading their vector infos.

A **decision** (DESIGN.md) is one policy call: observe, sample a Ta x Da chunk, execute its first Te actions.
:class:`ActionChunkWrapper` makes that one environment step: its action is the (Te, Da) executed part, it
steps the wrapped environment up to Te times (stopping early when the episode ends), and its reward is the
sum of those Te rewards. Vectorised with same-step autoreset (:func:`make_envs`), every ``step`` of the
vector env is therefore one decision for every environment, which is what PPO stores; :func:`step_info` and
:func:`stack_final_obs` read what an autoreset step reports about the episodes it ended.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import gymnasium as gym
import numpy as np

from diffpolicy.config import EnvConfig
from diffpolicy.modalities import KEYS


class ActionChunkWrapper(gym.Wrapper):
    """One ``step`` executes a (Te, Da) action chunk; the reward is the sum of the executed steps' rewards.

    ``info`` carries the last inner step's info plus ``executed`` (inner steps run, <= Te) and
    ``is_success`` (true if any inner step succeeded; absent when the env reports none, as Hopper's). With
    ``record=True`` the wrapped env's ``render()`` frame is appended to :attr:`frames` after every inner step
    (for videos).
    """

    def __init__(self, env: gym.Env, n_action_steps: int, record: bool = False) -> None:
        super().__init__(env)
        self.n_action_steps = n_action_steps
        inner = env.action_space
        self.action_space = gym.spaces.Box(
            low=np.repeat(inner.low[None], n_action_steps, 0),
            high=np.repeat(inner.high[None], n_action_steps, 0),
            dtype=np.float32,
        )
        self.record = record
        self.frames: list[np.ndarray] = []

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        if self.record:
            self.frames.append(self.env.render())
        return obs, info

    def step(self, chunk: np.ndarray):
        chunk = np.asarray(chunk, dtype=np.float32)
        if chunk.shape != self.action_space.shape:
            raise ValueError(
                f"action chunk must have shape {self.action_space.shape} (Te, Da), got {chunk.shape}"
            )
        total, success, reported = 0.0, False, False
        terminated = truncated = False
        info: dict[str, Any] = {}
        executed = 0
        for action in chunk:
            obs, reward, terminated, truncated, info = self.env.step(action)
            executed += 1
            total += float(reward)
            success = success or bool(info.get("is_success", False))
            reported = reported or "is_success" in info
            if self.record:
                self.frames.append(self.env.render())
            if terminated or truncated:
                break
        info = {**info, "executed": executed}
        if reported:
            info["is_success"] = success
        return obs, total, terminated, truncated, info


def env_kwargs(cfg: EnvConfig, n_action_steps: int) -> dict[str, Any]:
    """Constructor keyword arguments for ``cfg``'s environment (camera rendered once per decision)."""
    kwargs: dict[str, Any] = {"max_episode_steps": cfg.max_episode_steps}
    if cfg.name in ("mujoco_pick", "mujoco_dialogue", "mujoco_stages", "metaworld"):
        kwargs.update(
            obs_mode=cfg.obs_mode, image_size=cfg.image_size, n_points=cfg.n_points, obs_every=n_action_steps
        )
    if cfg.name == "metaworld":
        kwargs.update(task=cfg.task, time_limit=cfg.max_episode_steps)
    kwargs.update(cfg.kwargs)
    return kwargs


def make_one_env(
    cfg: EnvConfig,
    n_action_steps: int,
    render_mode: str | None = None,
    record: bool = False,
    chunked: bool = True,
) -> gym.Env:
    """One environment of ``cfg``: decision-level (wrapped in :class:`ActionChunkWrapper`) or, with
    ``chunked=False``, control-step; ``record`` keeps its rendered frames (needs ``render_mode``)."""
    from diffpolicy_envs.adapters import make_env

    kwargs = env_kwargs(cfg, n_action_steps)
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    env = make_env(cfg.id, **kwargs)
    return ActionChunkWrapper(env, n_action_steps, record=record) if chunked else env


def make_envs(
    cfg: EnvConfig, n_action_steps: int, num_envs: int, seed: int, *, chunked: bool = True
) -> gym.vector.VectorEnv:
    """``num_envs`` environments (same-step autoreset), seeded ``seed + i``: decision-level (one step executes
    a (Te, Da) chunk; actions (B, Te, Da)) or, with ``chunked=False``, control-step environments (one step,
    one (Da,) action per env; actions (B, Da)).

    ``cfg.vectorization="sync"`` steps them all in this process; "async" shards them over ``cfg.workers``
    worker processes (0: one per CPU), each stepping its share in turn (:class:`ShardedVectorEnv`, the same
    results as sync), so B environments keep W cores busy without B processes contending for them. Workers
    start from a fork server (forking a process that holds an EGL context hangs the children) that has
    imported this module and the MuJoCo env once, so a later ``make_envs`` (each evaluation) starts its
    workers in milliseconds instead of seconds.
    """
    from diffpolicy_envs.vector import vectorize

    fns = [partial(make_one_env, cfg, n_action_steps, chunked=chunked) for _ in range(num_envs)]
    return vectorize(
        fns,
        seed,
        "sync" if cfg.vectorization == "sync" else "sharded",
        workers=cfg.workers or None,  # None: one per CPU
        preload=("diffpolicy.env_factory", "diffpolicy_envs.mujoco_pick"),  # torch, mujoco: imported once
    )


def obs_spec(space: gym.spaces.Dict) -> dict[str, list[int]]:
    """Modality -> per-step shape, from a single environment's Dict observation space (instruction -> [])."""
    spec: dict[str, list[int]] = {}
    for key in KEYS:
        if key in space.spaces:
            sub = space.spaces[key]
            spec[key] = [] if key == "instruction" else list(sub.shape)
    if "state" not in spec:
        raise ValueError(f"environment observations must contain 'state'; got keys {sorted(space.spaces)}")
    return spec


def step_info(info: dict[str, Any], key: str, num_envs: int, default: Any) -> np.ndarray:
    """Per-environment ``info[key]`` of the step just taken, (B,).

    With same-step autoreset an environment whose episode ended is already reset, and the top-level info
    holds its reset info; the last step's info is in ``info["final_info"]`` where ``info["_final_info"]``.
    """
    out = np.asarray(info.get(key, np.full(num_envs, default)))
    out = out.astype(object) if out.dtype.kind == "U" else out.copy()  # strings of any length fit
    done = np.asarray(info.get("_final_info", np.zeros(num_envs, dtype=bool)), dtype=bool)
    if done.any():
        final = info["final_info"]
        if key in final:
            out[done] = np.asarray(final[key])[done]
    return out


def stack_final_obs(final_obs: Any, index: np.ndarray) -> dict[str, Any]:
    """Batch the autoreset ``info['final_obs']`` entries of environments ``index`` into one obs dict."""
    items = [final_obs[i] for i in index]
    out: dict[str, Any] = {}
    for key in items[0]:
        vals = [it[key] for it in items]
        out[key] = vals if key == "instruction" else np.stack([np.asarray(v) for v in vals])
    return out
