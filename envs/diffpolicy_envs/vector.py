"""Vectorised environments with same-step autoreset and reproducible seeding.

``make_vec_env(env_id, num_envs, seed)`` builds ``num_envs`` copies with :func:`diffpolicy_envs.adapters.make_env`
(``vectorize(env_fns, seed)`` does the same for any env constructors, e.g. wrapped ones) in a gymnasium ``SyncVectorEnv`` (one process), a gymnasium ``AsyncVectorEnv`` (one subprocess per env) or a
:class:`ShardedVectorEnv` (the envs split over a few worker processes), all with ``AutoresetMode.SAME_STEP``:
when sub-env i terminates or truncates at a step, that same ``step`` call resets it and returns the first
observation of its next episode in ``obs``; the last observation of the finished episode is in
``info["final_obs"]`` and its info in ``info["final_info"]`` (entries valid where ``info["_final_obs"]`` is
True). So no step is ever spent on a reset and every returned observation is one the policy may act on.

Seeding: the first ``reset()`` (without a seed) seeds sub-env i with ``seed + i`` and the action space
with ``seed``; the following episodes continue the sub-envs' seeded generators, so the whole stream of
episodes is reproducible from ``seed``. ``reset(seed=s)`` later re-seeds with ``s + i``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable, Sequence
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import CloudpickleWrapper, batch_space, concatenate, create_empty_array, iterate

from diffpolicy_envs.adapters import make_env

VECTORIZATION_MODES = ("sync", "async", "sharded")


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


def _shard_worker(env_fns: CloudpickleWrapper, pipe: Connection, parent_pipe: Connection) -> None:
    """Worker process of :class:`ShardedVectorEnv`: builds its envs, then serves commands until "close".

    Each command gets one reply ``(ok, payload)``; a failing command replies ``(False, traceback)`` and the
    worker keeps serving, so the parent can still close it cleanly.
    """
    parent_pipe.close()
    envs: list[gym.Env] = []
    try:
        envs = [fn() for fn in env_fns.fn]
        first = envs[0]
        pipe.send((True, (first.observation_space, first.action_space, first.metadata, first.render_mode)))
    except Exception:
        pipe.send((False, traceback.format_exc()))
        return
    while True:
        try:
            command, data = pipe.recv()
        except (EOFError, KeyboardInterrupt):  # the parent went away
            break
        try:
            if command == "step":
                results = []
                for env, action in zip(envs, data, strict=True):
                    obs, reward, terminated, truncated, info = env.step(action)
                    final = None
                    if terminated or truncated:  # same-step autoreset
                        final = (obs, info)
                        obs, info = env.reset()
                    results.append((obs, reward, terminated, truncated, info, final))
                pipe.send((True, results))
            elif command == "reset":
                seeds, options, mask = data
                pipe.send(
                    (
                        True,
                        [
                            env.reset(seed=seed, options=options) if keep else None
                            for env, seed, keep in zip(envs, seeds, mask, strict=True)
                        ],
                    )
                )
            elif command == "call":
                name, args, kwargs = data
                out = []
                for env in envs:
                    attr = env.get_wrapper_attr(name)
                    out.append(attr(*args, **kwargs) if callable(attr) else attr)
                pipe.send((True, out))
            elif command == "set_attr":
                name, values = data
                for env, value in zip(envs, values, strict=True):
                    env.set_wrapper_attr(name, value)
                pipe.send((True, None))
            elif command == "close":
                pipe.send((True, None))
                break
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception:
            pipe.send((False, traceback.format_exc()))
    for env in envs:
        env.close()


class ShardedVectorEnv(gym.vector.VectorEnv):
    """``len(env_fns)`` = B environments split into ``workers`` contiguous shards, one worker process each.

    A worker steps its B / W environments one after the other, so B environments cost W processes (one per
    core) instead of B: with B = 16 on 2 cores an ``AsyncVectorEnv`` runs 16 processes that contend for the
    cores and pickle every step through 16 pipes, here 2 processes exchange one message per step each.
    Shard k holds envs ``[start_k, start_k + size_k)``, the sizes differing by at most one.

    Semantics are those of ``SyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.SAME_STEP)``: the same
    seeds (``reset(seed=s)`` -> env i gets ``s + i``), the same same-step autoreset (a finished env is reset
    in the step that finished it; ``final_obs`` / ``final_info`` / ``_final_obs`` / ``_final_info`` hold
    the finished episode's last observation and info) and the infos merged by the same
    :meth:`~gymnasium.vector.VectorEnv._add_info`, called for the envs in the same order. Given the same
    seeds and actions the two therefore return identical results.

    Workers start with the ``context`` start method, "forkserver" by default: forking a process that already
    holds an EGL context can hang the children. Each returned observation is a
    fresh batch (no buffer shared between steps).

    Args:
        env_fns: one constructor per environment (cloudpickled to the workers, so lambdas work).
        workers: W, worker processes (at most B; the default is the number of CPUs).
        context: multiprocessing start method of the workers.
        preload: modules the fork server imports when it starts (context "forkserver"), so the workers of
            this and of every later vector env fork with them already imported instead of importing them
            each (seconds for a module that pulls in torch). The fork server is one per Python process:
            once it runs, later ``preload`` lists have no effect.
    """

    def __init__(
        self,
        env_fns: Sequence[Callable[[], gym.Env]],
        workers: int | None = None,
        context: str = "forkserver",
        preload: Sequence[str] = (),
    ) -> None:
        self.closed = True  # until the workers are up (``__del__`` then has nothing to close)
        if len(env_fns) < 1:
            raise ValueError("ShardedVectorEnv needs at least one environment constructor")
        if workers is None:
            workers = os.cpu_count() or 1
        if int(workers) != workers or workers < 1:
            raise ValueError(f"workers must be a positive integer, got {workers!r}")
        self.num_envs = len(env_fns)
        n_workers = min(int(workers), self.num_envs)
        sizes = [self.num_envs // n_workers + (k < self.num_envs % n_workers) for k in range(n_workers)]
        starts = np.cumsum([0, *sizes]).tolist()
        self.shards = [(starts[k], starts[k + 1]) for k in range(n_workers)]
        """(start, stop) env indices of each worker."""
        self._pipes: list[Connection] = []
        self._processes: list[mp.process.BaseProcess] = []
        ctx = mp.get_context(context)
        if preload and context == "forkserver":
            ctx.set_forkserver_preload(["__main__", *preload])  # "__main__": the default preload
        self.closed = False  # from here on ``close`` stops the workers started so far
        for start, stop in self.shards:
            parent_pipe, child_pipe = ctx.Pipe()
            process = ctx.Process(
                target=_shard_worker,
                name=f"ShardedVectorEnv-{start}-{stop}",
                args=(CloudpickleWrapper(list(env_fns[start:stop])), child_pipe, parent_pipe),
                daemon=True,
            )
            process.start()
            child_pipe.close()
            self._pipes.append(parent_pipe)
            self._processes.append(process)
        try:
            spaces = self._receive()
        except BaseException:
            self.close(terminate=True)
            raise
        obs_space, act_space, metadata, render_mode = spaces[0]
        if any(s[0] != obs_space or s[1] != act_space for s in spaces[1:]):
            self.close()
            raise ValueError("ShardedVectorEnv needs the same observation and action space in every env")
        self.single_observation_space = obs_space
        self.single_action_space = act_space
        self.observation_space = batch_space(obs_space, self.num_envs)
        self.action_space = batch_space(act_space, self.num_envs)
        self.metadata = {**metadata, "autoreset_mode": AutoresetMode.SAME_STEP}
        self.render_mode = render_mode
        self._env_obs: list[Any] = [None] * self.num_envs

    # ------------------------------------------------------------------------------------ VectorEnv API
    def reset(
        self, *, seed: int | list[int | None] | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Reset every env (``options["reset_mask"]``: only the masked ones), seeds as in ``SyncVectorEnv``."""
        if seed is None:
            seed = [None] * self.num_envs
        elif isinstance(seed, int):
            seed = [seed + i for i in range(self.num_envs)]
        if len(seed) != self.num_envs:
            raise ValueError(
                f"If seeds are passed as a list the length must match num_envs={self.num_envs} but got "
                f"length={len(seed)}."
            )
        mask = [True] * self.num_envs
        if options is not None and "reset_mask" in options:
            options = dict(options)
            reset_mask = options.pop("reset_mask")
            if not isinstance(reset_mask, np.ndarray) or reset_mask.dtype != np.bool_:
                raise TypeError("options['reset_mask'] must be a numpy array of dtype bool")
            if reset_mask.shape != (self.num_envs,) or not reset_mask.any():
                raise ValueError(
                    f"options['reset_mask'] must have shape ({self.num_envs},) and a True value, "
                    f"got {reset_mask}"
                )
            mask = reset_mask.tolist()
        for (start, stop), pipe in zip(self.shards, self._pipes, strict=True):
            pipe.send(("reset", (seed[start:stop], options, mask[start:stop])))
        infos: dict[str, Any] = {}
        for i, result in enumerate(self._receive_flat()):
            if result is not None:
                self._env_obs[i], env_info = result
                infos = self._add_info(infos, env_info, i)
        return self._batch_obs(), infos

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        """Step every env with its row of ``actions`` (B, ...); finished envs are reset in the same step."""
        per_env = list(iterate(self.action_space, actions))
        if len(per_env) != self.num_envs:
            raise ValueError(f"expected actions for {self.num_envs} environments, got {len(per_env)}")
        for (start, stop), pipe in zip(self.shards, self._pipes, strict=True):
            pipe.send(("step", per_env[start:stop]))
        rewards = np.zeros(self.num_envs, dtype=np.float64)
        terminations = np.zeros(self.num_envs, dtype=np.bool_)
        truncations = np.zeros(self.num_envs, dtype=np.bool_)
        infos: dict[str, Any] = {}
        for i, (obs, reward, terminated, truncated, info, final) in enumerate(self._receive_flat()):
            self._env_obs[i] = obs
            rewards[i], terminations[i], truncations[i] = reward, terminated, truncated
            if final is not None:
                infos = self._add_info(infos, {"final_obs": final[0], "final_info": final[1]}, i)
            infos = self._add_info(infos, info, i)
        return self._batch_obs(), rewards, terminations, truncations, infos

    def render(self) -> tuple[Any, ...]:
        """The rendered frames of the environments."""
        return self.call("render")

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name`` of every env (or read attribute ``name``); the results in env order."""
        for pipe in self._pipes:
            pipe.send(("call", (name, args, kwargs)))
        return tuple(self._receive_flat())

    def get_attr(self, name: str) -> tuple[Any, ...]:
        """Attribute ``name`` of every env."""
        return self.call(name)

    def set_attr(self, name: str, values: list[Any] | tuple[Any, ...] | Any) -> None:
        """Set attribute ``name`` of every env: to ``values[i]`` for a list or tuple, else to ``values``."""
        if not isinstance(values, (list, tuple)):
            values = [values] * self.num_envs
        if len(values) != self.num_envs:
            raise ValueError(
                f"Values must be a list or tuple with length equal to the number of environments. "
                f"Got `{len(values)}` values for {self.num_envs} environments."
            )
        for (start, stop), pipe in zip(self.shards, self._pipes, strict=True):
            pipe.send(("set_attr", (name, list(values[start:stop]))))
        self._receive()

    def close_extras(self, timeout: float = 10.0, terminate: bool = False, **kwargs: Any) -> None:
        """Ask the workers to close their envs and exit; kill any still running after ``timeout`` s."""
        if not terminate:
            for pipe, process in zip(self._pipes, self._processes, strict=True):
                if process.is_alive():
                    try:
                        pipe.send(("close", None))
                        if pipe.poll(timeout):
                            pipe.recv()
                    except (BrokenPipeError, EOFError, ConnectionResetError):
                        pass
        for process in self._processes:
            process.join(0 if terminate else timeout)
            if process.is_alive():
                process.terminate()
                process.join()
        for pipe in self._pipes:
            pipe.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.close(terminate=True)

    # ---------------------------------------------------------------------------------------- internals
    def _receive(self) -> list[Any]:
        """One reply per worker, in shard order; raises after all replies are in if any worker failed."""
        replies = []
        for pipe in self._pipes:
            try:
                replies.append(pipe.recv())
            except EOFError:
                replies.append((False, "the worker process exited"))
        errors = [
            f"worker {k} (envs {self.shards[k][0]}..{self.shards[k][1] - 1}):\n{payload}"
            for k, (ok, payload) in enumerate(replies)
            if not ok
        ]
        if errors:
            raise RuntimeError("ShardedVectorEnv: " + "\n".join(errors))
        return [payload for _, payload in replies]

    def _receive_flat(self) -> list[Any]:
        """The workers' per-env replies concatenated: one entry per env, in env order."""
        return [item for shard in self._receive() for item in shard]

    def _batch_obs(self) -> Any:
        """The envs' last observations as one fresh batch (B, ...)."""
        out = create_empty_array(self.single_observation_space, n=self.num_envs, fn=np.zeros)
        return concatenate(self.single_observation_space, self._env_obs, out)


def vectorize(
    env_fns: list[Any],
    seed: int | None = 0,
    vectorization_mode: str = "sync",
    context: str = "forkserver",
    workers: int | None = None,
    preload: tuple[str, ...] = (),
) -> gym.vector.VectorEnv:
    """The one way this package vectorises: env constructors -> a seeded, same-step-autoreset vector env.

    ``vectorization_mode`` is "sync" (one process), "async" (gymnasium's ``AsyncVectorEnv``, one subprocess per
    env) or "sharded" (:class:`ShardedVectorEnv`, ``workers`` processes, the number of CPUs by default, which
    import ``preload`` once in their fork server). ``context`` is the multiprocessing start method of the
    subprocesses; the default "forkserver" starts them from a clean process, because forking a process that
    already holds an EGL context can deadlock the children. One env is always stepped in process.
    """
    if len(env_fns) < 1:
        raise ValueError(f"num_envs must be >= 1, got {len(env_fns)}")
    if vectorization_mode not in VECTORIZATION_MODES:
        raise ValueError(
            f"vectorization_mode must be one of {VECTORIZATION_MODES}, got {vectorization_mode!r}"
        )
    if vectorization_mode == "sync" or len(env_fns) == 1:
        venv = SyncVectorEnv(env_fns, autoreset_mode=AutoresetMode.SAME_STEP)
    elif vectorization_mode == "sharded":
        venv = ShardedVectorEnv(env_fns, workers=workers, context=context, preload=preload)
    else:
        # shared_memory=False: gymnasium (<= 1.4) reads a Text space out of shared memory once, at
        # construction, so every later ``instruction`` would be stale; pipes copy the (small) observations.
        venv = AsyncVectorEnv(
            env_fns, shared_memory=False, context=context, autoreset_mode=AutoresetMode.SAME_STEP
        )
    return SeededVectorEnv(venv, seed)


def make_vec_env(
    env_id: str,
    num_envs: int,
    seed: int | None = 0,
    vectorization_mode: str = "sync",
    context: str = "forkserver",
    workers: int | None = None,
    **kwargs: Any,
) -> gym.vector.VectorEnv:
    """``num_envs`` copies of ``env_id`` (kwargs go to each env), vectorised by :func:`vectorize`.

    Observations come batched: a Dict of arrays with a leading B = ``num_envs`` axis (``instruction`` as a
    tuple of B strings). Actions are (B, Da) in [-1, 1].
    """
    if num_envs < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    env_fns = [partial(make_env, env_id, **kwargs) for _ in range(num_envs)]
    return vectorize(env_fns, seed, vectorization_mode, context, workers)
