"""bc.demos=lerobot:DIR and collect format=lerobot: LeRobotDataset v2.1 / v3.0 read from disk (a dataset written
by LeRobot's own writer among them), the policy's modalities following what the dataset holds, the cache keyed
on the content, export -> import round trips, and bad data stopped in one line with the cache untouched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from diffpolicy.config import EnvConfig
from diffpolicy.data.dataset import DemoReader
from diffpolicy.data.windows import DemoWindows
from diffpolicy.demos import collect_demos, export_lerobot, import_demos, import_key

pytest.importorskip(
    "pyarrow", reason='LeRobot datasets need the `lerobot` extra: pip install -e ".[lerobot]"'
)
av = pytest.importorskip(
    "av", reason='LeRobot datasets need the `lerobot` extra: pip install -e ".[lerobot]"'
)
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "lerobot_pick"
"""Three MujocoPick expert episodes (rgb video, state, action, reward, target_pos, task; no points) written by
LeRobot's own writer (``scripts/lerobot_reference/write_with_lerobot.py``, lerobot-dataset 0.4.4, AV1)."""
PICK = EnvConfig(obs_mode="multimodal", image_size=32, n_points=64, num_envs=2)
RGB_TOLERANCE = 8.0
"""Mean |difference| (of 255) a decoded frame may show against the one encoded: video compression."""


