"""``python -m diffpolicy.collect env=mujoco_pick n_episodes=100``: scripted-expert demonstrations.

The dataset goes to ``out`` (or ``<run_dir>/demos``); the summary (last stdout line) is
``{"success_rate", "n_episodes", "n_kept", "steps", "path", "wall_time_s"}``. The recording itself is
:func:`diffpolicy.demos.collect_demos`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from diffpolicy.cli import launch
from diffpolicy.config import CollectConfig
from diffpolicy.demos import collect_demos


def main(cfg: CollectConfig, run_dir: Path) -> dict[str, Any]:
    """Collect ``cfg.n_episodes`` expert demonstrations into ``cfg.out`` or ``<run_dir>/demos``."""
    from diffpolicy.logger import Logger

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
        log.log({"rollout/success_rate": summary["success_rate"]}, step=summary["steps"])
    return summary


if __name__ == "__main__":
    launch("collect", main)
