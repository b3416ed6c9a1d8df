"""``python -m diffpolicy.train env=mujoco_pick``: collect (cached), pre-train by BC (cached), PPO, evaluate.

Prints one JSON summary line last on stdout (``bc_success_rate``, ``ppo_success_rate``, ``env_steps``,
``wall_time_s``) and writes everything else into the Hydra run directory.
"""

from __future__ import annotations

from pathlib import Path

from diffpolicy.cli import NotBuiltYet, launch
from diffpolicy.config import TrainConfig
from diffpolicy.device import Runtime


def main(cfg: TrainConfig, run_dir: Path) -> dict:
    """Run the whole pipeline for ``cfg`` inside ``run_dir``."""
    Runtime.from_config(cfg.device)  # fail early, in one line, when the device is unusable
    raise NotBuiltYet("the PPO fine-tuning pipeline (issue 6) has not landed; see README 'Status'")


if __name__ == "__main__":
    launch("train", main)
