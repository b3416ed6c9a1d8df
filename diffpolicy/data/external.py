"""Demonstrations in other tools' formats: robomimic-style HDF5 files and Minari datasets, read episode by
episode (:func:`open_source`); and this project's datasets written as robomimic-style HDF5
(:func:`write_robomimic`).

robomimic-style HDF5, one file (robomimic's own layout)::

    data/                         attrs: total (steps), env_args (JSON: env_name, type, env_kwargs)
      demo_0/                     attrs: num_samples (L); optional: success (bool), seed (int)
        actions         (L, Da)
        rewards         (L,)
        dones           (L,)      1 at the episode's last step
        obs/<key>       (L, ...)  the observation each action was taken on
        next_obs/<key>  (L, ...)  the one after it (the export repeats the last step's own observation)
      demo_1/ ...
    mask/                         optional filter keys (not read)

Demos are read in the order of their number N (``demo_2`` before ``demo_10``); a string dataset
(``obs/instruction``, UTF-8) is read as one text per step. robomimic's image datasets map by its own names
when the environment's are absent: ``rgb`` <- the one ``obs/<camera>_image`` (resized to the policy's size;
several cameras: name one with ``bc.obs_keys.rgb``), ``points`` <- ``obs/<camera>_depth`` (metres) back-projected
with the camera parameters robomimic stores per demo (attribute ``camera_info``: JSON, camera -> 3x3
``intrinsics`` and 4x4 camera-to-world ``extrinsics``), coloured from ``<camera>_image``
(:func:`diffpolicy.data.camera.depth_points`); without them a warning says the policy goes without points. ``state`` <- every
low-dim key (one vector per step), concatenated in name order (``robot0_eef_pos``, ``robot0_eef_quat``,
``robot0_gripper_qpos``, ...); ``bc.obs_keys.state`` picks and orders them otherwise.

Minari: a dataset saved by the ``minari`` package, named ``minari:ID`` (looked up among the local datasets,
under ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``: nothing is downloaded) or given by its
directory. An episode's L + 1 observations give the L that its actions were taken on; a Box observation is
read as the key ``state``, a Dict one as its keys (nested keys joined by ``/``); its success is the last
``success`` / ``is_success`` info when it records one.

LeRobotDataset directories (``lerobot:DIR``, or a directory holding ``meta/info.json``) are read by
:mod:`diffpolicy.data.lerobot`.

Every failure to read is one line, :class:`~diffpolicy.data.dataset.DemoFormatError`, starting with the
source's label (what the user typed). h5py and minari are the optional ``data`` extra, imported only when a
file of theirs is read. This module imports numpy (and those two) only: no torch, no environments.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from diffpolicy.data.camera import depth_points, resize_frames
from diffpolicy.data.dataset import (
    ACTION_KEY,
    INSTRUCTION_KEY,
    META_FILE,
    NON_OBSERVATION_FIELDS,
    REWARD_KEY,
    TARGET_KEY,
    DemoFormatError,
    DemoReader,
)
from diffpolicy.data.source import DemoSource, SourceEpisode, first_line, require

MINARI_PREFIX = "minari:"
"""``bc.demos=minari:ID`` names a local Minari dataset by its id."""
ROBOMIMIC_GYM_TYPE = 2
"""robomimic's ``env_args["type"]`` for gym(nasium) environments (1 is robosuite)."""
_DEMO_NAME = re.compile(r"demo_(\d+)")
IMAGE_SUFFIX, DEPTH_SUFFIX, POINTS_SUFFIX = "_image", "_depth", "_points"
"""robomimic's camera keys: ``<camera>_image`` (L, H, W, 3) uint8, ``<camera>_depth`` (L, H, W, 1) metres;
``<camera>_points`` is what this reader makes of a depth map (:func:`depth_points`)."""


def minari_root() -> Path:
    """Where Minari keeps local datasets: ``$MINARI_DATASETS_PATH``, else ``~/.minari/datasets``."""
    return Path(os.environ.get("MINARI_DATASETS_PATH") or Path.home() / ".minari" / "datasets")


