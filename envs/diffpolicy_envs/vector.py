"""Vectorised environments with same-step autoreset and reproducible seeding.

``make_vec_env(env_id, num_envs, seed)`` builds ``num_envs`` copies with :func:`diffpolicy_envs.adapters.make_env`
in a gymnasium ``SyncVectorEnv`` (one process) or ``AsyncVectorEnv`` (one subprocess per env) with
``AutoresetMode.SAME_STEP``: when sub-env i terminates or truncates at a step, that same ``step`` call
resets it and returns the first observation of its next episode in ``obs``; the last observation of the
finished episode is in ``info["final_obs"]`` and its info in ``info["final_info"]`` (entries valid where
``info["_final_obs"]`` is True). So no step is ever spent on a reset and every returned observation is one
the policy may act on.

Seeding: the first ``reset()`` (without a seed) seeds sub-env i with ``seed + i`` and the action space
with ``seed``; the following episodes continue the sub-envs' seeded generators, so the whole stream of
episodes is reproducible from ``seed``. ``reset(seed=s)`` later re-seeds with ``s + i``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import gymnasium as gym
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

from diffpolicy_envs.adapters import make_env

VECTORIZATION_MODES = ("sync", "async")


class SeededVectorEnv(gym.vector.VectorWrapper):
    """Seeds the first ``reset()`` with ``seed`` (sub-env i gets ``seed + i``) unless a seed is given."""

    def __init__(self, env: gym.vector.VectorEnv, seed: int | None) -> None:
        super().__init__(env)
        self._pending_seed = seed
        if seed is not None:
            self.env.action_space.seed(seed)

    def reset(self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None):
        if seed is None and self._pending_seed is not None:
            seed = self._pending_seed
        self._pending_seed = None
        return self.env.reset(seed=seed, options=options)


def make_vec_env(
    env_id: str,
    num_envs: int,
    seed: int | None = 0,
    vectorization_mode: str = "sync",
    context: str = "forkserver",
    **kwargs: Any,
) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``env_id`` (kwargs go to each env), same-step autoreset, seeded from ``seed``.

    Observations come batched: a Dict of arrays with a leading B = ``num_envs`` axis (``instruction`` as a
    tuple of B strings). Actions are (B, Da) in [-1, 1]. ``context`` is the multiprocessing start method
    of the async workers; the default "forkserver" starts them from a clean process, because forking a
    process that already holds an EGL context or open3d's thread pools can deadlock the children.
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    if vectorization_mode not in VECTORIZATION_MODES:
        raise ValueError(
            f"vectorization_mode must be one of {VECTORIZATION_MODES}, got {vectorization_mode!r}"
        )
    env_fns = [partial(make_env, env_id, **kwargs) for _ in range(num_envs)]
    if vectorization_mode == "sync":
        venv = SyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.SAME_STEP)
    else:
        # shared_memory=False: gymnasium (<= 1.4) reads a Text space out of shared memory once, at
        # construction, so every later ``instruction`` would be stale; pipes copy the (small) observations.
        venv = AsyncVectorEnv(
            env_fns, shared_memory=False, context=context, autoreset_mode=AutoresetMode.SAME_STEP
        )
    return SeededVectorEnv(venv, seed)
