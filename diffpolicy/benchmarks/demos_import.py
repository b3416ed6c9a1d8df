"""Benchmark of ``bc.demos=lerobot:DIR``: decoding a LeRobotDataset's video and caching it, in frames per second.

``episodes`` MujocoPick expert episodes (84 x 84 RGB, state, instruction; ~70 frames each) are recorded once,
written as LeRobotDataset v3.0 with H.264 and with AV1 video (:func:`diffpolicy.data.lerobot_writer.write_lerobot`,
LeRobot's encoder settings), and each is imported into an empty cache ``repeats`` times
(:func:`diffpolicy.demos.import_demos`: hash the files, build the environment once to check shapes and
bounds, decode every frame, convert, write the cache). Reported, as medians:

- ``import_fps_h264`` / ``import_fps_av1``: frames imported per second, end to end (the figure the goal is on:
  at least 500 from H.264 on 2 cores);
- ``decode_fps_h264`` / ``decode_fps_av1``: frames per second of the reader alone (parquet + video decode);
- ``native_import_fps``: the same episodes imported from this project's own format (no video to decode):
  the reference measured in the same run, so the cost of video is the ratio.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path

from diffpolicy.config import EnvConfig
from diffpolicy.data.dataset import DemoReader, DemoWriter


def _rgb_only(source: Path, out: Path) -> int:
    """Copy the dataset without its point cloud (the benchmark is about images); returns its frame count."""
    reader = DemoReader(source)
    with DemoWriter(out, env_id=reader.meta["env_id"]) as writer:
        for i in range(reader.num_episodes):
            fields = {k: v for k, v in reader.episode(i).items() if k != "points"}
            writer.add_episode(fields, seed=reader.meta["seeds"][i], success=reader.meta["success"][i])
    return reader.num_steps


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run(repeats: int = 3, episodes: int = 40, threads: int = 2) -> dict:
    """See the module docstring. ``threads`` is torch's (the decoder's frame threads follow the CPU count)."""
    from diffpolicy.data.external import open_source
    from diffpolicy.demos import collect_demos, export_lerobot, import_demos

    env = EnvConfig(obs_mode="multimodal", image_size=84)
    root = Path(tempfile.mkdtemp(prefix="demos_import-"))
    try:
        collect_demos(env, episodes, 0, root / "collected")
        frames = _rgb_only(root / "collected", root / "native")
        out: dict = {"frames": frames, "image_size": env.image_size, "episodes": episodes}
        for codec in ("h264", "av1"):
            dataset = root / f"lerobot-{codec}"
            export_lerobot(root / "native", dataset, env, video_codec=codec)
            out[f"video_bytes_{codec}"] = sum(p.stat().st_size for p in (dataset / "videos").rglob("*.mp4"))

            def decode(dataset=dataset) -> None:
                with open_source(f"lerobot:{dataset}", image_size=env.image_size) as source:
                    for _ in source.episodes():
                        pass

            def fresh_import(dataset=dataset) -> None:
                cache = root / "cache"
                shutil.rmtree(cache, ignore_errors=True)
                import_demos(f"lerobot:{dataset}", env, cache)

            out[f"decode_fps_{codec}"] = round(frames / _median_s(decode, repeats))
            out[f"import_fps_{codec}"] = round(frames / _median_s(fresh_import, repeats))

        def native_import() -> None:
            cache = root / "cache"
            shutil.rmtree(cache, ignore_errors=True)
            import_demos(str(root / "native"), env, cache)

        out["native_import_fps"] = round(frames / _median_s(native_import, repeats))
        out["goal_import_fps_h264"] = 500
        return out
    finally:
        shutil.rmtree(root, ignore_errors=True)
