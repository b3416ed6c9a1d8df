"""LeRobotDataset on disk: read (codebase v2.0, v2.1 and v3.0) and write (v3.0), with pyarrow and PyAV only.

Nothing is fetched from a hub: ``bc.demos=lerobot:DIR`` (or a directory holding ``meta/info.json``) names a
dataset already on disk. The layouts, as LeRobot writes them::

    v3.0                                                 v2.0 / v2.1
    meta/info.json          codebase_version, fps,        meta/info.json       (same keys; chunks_size
                            features, data_path,                               counts episodes per chunk)
                            video_path, chunks_size       meta/episodes.jsonl  episode_index, tasks, length
    meta/episodes/chunk-CCC/file-FFF.parquet              meta/tasks.jsonl     task_index, task
        episode_index, tasks, length,                     data/chunk-CCC/episode_EEEEEE.parquet
        data/{chunk,file}_index,                          videos/chunk-CCC/<key>/episode_EEEEEE.mp4
        dataset_{from,to}_index,
        videos/<key>/{chunk_index,file_index,
                      from_timestamp,to_timestamp}
    meta/tasks.parquet      the task string as the pandas index, task_index
    data/chunk-CCC/file-FFF.parquet                       many episodes per file
    videos/<key>/chunk-CCC/file-FFF.mp4                   many episodes per file, one after another

Each data row is one frame: the feature columns (``observation.state``, ``action``, ``next.reward``, ...) and
the bookkeeping ones (``timestamp``, ``frame_index``, ``episode_index``, ``index``, ``task_index``). A
``video`` feature's frames live in the mp4 at ``from_timestamp + timestamp``; an ``image`` feature's are
encoded images in the parquet itself.

:class:`LeRobotSource` yields one :class:`~diffpolicy.data.external.SourceEpisode` per episode: every numeric
feature as (L, *shape), the camera the import wants decoded to (L, H, W, 3) uint8 at the policy's size, and
``task`` as the L instructions. Frames are checked against the data: a video that holds fewer or more frames
than the episode, or whose timestamps drift from the data's by more than half a frame, stops the import.
:func:`diffpolicy.data.lerobot_writer.write_lerobot` writes a v3.0 dataset that LeRobot's own loader opens
(videos in AV1 like LeRobot's writer, or H.264).

pyarrow and av (PyAV, which bundles FFmpeg with AV1 and H.264) are the optional ``lerobot`` extra, imported
only when a LeRobot dataset is read or written. No torch, no environments.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from diffpolicy.data.dataset import (
    ACTION_KEY,
    INSTRUCTION_KEY,
    TARGET_KEY,
    DemoFormatError,
)
from diffpolicy.data.source import DemoSource, SourceEpisode, first_line, require

LEROBOT_PREFIX = "lerobot:"
"""``bc.demos=lerobot:DIR`` names a LeRobotDataset directory."""
INFO_FILE = Path("meta") / "info.json"
VERSIONS = ("v2.0", "v2.1", "v3.0")
"""The codebase versions read."""
BOOKKEEPING = ("timestamp", "frame_index", "episode_index", "index", "task_index")
"""Columns every LeRobot frame carries that are not features of the robot."""
TASK_KEY = "task"
"""The per-frame instruction, as :class:`LeRobotSource` names it among an episode's observations."""
STATE_FEATURE = "observation.state"
REWARD_FEATURE = "next.reward"
SUCCESS_FEATURE = "next.success"
DONE_FEATURE = "next.done"
POINT_FEATURES = ("observation.points", "observation.point_cloud", "observation.pointcloud")
"""Feature names read as the point cloud (LeRobot has no convention of its own for points)."""
CAMERA = "front"
"""The camera name :func:`write_lerobot` gives the RGB stream: ``observation.images.front``."""
CODECS = {"av1": "libsvtav1", "h264": "libx264"}
"""``video_codec`` -> the PyAV encoder (LeRobot's writer defaults to AV1 through SVT-AV1)."""


def is_lerobot(path: Path) -> bool:
    """Whether the directory ``path`` looks like a LeRobotDataset (it holds ``meta/info.json``)."""
    return (path / INFO_FILE).is_file()