def _tree(root: Path) -> dict[str, tuple[int, int] | None]:
    return {
        str(p.relative_to(root)): None if p.is_dir() else (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
    }


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> Path:
    """Two MujocoPick expert episodes of every modality, at 32 x 32 pixels and 64 points."""
    out = tmp_path_factory.mktemp("native") / "demos"
    collect_demos(PICK, 2, 0, out)
    return out


@pytest.fixture(scope="module")
def exported(native, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("lerobot") / "pick"
    export_lerobot(native, out, PICK, video_codec="h264")
    return out


def _same_up_to_video(imported: Path, native: Path) -> None:
    a, b = DemoReader(imported), DemoReader(native)
    assert a.num_episodes == b.num_episodes and a.meta["episode_lengths"] == b.meta["episode_lengths"]
    assert a.meta["success"] == b.meta["success"]
    for i in range(a.num_episodes):
        x, y = a.episode(i), b.episode(i)
        for key in ("state", "action", "points", "reward", "target_pos"):
            np.testing.assert_array_equal(x[key], y[key], err_msg=key)
        assert x["instruction"] == y["instruction"]
        assert np.abs(x["rgb"].astype(np.float64) - y["rgb"]).mean() < RGB_TOLERANCE
    wa, wb = DemoWindows(imported, 2, 16), DemoWindows(native, 2, 16)  # the training windows the policy sees
    idx = torch.arange(len(wa))
    for key, value in wa.batch(idx)[0].items():
        if key == "rgb":
            assert (value.float() - wb.batch(idx)[0][key].float()).abs().mean() < RGB_TOLERANCE
        elif key != "instruction":
            assert bool((value == wb.batch(idx)[0][key]).all()), key
    assert bool((wa.batch(idx)[1] == wb.batch(idx)[1]).all())


@pytest.mark.parametrize("codec", ["h264", "av1"])
def test_export_then_import_gives_the_same_windows_up_to_video(native, tmp_path, codec):
    out = tmp_path / "pick"
    written = export_lerobot(native, out, PICK, video_codec=codec)
    assert written["fps"] == 10.0 and written["n_episodes"] == 2
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["codebase_version"] == "v3.0" and info["features"]["observation.images.front"]["info"][
        "video.codec"] == codec  # fmt: skip
    path, made = import_demos(f"lerobot:{out}", PICK, tmp_path / "cache")
    assert made and DemoReader(path).meta["attrs"]["format"] == "lerobot"
    assert DemoReader(path).meta["attrs"]["fps"] == 10.0
    _same_up_to_video(path, native)
    assert import_demos(str(out), PICK, tmp_path / "cache") == (path, False)  # a plain directory too; cached


def test_a_dataset_written_by_lerobots_own_writer_is_read(tmp_path):
    path, _ = import_demos(f"lerobot:{FIXTURE}", PICK, tmp_path / "cache")
    reader = DemoReader(path)
    assert reader.meta["attrs"]["modalities"] == ["instruction", "rgb", "state"]  # it holds no points
    assert reader.fields["rgb"]["shape"] == [32, 32, 3]  # decoded at the policy's size (stored at 84)
    assert reader.num_episodes == 3 and reader.meta["episode_lengths"] == [75, 54, 81]
    episode = reader.episode(1)
    assert episode["instruction"][0] == "pick up the green cube and drop it in the tray"
    assert episode["target_pos"].shape == (54, 3) and episode["action"].shape == (54, 7)
    assert 20 < episode["rgb"].mean() < 235  # a picture, not a blank frame


def _v21(v30: Path, out: Path) -> Path:
    """The v3.0 dataset ``v30`` rewritten in v2.1's layout: one parquet and one mp4 per episode, meta/*.jsonl."""
    info = json.loads((v30 / "meta" / "info.json").read_text())
    data = pq.read_table(v30 / "data" / "chunk-000" / "file-000.parquet")
    episodes = pq.read_table(next((v30 / "meta" / "episodes").rglob("*.parquet"))).to_pylist()
    tasks = pq.read_table(v30 / "meta" / "tasks.parquet").to_pydict()
    camera = "observation.images.front"
    source = av.open(str(v30 / "videos" / camera / "chunk-000" / "file-000.mp4"))
    frames = [f.to_ndarray(format="rgb24") for f in source.decode(video=0)]
    source.close()
    (out / "meta").mkdir(parents=True)
    for ep in episodes:
        e, start, stop = ep["episode_index"], ep["dataset_from_index"], ep["dataset_to_index"]
        (out / "data" / "chunk-000").mkdir(parents=True, exist_ok=True)
        pq.write_table(
            data.slice(start, stop - start), out / "data" / "chunk-000" / f"episode_{e:06d}.parquet"
        )
        video = out / "videos" / "chunk-000" / camera / f"episode_{e:06d}.mp4"
        video.parent.mkdir(parents=True, exist_ok=True)
        with av.open(str(video), "w") as container:
            stream = container.add_stream("libx264", rate=info["fps"], options={"crf": "18", "g": "2"})
            stream.pix_fmt, stream.width, stream.height = "yuv420p", frames[0].shape[1], frames[0].shape[0]
            for frame in frames[start:stop]:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
            container.mux(stream.encode())
    lines = [
        {"episode_index": ep["episode_index"], "tasks": ep["tasks"], "length": ep["length"]}
        for ep in episodes
    ]
    (out / "meta" / "episodes.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    names = tasks["__index_level_0__"]
    (out / "meta" / "tasks.jsonl").write_text(
        "".join(json.dumps({"task_index": i, "task": t}) + "\n" for i, t in zip(tasks["task_index"], names))
    )
    info.update(codebase_version="v2.1", total_chunks=1, total_videos=len(episodes))
    info["data_path"] = "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet"
    info["video_path"] = "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4"
    (out / "meta" / "info.json").write_text(json.dumps(info))
    return out


def test_v21_per_episode_files_are_read(native, exported, tmp_path):
    path, _ = import_demos(f"lerobot:{_v21(exported, tmp_path / 'v21')}", PICK, tmp_path / "cache")
    _same_up_to_video(path, native)


def test_the_cache_keys_on_the_content(exported, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(exported, copy)
    assert import_key(f"lerobot:{copy}", PICK) == import_key(f"lerobot:{exported}", PICK)
    table = pq.read_table(copy / "data" / "chunk-000" / "file-000.parquet")
    action = np.asarray(table.column("action").to_pylist(), np.float32)
    action[3, 0] *= 0.5
    table = table.set_column(
        table.column_names.index("action"), "action",
        pa.FixedSizeListArray.from_arrays(pa.array(action.reshape(-1)), action.shape[1]),
    )  # fmt: skip
    pq.write_table(table, copy / "data" / "chunk-000" / "file-000.parquet")
    assert import_key(f"lerobot:{copy}", PICK) != import_key(f"lerobot:{exported}", PICK)


def _rewrite_column(root: Path, name: str, edit) -> None:
    file = root / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(file)
    values = np.asarray(table.column(name).to_pylist(), np.float32)
    values = edit(values)
    column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), values.shape[1])
    pq.write_table(table.set_column(table.column_names.index(name), name, column), file)


def _reencode(root: Path, keep: slice, codec: str = "libx264") -> Path:
    video = root / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    with av.open(str(video)) as source:
        frames = [f.to_ndarray(format="rgb24") for f in source.decode(video=0)][keep]
    with av.open(str(video), "w") as container:
        stream = container.add_stream(codec, rate=10)
        stream.pix_fmt, stream.width, stream.height = "yuv420p", frames[0].shape[1], frames[0].shape[0]
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return video


def _break(kind: str, root: Path) -> dict:
    """Damage the dataset at ``root`` as ``kind`` says; returns the info.json edits made."""
    data = root / "data" / "chunk-000" / "file-000.parquet"
    video = root / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    info_file = root / "meta" / "info.json"
    info = json.loads(info_file.read_text())
    if kind == "truncated_parquet":
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    elif kind == "missing_video":
        video.unlink()
    elif kind == "frame_count":
        _reencode(root, slice(0, -5))  # the last episode's last five frames are gone
    elif kind == "undecodable_video":
        raw = bytearray(video.read_bytes())
        mdat = raw.find(b"mdat")
        raw[mdat + 8 :] = bytes(len(raw) - mdat - 8)  # the stream's bytes zeroed: a container, no pictures
        video.write_bytes(bytes(raw))
    elif kind == "unknown_codec":
        raw = video.read_bytes()
        video.write_bytes(raw.replace(b"avc1", b"zzzz"))  # a sample entry no decoder knows
    elif kind == "nan_action":
        _rewrite_column(root, "action", lambda a: np.where(np.arange(len(a))[:, None] == 100, np.nan, a))
    elif kind == "action_dim":
        _rewrite_column(root, "action", lambda a: a[:, :5])
        info["features"]["action"]["shape"] = [5]
    elif kind == "version":
        info["codebase_version"] = "v1.6"
    elif kind == "two_cameras":
        info["features"]["observation.images.wrist"] = dict(info["features"]["observation.images.front"])
    info_file.write_text(json.dumps(info))
    return info


BAD = {
    "truncated_parquet": r"data/chunk-000/file-000\.parquet is not a readable parquet file: truncated or corrupt",
    "missing_video": r"episode 0: video videos/observation\.images\.front/chunk-000/file-000\.mp4 is missing",
    "frame_count": r"episode 1: video file-000\.mp4 ends after 49 of the 54 frames .*frame-count mismatch",
    "undecodable_video": r"episode 0: video file-000\.mp4 (will not open|.*will not decode) \(Invalid data",
    "unknown_codec": r"episode 0: video file-000\.mp4 uses a codec this FFmpeg build cannot decode \(meta/info\.json says h264\)",
    "nan_action": r"episode 1 step \d+: action\[0\] is nan",
    "action_dim": r"episode 0 has 5-D actions, diffpolicy_envs:MujocoPick-v0 takes 7-D actions",
    "version": r"codebase_version v1\.6 is not read \(only v2\.0, v2\.1, v3\.0\)",
    "two_cameras": r"holds 2 cameras \(observation\.images\.front, observation\.images\.wrist\) .*"
    r"\+bc\.obs_keys\.rgb=\[observation\.images\.front\]",
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_data_fails_in_one_line_and_leaves_the_cache_untouched(kind, exported, tmp_path):
    cache = tmp_path / "cache"
    import_demos(f"lerobot:{exported}", PICK, cache)  # a cache that already holds an import
    before = _tree(cache)
    broken = tmp_path / "broken"
    shutil.copytree(exported, broken)
    _break(kind, broken)
    label = f"bc.demos=lerobot:{broken}"
    with pytest.raises(ValueError, match=BAD[kind]) as info:
        import_demos(f"lerobot:{broken}", PICK, cache, label=label)
    assert "\n" not in str(info.value) and str(info.value).startswith(label)
    assert _tree(cache) == before


def test_missing_directory_and_non_dataset_are_one_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory .*nothing is downloaded"):
        import_demos(f"lerobot:{tmp_path / 'nowhere'}", PICK, tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a LeRobotDataset: it has no meta/info.json"):
        import_demos(f"lerobot:{tmp_path / 'empty'}", PICK, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_collect_format_lerobot(tmp_path, compose):
    from diffpolicy.collect import main

    cfg = compose("collect", ["env=mujoco_pick", "env.obs_mode=multimodal", "env.image_size=32", "env.n_points=64",
                              "n_episodes=1", "format=lerobot", "video_codec=h264"])  # fmt: skip
    summary = main(cfg, tmp_path / "run")
    assert summary["lerobot"] == str(tmp_path / "run" / "lerobot") and summary["fps"] == 10.0
    info = json.loads((tmp_path / "run" / "lerobot" / "meta" / "info.json").read_text())
    assert info["total_episodes"] == 1 and "observation.points" in info["features"]
    with pytest.raises(ValueError, match="video_codec"):
        compose("collect", ["format=lerobot", "video_codec=vp9"])


def test_lerobot_data_trains_the_multimodal_policy_end_to_end(tmp_path, compose):
    """LeRobot's own dataset -> BC (the policy reads rgb, state and text: the dataset has no points) -> one
    round of the pick task's learner (PPO + GAE, its anchor imitating the dataset's episodes) -> test
    evaluation, in process."""
    from diffpolicy import checkpoint
    from diffpolicy.train import main

    cfg = compose(
        "train",
        [
            "env=mujoco_pick", "env.obs_mode=multimodal", "env.image_size=32", "env.n_points=64",
            "env.num_envs=2", "env.vectorization=sync", f"bc.demos=lerobot:{FIXTURE}", "bc.epochs=1",
            "bc.batch_size=16", "bc.target_aux_weight=1", "algo.iterations=1", "algo.n_steps=4",
            "algo.critic_warmup=0", "algo.anchor_steps=2", "policy.down_dims=[16,32]", "policy.cond_dim=32", "policy.step_embed_dim=16",
            "policy.horizon=16", "policy.n_action_steps=8", "policy.ddim_steps=4",
            "policy.encoder.token_dim=32", "policy.encoder.rgb_channels=[8]", "policy.encoder.rgb_keypoints=4",
            "eval_episodes=2", "video_episodes=0", "log.progress=false", f"cache_dir={tmp_path / 'cache'}",
        ],
    )  # fmt: skip
    summary = main(cfg, tmp_path / "run")
    assert summary["env_steps"] > 0 and summary["eval_episodes"] == 2
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoints")
    assert sorted(ckpt.extra["obs_spec"]) == ["instruction", "rgb", "state"]


def test_demos_import_benchmark_tiny() -> None:
    from diffpolicy.benchmarks.demos_import import run

    out = run(repeats=1, episodes=2)
    assert out["frames"] > 100 and out["image_size"] == 84
    for key in (
        "import_fps_h264",
        "import_fps_av1",
        "decode_fps_h264",
        "decode_fps_av1",
        "native_import_fps",
    ):
        assert out[key] > 0, key
    assert out["video_bytes_av1"] > 0 and out["video_bytes_h264"] > 0


def test_image_features_stored_in_the_parquet_are_read(native, exported, tmp_path):
    """A camera stored as ``image`` (PNG bytes in the data rows, as LeRobot's ``use_videos=False`` writes it)
    instead of video decodes to the same frames, losslessly."""
    import io

    from PIL import Image

    root = tmp_path / "images"
    shutil.copytree(exported, root)
    shutil.rmtree(root / "videos")
    frames = np.concatenate([DemoReader(native).episode(i)["rgb"] for i in range(2)])  # (L, 32, 32, 3)
    cells = []
    for frame in frames:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="PNG")
        cells.append({"bytes": buffer.getvalue(), "path": None})
    data = root / "data" / "chunk-000" / "file-000.parquet"
    table = pq.read_table(data)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    pq.write_table(table.append_column("observation.images.front", pa.array(cells, image_type)), data)
    info = json.loads((root / "meta" / "info.json").read_text())
    info["features"]["observation.images.front"] = {"dtype": "image", "shape": [32, 32, 3], "names": None}
    info["video_path"] = None
    (root / "meta" / "info.json").write_text(json.dumps(info))
    path, _ = import_demos(f"lerobot:{root}", PICK, tmp_path / "cache")
    got = DemoReader(path)
    np.testing.assert_array_equal(np.concatenate([got.episode(i)["rgb"] for i in range(2)]), frames)


def test_episodes_out_of_order_in_the_video_are_found_by_seeking(native, exported, tmp_path):
    """A v3.0 file whose second episode's frames come first (the reader seeks forward, then back to 0)."""
    root = tmp_path / "swapped"
    shutil.copytree(exported, root)
    lengths = DemoReader(native).meta["episode_lengths"]
    video = root / "videos" / "observation.images.front" / "chunk-000" / "file-000.mp4"
    with av.open(str(video)) as source:
        frames = [f.to_ndarray(format="rgb24") for f in source.decode(video=0)]
    frames = frames[lengths[0] :] + frames[: lengths[0]]  # episode 1, then episode 0
    with av.open(str(video), "w") as container:
        stream = container.add_stream("libx264", rate=10, options={"g": "2", "crf": "18"})
        stream.pix_fmt, stream.width, stream.height = "yuv420p", frames[0].shape[1], frames[0].shape[0]
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    episodes_file = next((root / "meta" / "episodes").rglob("*.parquet"))
    table = pq.read_table(episodes_file)
    starts = {"from": [lengths[1] / 10, 0.0], "to": [sum(lengths) / 10, lengths[1] / 10]}
    for end in ("from", "to"):
        name = f"videos/observation.images.front/{end}_timestamp"
        table = table.set_column(table.column_names.index(name), name, pa.array(starts[end], pa.float64()))
    pq.write_table(table, episodes_file)
    path, _ = import_demos(f"lerobot:{root}", PICK, tmp_path / "cache")
    _same_up_to_video(path, native)
