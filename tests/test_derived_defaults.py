"""Defaults that depend on another field are derived from it, so an override never meets a default that
contradicts it (``policy.ddim_steps=4`` with any algo composes and runs); values the user sets that cannot
work are still rejected in one line naming them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diffpolicy import config as C
from diffpolicy.checkpoint import Checkpoint
from diffpolicy.cli import CONF_DIR
from diffpolicy.policy_io import configs_from

ALGOS = sorted(p.stem for p in (CONF_DIR / "algo").glob("*.yaml"))
POLICIES = sorted(p.stem for p in (CONF_DIR / "policy").glob("*.yaml"))
BUDGET = {"iterations": 1, "n_steps": 4, "minibatch_size": 8, "update_epochs": 1, "critic_warmup": 0,
          "round_episodes": 2, "bc_steps": 2, "mc_draws": 2}  # fmt: skip
"""The smallest run of each learner: every budget field it has is cut to this."""


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("algo", ALGOS)
def test_ddim_steps_composes_with_every_algo_and_policy(algo: str, policy: str, compose) -> None:
    cfg = compose("train", [f"algo={algo}", f"policy={policy}", "policy.ddim_steps=4"])
    assert cfg.policy.ddim_steps == 4 and 1 <= getattr(cfg.algo, "ft_steps", 4) <= 4


def test_defaults_are_derived_from_what_they_depend_on(compose) -> None:
    cfg = compose("train", ["algo=filtered_bc"])
    p = cfg.policy
    assert (p.ddim_steps, cfg.algo.ft_steps, p.n_action_steps, p.n_groups) == (10, 10, 8, 8)  # as documented
    assert (
        compose("train", ["algo=filtered_bc", "policy.ddim_steps=4"]).algo.ft_steps == 4
    )  # null: all K steps
    short = compose("train", ["algo=filtered_bc", "policy.train_timesteps=5"])
    assert (short.policy.ddim_steps, short.algo.ft_steps) == (5, 5)
    # the default learner (env=mujoco_pick's ppo_anchor, DPPO's family): K' = ft_fraction 0.5 of K
    assert compose("train", []).algo.ft_steps == 5
    assert compose("train", ["policy.ddim_steps=4"]).algo.ft_steps == 2
    assert compose("train", ["policy.horizon=4"]).policy.n_action_steps == 4
    assert compose("train", ["policy.down_dims=[4,12]", "policy.horizon=4"]).policy.n_groups == 4
    assert compose("train", ["policy.down_dims=[6,12]", "policy.horizon=4"]).policy.n_groups == 6
    # the executed steps carry half of the BC loss: 8 / 56 for the default's 64-step chunks, plain mean for 16
    assert (p.horizon, p.fold, p.prediction, p.unexecuted_weight) == (64, 4, "sample", 0.143)
    assert compose("train", ["policy=unet_small"]).policy.unexecuted_weight == 1.0
    # the fold follows the horizon: every chunk length runs a 16-step chunk's convolutions
    assert [compose("train", [f"policy.horizon={h}"]).policy.fold for h in (4, 16, 32, 128)] == [1, 1, 2, 8]
    assert compose("train", ["policy.horizon=64", "policy.fold=2"]).policy.fold == 2  # a set value stays
    assert compose("train", ["policy.horizon=64"]).policy.unexecuted_weight == 0.143
    assert compose("train", ["policy=unet_large"]).policy.unexecuted_weight == 0.143
    assert (
        compose("train", ["policy.horizon=64", "policy.n_action_steps=16"]).policy.unexecuted_weight == 0.333
    )
    assert (
        compose("train", ["policy.horizon=64", "policy.unexecuted_weight=1.0"]).policy.unexecuted_weight
        == 1.0
    )
    assert compose("train", ["env=hopper"]).policy.unexecuted_weight == 1.0  # Ta = Te = 4


STATE_RECIPE = ["policy.encoder.use_state=true", "bc.epochs=80", "bc.batch_size=128"]
MULTIMODAL_RECIPE = [
    "policy.encoder.use_state=false",
    "bc.epochs=18",
    "bc.batch_size=64",
    "bc.target_aux_weight=1.0",
]
"""The BC recipes of ``C.OBS_MODE_DEFAULTS`` as explicit overrides (docs/experiments.md: state 0.89-0.90,
multimodal 1.00 held-out)."""


def _key(cfg: Any) -> str:
    from diffpolicy.bc import bc_key

    return bc_key(cfg.env, cfg.policy, cfg.bc, cfg.seed)


@pytest.mark.parametrize("name", ["train", "pretrain"])
@pytest.mark.parametrize("overrides", [[], ["bc.n_demos=40"], ["env=obstacle_reach"], ["policy=unet_large"]])
def test_state_defaults_keep_the_bc_cache_key(name: str, overrides: list, compose) -> None:
    """The derived state values are today's explicit ones, so cached BC checkpoints (keyed by them) stay valid."""
    derived = compose(name, overrides)
    assert (derived.policy.encoder.use_state, derived.bc.epochs, derived.bc.batch_size) == (True, 80, 128)
    assert _key(derived) == _key(compose(name, [*overrides, *STATE_RECIPE]))