def camera_features(features: dict[str, Any]) -> list[str]:
    """The RGB camera features (``video`` or ``image``, not depth maps), in the order ``info.json`` lists them."""
    return [
        key
        for key, ft in features.items()
        if ft.get("dtype") in ("video", "image") and not (ft.get("info") or {}).get("video.is_depth_map")
    ]


def _column_values(column: Any, length: int, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """An arrow column of ``length`` rows (scalars, or lists nested to any depth) as (length, *shape)."""
    pa = require("pyarrow", "lerobot")
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    while (
        pa.types.is_list(array.type)
        or pa.types.is_large_list(array.type)
        or pa.types.is_fixed_size_list(array.type)
    ):
        array = array.flatten()
    values = array.to_numpy(zero_copy_only=False)
    size = int(np.prod(shape)) if shape else 1
    if values.size != length * size:
        raise ValueError(f"{values.size} values for {length} frames of shape {list(shape)}")
    return values.reshape(length, *shape).astype(dtype, copy=False)


class _VideoCursor:
    """One open mp4 file, decoded forward; a later read that starts where the last one stopped continues
    without seeking (v3.0 files hold episodes one after another)."""

    def __init__(self, path: Path, label: str, declared: str = "") -> None:
        av = require("av", "lerobot")
        self.path, self.label = path, label
        try:
            self.container = av.open(str(path))
            self.stream = self.container.streams.video[0]
        except (av.error.FFmpegError, IndexError, ValueError) as err:
            raise DemoFormatError(f"{label}: video {path.name} will not open ({first_line(err)})") from None
        if self.stream.codec_context is None:  # FFmpeg knows no decoder for the stream's codec
            self.container.close()
            raise DemoFormatError(
                f"{label}: video {path.name} uses a codec this FFmpeg build cannot decode (meta/info.json says "
                f"{declared or 'nothing'}); re-encode it in AV1 or H.264"
            )
        self.codec = self.stream.codec_context.name
        from av.video.reformatter import VideoReformatter

        # one converter for every frame of the file: ~15x faster than to_ndarray's one per frame
        self._reformatter = VideoReformatter()
        self._frames: Iterator[Any] | None = None
        self.position = -1.0  # time (s) of the next frame the iterator gives; -1: not started

    def close(self) -> None:
        self.container.close()

    def read(self, start: float, timestamps: np.ndarray, fps: float, size: int | None) -> np.ndarray:
        """The frames at ``start + timestamps`` (L,) s, as (L, H, W, 3) uint8 (H = W = ``size`` when given)."""
        av = require("av", "lerobot")
        tolerance = 0.5 / fps
        if self._frames is None or abs(start - self.position) > tolerance:  # not where the last read stopped
            if self._frames is not None or start > tolerance:
                self.container.seek(int(start / self.stream.time_base), stream=self.stream, backward=True)
            self._frames = self.container.decode(self.stream)
        out = np.empty((len(timestamps), size or self.stream.height, size or self.stream.width, 3), np.uint8)
        want = start + np.asarray(timestamps, np.float64)
        i = 0
        try:
            while i < len(want):
                frame = next(self._frames, None)
                if frame is None:
                    raise DemoFormatError(
                        f"{self.label}: video {self.path.name} ends after {i} of the {len(want)} frames the data "
                        f"holds from t={start:.3f} s (frame-count mismatch)"
                    )
                if frame.time is None:
                    raise DemoFormatError(
                        f"{self.label}: video {self.path.name} has frames without timestamps"
                    )
                t = float(frame.time)
                if t < want[i] - tolerance:  # before this episode: decoded on the way from a key frame
                    continue
                if t > want[i] + tolerance:
                    raise DemoFormatError(
                        f"{self.label}: video {self.path.name} has no frame at t={want[i]:.3f} s (the next is at "
                        f"{t:.3f} s): its frames do not match the data's timestamps"
                    )
                rgb = self._reformatter.reformat(
                    frame, width=out.shape[2], height=out.shape[1], format="rgb24"
                )
                out[i] = rgb.to_ndarray()
                i += 1
        except av.error.FFmpegError as err:
            raise DemoFormatError(
                f"{self.label}: video {self.path.name} ({self.codec}) will not decode ({first_line(err)})"
            ) from None
        self.position = float(want[-1] + 1.0 / fps) if len(want) else start
        return out


class LeRobotSource(DemoSource):
    """Episodes of a LeRobotDataset directory (layouts in the module docstring); a context manager.

    ``wanted`` (set before :meth:`episodes`) names the features to read: cameras not in it are never
    decoded. ``image_size`` resizes every decoded frame to a square of that side (None keeps the video's)."""

    kind = "lerobot"

    def __init__(self, path: Path, label: str, image_size: int | None = None) -> None:
        super().__init__(label)
        self.root, self.image_size = path, image_size
        self._pq = require("pyarrow.parquet", "lerobot")
        require("av", "lerobot")
        try:
            self.info = json.loads((path / INFO_FILE).read_text())
        except (OSError, ValueError) as err:
            raise self._fail(f"{INFO_FILE} is not readable JSON ({first_line(err)})") from None
        self.version = str(self.info.get("codebase_version", ""))
        if self.version not in VERSIONS:
            raise self._fail(
                f"codebase_version {self.version or 'missing'!s} is not read (only {', '.join(VERSIONS)}); "
                "LeRobot's converters bring older datasets to v3.0"
            )
        try:
            self.fps = float(self.info["fps"])
            self.features: dict[str, Any] = dict(self.info["features"])
            self.data_path: str = self.info["data_path"]
            self.video_path: str | None = self.info.get("video_path")
        except (KeyError, TypeError, ValueError) as err:
            raise self._fail(f"{INFO_FILE} lacks {first_line(err)}") from None
        if ACTION_KEY not in self.features:
            raise self._fail(f"has no 'action' feature (features: {', '.join(self.features)})")
        self.cameras = camera_features(self.features)
        self.episodes_meta = self._read_episodes()
        self.tasks = self._read_tasks()
        self._table: tuple[Path, Any] | None = None
        self._videos: dict[Path, _VideoCursor] = {}
        if not self.episodes_meta:
            raise self._fail("holds no episodes")

    # ------------------------------------------------------------------------------------------ meta
    def _parquet(self, path: Path, columns: list[str] | None = None) -> Any:
        try:
            return self._pq.read_table(path, columns=columns)
        except FileNotFoundError:
            raise self._fail(f"{path.relative_to(self.root)} is missing") from None
        except (OSError, ValueError, KeyError) as err:  # truncated, corrupt, or a column it lacks
            raise self._fail(
                f"{path.relative_to(self.root)} is not a readable parquet file: truncated or corrupt "
                f"({first_line(err)})"
            ) from None

    def _jsonl(self, name: str) -> list[dict[str, Any]]:
        path = self.root / "meta" / name
        try:
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            raise self._fail(f"meta/{name} is missing") from None
        except ValueError as err:
            raise self._fail(f"meta/{name} is not JSON lines ({first_line(err)})") from None

    def _read_episodes(self) -> list[dict[str, Any]]:
        """Per episode, in index order: ``episode_index``, ``length`` and, in v3.0, where its rows and frames lie."""
        if self.version != "v3.0":
            rows = self._jsonl("episodes.jsonl")
        else:
            files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
            if not files:
                raise self._fail("meta/episodes/ holds no parquet files")
            rows = []
            for file in files:
                table = self._parquet(file)
                keep = [c for c in table.column_names if not c.startswith("stats/")]
                rows.extend(table.select(keep).to_pylist())
        try:
            rows.sort(key=lambda r: int(r["episode_index"]))
            for row in rows:
                int(row["length"])
        except (KeyError, TypeError, ValueError) as err:
            raise self._fail(f"an episode's metadata lacks {first_line(err)}") from None
        return rows

    def _read_tasks(self) -> dict[int, str]:
        if self.version != "v3.0":
            return {int(r["task_index"]): str(r["task"]) for r in self._jsonl("tasks.jsonl")}
        table = self._parquet(self.root / "meta" / "tasks.parquet")
        names = [c for c in table.column_names if c != "task_index"]
        if "task_index" not in table.column_names or len(names) != 1:
            raise self._fail(
                f"meta/tasks.parquet has columns {table.column_names}, not task_index and the task"
            )
        return dict(zip(table.column("task_index").to_pylist(), map(str, table.column(names[0]).to_pylist())))

    # --------------------------------------------------------------------------------------- reading
    def __len__(self) -> int:
        return len(self.episodes_meta)

    def keys(self) -> list[str]:
        """What an episode's observations can hold: the features other than the bookkeeping, the action,
        reward, done and success flags and the privileged ``target_pos`` label, and ``task``."""
        skip = {*BOOKKEEPING, ACTION_KEY, REWARD_FEATURE, SUCCESS_FEATURE, DONE_FEATURE, TARGET_KEY}
        return [k for k in self.features if k not in skip] + [TASK_KEY]

    def default_keys(self, key: str, available: set[str]) -> list[str] | None:
        """The dataset features an environment observation ``key`` is read from when ``bc.obs_keys`` does not
        name them (None: the dataset has none)."""
        if key == "state":
            candidates = [STATE_FEATURE, "state"]
        elif key == INSTRUCTION_KEY:
            candidates = [TASK_KEY]
        elif key == "points":
            candidates = list(POINT_FEATURES)
        elif key == "rgb":
            return self.only_one([c for c in self.cameras if c in available], key, "cameras")
        else:
            candidates = [f"observation.{key}", key]
        found = [c for c in candidates if c in available]
        return found[:1] or None

    def _data_file(self, meta: dict[str, Any]) -> Path:
        index = int(meta["episode_index"])
        if self.version == "v3.0":
            chunk, file = int(meta["data/chunk_index"]), int(meta["data/file_index"])
            return self.root / self.data_path.format(chunk_index=chunk, file_index=file)
        chunk = index // int(self.info.get("chunks_size", 1000))
        return self.root / self.data_path.format(episode_chunk=chunk, episode_index=index)

    def _video_file(self, key: str, meta: dict[str, Any]) -> tuple[Path, float]:
        if not self.video_path:
            raise self._fail(f"{INFO_FILE} has no video_path for the video feature {key!r}")
        index = int(meta["episode_index"])
        if self.version == "v3.0":
            try:
                chunk, file = int(meta[f"videos/{key}/chunk_index"]), int(meta[f"videos/{key}/file_index"])
                start = float(meta[f"videos/{key}/from_timestamp"])
            except (KeyError, TypeError) as err:
                raise self._fail(f"episode {index}'s metadata lacks {first_line(err)}") from None
            return self.root / self.video_path.format(
                video_key=key, chunk_index=chunk, file_index=file
            ), start
        chunk = index // int(self.info.get("chunks_size", 1000))
        path = self.video_path.format(episode_chunk=chunk, video_key=key, episode_index=index)
        return self.root / path, 0.0

    def _rows(self, meta: dict[str, Any]) -> Any:
        """The episode's data rows, in frame order."""
        path = self._data_file(meta)
        if self._table is None or self._table[0] != path:
            self._table = (path, self._parquet(path))
        table = self._table[1]
        index = int(meta["episode_index"])
        if self.version == "v3.0" and "episode_index" in table.column_names:
            pc = require("pyarrow.compute", "lerobot")
            table = table.filter(pc.equal(table.column("episode_index"), index))
            if "frame_index" in table.column_names:
                table = table.sort_by("frame_index")
        return table

    def _frames(self, key: str, meta: dict[str, Any], timestamps: np.ndarray) -> np.ndarray:
        name = f"episode {int(meta['episode_index'])}"
        if self.features[key]["dtype"] == "image":
            return self._images(key, name)
        path, start = self._video_file(key, meta)
        if not path.is_file():
            raise self._fail(f"{name}: video {path.relative_to(self.root)} is missing")
        cursor = self._videos.get(path)
        if cursor is None:
            self.close()  # one file open at a time: episodes go file after file
            declared = str((self.features[key].get("info") or {}).get("video.codec", ""))
            cursor = self._videos[path] = _VideoCursor(path, f"{self.label}: {name}", declared)
        cursor.label = f"{self.label}: {name}"
        return cursor.read(start, timestamps, self.fps, self.image_size)

    def _images(self, key: str, name: str) -> np.ndarray:
        """An ``image`` feature (encoded images in the parquet rows) as (L, H, W, 3) uint8."""
        import io

        from PIL import Image

        rows = self._current.column(key).to_pylist()
        out = []
        for t, cell in enumerate(rows):
            try:
                image = Image.open(io.BytesIO(cell["bytes"])).convert("RGB")
            except Exception as err:  # PIL raises many kinds for a bad image
                raise self._fail(
                    f"{name} step {t}: image {key!r} will not decode ({first_line(err)})"
                ) from None
            if self.image_size and image.size != (self.image_size, self.image_size):
                image = image.resize((self.image_size, self.image_size), Image.BILINEAR)
            out.append(np.asarray(image, np.uint8))
        return np.stack(out)

    def episodes(self) -> Iterator[Any]:
        wanted = set(self.keys()) if self.wanted is None else set(self.wanted)
        for meta in self.episodes_meta:
            index, length = int(meta["episode_index"]), int(meta["length"])
            name = f"episode {index}"
            table = self._rows(meta)
            self._current = table
            if table.num_rows != length:
                raise self._fail(
                    f"{name} is truncated: its metadata says {length} frames, the data holds {table.num_rows}"
                )
            if "timestamp" in table.column_names:
                timestamps = table.column("timestamp").to_numpy().astype(np.float64)  # (L,) s
            else:
                timestamps = np.arange(length) / self.fps
            obs: dict[str, Any] = {}
            for key in self.keys():
                if key not in wanted:
                    continue
                if key == TASK_KEY:
                    obs[key] = self._task_strings(table, meta, name)
                elif key in self.cameras:
                    obs[key] = self._frames(key, meta, timestamps)
                elif self.features[key].get("dtype") in ("video", "image"):
                    continue  # depth maps: not read
                else:
                    obs[key] = self._numeric(table, key, length, name)
            actions = self._numeric(table, ACTION_KEY, length, name)
            rewards = self._numeric(table, REWARD_FEATURE, length, name).reshape(length) if (
                REWARD_FEATURE in table.column_names) else None  # fmt: skip
            success = None
            if SUCCESS_FEATURE in table.column_names:
                success = bool(self._numeric(table, SUCCESS_FEATURE, length, name).any())
            target = (
                self._numeric(table, TARGET_KEY, length, name) if TARGET_KEY in table.column_names else None
            )
            yield SourceEpisode(name=name, obs=obs, actions=actions, rewards=rewards, success=success,
                                target=target)  # fmt: skip

    def _numeric(self, table: Any, key: str, length: int, name: str) -> np.ndarray:
        if key not in table.column_names:
            raise self._fail(f"{name} has no column {key!r}, which {INFO_FILE} lists")
        feature = self.features.get(key, {})
        shape = tuple(int(s) for s in feature.get("shape", ()))
        if shape == (1,) and key in (REWARD_FEATURE, SUCCESS_FEATURE, DONE_FEATURE):
            shape = ()
        dtype = {"bool": "bool", "int64": "int64", "int32": "int32"}.get(feature.get("dtype"), "float32")
        try:
            return _column_values(table.column(key), length, shape, dtype)
        except (ValueError, TypeError) as err:
            raise self._fail(
                f"{name}: column {key!r} does not hold {list(shape)} per frame ({first_line(err)})"
            ) from None

    def _task_strings(self, table: Any, meta: dict[str, Any], name: str) -> list[str]:
        if "task_index" in table.column_names:
            indices = table.column("task_index").to_pylist()
            missing = sorted({i for i in indices if i not in self.tasks})
            if missing:
                raise self._fail(f"{name} names task {missing[0]}, which the tasks file does not hold")
            return [self.tasks[i] for i in indices]
        tasks = meta.get("tasks") or [""]
        return [str(tasks[0])] * table.num_rows

    def close(self) -> None:
        for cursor in self._videos.values():
            cursor.close()
        self._videos = {}
