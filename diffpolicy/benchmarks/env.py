"""Environment throughput: MujocoPick-v0 steps per second on one CPU thread.

``run()`` measures, each as the median over ``repeats`` runs of ``steps`` steps (resets included, random
actions from a seeded generator, so the numbers do not depend on a policy):

| key | what |
|---|---|
| ``full_obs_sps`` | multimodal observation (rgb + points + instruction + state) rendered on every step |
| ``replan_obs_sps`` | multimodal, camera rendered only every ``obs_every`` (= Te) steps, as when a policy replans |
| ``state_obs_sps`` | ``obs_mode="state"``: physics only, no rendering |
| ``obstacle_reach_sps`` | ``ObstacleReach-v0`` |

Targets (issue 3): ``full_obs_sps >= 70`` and ``replan_obs_sps >= 230`` on one core. Torch and OpenMP are
limited to one thread for the measurement; rendering is headless (``MUJOCO_GL=egl`` unless set).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

os.environ.setdefault("MUJOCO_GL", "egl")


def _limit_threads() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # open3d reads it at import, if not imported yet
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # the benchmark itself does not need torch
        pass


def _steps_per_second(env_id: str, steps: int, repeats: int, seed: int, **env_kwargs: Any) -> float:
    import gymnasium as gym
    import numpy as np

    env = gym.make(env_id, **env_kwargs)
    rng = np.random.default_rng(seed)
    shape = env.action_space.shape
    rates = []
    try:
        env.reset(seed=seed)
        env.step(rng.uniform(-1.0, 1.0, shape))  # warm-up: lazy renderer / open3d initialisation
        for r in range(repeats):
            env.reset(seed=seed + r)
            start = time.perf_counter()
            for _ in range(steps):
                _, _, terminated, truncated, _ = env.step(rng.uniform(-1.0, 1.0, shape))
                if terminated or truncated:
                    env.reset()
            rates.append(steps / (time.perf_counter() - start))
    finally:
        env.close()
    return float(statistics.median(rates))


def run(
    steps: int = 200,
    repeats: int = 3,
    obs_every: int = 8,
    image_size: int = 84,
    n_points: int = 512,
    seed: int = 0,
) -> dict[str, Any]:
    """Median steps/s of MujocoPick-v0 (full, replan-only and state observations) and ObstacleReach-v0.

    Args:
        steps: environment steps per timed run.
        repeats: timed runs per configuration; the median is reported.
        obs_every: Te, steps between camera renders in the ``replan_obs_sps`` configuration.
        image_size: side of ``rgb`` (pixels).
        n_points: points N in ``points``.
        seed: seed of the episodes and the random actions.
    """
    _limit_threads()
    import diffpolicy_envs  # noqa: F401  (registers the environments)

    pick = "diffpolicy_envs:MujocoPick-v0"
    common = {"image_size": image_size, "n_points": n_points}
    return {
        "full_obs_sps": _steps_per_second(pick, steps, repeats, seed, obs_every=1, **common),
        "replan_obs_sps": _steps_per_second(pick, steps, repeats, seed, obs_every=obs_every, **common),
        "state_obs_sps": _steps_per_second(pick, steps, repeats, seed, obs_mode="state"),
        "obstacle_reach_sps": _steps_per_second("diffpolicy_envs:ObstacleReach-v0", steps, repeats, seed),
        "steps": steps,
        "repeats": repeats,
        "obs_every": obs_every,
        "image_size": image_size,
        "n_points": n_points,
        "threads": 1,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