def resolve(spec: str, label: str | None = None) -> tuple[str, Path]:
    """``(kind, path)`` of a dataset spec: kind ``native`` | ``robomimic`` | ``minari``; path the file or
    directory to read (for Minari, its ``data`` directory). Raises FileNotFoundError / DemoFormatError
    starting with ``label`` (default ``spec``)."""
    from diffpolicy.data.lerobot import LEROBOT_PREFIX, is_lerobot

    label = label or spec
    if spec.startswith(LEROBOT_PREFIX):
        path = Path(spec[len(LEROBOT_PREFIX) :]).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(
                f"{label}: no such directory (nothing is downloaded: give a local LeRobotDataset)"
            )
        if not is_lerobot(path):
            raise DemoFormatError(f"{label} is not a LeRobotDataset: it has no meta/info.json")
        return "lerobot", path
    if spec.startswith(MINARI_PREFIX):
        dataset_id = spec[len(MINARI_PREFIX) :]
        path = minari_root() / dataset_id / "data"
        if not (path / "metadata.json").is_file():
            raise FileNotFoundError(
                f"{label}: no local Minari dataset {dataset_id!r} under {minari_root()} (nothing is "
                "downloaded; `minari download ID` fetches one, MINARI_DATASETS_PATH moves the root)"
            )
        return "minari", path
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{label}: no such file or directory")
    if path.is_dir():
        if (path / META_FILE).is_file():
            return "native", path
        if is_lerobot(path):
            return "lerobot", path
        for data in (path / "data", path):
            if (data / "metadata.json").is_file():
                return "minari", data
        raise DemoFormatError(
            f"{label} is a directory but neither this project's dataset ({META_FILE}), a LeRobotDataset "
            "(meta/info.json) nor a Minari dataset (data/metadata.json)"
        )
    return "robomimic", path


def fingerprint(spec: str, label: str | None = None) -> dict[str, Any]:
    """What identifies a dataset: its kind and the SHA-256 of its content (every file under a directory, by
    relative path, in sorted order), so that a copy elsewhere shares its cache and an edit in place does not.
    Hashing reads the files once (~1 s per GB)."""
    import hashlib

    kind, path = resolve(spec, label)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    stats = [f.stat() for f in files]
    stamp = (str(path.resolve()), tuple((str(f), st.st_size, st.st_mtime_ns) for f, st in zip(files, stats)))
    if stamp in _HASHED:  # the same files, unchanged since this process hashed them
        return _HASHED[stamp]
    digest = hashlib.sha256()
    size = 0
    for file in files:
        digest.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
        with open(file, "rb") as f:
            while block := f.read(1 << 22):
                digest.update(block)
                size += len(block)
        digest.update(b"\0")
    _HASHED[stamp] = {"kind": kind, "files": len(files), "bytes": size, "sha256": digest.hexdigest()}
    return _HASHED[stamp]


_HASHED: dict[tuple[Any, ...], dict[str, Any]] = {}
"""fingerprint's results in this process, by path and every file's size and modification time."""


def open_source(
    spec: str, label: str | None = None, image_size: int | None = None, n_points: int | None = None
) -> Any:
    """The dataset ``spec`` names (see the module docstring); ``label`` starts every error message; camera
    images are decoded or resized to ``image_size`` squares, depth maps become ``n_points`` points."""
    label = label or spec
    kind, path = resolve(spec, label)
    if kind == "lerobot":
        from diffpolicy.data.lerobot import LeRobotSource

        return LeRobotSource(path, label, image_size)
    if kind == "native":
        return NativeSource(path, label)
    if kind == "minari":
        return MinariSource(path, label)
    return RobomimicSource(path, label, image_size, n_points)


class NativeSource(DemoSource):
    """This project's chunked store (:mod:`diffpolicy.data.dataset`)."""

    kind = "native"

    def __init__(self, path: Path, label: str) -> None:
        super().__init__(label)
        try:
            self.reader = DemoReader(path)
        except DemoFormatError as err:
            raise self._fail(str(err)) from None

    def __len__(self) -> int:
        return self.reader.num_episodes

    def keys(self) -> list[str]:
        return [k for k in self.reader.fields if k not in NON_OBSERVATION_FIELDS]

    def episodes(self) -> Iterator[SourceEpisode]:
        meta = self.reader.meta
        for i in range(self.reader.num_episodes):
            try:
                fields = self.reader.episode(i)
            except (OSError, ValueError) as err:  # a damaged chunk
                raise self._fail(f"cannot read episode {i} ({first_line(err)})") from None
            yield SourceEpisode(
                name=f"episode {i}",
                obs={k: v for k, v in fields.items() if k not in NON_OBSERVATION_FIELDS},
                actions=fields[ACTION_KEY],
                rewards=fields.get(REWARD_KEY),
                success=meta["success"][i],
                seed=meta["seeds"][i],
                target=fields.get(TARGET_KEY),
            )


