"""Demonstrations for behaviour cloning: the scripted expert's, or a dataset on disk; and the cache both go to.

Episode i resets a single environment (camera rendered every step, every modality of ``env.obs_mode``) with
seed ``seed + i`` and rolls out the environment's scripted expert (:mod:`diffpolicy_envs.experts`). Each
step stores the observation the expert acted on, its action and its reward, in the format of
:mod:`diffpolicy.data.dataset`; episodes where the expert failed are skipped unless ``keep_failures``.

:func:`collect_demos` writes a dataset; :func:`cached_demos` reuses the dataset cached under
``<cache_dir>/demos/<key>`` for the same environment, count and seed, or collects it.

:func:`import_demos` (``bc.demos=PATH``) reads a robomimic-style HDF5 file (images and depth included), a
LeRobotDataset (``lerobot:DIR``), a Minari dataset or a dataset of this project's format
(:mod:`diffpolicy.data.external`, :mod:`diffpolicy.data.lerobot`), matches it to the environment and converts
it once into ``<cache_dir>/demos/<key>`` (keyed by the SHA-256 of the source's content, the environment and
``bc.obs_keys``), decoding videos once, not every epoch:

- each observation key of the environment (rgb, points, state, instruction: those a policy reads) is read
  from the keys ``bc.obs_keys.<key>`` lists (flattened and concatenated in order), else from the source's
  default (the same name; a LeRobotDataset's ``observation.state``, its one camera, its task; robomimic's
  ``<camera>_image``, depth and low-dim keys); its per-step shape must be the environment's;
- a modality the dataset does not hold is left out, and the policy is built without it (RGB without points,
  points without RGB, with or without text); ``state`` is required;
- actions must have the environment's Da and lie within its action bounds (a tolerance of 1e-4 of the
  range); a plain Box environment's actions are rescaled from its units to the adapter's [-1, 1]
  (:class:`diffpolicy_envs.adapters.BoxEnvAdapter`);
- the first mismatch stops the import with one line naming the episode, the step and the key, and nothing
  is left in the cache (the writer is atomic; directories the import created are removed again).

:func:`demonstrations` picks between the two for a :class:`~diffpolicy.config.BCConfig`;
:func:`export_robomimic` writes a dataset of this project's format as robomimic-style HDF5.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from diffpolicy.config import ENV_FIELDS_ADDED, ENV_RUNTIME_FIELDS, BCConfig, EnvConfig
from diffpolicy.data.dataset import (
    INSTRUCTION_KEY,
    REWARD_KEY,
    SUBTASK_KEY,
    TARGET_KEY,
    DemoFormatError,
    DemoWriter,
    read_meta,
)
from diffpolicy.modalities import TENSOR_KEYS

Progress = Callable[..., Iterator[Any]]
"""``progress(iterable, total=, desc=)`` (e.g. :meth:`diffpolicy.logger.Logger.progress`)."""

# Headless rendering when used as a library (the CLI sets it too). MuJoCo reads MUJOCO_GL when it is first
# imported, and diffpolicy_envs.experts imports mujoco before the env module's own default applies.
os.environ.setdefault("MUJOCO_GL", "egl")

DEMOS_VERSION = 5
"""Part of the cache key; bumped when an environment's action or observation semantics change
(4: MujocoPick actions became tool waypoints; 5: its state observation gained the target's position)."""
MAX_TRIES_PER_DEMO = 3
"""Without failures kept: the expert gets at most this many seeds per demonstration asked for."""
IMPORT_VERSION = 2
"""Part of an imported dataset's cache key; bumped when the conversion changes (2: keyed on the content's
hash; modalities the dataset lacks are left out; LeRobot datasets)."""
ACTION_TOLERANCE = 1e-4
"""How far (as a fraction of the bound's range) an imported action may lie outside the env's bounds."""


def _no_progress(iterable: Iterable[Any], **_: Any) -> Iterator[Any]:
    yield from iterable


def _make_env(env_cfg: EnvConfig):
    """One environment rendering its camera every step (obs_every = 1), no action chunking."""
    from diffpolicy.env_factory import env_kwargs
    from diffpolicy_envs.adapters import make_env

    if env_cfg.name == "gym":
        raise ValueError(
            f"env=gym ({env_cfg.id}) has no scripted expert to collect demonstrations from; give your own "
            "with bc.demos=PATH (robomimic-style HDF5, minari:ID or a dataset directory), or use env=mujoco_pick, "
            "env=obstacle_reach or env=hopper"
        )
    return make_env(env_cfg.id, **env_kwargs(env_cfg, 1))


def run_expert_episode(env: Any, expert: Any, seed: int) -> tuple[dict[str, Any], bool | None]:
    """One expert episode from ``env.reset(seed=seed)``.

    Returns:
        ``(episode, success)``: ``episode`` maps ``action`` (L, Da), ``reward`` (L,) and each observation key
        to L steps (``rgb`` (L, H, W, 3) uint8, ``points`` (L, N, 6), ``state`` (L, Ds); ``instruction`` one
        string, or L strings when it changed during the episode: a dialogue), plus ``target_pos`` (L, 3 k)
        where the env's info reports it (a privileged label) and ``subtask`` (L strings, multi-stage tasks'
        label); step t holds the observation the expert acted on, the action it took and its reward.
        ``success`` is None when the environment reports no ``is_success`` (Hopper: returns, no goal).
    """
    obs, info = env.reset(seed=seed)
    steps: dict[str, list[Any]] = {k: [] for k in TENSOR_KEYS if k in obs}
    targets: list[np.ndarray] | None = [] if TARGET_KEY in info else None
    subtasks: list[str] | None = [] if SUBTASK_KEY in info else None
    actions: list[np.ndarray] = []
    rewards: list[float] = []
    texts: list[str] | None = [] if "instruction" in obs else None
    success, reported = False, False
    while True:
        for key in steps:
            steps[key].append(np.array(obs[key], copy=True))
        if texts is not None:  # the instruction of this step (a dialogue grows during the episode)
            texts.append(str(obs["instruction"]))
        if targets is not None:  # the label of the observation just stored
            targets.append(np.asarray(info[TARGET_KEY], dtype=np.float32))
        if subtasks is not None:  # the sub-task the expert works on at this observation
            subtasks.append(str(info[SUBTASK_KEY]))
        action = expert.act(env)
        actions.append(np.asarray(action, dtype=np.float32))
        obs, reward, terminated, truncated, info = env.step(action)
        rewards.append(float(reward))
        success = success or bool(info.get("is_success", False))
        reported = reported or "is_success" in info
        if terminated or truncated:
            break
    episode: dict[str, Any] = {key: np.stack(values) for key, values in steps.items()}
    episode["action"] = np.stack(actions)  # (L, Da)
    episode[REWARD_KEY] = np.asarray(rewards, dtype=np.float32)  # (L,)
    if targets is not None:
        episode[TARGET_KEY] = np.stack(targets)  # (L, 3 k): k labelled points
    if subtasks is not None:
        episode[SUBTASK_KEY] = subtasks  # L strings
    if texts is not None:
        episode["instruction"] = texts[0] if len(set(texts)) == 1 else texts
    return episode, success if reported else None


def collect_demos(
    env_cfg: EnvConfig,
    n_episodes: int,
    seed: int,
    out: str | Path,
    keep_failures: bool | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Roll out the scripted expert on seeds ``seed, seed + 1, ...`` and write a dataset at ``out``.

    With failures kept, ``n_episodes`` episodes are run and all stored. Without, ``n_episodes`` is the number
    of successful episodes to store: seeds are tried in order until that many succeeded (at most
    ``MAX_TRIES_PER_DEMO`` x ``n_episodes`` of them; fewer are stored when the expert fails more often).

    Args:
        env_cfg: environment (``mujoco_pick`` in either obs mode, ``obstacle_reach``, ``hopper`` or ``metaworld``).
        n_episodes: episodes to store (the successful ones when failures are dropped).
        seed: first episode seed (also seeds the expert's own choices).
        out: dataset directory to create (must not exist).
        keep_failures: also store episodes the expert failed (None: ``env_cfg.demo_failures``).
        progress: wraps the episode loop (e.g. ``logger.progress``).

    Returns:
        ``{"success_rate", "mean_return", "n_episodes", "n_kept", "steps", "path", "wall_time_s"}``
        (``success_rate`` None when the environment reports no success).

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
    successes: list[bool | None] = []
    returns: list[float] = []
    steps = 0
    try:
        tries = n_episodes if keep_failures else MAX_TRIES_PER_DEMO * n_episodes
        bar = iter(progress(range(n_episodes), total=n_episodes, desc="collect"))
        for i in range(tries):
            episode, success = run_expert_episode(env, expert, seed + i)
            successes.append(success)
            returns.append(float(episode[REWARD_KEY].sum()))
            if success is not False or keep_failures:  # None: no notion of success, every episode kept
                writer.add_episode(episode, seed=seed + i, success=success)
                steps += len(episode["action"])
                next(bar, None)
            if writer.num_episodes == n_episodes:
                break
        next(bar, None)  # let the bar close
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
    known = [s for s in successes if s is not None]
    return {
        "success_rate": float(np.mean(known)) if known else None,
        "mean_return": round(float(np.mean(returns)), 2),
        "n_episodes": len(successes),
        "n_kept": writer.num_episodes,
        "steps": steps,
        "path": str(path),
        "wall_time_s": round(time.perf_counter() - t0, 2),
    }


def demos_key(env_cfg: EnvConfig, n_episodes: int, seed: int) -> str:
    """Short hash naming a cached dataset: the environment's data-relevant fields, episode count and seed.

    Without ``env.demo_failures`` the count is of successful episodes (:func:`collect_demos`), which the key
    says, so a dataset collected when it counted every episode is not reused."""
    key: dict[str, Any] = {
        "env": _env_data_fields(env_cfg),
        "n": n_episodes,
        "seed": seed,
        "version": DEMOS_VERSION,
    }
    if not env_cfg.demo_failures:
        key["count"] = "successes"
    blob = json.dumps(key, sort_keys=True, default=str)
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


# ------------------------------------------------------------------------------- datasets from elsewhere
def _env_data_fields(env_cfg: EnvConfig) -> dict[str, Any]:
    """The EnvConfig fields that say what the data holds (not how envs run; added fields only when set)."""
    return {
        k: v
        for k, v in dataclasses.asdict(env_cfg).items()
        if k not in ENV_RUNTIME_FIELDS and not (k in ENV_FIELDS_ADDED and v == ENV_FIELDS_ADDED[k])
    }


def import_key(
    source: str, env_cfg: EnvConfig, obs_keys: dict[str, list[str]] | None = None, label: str | None = None
) -> str:
    """Short hash naming an imported dataset: the source's fingerprint (kind, path, size, modification
    time), the environment's data-relevant fields and the observation key map (``label`` names the source in
    the error when there is none)."""
    from diffpolicy.data.external import fingerprint

    blob = json.dumps(
        {
            "source": fingerprint(source, label),
            "env": _env_data_fields(env_cfg),
            "obs_keys": {k: list(v) for k, v in (obs_keys or {}).items()},
            "version": IMPORT_VERSION,
        },
        sort_keys=True,
        default=str,
    )
    return f"{env_cfg.name}-import-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


@dataclasses.dataclass
class EnvTarget:
    """What an imported episode must fit: the environment's observation keys and its action space."""

    env_id: str
    obs: dict[str, tuple[tuple[int, ...], np.dtype | None]]
    """Observation key -> (per-step shape, dtype); text keys have shape () and dtype None."""
    low: np.ndarray
    """(Da,) action lower bound in the units the dataset is read in."""
    high: np.ndarray
    """(Da,) action upper bound."""
    to_unit: Callable[[np.ndarray], np.ndarray] | None
    """Rescales (L, Da) actions to the adapter's [-1, 1] (plain Box environments), else None."""


def env_target(env_cfg: EnvConfig) -> EnvTarget:
    """The :class:`EnvTarget` of ``env_cfg``, read from one freshly built instance."""
    from diffpolicy.env_factory import env_kwargs, obs_spec
    from diffpolicy_envs.adapters import BoxEnvAdapter, make_env

    env = make_env(env_cfg.id, **env_kwargs(env_cfg, 1))
    try:
        spaces = env.observation_space.spaces
        obs = {
            key: (tuple(shape), None if key == INSTRUCTION_KEY else np.dtype(spaces[key].dtype))
            for key, shape in obs_spec(env.observation_space).items()
        }
        if isinstance(env, BoxEnvAdapter):
            raw = env.source_action_space
            return EnvTarget(env_cfg.id, obs, raw.low.astype(np.float64), raw.high.astype(np.float64),
                             env.to_unit_action)  # fmt: skip
        space = env.action_space
        return EnvTarget(env_cfg.id, obs, space.low.astype(np.float64), space.high.astype(np.float64), None)
    finally:
        env.close()


def _key_map(
    target: EnvTarget, obs_keys: dict[str, list[str]], source: Any, available: set[str], label: str
) -> dict[str, list[str]]:
    """Environment observation key -> the dataset keys that form it: ``bc.obs_keys``'s, else the source's
    default (the same name; a LeRobotDataset's ``observation.state``, its camera, ``task``). A modality the
    dataset does not hold is left out, and the policy goes without it; ``state`` is required."""
    unknown = sorted(set(obs_keys) - set(target.obs))
    if unknown:
        raise DemoFormatError(
            f"{label}: bc.obs_keys names {unknown[0]!r}, which {target.env_id} does not observe "
            f"(it observes {', '.join(target.obs)})"
        )
    keys: dict[str, list[str]] = {}
    for key in target.obs:
        found = list(obs_keys[key]) if key in obs_keys else source.default_keys(key, available)
        if found is not None:
            keys[key] = found
        elif key == "state":
            raise DemoFormatError(
                f"{label} has no observation 'state', which {target.env_id} observes (it has: "
                f"{', '.join(sorted(available)) or 'none'}; +bc.obs_keys.state=[...] names the dataset keys that "
                "form it)"
            )
    return keys


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + (",)" if len(shape) == 1 else ")")


def convert_episode(
    episode: Any, target: EnvTarget, keys: dict[str, list[str]], label: str
) -> dict[str, Any]:
    """One :class:`~diffpolicy.data.external.SourceEpisode` -> the fields of this project's store, checked
    against ``target``: observations (L, ...) per env key, ``action`` (L, Da) in the env's action units,
    ``reward`` (L,) when the source has rewards. Raises a one-line DemoFormatError at the first mismatch."""
    name, length = episode.name, len(episode.actions)
    where = f"{label}: {name}"
    out: dict[str, Any] = {}
    for key, sources in keys.items():
        missing = [s for s in sources if s not in episode.obs]
        if missing:
            wanted = f"which {target.env_id} observes" if missing[0] == key else f"for bc.obs_keys.{key}"
            raise DemoFormatError(
                f"{where} has no observation {missing[0]!r}, {wanted} (it has: "
                f"{', '.join(sorted(episode.available or episode.obs)) or 'none'}; +bc.obs_keys.{key}=[...] names "
                "the dataset keys "
                "that form it)"
            )
        shape, dtype = target.obs[key]
        if dtype is None:  # text: one string per step
            texts = episode.obs[sources[0]]
            if len(sources) > 1 or isinstance(texts, np.ndarray) and texts.dtype.kind not in "OUS":
                raise DemoFormatError(f"{where}: observation {sources[0]!r} for {key!r} must be text")
            out[key] = [str(t) for t in texts]
            continue
        parts = [episode.obs[s] for s in sources]
        for source, part in zip(sources, parts):
            if not isinstance(part, np.ndarray) or part.dtype.kind not in "biuf":
                raise DemoFormatError(f"{where}: observation {source!r} is not numeric")
        if len(sources) > 1 or len(shape) == 1:  # vectors: flatten each part, concatenate in order
            value = np.concatenate([p.reshape(length, -1) for p in parts], axis=1)  # (L, D)
        else:
            value = parts[0]
        if tuple(value.shape[1:]) != shape:
            given = "+".join(sources) if len(sources) > 1 else repr(sources[0])
            raise DemoFormatError(
                f"{where}: observation {given} is {_shape(tuple(value.shape[1:]))} per step, "
                f"{target.env_id} observes {key!r} as {_shape(shape)}"
            )
        if dtype.kind in "ui" and value.dtype != dtype:
            raise DemoFormatError(
                f"{where}: observation {key!r} is {value.dtype}, {target.env_id} observes {dtype}"
            )
        out[key] = value.astype(dtype, copy=False)
    actions = np.asarray(episode.actions)
    da = len(target.low)
    if actions.ndim != 2 or actions.shape[1] != da:
        got = f"{actions.shape[1]}-D" if actions.ndim == 2 else f"shaped {_shape(actions.shape)}"
        raise DemoFormatError(f"{where} has {got} actions, {target.env_id} takes {da}-D actions")
    if not np.all(np.isfinite(actions)):
        t, j = np.argwhere(~np.isfinite(actions))[0]
        raise DemoFormatError(f"{where} step {t}: action[{j}] is {actions[t, j]}")
    slack = ACTION_TOLERANCE * (target.high - target.low)
    outside = (actions < target.low - slack) | (actions > target.high + slack)  # (L, Da)
    if outside.any():
        t, j = np.argwhere(outside)[0]
        raise DemoFormatError(
            f"{where} step {t}: action[{j}]={actions[t, j]:.6g} lies outside {target.env_id}'s action bounds "
            f"[{target.low[j]:.6g}, {target.high[j]:.6g}]"
        )
    actions = np.clip(actions, target.low, target.high)
    if target.to_unit is not None:
        actions = np.clip(target.to_unit(actions), -1.0, 1.0)
    out["action"] = actions.astype(np.float32, copy=False)  # (L, Da)
    if episode.rewards is not None:
        out[REWARD_KEY] = np.asarray(episode.rewards, dtype=np.float32).reshape(length)  # (L,)
    if episode.target is not None:
        target_pos = np.asarray(episode.target, dtype=np.float32).reshape(length, -1)  # (L, 3 k)
        if not np.all(np.isfinite(target_pos)):
            raise DemoFormatError(f"{where}: {TARGET_KEY} is not finite")
        out[TARGET_KEY] = target_pos
    return out


def import_demos(
    source: str,
    env_cfg: EnvConfig,
    cache_dir: str | Path,
    obs_keys: dict[str, list[str]] | None = None,
    *,
    label: str | None = None,
    progress: Progress | None = None,
) -> tuple[Path, bool]:
    """The dataset ``source`` (a path or ``minari:ID``) matched to ``env_cfg``, converted into
    ``<cache_dir>/demos/<import_key>`` on first use (see the module docstring).

    Args:
        source: robomimic-style HDF5 file, Minari dataset (``minari:ID`` or its directory), or a dataset
            directory of this project's format.
        env_cfg: the environment the demonstrations must fit.
        cache_dir: cache root.
        obs_keys: env observation key -> dataset keys forming it (``bc.obs_keys``).
        label: how error messages name the source (default ``source``; ``bc.demos=...`` from the configs).
        progress: wraps the episode loop.

    Returns:
        ``(path, imported)``: the converted dataset and whether this call converted it.

    Raises:
        FileNotFoundError: no such source. DemoFormatError (a ValueError): the first mismatch, one line;
        the cache is then as it was.
    """
    from diffpolicy.data.external import open_source

    label = label or source
    obs_keys = dict(obs_keys or {})
    path = Path(cache_dir) / "demos" / import_key(source, env_cfg, obs_keys, label)
    try:
        read_meta(path)
        return path, False
    except DemoFormatError:
        if path.exists():
            raise ValueError(f"demonstration cache {path} is corrupt; remove it to import again") from None
    progress = progress or _no_progress
    created = [d for d in (Path(cache_dir), path.parent) if not d.exists()]  # removed again on failure
    writer: DemoWriter | None = None
    try:
        with open_source(source, label, env_cfg.image_size, env_cfg.n_points) as episodes:
            target = env_target(env_cfg)
            known = episodes.keys()
            stream = iter(episodes.episodes()) if known is None else None
            first = next(stream, None) if stream is not None else None  # the keys of an episode, when unknown
            available = set(first.obs if first is not None else known or ())
            keys = _key_map(target, obs_keys, episodes, available, label)
            episodes.wanted = {name for names in keys.values() for name in names}
            if stream is None:
                stream = iter(episodes.episodes())
            elif first is not None:
                stream = itertools.chain([first], stream)
            for episode in progress(stream, total=len(episodes), desc="import"):
                fields = convert_episode(episode, target, keys, label)
                if writer is None:
                    attrs = {"source": source, "format": episodes.kind, "env": dataclasses.asdict(env_cfg),
                             "modalities": sorted(keys), "fps": getattr(episodes, "fps", None)}  # fmt: skip
                    writer = DemoWriter(path, env_id=env_cfg.id, attrs=attrs)
                writer.add_episode(fields, seed=episode.seed, success=episode.success)
            if writer is None:
                raise DemoFormatError(f"{label} holds no episodes")
            writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        for directory in reversed(created):
            with contextlib.suppress(OSError):  # not empty: another process wrote there meanwhile
                directory.rmdir()
        raise
    return path, True


def demonstrations(
    env_cfg: EnvConfig, bc_cfg: BCConfig, seed: int, cache_dir: str | Path, progress: Progress | None = None
) -> tuple[Path, bool]:
    """The demonstrations behaviour cloning reads: ``bc.demos`` imported (:func:`import_demos`), else the
    scripted expert's ``bc.n_demos`` episodes from ``seed`` (:func:`cached_demos`).

    Returns:
        ``(path, made)``: the dataset directory and whether this call imported or collected it.
    """
    if bc_cfg.demos:
        return import_demos(
            bc_cfg.demos,
            env_cfg,
            cache_dir,
            bc_cfg.obs_keys,
            label=f"bc.demos={bc_cfg.demos}",
            progress=progress,
        )
    return cached_demos(env_cfg, bc_cfg.n_demos, seed, cache_dir, progress=progress)


def demonstrations_key(env_cfg: EnvConfig, bc_cfg: BCConfig, seed: int) -> str:
    """The cache key of :func:`demonstrations`' dataset (part of the BC cache key)."""
    if bc_cfg.demos:
        return import_key(bc_cfg.demos, env_cfg, bc_cfg.obs_keys, label=f"bc.demos={bc_cfg.demos}")
    return demos_key(env_cfg, bc_cfg.n_demos, seed)


def export_robomimic(source: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the dataset directory ``source`` (this project's format) as the robomimic-style HDF5 file ``out``;
    ``env_args`` records the gymnasium id and the collecting EnvConfig. Returns ``{"path", "n_episodes",
    "steps"}``."""
    from diffpolicy.data.external import ROBOMIMIC_GYM_TYPE, write_robomimic

    meta = read_meta(source)
    env = meta["attrs"].get("env", {})
    env_args = {"env_name": meta["env_id"], "type": ROBOMIMIC_GYM_TYPE, "env_kwargs": env.get("kwargs", {}),
                "diffpolicy": meta["attrs"]}  # fmt: skip
    return write_robomimic(source, out, env_args)


def control_fps(env_cfg: EnvConfig) -> float:
    """The environment's control rate in steps per second (its ``metadata["render_fps"]``; 10 when unset)."""
    env = _make_env(env_cfg)
    try:
        return float(env.metadata.get("render_fps") or 10)
    finally:
        env.close()


def export_lerobot(
    source: str | Path,
    out: str | Path,
    env_cfg: EnvConfig,
    fps: float | None = None,
    video_codec: str = "av1",
) -> dict[str, Any]:
    """Write the dataset directory ``source`` (this project's format) as a LeRobotDataset v3.0 at ``out``
    (:func:`diffpolicy.data.lerobot.write_lerobot`), at ``fps`` frames per second (None: ``env_cfg``'s
    control rate). Returns ``{"path", "n_episodes", "steps", "video_codec", "fps"}``."""
    from diffpolicy.data.lerobot_writer import write_lerobot

    fps = fps or control_fps(env_cfg)
    robot = env_cfg.task or env_cfg.name
    return {**write_lerobot(source, out, fps=fps, video_codec=video_codec, robot_type=robot), "fps": fps}
