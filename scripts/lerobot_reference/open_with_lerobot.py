"""Open a LeRobotDataset (e.g. ``collect format=lerobot``'s output) with LeRobot's own loader and compare it
with the native dataset it was exported from: every frame's numeric features exactly, its video frame up to
compression. Prints one JSON line. Runs in the environment ``build_env.sh`` builds::

    ENV_DIR/bin/lerobot-python scripts/lerobot_reference/open_with_lerobot.py LEROBOT_DIR NATIVE_DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from diffpolicy.data.dataset import DemoReader


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lerobot", help="the LeRobotDataset directory")
    parser.add_argument("native", help="the dataset of this project's format it was written from")
    parser.add_argument("--frames", type=int, default=200, help="frames compared, spread over the dataset")
    args = parser.parse_args()

    from ledataset.datasets.lerobot_dataset import LeRobotDataset

    dataset = LeRobotDataset("local/diffpolicy", root=args.lerobot)
    reader = DemoReader(args.native)
    pairs = {"observation.state": "state", "action": "action", "observation.points": "points",
             "target_pos": "target_pos"}  # fmt: skip
    numeric_equal, rgb_error, tasks_equal = True, [], True
    for index in np.linspace(0, len(dataset) - 1, min(args.frames, len(dataset))).astype(int):
        item = dataset[int(index)]
        for key, field in pairs.items():
            if key in item:
                numeric_equal &= bool(
                    np.array_equal(item[key].numpy(), reader.read(field, index, index + 1)[0])
                )
        if "observation.images.front" in item:
            image = (item["observation.images.front"].permute(1, 2, 0).numpy() * 255.0).round()
            rgb_error.append(float(np.abs(image - reader.read("rgb", index, index + 1)[0]).mean()))
        if "instruction" in reader.fields:
            tasks_equal &= (
                item["task"] == reader.instructions[int(reader.read("instruction", index, index + 1)[0])]
            )
    print(json.dumps({"frames": len(dataset), "episodes": dataset.num_episodes, "compared": len(rgb_error) or
                      args.frames, "numeric_equal": numeric_equal, "tasks_equal": tasks_equal,
                      "rgb_mean_abs_error": round(float(np.mean(rgb_error)), 3) if rgb_error else None}))  # fmt: skip


if __name__ == "__main__":
    main()
