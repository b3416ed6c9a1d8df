"""Write a dataset of this project's format through LeRobot's own writer (``LeRobotDataset.create``).

Runs in the separate environment ``scripts/lerobot_reference/build_env.sh`` builds (LeRobot's package cannot
share the project's environment); it reads the native dataset with numpy alone
(:mod:`diffpolicy.data.dataset` imports nothing else) and writes a LeRobotDataset v3.0 with LeRobot's
defaults (AV1 video). Used to make ``tests/data/lerobot_pick`` and to check that what LeRobot writes is
what ``bc.demos=lerobot:DIR`` reads::

    scripts/lerobot_reference/build_env.sh ENV_DIR
    ENV_DIR/bin/lerobot-python scripts/lerobot_reference/write_with_lerobot.py NATIVE OUT [--points]
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from diffpolicy.data.dataset import DemoReader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("native", help="a dataset directory of this project's format")
    parser.add_argument("out", help="the LeRobotDataset directory to create (replaced)")
    parser.add_argument("--points", action="store_true", help="also write the point cloud (a 2-D feature)")
    parser.add_argument("--fps", type=int, default=10)
    args = parser.parse_args()

    from ledataset.datasets.lerobot_dataset import LeRobotDataset

    reader = DemoReader(args.native)
    fields = reader.fields
    features = {
        "observation.state": {"dtype": "float32", "shape": tuple(fields["state"]["shape"]), "names": None},
        "action": {"dtype": "float32", "shape": tuple(fields["action"]["shape"]), "names": None},
    }
    if "rgb" in fields:
        features["observation.images.front"] = {
            "dtype": "video",
            "shape": tuple(fields["rgb"]["shape"]),
            "names": ["height", "width", "channels"],
        }
    if args.points and "points" in fields:
        features["observation.points"] = {
            "dtype": "float32",
            "shape": tuple(fields["points"]["shape"]),
            "names": None,
        }
    if "reward" in fields:
        features["next.reward"] = {"dtype": "float32", "shape": (1,), "names": None}
    if "target_pos" in fields:
        features["target_pos"] = {
            "dtype": "float32",
            "shape": tuple(fields["target_pos"]["shape"]),
            "names": None,
        }
    shutil.rmtree(args.out, ignore_errors=True)
    dataset = LeRobotDataset.create(
        "local/diffpolicy", fps=args.fps, features=features, root=args.out, robot_type="sim", use_videos=True
    )
    for i in range(reader.num_episodes):
        episode = reader.episode(i)
        for t in range(len(episode["action"])):
            frame = {"observation.state": episode["state"][t], "action": episode["action"][t]}
            if "observation.images.front" in features:
                frame["observation.images.front"] = np.ascontiguousarray(episode["rgb"][t])
            if "observation.points" in features:
                frame["observation.points"] = episode["points"][t]
            if "next.reward" in features:
                frame["next.reward"] = np.asarray([episode["reward"][t]], np.float32)
            if "target_pos" in features:
                frame["target_pos"] = episode["target_pos"][t]
            frame["task"] = episode["instruction"][t] if "instruction" in episode else ""
            dataset.add_frame(frame)
        dataset.save_episode()
    dataset.finalize()
    print(f"wrote {args.out}: {reader.num_episodes} episodes, {reader.num_steps} frames")


if __name__ == "__main__":
    main()
