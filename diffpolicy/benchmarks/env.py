"""Environment throughput: MujocoPick-v0 steps per second on one CPU thread.

``run()`` measures, each as the median over ``repeats`` runs of ``steps`` steps (resets included, random
actions from a seeded generator, so the numbers do not depend on a policy):

| key | what |
|---|---|
| ``full_obs_sps`` | multimodal observation (rgb + points + instruction + state) rendered on every step |
| ``replan_obs_sps`` | multimodal, camera rendered only every ``obs_every`` (= Te) steps, as when a policy replans |
| ``state_obs_sps`` | ``obs_mode="state"``: physics only, no rendering |
| ``obstacle_reach_sps`` | ``ObstacleReach-v0`` |

and, over ``state_steps`` steps with a pre-drawn sequence of random actions (no random draws timed):

| key | what |
|---|---|
| ``state_sps`` | ``obs_mode="state"`` steps per second of the ``gymnasium.make`` env (IK, physics, reward, obs) |
| ``physics_sps`` | the same steps' physics alone: the recorded controls replayed with ``mujoco.mj_step`` (20 substeps per step) from the same states on the same model |
| ``state_over_physics`` | time of a state step over the time of its physics: the median over repeats of the paired ratio |

and, when the ``metaworld`` extra is installed, Meta-World (``metaworld_task``, default stick-pull; random
actions, so episodes run to the 200-step limit; the multimodal rows with ``env=metaworld``'s camera, point and
drawing kwargs):

| key | what |
|---|---|
| ``metaworld_state_sps`` | ``obs_mode="state"`` (its 39-D vector; no rendering) |
| ``metaworld_replan_sps`` | multimodal, the camera (rgb + depth -> points) rendered every ``obs_every`` steps |
| ``metaworld_full_sps`` | multimodal, rendered every step |
| ``metaworld_replan_over_state`` | a replan-rendered step's time over a state step's: median of paired repeats |

Each repeat times the env and its physics replay back to back, so a load change on a shared machine moves
both; the ratio is the Python overhead of a step on top of its physics.

Targets: ``full_obs_sps >= 70`` and ``replan_obs_sps >= 230`` on one core (issue 3), ``state_over_physics
<= 1.5`` (issue 16). Torch and OpenMP are limited to one thread for the measurement; rendering is headless
(``MUJOCO_GL=egl`` unless set).
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from typing import Any

os.environ.setdefault("MUJOCO_GL", "egl")


def _limit_threads() -> None:
    os.environ["OMP_NUM_THREADS"] = "1"  # one core, as the figures say
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
        env.step(rng.uniform(-1.0, 1.0, shape))  # warm-up: lazy renderer initialisation
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


def _state_and_physics(steps: int, repeats: int, seed: int) -> dict[str, float]:
    """``state_sps``, ``physics_sps`` and ``state_over_physics`` of MujocoPick-v0 (see the module docstring)."""
    import gymnasium as gym
    import mujoco
    import numpy as np

    from diffpolicy_envs.mujoco_pick import N_SUBSTEPS

    env = gym.make("diffpolicy_envs:MujocoPick-v0", obs_mode="state")
    u = env.unwrapped
    m = u.model
    actions = np.random.default_rng(seed).uniform(-1.0, 1.0, (steps, 7)).astype(np.float32)

    def run_env(episode_seed: int, record: bool) -> tuple[float, list]:
        """Seconds for ``steps`` env steps; with ``record`` also the physics inputs, one segment per episode:
        (tray position, MjData right after the reset, controls of each step)."""
        segments: list = []

        def new_segment() -> None:
            if record:  # copy.copy of an MjData copies its state (mj_copyData is not in every MuJoCo release)
                segments.append((m.body_pos[u.tray_body].copy(), copy.copy(u.data), []))

        env.reset(seed=episode_seed)
        new_segment()
        start = time.perf_counter()
        for action in actions:
            _, _, terminated, truncated, _ = env.step(action)
            if record:
                segments[-1][2].append(u.data.ctrl.copy())
            if terminated or truncated:
                env.reset()
                new_segment()
        return time.perf_counter() - start, segments

    def run_physics(segments: list) -> tuple[float, mujoco.MjData]:
        """Seconds to replay ``segments`` with ``mj_step`` alone, and the last segment's final data."""
        copies = [copy.copy(data) for _, data, _ in segments]  # untimed: fresh copies of the start states
        start = time.perf_counter()
        for (tray, _, controls), scratch in zip(segments, copies):
            m.body_pos[u.tray_body] = tray
            for ctrl in controls:
                scratch.ctrl[:] = ctrl
                mujoco.mj_step(m, scratch, nstep=N_SUBSTEPS)
        return time.perf_counter() - start, copies[-1]

    state_rates, physics_rates, ratios = [], [], []
    try:
        run_env(seed, record=False)  # warm-up
        for r in range(repeats):
            env_time, _ = run_env(seed + r, record=False)
            _, segments = run_env(seed + r, record=True)  # untimed: the same episodes' physics inputs
            physics_time, scratch = run_physics(segments)
            # The replay is the env's physics only if it ends where the env did.
            if not np.array_equal(scratch.qpos, u.data.qpos):
                raise RuntimeError("physics replay diverged from the environment's trajectory")
            state_rates.append(steps / env_time)
            physics_rates.append(steps / physics_time)
            ratios.append(env_time / physics_time)
    finally:
        env.close()
    return {
        "state_sps": float(statistics.median(state_rates)),
        "physics_sps": float(statistics.median(physics_rates)),
        "state_over_physics": float(statistics.median(ratios)),
    }


