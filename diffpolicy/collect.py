"""``python -m diffpolicy.collect env=mujoco_pick n_episodes=100``: scripted-expert demonstrations.

The dataset goes to ``out`` (or ``<run_dir>/demos``); the summary (last stdout line) is
``{"success_rate", "n_episodes", "n_kept", "steps", "path", "wall_time_s"}``. The recording itself is
:func:`diffpolicy.demos.collect_demos`.

``format=robomimic`` also writes the demonstrations as one robomimic-style HDF5 file for other tools
(``out``, or ``<run_dir>/demos.hdf5``; :func:`diffpolicy.demos.export_robomimic`), named in the summary as
``robomimic``; ``path`` is then the native store it was written from, ``<run_dir>/demos``.
``format=lerobot`` writes a LeRobotDataset v3.0 the same way (``out``, or ``<run_dir>/lerobot``; videos in
``video_codec``; :func:`diffpolicy.demos.export_lerobot`), named ``lerobot`` in the summary with its ``fps``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffpolicy.cli import launch
from diffpolicy.config import CollectConfig
from diffpolicy.demos import collect_demos, export_lerobot, export_robomimic


def main(cfg: CollectConfig, run_dir: Path) -> dict[str, Any]:
    """Collect ``cfg.n_episodes`` expert demonstrations into ``cfg.out`` or ``<run_dir>/demos``."""
    from diffpolicy.logger import Logger

    export = None
    if cfg.format != "native":
        export = (
            Path(cfg.out) if cfg.out else run_dir / ("demos.hdf5" if cfg.format == "robomimic" else "lerobot")
        )
        if export.exists():  # before the recording, not after it
            raise ValueError(
                f"out={export} already exists; give a new {'file' if cfg.format == 'robomimic' else 'directory'} or remove it"
            )
        out = run_dir / "demos"
    else:
        out = Path(cfg.out) if cfg.out else run_dir / "demos"
    with Logger(run_dir, tensorboard=False) as log:
        summary = collect_demos(
            cfg.env,
            cfg.n_episodes,
            cfg.seed,
            out,
            cfg.keep_failures,  # None: the env's demo_failures
            progress=log.progress,
        )
        metrics = {"rollout/mean_return": summary["mean_return"]}
        if summary["success_rate"] is not None:  # None: the env reports no success (Hopper)
            metrics["rollout/success_rate"] = summary["success_rate"]
        log.log(metrics, step=summary["steps"])
    if cfg.format == "robomimic":
        summary["robomimic"] = export_robomimic(summary["path"], export)["path"]
    elif cfg.format == "lerobot":
        written = export_lerobot(summary["path"], export, cfg.env, cfg.fps, cfg.video_codec)
        summary["lerobot"], summary["fps"] = written["path"], written["fps"]
    return summary


if __name__ == "__main__":
    launch("collect", main)