class RobomimicSource(DemoSource):
    """A robomimic-style HDF5 file (layout in the module docstring)."""

    kind = "robomimic"

    def __init__(
        self, path: Path, label: str, image_size: int | None = None, n_points: int | None = None
    ) -> None:
        super().__init__(label)
        self.image_size, self.n_points = image_size, n_points
        self._shapes: dict[str, tuple[int, ...]] = {}  # obs key -> per-step shape, filled by keys()
        h5py = require("h5py", "data")
        self._h5py = h5py
        if path.stat().st_size == 0:
            raise self._fail("is an empty file (0 bytes), not a robomimic-style HDF5 file")
        try:
            self._file = h5py.File(path, "r")
        except OSError as err:
            raise self._fail(
                f"not a readable HDF5 file: empty, truncated or not HDF5 ({first_line(err)}); bc.demos takes a "
                "robomimic-style HDF5 file, a Minari dataset or this project's dataset directory"
            ) from None
        data = self._file.get("data")
        if not isinstance(data, h5py.Group):
            self.close()
            raise self._fail("has no 'data' group: not a robomimic-style file (data/demo_N/...)")
        self._data = data
        matches = [_DEMO_NAME.fullmatch(name) for name in data]
        self.names = [m.group(0) for m in sorted((m for m in matches if m), key=lambda m: int(m.group(1)))]
        if not self.names:
            self.close()
            raise self._fail("holds no demonstrations (no data/demo_N groups)")

    def __len__(self) -> int:
        return len(self.names)

    def keys(self) -> list[str]:
        """The first demo's ``obs`` keys, and ``<camera>_points`` for each ``<camera>_depth`` whose camera
        parameters the demo records (``camera_info``)."""
        first = self._data[self.names[0]]
        group = first.get("obs")
        keys = list(group) if isinstance(group, self._h5py.Group) else []
        self._shapes = {
            k: tuple(group[k].shape[1:]) for k in keys if isinstance(group[k], self._h5py.Dataset)
        }
        cameras = self._camera_info(first)
        depth = [k[: -len(DEPTH_SUFFIX)] for k in keys if k.endswith(DEPTH_SUFFIX)]
        return keys + [f"{c}{POINTS_SUFFIX}" for c in depth if c in cameras]

    def default_keys(self, key: str, available: set[str]) -> list[str] | None:
        """The same name first; else robomimic's: ``rgb`` <- the one ``<camera>_image``, ``points`` <- the
        points of the one ``<camera>_depth`` with camera parameters, ``state`` <- every low-dim key (one
        value vector per step, not an image or depth map), in name order."""
        if key in available:
            return [key]
        if key == "rgb":
            return self.only_one(sorted(k for k in available if k.endswith(IMAGE_SUFFIX)), key, "cameras")
        if key == "points":
            points = sorted(k for k in available if k.endswith(POINTS_SUFFIX))
            if not points and any(k.endswith(DEPTH_SUFFIX) for k in available):
                warnings.warn(
                    f"{self.label}: depth maps but no camera parameters (demo attribute camera_info, which "
                    "robomimic's dataset_states_to_obs.py --depth writes): the policy goes without points",
                    stacklevel=2,
                )
            return self.only_one(points, key, "depth cameras")
        if key == "state":
            low = sorted(k for k in available if len(self._shapes.get(k, (0, 0))) <= 1
                         and not k.endswith((IMAGE_SUFFIX, DEPTH_SUFFIX)))  # fmt: skip
            return low or None
        return None

    def _camera_info(self, demo: Any) -> dict[str, Any]:
        raw = demo.attrs.get("camera_info")
        if raw is None:
            return {}
        try:
            return dict(json.loads(raw))
        except (TypeError, ValueError) as err:
            raise self._fail(f"camera_info of {demo.name} is not JSON ({first_line(err)})") from None

    def _points(self, demo: Any, obs: dict[str, Any], key: str, name: str) -> np.ndarray:
        """``<camera>_points`` of one demo: (L, N, 6) from its depth maps, camera parameters and images."""
        camera = key[: -len(POINTS_SUFFIX)]
        info = self._camera_info(demo).get(camera)
        if info is None:
            raise self._fail(
                f"{name} records no camera_info for {camera!r}, whose depth the points come from"
            )
        try:
            intrinsics = np.asarray(info["intrinsics"], np.float64).reshape(3, 3)
            extrinsics = np.asarray(info["extrinsics"], np.float64).reshape(4, 4)
        except (KeyError, ValueError) as err:
            raise self._fail(f"{name}: camera_info[{camera!r}] lacks a 3x3 intrinsics and a 4x4 extrinsics "
                             f"({first_line(err)})") from None  # fmt: skip
        depth = obs.get(f"{camera}{DEPTH_SUFFIX}")
        if depth is None:
            depth = self._read(demo["obs"], f"{camera}{DEPTH_SUFFIX}", name)
        rgb = obs.get(f"{camera}{IMAGE_SUFFIX}")
        if rgb is not None and rgb.shape[1:3] != depth.shape[1:3]:
            rgb = None
        n = self.n_points or 512
        index = self.names.index(name)
        return np.stack([
            depth_points(depth[t], intrinsics, extrinsics, n, None if rgb is None else rgb[t], index * 100_003 + t)
            for t in range(len(depth))
        ])  # fmt: skip

    def close(self) -> None:
        if getattr(self, "_file", None) is not None:
            self._file.close()
            self._file = None

    def _read(self, group: Any, key: str, name: str) -> Any:
        item = group.get(key)
        if not isinstance(item, self._h5py.Dataset):
            raise self._fail(f"{name} has no dataset {key!r}")
        try:
            if self._h5py.check_string_dtype(item.dtype) is not None:
                return [str(s) for s in item.asstr()[()]]
            return np.asarray(item[()])
        except (OSError, ValueError, TypeError) as err:
            raise self._fail(f"cannot read {name}/{key}: truncated or corrupt ({first_line(err)})") from None

    def episodes(self) -> Iterator[SourceEpisode]:
        for name in self.names:
            group = self._data[name]
            actions = self._read(group, "actions", name)
            obs_group = group.get("obs")
            if not isinstance(obs_group, self._h5py.Group):
                raise self._fail(f"{name} has no 'obs' group")
            wanted = self.wanted
            obs = {key: self._read(obs_group, key, name) for key in obs_group
                   if wanted is None or key in wanted or key.endswith((DEPTH_SUFFIX, IMAGE_SUFFIX))}  # fmt: skip
            for key in wanted or ():
                if key.endswith(POINTS_SUFFIX) and key not in obs:
                    obs[key] = self._points(group, obs, key, name)
            for key in list(obs):
                if key.endswith(IMAGE_SUFFIX) and self.image_size and obs[key].ndim == 4:
                    obs[key] = resize_frames(obs[key], self.image_size)
            rewards = self._read(group, "rewards", name) if "rewards" in group else None
            per_step = {f"obs/{k}": v for k, v in obs.items()}
            if rewards is not None:
                per_step["rewards"] = rewards
            self._check_lengths(name, len(actions), per_step)
            success = group.attrs.get("success")
            seed = group.attrs.get("seed")
            yield SourceEpisode(
                name=name,
                obs=obs,
                available=tuple(obs_group),
                actions=actions,
                rewards=rewards,
                success=None if success is None else bool(success),
                seed=None if seed is None else int(seed),
            )