@pytest.mark.parametrize("name", ["train", "pretrain"])
def test_multimodal_alone_gives_its_measured_recipe_and_set_values_win(name: str, compose) -> None:
    mm = ["env.obs_mode=multimodal"]
    cfg = compose(name, mm)
    assert (cfg.policy.encoder.use_state, cfg.bc.epochs, cfg.bc.batch_size) == (False, 18, 64)
    assert _key(cfg) == _key(compose(name, [*mm, *MULTIMODAL_RECIPE]))
    for override, expected in [
        ("bc.epochs=80", (False, 80, 64)),
        ("bc.batch_size=128", (False, 18, 128)),
        ("policy.encoder.use_state=true", (True, 18, 64)),
    ]:
        cfg = compose(name, [*mm, override])
        assert (cfg.policy.encoder.use_state, cfg.bc.epochs, cfg.bc.batch_size) == expected, override
    state = compose(name, ["policy.encoder.use_state=false", "bc.epochs=7"])  # state mode, set values
    assert (state.policy.encoder.use_state, state.bc.epochs, state.bc.batch_size) == (False, 7, 128)


def test_an_environment_derives_per_observation_mode(compose) -> None:
    """ENV_DEFAULTS: metaworld's step budget in both modes, its scene translation only where there are
    points to shift (multimodal); a value set on the command line wins; pick keeps its epochs."""
    mm = compose("pretrain", ["env=metaworld", "env.task=reach"]).bc
    assert (mm.steps, mm.translate, mm.translate_state) == (3000, 0.1, True)
    state = compose("pretrain", ["env=metaworld", "env.task=reach", "env.obs_mode=state"]).bc
    assert (state.steps, state.translate, state.translate_state) == (3000, 0.0, False)
    set_ = compose("pretrain", ["env=metaworld", "env.task=reach", "bc.translate=0", "bc.steps=0"]).bc
    assert (set_.steps, set_.translate, set_.translate_state) == (0, 0.0, True)
    pick = compose("pretrain", ["env.obs_mode=multimodal"]).bc
    assert (pick.steps, pick.translate, pick.epochs) == (0, 0.0, 18)


def test_metaworld_multimodal_predicts_then_acts(compose) -> None:
    """Meta-World's multimodal policy reads object and goal positions (the env labels both) predicted off
    its point cloud; its state policy and the pick task's do not; a value set on the command line wins."""
    enc = lambda *o: compose("pretrain", list(o)).policy.encoder
    mm = compose("pretrain", ["env=metaworld", "env.task=push"])
    assert (mm.policy.encoder.predict_positions, mm.env.kwargs["label"]) == (2, "both")
    assert mm.policy.encoder.position_head == "points"
    assert enc("env.obs_mode=multimodal").position_head == "fused"
    assert (
        enc("env=metaworld", "env.task=push", "policy.encoder.position_head=fused").position_head == "fused"
    )
    assert enc("env=metaworld", "env.task=push", "env.obs_mode=state").predict_positions == 0
    assert enc("env=metaworld", "env.task=push", "policy.encoder.predict_positions=0").predict_positions == 0
    assert enc("env.obs_mode=multimodal").predict_positions == 0 and enc().predict_positions == 0


