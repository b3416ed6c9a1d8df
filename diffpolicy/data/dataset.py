"""Demonstrations on disk: a chunked, memory-mappable format and its writer and reader.

On-disk format (``FORMAT_VERSION`` 1), one directory per dataset::

    <path>/
      meta.json                     description below
      <field>/000000.npy            steps [0, chunk_len) of <field>
      <field>/000001.npy            steps [chunk_len, 2 * chunk_len); the last chunk may be shorter
      ...

All episodes are concatenated along the step axis; every field is split into chunks of ``chunk_len`` steps,
each a plain ``.npy`` file, so a reader memory-maps (``np.load(mmap_mode="r")``) only the chunks it
touches and never loads the whole dataset. Fields (per step):

| field | dtype | shape | content |
|---|---|---|---|
| ``action`` | float32 | (Da,) | the action taken at the step (required) |
| ``reward`` | float32 | () | the reward that action earned (optional; not an observation) |
| ``state`` | float32 | (Ds,) | proprioception / state observation |
| ``rgb`` | uint8 | (H, W, 3) | camera image |
| ``points`` | float32 | (N, 3) | point cloud |
| ``instruction`` | int32 | () | index into ``meta["instructions"]`` |
| ``subtask`` | int32 | () | index into ``meta["instructions"]``: the sub-task the expert works on (a label) |

Any other observation array may be stored too; float64 input is stored as float32. ``meta.json`` holds
``format`` ("diffpolicy-demos"), ``version``, ``env_id``, ``chunk_len``, ``num_steps``, ``num_episodes``,
``fields`` (name -> {"dtype", "shape"} of one step), ``episode_ends`` (exclusive end step of each episode,
cumulative), ``episode_lengths``, ``seeds`` and ``success`` (per episode, null when unknown),
``instructions`` (the distinct instruction strings) and ``attrs`` (free JSON, e.g. env kwargs).

:class:`DemoWriter` writes into a temporary sibling directory and renames it into place on ``close()``, so
``<path>`` either holds a complete dataset or does not exist. :class:`DemoReader` validates ``meta.json``
(one-line :class:`DemoFormatError` when it is missing or corrupt) and reads steps. Training windows are
:class:`diffpolicy.data.windows.DemoWindows`; the policy normalises actions and state itself
(:class:`diffpolicy.normalizer.MinMaxNormalizer`).

This module imports numpy only (no torch, no Hydra, no environments).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "diffpolicy-demos"
FORMAT_VERSION = 1
META_FILE = "meta.json"
ACTION_KEY = "action"
REWARD_KEY = "reward"
INSTRUCTION_KEY = "instruction"
TARGET_KEY = "target_pos"
"""A privileged training label (3 k,) m: k positions, the named object's (MujocoPick's ``info["target_pos"]``),
recorded by the scripted expert's collection and read only by BC's auxiliary loss, never by a policy."""
SUBTASK_KEY = "subtask"
"""A training label of multi-stage tasks: the sub-task of the step as a one-step instruction
(MujocoDialogue's ``info["subtask"]``), what a high-level selector learns to say."""
TEXT_FIELDS = (INSTRUCTION_KEY, SUBTASK_KEY)
"""Fields stored as indices into ``meta["instructions"]``."""
NON_OBSERVATION_FIELDS = (ACTION_KEY, REWARD_KEY, TARGET_KEY, SUBTASK_KEY)
"""Fields of a step that are not observations (every other field is one)."""
DEFAULT_CHUNK_LEN = 1024
"""Steps per chunk file."""
META_KEYS = (
    "format",
    "version",
    "env_id",
    "chunk_len",
    "num_steps",
    "num_episodes",
    "fields",
    "episode_ends",
    "episode_lengths",
    "seeds",
    "success",
    "instructions",
    "attrs",
)


class DemoFormatError(ValueError):
    """A demonstration directory is missing, incomplete or does not follow the format."""


def _chunk_path(root: Path, field: str, index: int) -> Path:
    return root / field / f"{index:06d}.npy"


class DemoWriter:
    """Stream episodes into a new dataset directory; atomic: nothing appears at ``path`` before ``close()``.

    Usage::

        with DemoWriter("data/pick", env_id="MujocoPick-v0") as writer:
            writer.add_episode({"action": actions, "state": states, "instruction": text}, seed=3, success=True)

    Leaving the ``with`` block by an exception discards everything (``abort()``).

    Args:
        path: dataset directory to create; must not exist unless ``overwrite``.
        env_id: id of the environment the demonstrations come from.
        chunk_len: steps per chunk file.
        attrs: JSON-serialisable extra description stored in ``meta["attrs"]``.
        overwrite: replace an existing dataset at ``path`` (only once the new one is complete).
    """

    def __init__(
        self,
        path: str | os.PathLike,
        env_id: str = "",
        chunk_len: int = DEFAULT_CHUNK_LEN,
        attrs: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        if chunk_len < 1:
            raise ValueError(f"chunk_len must be >= 1, got {chunk_len}")
        self.path = Path(path)
        if self.path.exists() and not overwrite:
            raise FileExistsError(f"{self.path} already exists (pass overwrite=True to replace it)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.tmp-", dir=self.path.parent))
        self.overwrite = overwrite
        self.env_id = env_id
        self.chunk_len = int(chunk_len)
        self.attrs = dict(attrs or {})
        json.dumps(self.attrs)  # fail now, not at close(), if attrs are not JSON
        self._fields: dict[str, dict[str, Any]] = {}
        self._buffers: dict[str, list[np.ndarray]] = {}
        self._buffered = 0  # steps waiting in the buffers
        self._chunks_written = 0
        self._episode_lengths: list[int] = []
        self._seeds: list[int | None] = []
        self._success: list[bool | None] = []
        self._instructions: dict[str, int] = {}
        self._closed = False

    def __enter__(self) -> DemoWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    @property
    def num_episodes(self) -> int:
        return len(self._episode_lengths)

    def add_episode(
        self, episode: Mapping[str, Any], seed: int | None = None, success: bool | None = None
    ) -> None:
        """Append one episode of L steps.

        Args:
            episode: ``"action"`` (L, Da) and observation arrays (L, ...), all with the same L >= 1;
                ``"instruction"`` (and ``"subtask"``) may be one string for the whole episode or a sequence
                of L strings.
            seed: the reset seed of the episode, if known.
            success: whether the episode succeeded, if known.
        """
        if self._closed:
            raise RuntimeError("DemoWriter is closed")
        if ACTION_KEY not in episode:
            raise ValueError(f"an episode needs an {ACTION_KEY!r} array, got keys {sorted(episode)}")
        length = len(episode[ACTION_KEY])
        if length < 1:
            raise ValueError("an episode needs at least one step")
        arrays = {}
        for name, value in episode.items():
            if name in TEXT_FIELDS:
                texts = [value] * length if isinstance(value, str) else list(value)
                ids = [self._instructions.setdefault(str(t), len(self._instructions)) for t in texts]
                value = np.asarray(ids, dtype=np.int32)
            value = np.asarray(value)
            if value.dtype == np.float64:
                value = value.astype(np.float32)
            if len(value) != length:
                raise ValueError(f"field {name!r} has {len(value)} steps, {ACTION_KEY!r} has {length}")
            arrays[name] = value
        self._check_fields(arrays)
        for name, value in arrays.items():
            self._buffers[name].append(value)
        self._buffered += length
        self._episode_lengths.append(length)
        self._seeds.append(None if seed is None else int(seed))
        self._success.append(None if success is None else bool(success))
        while self._buffered >= self.chunk_len:
            self._flush(self.chunk_len)

    def close(self) -> Path:
        """Write the last chunk and ``meta.json``, then move the dataset into place; returns ``path``."""
        if self._closed:
            return self.path
        if not self._episode_lengths:
            self.abort()
            raise ValueError("DemoWriter.close() with no episode: nothing to write")
        if self._buffered:
            self._flush(self._buffered)
        ends = np.cumsum(self._episode_lengths)
        meta = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "env_id": self.env_id,
            "chunk_len": self.chunk_len,
            "num_steps": int(ends[-1]),
            "num_episodes": len(self._episode_lengths),
            "fields": self._fields,
            "episode_ends": ends.tolist(),
            "episode_lengths": self._episode_lengths,
            "seeds": self._seeds,
            "success": self._success,
            "instructions": list(self._instructions),
            "attrs": self.attrs,
        }
        (self._tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        if self.path.exists() and self.overwrite:
            old = self.path.with_name(f".{self.path.name}.old-{os.getpid()}")
            os.rename(self.path, old)
            os.rename(self._tmp, self.path)
            shutil.rmtree(old)
        else:
            os.rename(self._tmp, self.path)
        self._closed = True
        return self.path

    def abort(self) -> None:
        """Discard everything written so far; ``path`` is left untouched."""
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._closed = True

    def _check_fields(self, arrays: dict[str, np.ndarray]) -> None:
        spec = {
            n: {"dtype": v.dtype.str.lstrip("<>|="), "shape": list(v.shape[1:])} for n, v in arrays.items()
        }
        if not self._fields:
            for name, s in spec.items():
                if not name or "/" in name or name.startswith("."):
                    raise ValueError(f"invalid field name {name!r}")
                if np.dtype(s["dtype"]).kind not in "biuf":
                    raise ValueError(f"field {name!r} has unsupported dtype {s['dtype']}")
            self._fields = spec
            self._buffers = {n: [] for n in spec}
            for name in spec:
                (self._tmp / name).mkdir()
            return
        if set(spec) != set(self._fields):
            raise ValueError(
                f"episode fields {sorted(spec)} differ from the first episode's {sorted(self._fields)}"
            )
        for name, s in spec.items():
            if s != self._fields[name]:
                raise ValueError(f"field {name!r} is {s}, the first episode had {self._fields[name]}")

    def _flush(self, n: int) -> None:
        """Write the first ``n`` buffered steps of every field as the next chunk."""
        for name, parts in self._buffers.items():
            data = np.concatenate(parts)
            np.save(_chunk_path(self._tmp, name, self._chunks_written), data[:n])
            self._buffers[name] = [data[n:]] if len(data) > n else []
        self._buffered -= n
        self._chunks_written += 1


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Parse and validate ``<path>/meta.json``; raises a one-line :class:`DemoFormatError`."""
    path = Path(path)
    meta_path = path / META_FILE
    if not meta_path.is_file():
        raise DemoFormatError(f"{meta_path} not found: {path} is not a demonstration dataset")
    try:
        meta = json.loads(meta_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DemoFormatError(f"{meta_path} is corrupt: {str(err).splitlines()[0]}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_NAME:
        raise DemoFormatError(f"{meta_path} is not a {FORMAT_NAME} description")
    if meta.get("version") != FORMAT_VERSION:
        raise DemoFormatError(
            f"{meta_path} has format version {meta.get('version')}, expected {FORMAT_VERSION}"
        )
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise DemoFormatError(f"{meta_path} lacks {missing}")
    ends = meta["episode_ends"]
    if (
        len(ends) != meta["num_episodes"]
        or (ends and ends[-1] != meta["num_steps"])
        or np.any(np.diff([0, *ends]) != np.asarray(meta["episode_lengths"]))
        or ACTION_KEY not in meta["fields"]
    ):
        raise DemoFormatError(f"{meta_path} is inconsistent (episode_ends, lengths, num_steps or fields)")
    return meta


class DemoReader:
    """Random access to a dataset written by :class:`DemoWriter`, through memory-mapped chunks.

    Chunks are opened lazily (each process that reads opens its own maps, so a reader can be shared with
    DataLoader workers).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.meta = read_meta(self.path)
        self.chunk_len: int = self.meta["chunk_len"]
        self.num_steps: int = self.meta["num_steps"]
        self.num_chunks = math.ceil(self.num_steps / self.chunk_len)
        self.fields: dict[str, dict[str, Any]] = self.meta["fields"]
        self.episode_ends = np.asarray(self.meta["episode_ends"], dtype=np.int64)
        self.episode_starts = np.concatenate([[0], self.episode_ends[:-1]])
        self.instructions: list[str] = self.meta["instructions"]
        for name in self.fields:
            for i in range(self.num_chunks):
                if not _chunk_path(self.path, name, i).is_file():
                    raise DemoFormatError(
                        f"{self.path} is incomplete: {_chunk_path(self.path, name, i)} missing"
                    )
        self._maps: dict[tuple[str, int], np.ndarray] = {}

    @property
    def num_episodes(self) -> int:
        return len(self.episode_ends)

    def _chunk(self, name: str, index: int) -> np.ndarray:
        key = (name, index)
        if key not in self._maps:
            arr = np.load(_chunk_path(self.path, name, index), mmap_mode="r")
            expect = tuple(self.fields[name]["shape"])
            if arr.shape[1:] != expect or arr.dtype != np.dtype(self.fields[name]["dtype"]):
                raise DemoFormatError(f"chunk {name}/{index} is {arr.dtype}{arr.shape}, meta says {expect}")
            self._maps[key] = arr
        return self._maps[key]

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """Steps [start, stop) of field ``name`` as one array (stop - start, ...), copied out of the maps."""
        if name not in self.fields:
            raise KeyError(f"no field {name!r}; fields: {sorted(self.fields)}")
        if not 0 <= start <= stop <= self.num_steps:
            raise IndexError(f"steps [{start}, {stop}) outside [0, {self.num_steps})")
        parts = []
        pos = start
        while pos < stop:
            index, offset = divmod(pos, self.chunk_len)
            take = min(stop - pos, self.chunk_len - offset)
            parts.append(self._chunk(name, index)[offset : offset + take])
            pos += take
        if not parts:
            shape = tuple(self.fields[name]["shape"])
            return np.empty((0, *shape), dtype=self.fields[name]["dtype"])
        return np.concatenate(parts)  # copies: the result no longer refers to the maps

    def take(self, name: str, steps: np.ndarray) -> np.ndarray:
        """Field ``name`` at the given global steps (any order, repeats allowed): (len(steps), ...)."""
        steps = np.asarray(steps, dtype=np.int64)
        lo, hi = int(steps.min()), int(steps.max()) + 1
        return self.read(name, lo, hi)[steps - lo]

    def episode(self, index: int) -> dict[str, Any]:
        """All fields of one episode; ``instruction`` and ``subtask`` decoded to lists of strings."""
        start, stop = int(self.episode_starts[index]), int(self.episode_ends[index])
        out: dict[str, Any] = {name: self.read(name, start, stop) for name in self.fields}
        for key in TEXT_FIELDS:
            if key in out:
                out[key] = [self.instructions[i] for i in out[key]]
        return out

    def iter_chunks(self, name: str) -> Iterable[np.ndarray]:
        """Field ``name`` chunk by chunk (memory-mapped, read-only), for streaming statistics."""
        for i in range(self.num_chunks):
            yield self._chunk(name, i)