def _metaworld_kwargs() -> dict[str, Any]:
    """The env kwargs of ``conf/env/metaworld.yaml`` (its camera, points and drawing)."""
    from omegaconf import OmegaConf

    from diffpolicy.cli import CONF_DIR

    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "env" / "metaworld.yaml").kwargs)


def _metaworld(
    task: str, steps: int, repeats: int, seed: int, obs_every: int, **common: Any
) -> dict[str, Any]:
    """The Meta-World rows (module docstring); ``{}`` with a note when the extra is not installed."""
    try:
        import metaworld  # noqa: F401
    except ImportError:
        return {"metaworld": "not installed (pip install -e '.[metaworld]')"}
    env_id = "diffpolicy_envs:MetaWorld-v0"
    common = {**common, **_metaworld_kwargs()}  # the camera, points and drawing of ``env=metaworld``
    state, replan = [], []
    for r in range(repeats):  # paired: a load change on a shared machine moves both
        state.append(_steps_per_second(env_id, steps, 1, seed + r, task=task, obs_mode="state"))
        replan.append(_steps_per_second(env_id, steps, 1, seed + r, task=task, obs_every=obs_every, **common))
    ratios = [s / m for s, m in zip(state, replan)]
    return {
        "metaworld_task": task,
        "metaworld_state_sps": float(statistics.median(state)),
        "metaworld_replan_sps": float(statistics.median(replan)),
        "metaworld_full_sps": _steps_per_second(
            env_id, steps, repeats, seed, task=task, obs_every=1, **common
        ),
        "metaworld_replan_over_state": float(statistics.median(ratios)),
    }


def run(
    steps: int = 200,
    repeats: int = 3,
    obs_every: int = 8,
    image_size: int = 84,
    n_points: int = 512,
    seed: int = 0,
    state_steps: int = 1000,
) -> dict[str, Any]:
    """Median steps/s of MujocoPick-v0 (full, replan-only and state observations) and ObstacleReach-v0, and
    the state-mode step time over its physics time.

    Args:
        steps: environment steps per timed run.
        repeats: timed runs per configuration; the median is reported.
        obs_every: Te, steps between camera renders in the ``replan_obs_sps`` configuration.
        image_size: side of ``rgb`` (pixels).
        n_points: points N in ``points``.
        seed: seed of the episodes and the random actions.
        state_steps: environment steps per timed run of ``state_sps`` / ``physics_sps`` (more than
            ``steps``: a state step takes well under a millisecond).
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
        **_state_and_physics(state_steps, repeats, seed),
        **_metaworld("stick-pull", 4 * steps, repeats, seed, obs_every, **common),
        "steps": steps,
        "state_steps": state_steps,
        "repeats": repeats,
        "obs_every": obs_every,
        "image_size": image_size,
        "n_points": n_points,
        "threads": 1,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