def test_a_yaml_value_wins_over_the_obs_mode_default(compose) -> None:
    """conf/experiment/quick.yaml sets 100 epochs of batch 64: both stay, use_state is derived."""
    cfg = compose("train", ["+experiment=quick", "env.obs_mode=multimodal"])
    assert (cfg.policy.encoder.use_state, cfg.bc.epochs, cfg.bc.batch_size) == (False, 100, 64)


def test_python_configs_derive_the_same_way() -> None:
    """Built without an environment a component takes the state values; a config that holds one derives the
    values still unset from its ``env.obs_mode``, and keeps those that were set."""
    assert (C.EncoderConfig().use_state, C.BCConfig().epochs, C.BCConfig().batch_size) == (True, 80, 128)
    for cls in (C.TrainConfig, C.PretrainConfig):
        mm = cls(env=C.EnvConfig(obs_mode="multimodal"), bc=C.BCConfig(epochs=3))
        assert (mm.policy.encoder.use_state, mm.bc.epochs, mm.bc.batch_size) == (False, 3, 64)
        state = cls(env=C.EnvConfig(obs_mode="state"), policy=C.PolicyConfig())
        assert (state.policy.encoder.use_state, state.bc.epochs, state.bc.batch_size) == (True, 80, 128)
    assert C.PretrainConfig(env=C.EnvConfig(obs_mode="multimodal"), demos="d.hdf5").bc.epochs == 18
    # the auxiliary target loss needs the expert's privileged label: on by default for its multimodal
    # demonstrations, off for a dataset from elsewhere (which has none) and for the state task
    assert C.TrainConfig(env=C.EnvConfig(obs_mode="multimodal")).bc.target_aux_weight == 1.0
    assert (
        C.PretrainConfig(env=C.EnvConfig(obs_mode="multimodal"), demos="d.hdf5").bc.target_aux_weight == 0.0
    )
    assert C.TrainConfig(env=C.EnvConfig(obs_mode="state")).bc.target_aux_weight == 0.0
    kept = C.TrainConfig(env=C.EnvConfig(obs_mode="multimodal"), bc=C.BCConfig(target_aux_weight=0.0))
    assert kept.bc.target_aux_weight == 0.0


def test_a_fraction_of_the_chain_follows_ddim_steps(compose) -> None:
    """``ft_fraction`` (DPPO's half chain: 0.5) gives K' = round(f K), at least 1; a set ft_steps wins."""
    half = ["algo=ppo", "algo.ft_steps=null", "algo.ft_fraction=0.5"]
    assert compose("train", half).algo.ft_steps == 5
    assert compose("train", [*half, "policy.ddim_steps=4"]).algo.ft_steps == 2
    assert compose("train", [*half, "policy.ddim_steps=1"]).algo.ft_steps == 1
    assert compose("train", [*half, "policy.ddim_steps=4", "algo.ft_steps=3"]).algo.ft_steps == 3


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["policy.ddim_steps=4", "algo.ft_steps=10"], "algo.ft_steps"),
        (["policy.ddim_steps=200"], "policy.ddim_steps"),
        (["policy.n_action_steps=32", "policy.horizon=16"], "policy.n_action_steps"),
        (["policy.n_groups=3"], "policy.n_groups"),
        (["policy.n_groups=0"], "policy.n_groups"),
        (["algo.ft_fraction=1.5"], "algo.ft_fraction"),
        (["algo.ft_fraction=0"], "algo.ft_fraction"),
        (["policy.down_dims=[64,128,256,512,1024,2048]"], "policy.down_dims"),
    ],
)
def test_values_the_user_set_that_cannot_work_are_rejected(overrides: list, field: str, compose) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as info:
        compose("train", overrides)
    assert "\n" not in str(info.value)


def test_a_checkpoint_from_before_the_learner_owned_sampling_samples_as_it_did(tmp_path: Path) -> None:
    """Checkpoints written before ``ft_fraction`` existed, or while K', eta and the std floor were policy
    fields, keep loading: the moved fields are read as the checkpoint's sampling (``sampling_of``)."""
    import dataclasses

    from diffpolicy.policy_io import policy_config_from, sampling_of

    raw = dataclasses.asdict(C.PolicyConfig(ddim_steps=4))
    raw.update(ft_steps=2, eta=0.5, min_std=0.05)  # as the PolicyConfig of earlier releases wrote them
    ckpt = Checkpoint(tmp_path, 0, {}, config={"env": dataclasses.asdict(C.EnvConfig()), "policy": raw})
    _, policy_cfg = configs_from(ckpt)
    assert policy_cfg.ddim_steps == 4 and not hasattr(policy_cfg, "ft_steps")
    assert sampling_of(ckpt) == {"ft_steps": 2, "eta": 0.5, "min_std": 0.05}
    assert policy_config_from(ckpt) == policy_cfg
    new = Checkpoint(
        tmp_path, 0, {}, config={"policy": raw, "sampling": {"ft_steps": 4, "eta": 1.0, "min_std": 0.1}}
    )
    assert sampling_of(new) == {"ft_steps": 4, "eta": 1.0, "min_std": 0.1}  # the recorded one wins


