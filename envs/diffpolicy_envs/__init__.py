"""Standalone gymnasium environments of diffpolicy (never imports ``diffpolicy``).

Importing this package registers:

| id | module | what |
|---|---|---|
| ``MujocoPick-v0`` | :mod:`diffpolicy_envs.mujoco_pick` | arm picks the named cube into a tray; rgb, points, text |
| ``MujocoDialogue-v0`` | :mod:`diffpolicy_envs.dialogue` | the same with two trays and an instruction corrected mid-episode |
| ``ObstacleReach-v0`` | :mod:`diffpolicy_envs.obstacle_reach` | 2-D point mass reaches a goal behind an obstacle |
| ``MetaWorld-v0`` | :mod:`diffpolicy_envs.meta_world` | any of Meta-World's 50 v3 tasks (``task=``), rgb, points, text (needs ``metaworld``) |

so ``gymnasium.make("diffpolicy_envs:MujocoPick-v0")`` works with no other import. Scripted experts live in
:mod:`diffpolicy_envs.experts`, the Box-env adapter in :mod:`diffpolicy_envs.adapters` and vectorised
construction in :mod:`diffpolicy_envs.vector`.
"""

import os

from gymnasium.envs.registration import register, registry

# Headless rendering unless the user chose a backend: MuJoCo reads MUJOCO_GL when it is first imported, and
# every submodule (experts, environments) is imported after this package.
os.environ.setdefault("MUJOCO_GL", "egl")

ENV_IDS = ("MujocoPick-v0", "MujocoDialogue-v0", "ObstacleReach-v0", "MetaWorld-v0")
"""Environments this package registers."""

if "MujocoPick-v0" not in registry:
    register(
        id="MujocoPick-v0",
        entry_point="diffpolicy_envs.mujoco_pick:MujocoPickEnv",
        max_episode_steps=120,
    )
if "MujocoDialogue-v0" not in registry:
    register(
        id="MujocoDialogue-v0",
        entry_point="diffpolicy_envs.dialogue:MujocoDialogueEnv",
        max_episode_steps=180,
    )
if "ObstacleReach-v0" not in registry:
    register(
        id="ObstacleReach-v0",
        entry_point="diffpolicy_envs.obstacle_reach:ObstacleReachEnv",
        max_episode_steps=50,
    )
if "MetaWorld-v0" not in registry:  # the module imports metaworld only when an env is built
    register(
        id="MetaWorld-v0",
        entry_point="diffpolicy_envs.meta_world:MetaWorldEnv",
        max_episode_steps=200,
    )

__all__ = ["ENV_IDS"]
