"""Tiny runs of every learner, pinned: a refactor that changes what a run does (its rollouts, its updates, its
RNG streams, how BC leaves the policy) changes these figures and fails here.

The values were written by the code before the learners became units (``rl/chain``, ``rl/residual``,
``rl/fpo.py``, ``rl/filtered_bc.py``) and before the chain's sampling settings moved from ``policy.*`` to
``algo.*``; both versions gave them to the last digit (returns as the summary rounds them, the sum of |w| over
the saved policy's weights to 1e-6). Bit-exact on one CPU thread with this torch build; a deliberate change of
behaviour updates them in the same commit, with the reason in its message (dppo's: DPPO HEAD's settings,
with the critic warm-up off so that the actor moves).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diffpolicy import checkpoint
from diffpolicy.cli import compose

TINY = ["policy.down_dims=[16,32]", "policy.cond_dim=32", "policy.step_embed_dim=16", "policy.horizon=16",
        "policy.n_action_steps=8", "policy.ddim_steps=4", "policy.encoder.state_hidden=32",
        "policy.encoder.token_dim=32", "seed=7", "bc.epochs=2", "bc.n_demos=3", "eval_episodes=2",
        "video_episodes=0", "log.progress=false", "device=cpu", "device.threads=1", "env.num_envs=2",
        "env.vectorization=sync"]  # fmt: skip
CHAIN = ["env=obstacle_reach", "algo.iterations=2", "algo.n_steps=3", "algo.minibatch_size=4"]
RUNS = {
    "ppo": [*CHAIN, "algo=ppo", "algo.update_epochs=2", "algo.ft_steps=2"],
    "dppo": [*CHAIN, "algo=dppo", "algo.update_epochs=2", "algo.critic_warmup=0"],  # the actor moves too
    "fpo": [*CHAIN, "algo=fpo", "algo.update_epochs=1", "algo.mc_draws=2", "algo.ft_steps=2"],
    "residual": [
        "env=obstacle_reach",
        "algo=residual",
        "algo.iterations=2",
        "algo.n_steps=12",
        "algo.minibatch_size=12",
        "algo.update_epochs=2",
        "algo.residual_hidden=[16,16]",
    ],  # fmt: skip
    "filtered_bc": [
        "env=mujoco_pick",
        "algo=filtered_bc",
        "algo.iterations=2",
        "algo.round_episodes=2",
        "algo.bc_steps=3",
        "algo.ft_steps=2",
    ],  # fmt: skip
}
PINNED = {  # bc_return, ppo_return, validation ppo_return, env_steps, sum |w| of the saved policy
    "ppo": (1.28, 1.26, 0.81, 92, 4928.924337),
    "dppo": (3.82, 3.83, 0.86, 87, 4928.778951),  # DPPO HEAD's values (lr 1e-4, reward scaling, no clip)
    "fpo": (1.28, 1.29, 0.79, 92, 4929.079323),
    # residual: 48 env steps of rollouts + 956 of the noise-bound measurement (algo.noise_tolerance, 2026-12-03)
    "residual": (3.5, 3.5, 1.08, 1004, 4929.079762),
    "filtered_bc": (-52.11, -51.61, -53.27, 480, 5034.370072),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One BC cache for the module: the obstacle_reach learners share their BC, as users' runs would."""
    return tmp_path_factory.mktemp("pinned") / "cache"


@pytest.mark.parametrize("name", list(RUNS))
def test_tiny_run_gives_its_pinned_figures(name: str, cache: Path, tmp_path: Path) -> None:
    from diffpolicy.train import main

    summary = main(compose("train", [*RUNS[name], *TINY, f"cache_dir={cache}"]), tmp_path)
    weights = checkpoint.load(tmp_path / "checkpoints").state["policy"]
    total = round(sum(float(w.double().abs().sum()) for w in weights.values() if w.is_floating_point()), 6)
    got = (
        summary["bc_return"],
        summary["ppo_return"],
        summary["val"]["ppo_return"],
        summary["env_steps"],
        total,
    )
    assert got == PINNED[name]
