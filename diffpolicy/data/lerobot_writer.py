"""LeRobotDataset v3.0 written with pyarrow and PyAV (:func:`write_lerobot`), in the layout
:mod:`diffpolicy.data.lerobot` describes and reads, such that LeRobot's own loader opens it (checked with
``scripts/lerobot_reference/open_with_lerobot.py``). Imports numpy, and pyarrow and av when called.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from diffpolicy.data.dataset import ACTION_KEY, INSTRUCTION_KEY, REWARD_KEY, TARGET_KEY, DemoReader
from diffpolicy.data.lerobot import (
    BOOKKEEPING,
    CAMERA,
    CODECS,
    DONE_FEATURE,
    INFO_FILE,
    REWARD_FEATURE,
    SUCCESS_FEATURE,
)
from diffpolicy.data.source import require


def _list_column(values: np.ndarray) -> Any:
    """(L, *shape) float values as an arrow column: a fixed-size list for (L, D), nested lists (HF datasets'
    ``Array2D`` storage) for (L, A, B), a plain column for (L,)."""
    pa = require("pyarrow", "lerobot")
    if values.ndim == 1:
        return pa.array(values)
    if values.ndim == 2:
        return pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
    inner = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[-1])
    outer = pa.ListArray.from_arrays(
        pa.array(np.arange(0, len(inner) + 1, values.shape[1], dtype=np.int32)), inner
    )
    return outer.cast(pa.list_(pa.list_(pa.from_numpy_dtype(values.dtype))))


def _stats(values: np.ndarray, image: bool = False) -> dict[str, list[Any]]:
    """LeRobot's per-feature statistics: min, max, mean, std over frames (images: per channel, in [0, 1],
    shaped (3, 1, 1)) and count."""
    if image:
        x = values.reshape(-1, 3).astype(np.float64) / 255.0
        shape = lambda a: a.reshape(3, 1, 1).tolist()
    else:
        x = values.reshape(len(values), -1).astype(np.float64)
        shape = lambda a: a.reshape(values.shape[1:] or (1,)).tolist()
    return {"min": shape(x.min(0)), "max": shape(x.max(0)), "mean": shape(x.mean(0)), "std": shape(x.std(0)),
            "count": [len(values)]}  # fmt: skip


def _encode(path: Path, frames: list[np.ndarray], fps: float, codec: str, crf: int) -> None:
    av = require("av", "lerobot")
    os.environ.setdefault("SVT_LOG", "1")  # SVT-AV1 prints its whole configuration to stderr otherwise
    path.parent.mkdir(parents=True, exist_ok=True)
    height, width = frames[0].shape[:2]
    options = {"g": "2", "crf": str(crf)}
    if codec == "libsvtav1":
        options["preset"] = "12"
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=Fraction(fps).limit_denominator(1001), options=options)
        stream.pix_fmt, stream.width, stream.height = "yuv420p", width, height
        for frame in frames:
            for packet in stream.encode(
                av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")
            ):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def write_lerobot(
    source: str | os.PathLike,
    out: str | os.PathLike,
    fps: float,
    video_codec: str = "av1",
    crf: int = 30,
    robot_type: str = "sim",
) -> dict[str, Any]:
    """Write this project's dataset at ``source`` as a LeRobotDataset v3.0 at ``out`` (atomically: a temporary
    sibling renamed into place).

    Features: ``observation.state`` (Ds,), ``action`` (Da,), ``observation.images.front`` (video, when the
    dataset has ``rgb``), ``observation.points`` (N, 6) (when it has ``points``), ``next.reward``,
    ``next.done`` (true at each episode's last frame), ``next.success`` (true at the last frame of an episode
    recorded as successful), ``target_pos`` (the privileged label, when recorded); the instruction is the task.
    Videos: ``video_codec`` av1 (SVT-AV1, LeRobot's default) or h264, ``crf``, a key frame every 2 frames,
    yuv420p, like LeRobot's writer.

    Returns:
        ``{"path", "n_episodes", "steps", "video_codec"}``.
    """
    pa = require("pyarrow", "lerobot")
    pq = require("pyarrow.parquet", "lerobot")
    if video_codec not in CODECS:
        raise ValueError(f"video_codec={video_codec!r} is not written; choose {' or '.join(CODECS)}")
    reader = DemoReader(source)
    out = Path(out)
    if out.exists():
        raise ValueError(f"out={out} already exists; give a new directory or remove it")
    out.parent.mkdir(parents=True, exist_ok=True)
    fps = int(fps) if float(fps).is_integer() else float(fps)  # LeRobot records an integer rate
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        summary = _write_v30(reader, tmp, fps, CODECS[video_codec], crf, robot_type, pa, pq)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"path": str(out), **summary, "video_codec": video_codec}


def _write_v30(reader: DemoReader, root: Path, fps: float, codec: str, crf: int, robot_type: str, pa: Any,
               pq: Any) -> dict[str, Any]:  # fmt: skip
    fields = reader.fields
    camera = f"observation.images.{CAMERA}"
    columns: dict[str, list[np.ndarray]] = {}
    frames: list[np.ndarray] = []
    tasks: dict[str, int] = {}
    task_index: list[np.ndarray] = []
    lengths = reader.meta["episode_lengths"]
    episode_tasks: list[list[str]] = []
    for i in range(reader.num_episodes):
        episode = reader.episode(i)
        length = len(episode[ACTION_KEY])
        texts = episode.get(INSTRUCTION_KEY) or [""] * length
        for text in texts:
            tasks.setdefault(text, len(tasks))
        task_index.append(np.array([tasks[t] for t in texts], np.int64))
        episode_tasks.append(sorted(set(texts), key=texts.index))
        per_frame = {"observation.state": episode["state"], ACTION_KEY: episode[ACTION_KEY]}
        if "points" in fields:
            per_frame["observation.points"] = episode["points"]
        if TARGET_KEY in fields:
            per_frame[TARGET_KEY] = episode[TARGET_KEY]
        per_frame[REWARD_FEATURE] = (
            episode[REWARD_KEY] if REWARD_KEY in fields else np.zeros(length, np.float32)
        )
        done = np.zeros(length, bool)
        done[-1] = True
        per_frame[DONE_FEATURE] = done
        per_frame[SUCCESS_FEATURE] = done & bool(reader.meta["success"][i])
        for key, value in per_frame.items():
            columns.setdefault(key, []).append(np.asarray(value))
        if "rgb" in fields:
            frames.extend(episode["rgb"])
    n = reader.num_steps
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    frame_index = np.concatenate([np.arange(length) for length in lengths]).astype(np.int64)
    episode_index = np.repeat(np.arange(reader.num_episodes), lengths).astype(np.int64)
    data = {key: np.concatenate(parts) for key, parts in columns.items()}
    data["timestamp"] = (frame_index / fps).astype(np.float32)
    data["frame_index"], data["episode_index"] = frame_index, episode_index
    data["index"], data["task_index"] = np.arange(n, dtype=np.int64), np.concatenate(task_index)
    table = pa.table({key: _list_column(value) for key, value in data.items()})
    (root / "data" / "chunk-000").mkdir(parents=True)
    pq.write_table(table, root / "data" / "chunk-000" / "file-000.parquet")

    features: dict[str, Any] = {}
    for key, value in data.items():
        dtype = {"b": "bool", "i": "int64"}.get(value.dtype.kind, "float32")
        features[key] = {"dtype": dtype, "shape": list(value.shape[1:]) or [1], "names": None}
    episodes: dict[str, Any] = {
        "episode_index": pa.array(np.arange(reader.num_episodes, dtype=np.int64)),
        "tasks": pa.array(episode_tasks, pa.list_(pa.string())),
        "length": pa.array(np.asarray(lengths, np.int64)),
        "data/chunk_index": pa.array(np.zeros(reader.num_episodes, np.int64)),
        "data/file_index": pa.array(np.zeros(reader.num_episodes, np.int64)),
        "dataset_from_index": pa.array(starts[:-1]),
        "dataset_to_index": pa.array(starts[1:]),
    }
    stats = {key: _stats(value) for key, value in data.items()}
    if frames:
        height, width = frames[0].shape[:2]
        _encode(root / "videos" / camera / "chunk-000" / "file-000.mp4", frames, fps, codec, crf)
        features[camera] = {
            "dtype": "video", "shape": [height, width, 3], "names": ["height", "width", "channels"],
            "info": {"video.height": height, "video.width": width, "video.codec": codec.removeprefix("lib").replace(
                "svtav1", "av1").replace("x264", "h264"), "video.pix_fmt": "yuv420p", "video.is_depth_map": False,
                "video.fps": fps, "video.channels": 3, "has_audio": False},
        }  # fmt: skip
        for name, value in (("chunk_index", np.zeros(reader.num_episodes, np.int64)),
                            ("file_index", np.zeros(reader.num_episodes, np.int64)),
                            ("from_timestamp", starts[:-1] / fps), ("to_timestamp", starts[1:] / fps)):  # fmt: skip
            episodes[f"videos/{camera}/{name}"] = pa.array(value)
        stats[camera] = _stats(np.stack(frames), image=True)
    episodes["meta/episodes/chunk_index"] = pa.array(np.zeros(reader.num_episodes, np.int64))
    episodes["meta/episodes/file_index"] = pa.array(np.zeros(reader.num_episodes, np.int64))
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True)
    pq.write_table(pa.table(episodes), root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    _write_tasks(root / "meta" / "tasks.parquet", tasks, pa, pq)
    ordered = {k: features[k] for k in [*data.keys(), camera] if k in features and k not in BOOKKEEPING}
    ordered.update({k: features[k] for k in BOOKKEEPING})
    info = {
        "codebase_version": "v3.0", "robot_type": robot_type, "total_episodes": reader.num_episodes,
        "total_frames": n, "total_tasks": len(tasks), "chunks_size": 1000, "data_files_size_in_mb": 100,
        "video_files_size_in_mb": 200, "fps": fps, "splits": {"train": f"0:{reader.num_episodes}"},
        "data_path": "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet",
        "video_path": "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4" if frames else None,
        "features": ordered,
    }  # fmt: skip
    (root / INFO_FILE).write_text(json.dumps(info, indent=4))
    (root / "meta" / "stats.json").write_text(json.dumps(stats))
    return {"n_episodes": reader.num_episodes, "steps": n}


def _write_tasks(path: Path, tasks: dict[str, int], pa: Any, pq: Any) -> None:
    """``meta/tasks.parquet`` as LeRobot writes it (pandas): the task string is the index, ``task_index`` the
    column."""
    table = pa.table({"task_index": pa.array(list(tasks.values()), pa.int64()),
                      "__index_level_0__": pa.array(list(tasks), pa.string())})  # fmt: skip
    pandas = {
        "index_columns": ["__index_level_0__"], "column_indexes": [],
        "columns": [
            {"name": "task_index", "field_name": "task_index", "pandas_type": "int64", "numpy_type": "int64",
             "metadata": None},
            {"name": None, "field_name": "__index_level_0__", "pandas_type": "unicode", "numpy_type": "object",
             "metadata": None},
        ],
        "creator": {"library": "pyarrow", "version": pa.__version__}, "pandas_version": "2.2.0",
    }  # fmt: skip
    pq.write_table(table.replace_schema_metadata({b"pandas": json.dumps(pandas).encode()}), path)