def _flatten_obs(obs: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obs, dict):
        out: dict[str, Any] = {}
        for key, value in obs.items():
            out.update(_flatten_obs(value, f"{prefix}{key}/"))
        return out
    return {prefix[:-1] if prefix else "state": obs}


class MinariSource(DemoSource):
    """A dataset saved by the ``minari`` package (its ``data`` directory)."""

    kind = "minari"

    def __init__(self, path: Path, label: str) -> None:
        super().__init__(label)
        minari = require("minari", "data")
        try:
            self._dataset = minari.MinariDataset(str(path))
            n = self._dataset.total_episodes
        except Exception as err:  # minari raises many kinds (ValueError, KeyError, OSError, AssertionError)
            raise self._fail(
                f"not a readable Minari dataset ({type(err).__name__}: {first_line(err)})"
            ) from None
        if n == 0:
            raise self._fail("holds no episodes")

    def __len__(self) -> int:
        return int(self._dataset.total_episodes)

    def episodes(self) -> Iterator[SourceEpisode]:
        for index in range(len(self)):
            try:
                episode = self._dataset[index]
            except Exception as err:
                raise self._fail(f"cannot read episode {index} ({first_line(err)})") from None
            name = f"episode {episode.id}"
            if isinstance(episode.actions, dict | tuple):
                raise self._fail(
                    f"{name} has {type(episode.actions).__name__} actions; only Box actions are read"
                )
            actions = np.asarray(episode.actions)
            length = len(actions)
            observations = _flatten_obs(episode.observations)
            for key, value in observations.items():  # L + 1 observations: the last follows the last action
                if len(value) != length + 1:
                    raise self._fail(
                        f"{name} is truncated: {length} actions but {len(value)} observations of {key} "
                        f"(Minari stores L + 1)"
                    )
            obs = {k: np.asarray(v)[:length] for k, v in observations.items()}
            success = None
            for key in ("success", "is_success"):
                if key in episode.infos and len(episode.infos[key]):
                    success = bool(np.asarray(episode.infos[key])[-1])
            yield SourceEpisode(name, obs, actions, np.asarray(episode.rewards), success, None)