def test_a_checkpoint_from_before_unexecuted_weight_keeps_the_plain_loss(tmp_path: Path) -> None:
    """A 64-step checkpoint written before ``unexecuted_weight`` existed was trained on the plain mean: it
    loads with 1.0, not the 0.143 a new 64-step config derives, and 1.0 stays out of the BC cache key."""
    import dataclasses

    from diffpolicy.bc import bc_key

    raw = dataclasses.asdict(C.PolicyConfig(horizon=64))
    assert raw.pop("unexecuted_weight") == 0.143
    ckpt = Checkpoint(tmp_path, 0, {}, config={"env": dataclasses.asdict(C.EnvConfig()), "policy": raw})
    env_cfg, policy_cfg = configs_from(ckpt)
    assert policy_cfg.unexecuted_weight == 1.0
    bc = C.BCConfig()
    plain = C.PolicyConfig(horizon=64, unexecuted_weight=1.0)
    key = bc_key(env_cfg, plain, bc, 0)
    raw["encoder"] = dataclasses.asdict(plain.encoder)
    before = {k: v for k, v in dataclasses.asdict(plain).items() if k != "unexecuted_weight"}
    assert before == {k: v for k, v in raw.items()}  # the same config but for the new field
    assert key != bc_key(env_cfg, C.PolicyConfig(horizon=64), bc, 0)  # the derived 0.143 is a new BC


@pytest.mark.parametrize("algo", ALGOS)
def test_ddim_steps_runs_with_every_algo(algo: str, tmp_path: Path, init_ckpt: Path) -> None:
    """One iteration of every learner on a K = 4 policy, K' derived (``init_ckpt`` samples with K = 4)."""
    _run(tmp_path, init_ckpt, [f"algo={algo}"])


def test_dppo_half_chain_runs_with_ddim_steps_4(tmp_path: Path, init_ckpt: Path) -> None:
    """What conf/algo/dppo.yaml gives once it asks for half the chain (ft_fraction 0.5): K' = 2 of K = 4."""
    policy = _run(tmp_path, init_ckpt, ["algo=dppo", "algo.ft_steps=null", "algo.ft_fraction=0.5"])
    assert policy.ft_steps == 2


def _run(tmp_path: Path, init: Path, overrides: list[str]) -> Any:
    """A one-iteration train run from ``init`` with ``overrides``; returns the policy it saved."""
    from diffpolicy.cli import compose
    from diffpolicy.policy_io import load_policy
    from diffpolicy.train import main

    base = ["env=obstacle_reach", "env.num_envs=4", "env.vectorization=sync", "policy.down_dims=[16,32]",
            "policy.cond_dim=32", "policy.step_embed_dim=16", "policy.horizon=16", "policy.ddim_steps=4",
            "policy.encoder.state_hidden=32", "policy.encoder.token_dim=32", f"policy.init={init}",
            "eval_episodes=4", "video_episodes=0", "checkpoint_every=1", "log.progress=false",
            "log.tensorboard=false", "device=cpu", *overrides]  # fmt: skip
    learner = compose("train", base).algo
    cfg = compose("train", [*base, *(f"algo.{k}={v}" for k, v in BUDGET.items() if hasattr(learner, k))])
    assert cfg.policy.ddim_steps == 4 and 1 <= getattr(cfg.algo, "ft_steps", 4) <= 4
    summary = main(cfg, tmp_path)
    assert summary["iterations"] == 1 and 0.0 <= summary["ppo_success_rate"] <= 1.0
    policy, _, _ = load_policy(tmp_path / "checkpoints")
    return getattr(policy, "base", policy)  # base + residual: the diffusion policy under the head
