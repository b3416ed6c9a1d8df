"""Scripted-expert demonstrations: record episodes, and the cache that pre-training reads.

Episode i resets a single environment (camera rendered every step, every modality of ``env.obs_mode``) with
seed ``seed + i`` and rolls out the environment's scripted expert (:mod:`diffpolicy_envs.experts`). Each
step stores the observation the expert acted on and its action, in the format of
:mod:`diffpolicy.data.dataset`; episodes where the expert failed are skipped unless ``keep_failures``.

:func:`collect_demos` writes a dataset; :func:`cached_demos` reuses the dataset cached under
``<cache_dir>/demos/<key>`` for the same environment, count and seed, or collects it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from diffpolicy.config import ENV_RUNTIME_FIELDS, EnvConfig
from diffpolicy.data.dataset import DemoFormatError, DemoWriter, read_meta
from diffpolicy.modalities import TENSOR_KEYS

Progress = Callable[..., Iterator[Any]]
"""``progress(iterable, total=, desc=)`` (e.g. :meth:`diffpolicy.logger.Logger.progress`)."""

# Headless rendering when used as a library (the CLI sets it too). MuJoCo reads MUJOCO_GL when it is first
# imported, and diffpolicy_envs.experts imports mujoco before the env module's own default applies.
os.environ.setdefault("MUJOCO_GL", "egl")

DEMOS_VERSION = 5
"""Part of the cache key; bumped when an environment's action or observation semantics change
(4: MujocoPick actions became tool waypoints; 5: its state observation gained the target's position)."""


def _no_progress(iterable: Iterable[Any], **_: Any) -> Iterator[Any]:
    yield from iterable


def _make_env(env_cfg: EnvConfig):
    """One environment rendering its camera every step (obs_every = 1), no action chunking."""
    from diffpolicy.env_factory import env_kwargs
    from diffpolicy_envs.adapters import make_env

    if env_cfg.name == "gym":
        raise ValueError(
            f"env=gym ({env_cfg.id}) has no scripted expert to collect demonstrations from; "
            "use env=mujoco_pick or env=obstacle_reach, or pass an existing dataset"
        )
    return make_env(env_cfg.id, **env_kwargs(env_cfg, 1))


def run_expert_episode(env: Any, expert: Any, seed: int) -> tuple[dict[str, Any], bool]:
    """One expert episode from ``env.reset(seed=seed)``.

    Returns:
        ``(episode, success)``: ``episode`` maps ``action`` (L, Da) and each observation key to L steps
        (``rgb`` (L, H, W, 3) uint8, ``points`` (L, N, 3), ``state`` (L, Ds), ``instruction`` one string);
        step t holds the observation the expert acted on and the action it took.
    """
    obs, _ = env.reset(seed=seed)
    steps: dict[str, list[Any]] = {k: [] for k in TENSOR_KEYS if k in obs}
    actions: list[np.ndarray] = []
    instruction = obs.get("instruction")
    success = False
    while True:
        for key in steps:
            steps[key].append(np.array(obs[key], copy=True))
        action = expert.act(env)
        actions.append(np.asarray(action, dtype=np.float32))
        obs, _, terminated, truncated, info = env.step(action)
        success = success or bool(info.get("is_success", False))
        if terminated or truncated:
            break
    episode: dict[str, Any] = {key: np.stack(values) for key, values in steps.items()}
    episode["action"] = np.stack(actions)  # (L, Da)
    if instruction is not None:
        episode["instruction"] = str(instruction)
    return episode, success


def collect_demos(
    env_cfg: EnvConfig,
    n_episodes: int,
    seed: int,
    out: str | Path,
    keep_failures: bool | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Roll out the scripted expert on seeds ``seed .. seed + n_episodes - 1`` and write a dataset at ``out``.

    Args:
        env_cfg: environment (``mujoco_pick`` in either obs mode, or ``obstacle_reach``).
        n_episodes: episodes to run.
        seed: first episode seed (also seeds the expert's own choices).
        out: dataset directory to create (must not exist).
        keep_failures: also store episodes the expert failed (None: ``env_cfg.demo_failures``).
        progress: wraps the episode loop (e.g. ``logger.progress``).

    Returns:
        ``{"success_rate", "n_episodes", "n_kept", "steps", "path", "wall_time_s"}``.

    Raises:
        ValueError: no expert for the environment, ``out`` exists, or no episode was kept.
    """
    from diffpolicy_envs.experts import make_expert

    t0 = time.perf_counter()
    out = Path(out)
    if out.exists():
        raise ValueError(f"out={out} already exists; give a new directory or remove it")
    if n_episodes < 1:
        raise ValueError(f"n_episodes={n_episodes} must be >= 1")
    progress = progress or _no_progress
    if keep_failures is None:
        keep_failures = env_cfg.demo_failures
    env = _make_env(env_cfg)
    try:
        expert = make_expert(env, seed=seed, **env_cfg.expert)
    except (TypeError, ValueError) as err:
        env.close()
        if isinstance(err, ValueError):
            raise
        raise ValueError(
            f"env.expert={dict(env_cfg.expert)} does not fit the scripted expert: {err}"
        ) from None
    attrs = {"env": dataclasses.asdict(env_cfg), "seed": seed, "keep_failures": keep_failures, "obs_every": 1}
    writer = DemoWriter(out, env_id=env_cfg.id, attrs=attrs)
    successes: list[bool] = []
    steps = 0
    try:
        for i in progress(range(n_episodes), total=n_episodes, desc="collect"):
            episode, success = run_expert_episode(env, expert, seed + i)
            successes.append(success)
            if success or keep_failures:
                writer.add_episode(episode, seed=seed + i, success=success)
                steps += len(episode["action"])
        if writer.num_episodes == 0:
            raise ValueError(
                f"the expert failed all {n_episodes} episodes of {env_cfg.id}; nothing to write "
                "(keep_failures=true stores failed episodes)"
            )
        path = writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        env.close()
    return {
        "success_rate": float(np.mean(successes)),
        "n_episodes": n_episodes,
        "n_kept": writer.num_episodes,
        "steps": steps,
        "path": str(path),
        "wall_time_s": round(time.perf_counter() - t0, 2),
    }


def demos_key(env_cfg: EnvConfig, n_episodes: int, seed: int) -> str:
    """Short hash naming a cached dataset: the environment's data-relevant fields, episode count and seed."""
    env = {k: v for k, v in dataclasses.asdict(env_cfg).items() if k not in ENV_RUNTIME_FIELDS}
    blob = json.dumps(
        {"env": env, "n": n_episodes, "seed": seed, "version": DEMOS_VERSION}, sort_keys=True, default=str
    )
    return f"{env_cfg.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def cached_demos(
    env_cfg: EnvConfig,
    n_episodes: int,
    seed: int,
    cache_dir: str | Path,
    progress: Progress | None = None,
) -> tuple[Path, bool]:
    """The dataset at ``<cache_dir>/demos/<demos_key>``, collected first if it is not there.

    Returns:
        ``(path, collected)``: the dataset directory and whether this call collected it.
    """
    path = Path(cache_dir) / "demos" / demos_key(env_cfg, n_episodes, seed)
    try:
        read_meta(path)
        return path, False
    except DemoFormatError:
        if path.exists():  # a broken leftover (the writer is atomic, so this is not a complete dataset)
            raise ValueError(f"demonstration cache {path} is corrupt; remove it to collect again") from None
    try:
        collect_demos(env_cfg, n_episodes, seed, path, progress=progress)
    except (ValueError, OSError):
        if path.exists():  # another process finished the same dataset first
            read_meta(path)
            return path, False
        raise
    return path, True
