"""Shared pieces of the typed configuration: validators, seed splits and the derived defaults per observation
mode and environment (:data:`OBS_MODE_DEFAULTS`, :data:`ENV_DEFAULTS`)."""

from __future__ import annotations

import os
from typing import Any

MISSING_PATH = ""


def _choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if allow_zero and value < 0 or not allow_zero and value <= 0:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} is out of range; it must be {bound}")


def check_splits(val_seed: int, val_episodes: int, test_seed: int, test_episodes: int) -> None:
    """ValueError when the validation and test seed ranges are negative or overlap."""
    _positive("val_seed", val_seed, allow_zero=True)
    _positive("val_episodes", val_episodes, allow_zero=True)
    _positive("eval_seed", test_seed, allow_zero=True)
    if (
        val_episodes
        and test_episodes
        and val_seed < test_seed + test_episodes
        and test_seed < val_seed + val_episodes
    ):
        raise ValueError(
            f"validation seeds {val_seed}..{val_seed + val_episodes - 1} overlap the test seeds "
            f"{test_seed}..{test_seed + test_episodes - 1}; choose disjoint val_seed and eval_seed"
        )


def default_cache_dir() -> str:
    """Where demonstrations and BC checkpoints are cached: ``$DIFFPOLICY_CACHE``, else ``runs/cache``."""
    return os.environ.get("DIFFPOLICY_CACHE") or "runs/cache"


def _unit(name: str, value: float, *, open_low: bool = False) -> None:
    low_ok = value > 0 if open_low else value >= 0
    if not (low_ok and value <= 1):
        low = "(0" if open_low else "[0"
        raise ValueError(f"{name}={value!r} is out of range; it must lie in {low}, 1]")


PROTOCOLS = {"noise_free": True, "ddim": True, "exploration": False, "dppo": False}
"""Evaluation protocols -> whether every DDIM step takes its mean. ``noise_free``: every step's mean (under the
policy's own eta, 1 for the chain learners: the eta-1 chain's posterior means with no noise; what ``train``
reports for residual and filtered_bc); ``ddim``: DDIM eta 0, every step's mean under eta 0 (the
deterministic sampler: the same denoiser, x_k weighted as the probability-flow ODE weighs it); ``exploration``: the stochastic chain
the rollouts sample (eta, the ``algo.min_std`` floor); ``dppo``: DPPO's deterministic evaluation, each step
drawn with its own eta-scaled std floored at 1e-3 and none at the last step, no exploration floor
(:meth:`diffpolicy.diffusion.schedule.NoiseSchedule.with_natural_std`). A checkpoint carries the one its
figure was reported under (``extra["protocol"]``)."""

ENV_RUNTIME_FIELDS = ("num_envs", "vectorization", "workers")
"""EnvConfig fields that say how environments run, not what they hold: left out of the demonstration cache
key, and given their defaults when a checkpoint written before they existed lacks them."""
ENV_FIELDS_ADDED = {"task": ""}
"""EnvConfig fields added after checkpoints and caches existed -> their default: left out of the cache keys
while at it (so existing caches keep their keys), and given it when an older checkpoint lacks them."""

VAL_SEED = 100_000
"""First validation seed: every choice (settings, sweeps, reachability, rollback) reads episodes from here."""
TEST_SEED = 1_000_000
"""First test seed: the reported figure, evaluated once at the end; disjoint from the demonstrations (0, 1,
...), validation (100 000 + i) and training rollouts (10 000 000 and above). Figures reported before the split
(docs/experiments.md, before 2026-12-02) were measured on 100 000 + i, the seeds settings were chosen on."""


PICK_WORKSPACE = ([-0.1, -0.45, -0.05], [0.8, 0.45, 0.6])
"""MujocoPick's point workspace (robot base frame, m): the corners point positions are scaled from."""