def write_robomimic(
    source: str | os.PathLike, out: str | os.PathLike, env_args: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Write this project's dataset at ``source`` as the robomimic-style HDF5 file ``out`` (atomically: a
    temporary sibling renamed into place, so ``out`` is either complete or absent).

    ``rewards`` are the recorded ones (zeros where the dataset predates recording them: then
    ``data.attrs["rewards_recorded"]`` is false); ``dones`` is 1 at each episode's last step; the
    instruction is ``obs/instruction`` (UTF-8 strings); success and seed become demo attributes.

    Returns:
        ``{"path", "n_episodes", "steps"}``.
    """
    h5py = require("h5py", "data")
    reader = DemoReader(source)
    out = Path(out)
    if out.exists():
        raise ValueError(f"out={out} already exists; give a new file or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.tmp-", dir=out.parent)
    os.close(fd)
    has_rewards = REWARD_KEY in reader.fields
    text = h5py.string_dtype("utf-8")
    try:
        with h5py.File(tmp, "w") as f:
            data = f.create_group("data")
            for i in range(reader.num_episodes):
                episode = reader.episode(i)
                length = len(episode[ACTION_KEY])
                demo = data.create_group(f"demo_{i}")
                demo.attrs["num_samples"] = length
                if reader.meta["success"][i] is not None:
                    demo.attrs["success"] = bool(reader.meta["success"][i])
                if reader.meta["seeds"][i] is not None:
                    demo.attrs["seed"] = int(reader.meta["seeds"][i])
                demo.create_dataset("actions", data=episode[ACTION_KEY])  # (L, Da)
                rewards = episode[REWARD_KEY] if has_rewards else np.zeros(length, np.float32)
                demo.create_dataset("rewards", data=rewards)  # (L,)
                dones = np.zeros(length, np.int64)
                dones[-1] = 1
                demo.create_dataset("dones", data=dones)  # (L,)
                obs, next_obs = demo.create_group("obs"), demo.create_group("next_obs")
                for key, value in episode.items():
                    if key in NON_OBSERVATION_FIELDS:
                        continue
                    value = np.asarray(value, dtype=text if key == INSTRUCTION_KEY else None)  # (L, ...)
                    obs.create_dataset(key, data=value)
                    next_obs.create_dataset(key, data=np.concatenate([value[1:], value[-1:]]))
            data.attrs["total"] = reader.num_steps
            data.attrs["env_args"] = json.dumps(env_args or {"env_name": reader.meta["env_id"]})
            data.attrs["rewards_recorded"] = has_rewards
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"path": str(out), "n_episodes": reader.num_episodes, "steps": reader.num_steps}