OBS_MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "state": {
        "policy.encoder.use_state": True,
        "policy.encoder.workspace_low": PICK_WORKSPACE[0],
        "policy.encoder.workspace_high": PICK_WORKSPACE[1],
        "bc.epochs": 80,
        "bc.steps": 0,
        "bc.batch_size": 128,
        "bc.n_demos": 40,
        "bc.target_aux_weight": 0.0,
        "bc.translate": 0.0,
        "bc.translate_state": False,
        "policy.encoder.predict_positions": 0,
        "policy.encoder.position_head": "fused",
    },
    "multimodal": {
        "policy.encoder.workspace_low": PICK_WORKSPACE[0],
        "policy.encoder.workspace_high": PICK_WORKSPACE[1],
        "policy.encoder.use_state": False,
        "bc.epochs": 18,
        "bc.steps": 0,
        "bc.batch_size": 64,
        "bc.n_demos": 100,
        "bc.target_aux_weight": 1.0,
        "bc.translate": 0.0,
        "bc.translate_state": False,
        "policy.encoder.predict_positions": 0,
        "policy.encoder.position_head": "fused",
    },
}
"""``env.obs_mode`` -> the values its null fields are derived to, the best BC recipe measured on mujoco_pick
(docs/experiments.md). state: 80 epochs of batch 128 with the state token (2026-11-30, the imprecise
demonstrator: 0.89-0.90 held-out against 0.73 at 40 epochs) on 40 precise demonstrations, the default task,
whose BC (0.795) algo=filtered_bc lifts to 0.98 (2026-12-01, the pick task's figure). multimodal: 100
demonstrations, no proprioception token, 18 epochs of batch 64 and the auxiliary target loss (2026-12-01
late: 1.00 held-out over 200 seeds in 1962 steps, 26 min on a slow 2-core machine; 0.99 at 40 epochs; 0.71 at
40 without the auxiliary loss, 0.025 with the state token).
A component built without an environment (``EncoderConfig()``, ``BCConfig()`` in Python) takes the state
values."""

ENV_DEFAULTS: dict[str, dict[str, Any]] = {
    "mujoco_dialogue": {"bc.n_demos": 200},
    "mujoco_stages": {"bc.n_demos": 200},
    "metaworld": {
        "policy.encoder.use_state": True,
        "policy.encoder.workspace_low": [-0.7, 0.2, 0.0],
        "policy.encoder.workspace_high": [0.7, 1.2, 0.7],
        "bc.epochs": 100,
        "bc.steps": 3000,
        "bc.batch_size": 64,
        "bc.n_demos": 10,
        "bc.target_aux_weight": 1.0,
    },
    "metaworld:multimodal": {
        "bc.translate": 0.1,
        "bc.translate_state": True,
        "policy.encoder.predict_positions": 2,
        "policy.encoder.position_head": "points",
    },
}
"""``env.name`` -> derived values that replace :data:`OBS_MODE_DEFAULTS`' for that environment, in either obs
mode (``<env.name>:<obs_mode>``: in that mode only). mujoco_dialogue: twice the pick task's 100 demonstrations,
since its episodes come in four situations (the object or the place corrected, before or after the grasp);
mujoco_stages the same (each episode two picks).
metaworld, the same for all 50 tasks, chosen on the
validation seeds of two development tasks, assembly and coffee-push (docs/experiments.md, 2026-12-02): DP3's 10
demonstrations; the proprioception token (hand and finger pads only, DP3's ``agent_pos``: no object pose); the
workspace is the env's point crop (world frame, ``diffpolicy_envs.meta_world.POINT_BOX_*``); 3000 optimiser
steps of batch 64 whatever the demonstrations' length (coffee-push 0.16 at 800 steps -> 0.36 at 3000); the
auxiliary target loss on the env's privileged label (``env.kwargs.label``; on the goal: assembly 0.18 without it
-> 0.96); multimodal only: the scene shifted by up to 10 cm in x and y with the proprioception and the label
(``bc.translate``: coffee-push 0.36 -> 0.46 at 5 cm -> 0.56 at 10 cm, assembly 1.00 at both), since 10
placements alone let BC memorise its scenes (10 of 10 training seeds, 0.36 validation) where the 39-D state
policy generalises (0.94); and predict-then-act on the object's and the goal's positions
(``predict_positions`` 2 with ``env.kwargs.label: both``; validation seeds of push and shelf-place,
2026-12-03: 0.12 -> 0.48 and 0.08 -> 0.28), since the fused perception let the denoiser key its actions on a
scene's look, the positions read off the point cloud (``position_head: points``: push 0.48 -> 0.61, its
puck located to 0.7 cm instead of 2.4 on new scenes; shelf-place 0.28 -> 0.17 with perception as precise,
0.5 cm; half the BC step's time). The cloud itself is cropped to the hand's reach in conf/env/metaworld.yaml
(``env.kwargs.point_box: reach``, inside this workspace: validation mean over DP3's ten tasks 0.53 -> 0.56)."""


def _derive_state_defaults(cfg: Any, prefix: str) -> None:
    """Give ``cfg``'s null :data:`OBS_MODE_DEFAULTS` fields (``<prefix>.<name>``) their state values and note
    their names in ``cfg._derived`` (a slot, so outside ``asdict`` and ``vars``), so that a config holding an
    environment (:func:`derive_from_obs_mode`) derives them again from its ``env.obs_mode`` while a value that
    was set stays."""
    derived = []
    for path, value in OBS_MODE_DEFAULTS["state"].items():
        owner, _, name = path.rpartition(".")
        if owner == prefix and getattr(cfg, name) is None:
            setattr(cfg, name, list(value) if isinstance(value, list) else value)
            derived.append(name)
    cfg._derived = frozenset(derived)
