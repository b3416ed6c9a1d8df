"""Config composition and validation: every group composes, bad values fail with one line naming the field."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from diffpolicy import config as C
from diffpolicy.cli import CONF_DIR

NEED_CHECKPOINT = ("evaluate", "export", "serve")
"""Entry points whose config requires ``checkpoint=PATH``."""


def test_defaults_are_valid() -> None:
    for cls in (*C.GROUPS.values(), *(c for n, c in C.PRIMARY.items() if n not in NEED_CHECKPOINT)):
        cls()  # __post_init__ accepts its own defaults


REQUIRED_OVERRIDES = {"env/metaworld": ["env.task=reach"]}
"""Entries that need one more value to compose (env=metaworld names its task; without it: a one-line error)."""


@pytest.mark.parametrize("group", sorted(C.GROUPS))
def test_every_group_entry_composes(group: str, compose) -> None:
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        cfg = compose("train", [f"{group}={path.stem}", *REQUIRED_OVERRIDES.get(f"{group}/{path.stem}", [])])
        assert isinstance(getattr(cfg, group), C.GROUPS[group])


def test_train_composes_typed(compose) -> None:
    cfg = compose("train", ["algo.lr=1e-4", "env.num_envs=2", "policy=unet_large"])
    assert isinstance(cfg, C.TrainConfig)
    assert cfg.algo.lr == pytest.approx(1e-4)
    assert cfg.env.num_envs == 2
    assert cfg.policy.down_dims == [256, 512, 1024]


@pytest.mark.parametrize("name", ["train", "pretrain"])
@pytest.mark.parametrize("env", ["hopper", "walker2d"])
def test_env_hopper_is_the_whole_setting_and_the_command_line_wins(name: str, env: str, compose) -> None:
    """env=hopper (and walker2d) chooses DPPO's Gym actor, its learner with the one measured departure
    (dppo_gym_tuned) and BC's budget; mujoco_pick brings its own learner (ppo_anchor) and train.yaml's BC."""
    cfg = compose(name, [f"env={env}"])
    assert (cfg.policy.name, cfg.algo.name, cfg.bc.n_demos, cfg.bc.epochs, cfg.eval_episodes) == (
        "mlp", "dppo_gym_tuned", 100, 100, 50,
    )  # fmt: skip
    assert cfg.env.expert["noise_scale"] == 0.1 and cfg.env.max_episode_steps == 1000
    cfg = compose(name, [f"env={env}", "algo=residual", "policy=unet_small", "bc.n_demos=3"])
    assert (cfg.policy.name, cfg.algo.name, cfg.bc.n_demos) == ("unet_small", "residual", 3)
    cfg = compose(name)
    assert (cfg.env.name, cfg.policy.name, cfg.algo.name, cfg.bc.n_demos) == (
        "mujoco_pick", "unet_small64", "ppo_anchor", 40,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["train", "pretrain"])
def test_env_mujoco_pick_brings_ppo_with_gae_judged_noise_free(name: str, compose) -> None:
    """The main job: env=mujoco_pick (the default env) fine-tunes with algo=ppo_anchor (PPO + GAE on held
    env-unit noise, the gradient through the last 2 denoising steps, the anchor inside the loop) and judges BC
    and the fine-tuned policy noise-free in train and pretrain; a learner on the command line wins and keeps
    the protocol, so algo=filtered_bc's baseline row is judged the same way."""
    for cfg in (compose(name), compose(name, ["env=mujoco_pick"])):
        algo = cfg.algo
        assert (algo.name, algo.learner, algo.advantage, algo.critic_warmup) == (
            "ppo_anchor",
            "chain",
            "gae",
            2,
        )
        assert (algo.action_std, algo.action_std_units, algo.action_corr, algo.grad_steps) == (
            0.05,
            "env",
            1.0,
            2,
        )
        assert (algo.anchor_steps, algo.norm_adv, algo.reward, cfg.eval_protocol) == (
            400, "batch", "success", "noise_free",
        )  # fmt: skip
    cfg = compose(name, ["algo=filtered_bc"])
    assert (cfg.algo.name, cfg.eval_protocol) == ("filtered_bc", "noise_free")
    assert (
        compose(name, ["env=obstacle_reach"]).algo.name == "filtered_bc"
    )  # train.yaml's, where no env names one


def test_env_hopper_departs_from_dppo_gym_in_the_actor_lr_alone(compose) -> None:
    """env=hopper's learner is DPPO's Gym entry with one stated departure (lr 1e-3, chosen on validation);
    algo=dppo_gym keeps DPPO's 1e-4, and no other field differs."""
    tuned = dataclasses.asdict(compose("train", ["env=hopper"]).algo)
    faithful = dataclasses.asdict(compose("train", ["env=hopper", "algo=dppo_gym"]).algo)
    differ = {k: (faithful[k], tuned[k]) for k in faithful if faithful[k] != tuned[k]}
    assert differ == {"name": ("dppo_gym", "dppo_gym_tuned"), "lr": (1e-4, 1e-3)}


@pytest.mark.parametrize("name", ["train", "pretrain"])
def test_env_metaworld_brings_its_learner_and_protocol_and_the_command_line_wins(name: str, compose) -> None:
    """env=metaworld fine-tunes with algo=dppo_success (DPPO's settings, the success reward, 44 iterations) and
    judges BC and the fine-tuned policy noise-free in train and pretrain alike; train reports DPPO's protocol
    beside it on 100 test episodes and chooses on 50 validation ones, where its guard also picks the checkpoint it
    deploys (keep_best). Its policy is unet_small. A learner or policy named on the command line wins."""
    cfg = compose(name, ["env=metaworld", "env.task=push"])
    assert (cfg.algo.name, cfg.algo.reward, cfg.algo.iterations, cfg.eval_protocol) == (
        "dppo_success", "success", 44, "noise_free",
    )  # fmt: skip
    if name == "train":
        assert (cfg.report_protocols, cfg.eval_episodes, cfg.val_episodes) == (["dppo"], 100, 50)
        # early stopping on the 50 validation episodes, judged every 4 iterations
        assert (cfg.algo.rollback_episodes, cfg.algo.keep_best, cfg.checkpoint_every) == (50, True, 4)
    # the 16 x 7 noise-predicting U-Net its table was measured with, not the default's 64 x 7 (cached BCs stay)
    assert (cfg.policy.name, cfg.policy.horizon, cfg.policy.fold, cfg.policy.prediction) == (
        "unet_small",
        16,
        1,
        "epsilon",
    )
    cfg = compose(name, ["env=metaworld", "env.task=push", "algo=filtered_bc", "eval_protocol=exploration"])
    assert (cfg.algo.name, cfg.eval_protocol) == ("filtered_bc", "exploration")
    assert compose(name, ["env=metaworld", "env.task=push", "policy=unet_large"]).policy.name == "unet_large"


@pytest.mark.parametrize("env", sorted(p.stem for p in (CONF_DIR / "env").glob("*.yaml")))
def test_collect_composes_with_every_env_entry(env: str, compose) -> None:
    """An env entry that chooses train's policy, learner and run values (env=hopper, env=metaworld) composes
    for collect too, whose own settings it leaves alone (collect once failed on them)."""
    cfg = compose("collect", [f"env={env}", *REQUIRED_OVERRIDES.get(f"env/{env}", []), "n_episodes=3"])
    assert cfg.env.name == env and cfg.n_episodes == 3 and cfg.keep_failures is None


def test_dppo_success_departs_from_dppo_in_the_reward_budget_and_advantage_scale_alone(compose) -> None:
    """algo=dppo_success is algo=dppo with the success reward, 44 iterations and advantages standardised over the
    rollout (each chosen on validation); no other field differs."""
    mine = dataclasses.asdict(compose("train", ["env=metaworld", "env.task=push"]).algo)
    dppo = dataclasses.asdict(compose("train", ["env=metaworld", "env.task=push", "algo=dppo"]).algo)
    differ = {k: (dppo[k], mine[k]) for k in dppo if dppo[k] != mine[k]}
    assert differ == {
        "name": ("dppo", "dppo_success"),
        "reward": ("env", "success"),
        "iterations": (151, 44),
        "norm_adv": ("minibatch", "batch"),
    }


def test_dppo_gym_takes_dppos_update_steps_per_iteration(compose) -> None:
    """DPPO's Gym fine-tuning: 40 envs x 500 decisions x K' 10 = 200k (decision, step) pairs in batches of
    50k: 4 minibatches per epoch, 5 epochs, 20 Adam steps per iteration (not 200, as minibatches of 500 gave)."""
    cfg = compose("train", ["env=hopper"])
    decisions = cfg.algo.n_steps * cfg.env.num_envs
    assert decisions // cfg.algo.minibatch_size * cfg.algo.update_epochs == 20
    assert cfg.algo.minibatch_size * cfg.algo.ft_steps == 50_000


@pytest.mark.parametrize("name", ["train", "pretrain", "collect", "bench"])
def test_primary_configs_compose(name: str, compose) -> None:
    assert isinstance(compose(name), C.PRIMARY[name])


@pytest.mark.parametrize("name", NEED_CHECKPOINT)
def test_checkpoint_entry_points_compose_and_require_one(name: str, compose) -> None:
    """evaluate, export and serve are typed configs of diffpolicy.config too, validated when composed."""
    assert isinstance(compose(name, ["checkpoint=somewhere"]), C.PRIMARY[name])
    with pytest.raises(ValueError, match="checkpoint is required"):
        compose(name)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("algo=ppo algo.gamma=1.5", "algo.gamma"),
        ("algo=ppo algo.clip=sometimes", "algo.clip"),
        ("algo=filtered_bc algo.explore=wander", "algo.explore"),
        ("algo=filtered_bc algo.explore_std=-0.1", "algo.explore_std"),
        ("env.num_envs=0", "env.num_envs"),
        ("algo.ft_steps=50", "algo.ft_steps"),
        ("policy.kernel_size=4", "policy.kernel_size"),
        ("policy.fold=0", "policy.fold"),
        ("policy.fold=3", "policy.fold"),
        ("policy.fold=32", "policy.fold"),  # 64 / 32 = 2 positions: not divisible by the U-Net's 4
        ("policy=unet_small policy.denoiser=mlp policy.fold=2", "policy.fold"),
        ("policy.prediction=v", "policy.prediction"),
        ("policy=unet_small policy.denoiser=mlp policy.prediction=sample", "policy.prediction"),
        ("device.precision=fp8", "device.precision"),
        ("env.obs_mode=lidar", "env.obs_mode"),
    ],
)
def test_out_of_range_names_the_field(override: str, field: str, compose) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as info:
        compose("train", override.split())
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("algo", "cls", "own", "foreign"),
    [
        ("ppo", "ChainConfig", "logprob_clamp", "residual_alpha"),
        ("grpo", "ChainConfig", "group_size", "bc_steps"),
        ("dppo", "ChainConfig", "noise_clip", "max_drift"),
        ("residual", "ResidualConfig", "max_drift", "logprob_clamp"),
        ("filtered_bc", "FilteredBCConfig", "bc_steps", "clip_eps"),
        ("fpo", "FPOConfig", "mc_draws", "logprob_clamp"),
    ],
)
def test_each_learner_has_its_own_config(algo: str, cls: str, own: str, foreign: str, compose) -> None:
    """algo=<x> composes that learner's schema: its own fields, none of another learner's."""
    cfg = compose("train", [f"algo={algo}"])
    assert type(cfg.algo) is getattr(C, cls) and cfg.algo.name == algo
    assert hasattr(cfg.algo, own) and not hasattr(cfg.algo, foreign)
    with pytest.raises(Exception, match=foreign):
        compose("train", [f"algo={algo}", f"algo.{foreign}=1"])


def test_every_algo_yaml_names_its_schema_and_sources() -> None:
    """Each conf/algo/*.yaml composes a learner schema (itself, or through the entry it extends) and says in a
    comment where its values come from."""
    paths = sorted((Path(__file__).resolve().parents[1] / "conf" / "algo").glob("*.yaml"))
    for path in paths:
        text = path.read_text()
        extends = set(re.findall(r"^  - (\w+)$", text, re.MULTILINE)) & {p.stem for p in paths}
        assert "_schema" in text or extends, path.name
        assert text.lstrip().startswith("#"), path.name
        assert "@package" not in text and "\nalgo:" not in text, (
            f"{path.name}: packaged under algo like the others"
        )
        assert "\nhead:" not in text and "\nlearner:" not in text, (
            f"{path.name}: the schema names the learner"
        )


def test_bare_learner_config_becomes_the_chain_learner() -> None:
    """A TrainConfig built in Python without a learner gets the chain learner with the given shared fields; a
    dict names its learner with ``learner`` (an unknown one is a one-line error)."""
    cfg = C.TrainConfig(algo=C.LearnerConfig(lr=5e-5))
    assert type(cfg.algo) is C.ChainConfig and cfg.algo.lr == 5e-5 and cfg.algo.name == "ppo"
    assert type(C.TrainConfig(algo={"learner": "filtered_bc", "lr": 1e-3}).algo) is C.FilteredBCConfig
    with pytest.raises(ValueError, match="algo.learner"):
        C.TrainConfig(algo={"learner": "nope"})


@pytest.mark.parametrize(
    "entry",
    [
        "ppo",
        "grpo",
        "dppo",
        "dppo_success",
        "dppo_gym",
        "dppo_gym_tuned",
        "ppo_anchor",
        "fpo",
        "residual",
        "filtered_bc",
    ],
)
def test_one_name_chooses_the_learner(entry: str, compose) -> None:
    """``algo=<entry>`` is the one choice: ``algo.name`` records it and the schema says which learner runs;
    there is no field naming the learner a second time, and the chain-sampling settings exist only on the
    learners that sample the chain."""
    algo = compose("train", [f"algo={entry}"]).algo
    assert algo.name == entry and algo.learner == type(algo).learner
    assert {f.name for f in dataclasses.fields(algo)}.isdisjoint({"head", "learner"})
    assert isinstance(algo, C.SamplingConfig) == (entry != "residual")
    with pytest.raises(Exception, match="head"):
        compose("train", [f"algo={entry}", "algo.head=chain"])


def test_unknown_key_and_wrong_type_fail(compose) -> None:
    with pytest.raises(Exception, match="nonexistent"):
        compose("train", ["env.nonexistent=1"])
    with pytest.raises(Exception, match="lr"):
        compose("train", ["algo.lr=fast"])


def test_dataclass_validation_in_python() -> None:
    with pytest.raises(ValueError, match=r"policy\.horizon"):
        C.PolicyConfig(horizon=60, down_dims=[8, 16, 32, 64])
    with pytest.raises(ValueError, match="checkpoint is required"):
        C.EvaluateConfig()
    ok = dataclasses.replace(C.ChainConfig(), lr=1e-3)
    assert ok.lr == 1e-3


def test_cache_dir_outside_hydra_is_a_path(monkeypatch) -> None:
    monkeypatch.delenv("DIFFPOLICY_CACHE", raising=False)
    assert C.TrainConfig().cache_dir == "runs/cache" and C.PretrainConfig().cache_dir == "runs/cache"
    monkeypatch.setenv("DIFFPOLICY_CACHE", "/data/cache")
    assert C.TrainConfig().cache_dir == "/data/cache"
    assert C.TrainConfig(cache_dir="mine").cache_dir == "mine"


def test_clip_eps_final_follows_clip_eps_unless_set(compose) -> None:
    """Raising algo.clip_eps no longer leaves the last step's clip range at its old default."""
    assert compose("train", ["algo=ppo", "algo.clip_eps=0.1"]).algo.clip_eps_final == 0.1
    assert (
        compose("train", ["algo=ppo", "algo.clip_eps=0.1", "algo.clip_eps_final=0.3"]).algo.clip_eps_final
        == 0.3
    )
    assert compose("train", ["algo=dppo"]).algo.clip_eps_final == 1e-2


def test_validation_and_test_seeds_are_disjoint_ranges() -> None:
    """Choices read validation seeds, the figure is reported on test seeds: the two never overlap."""
    cfg = C.TrainConfig(eval_episodes=50)
    assert (cfg.val_seed, cfg.val_episodes, cfg.eval_seed) == (C.VAL_SEED, 50, C.TEST_SEED)
    assert C.TrainConfig(eval_episodes=50, val_episodes=0).val_episodes == 0
    with pytest.raises(ValueError, match="overlap the test seeds"):
        C.TrainConfig(val_seed=C.TEST_SEED + 10, eval_episodes=20)
    with pytest.raises(ValueError, match="overlap the test seeds"):
        C.PretrainConfig(eval_episodes=10, val_episodes=10, val_seed=C.TEST_SEED - 5)
    # evaluate names its split; reachability chooses exploration settings, so it needs validation seeds
    assert C.EvaluateConfig(checkpoint="x").eval_seed == C.TEST_SEED
    assert C.EvaluateConfig(checkpoint="x", split="val").eval_seed == C.VAL_SEED
    with pytest.raises(ValueError, match="add split=val"):
        C.EvaluateConfig(checkpoint="x", reachability_tries=4)


@pytest.mark.parametrize(
    ("name", "overrides", "bc", "demos"),
    [
        # 61: the default policy became unet_small64 (64 x 7, fold 4, x0-predicting): a new BC, on purpose
        ("train", [], "mujoco_pick-unet_small64-64ac6fd999ec", "mujoco_pick-3950fa1e0ea9"),
        ("train", ["env=hopper"], "hopper-mlp-926eaa4d1a85", "hopper-1b540eca6e9d"),  # 35: D4RL-like actor
        # 33: Meta-World's cloud is cropped to the hand's reach (env.kwargs.point_box: reach; the env's kwargs
        # enter both keys, the state policy's too)
        ("pretrain", ["env=metaworld", "env.task=coffee-push"], "metaworld-unet_small-10ae06fcb2be",
         "metaworld-8d3e0886785a"),
        ("pretrain", ["env=metaworld", "env.task=assembly", "env.obs_mode=state"],
         "metaworld-unet_small-2a3ad1c02e65", "metaworld-2a7f1fd00c8a"),
    ],
)  # fmt: skip
def test_cache_keys_are_pinned(name: str, overrides: list[str], bc: str, demos: str, compose) -> None:
    """The default runs' demonstration and BC cache keys, as the caches of earlier releases were written:
    a refactor or a new field at its default must not orphan a user's cache (a deliberate change updates
    these and says so)."""
    from diffpolicy.bc import bc_key
    from diffpolicy.demos import demonstrations_key

    cfg = compose(name, overrides)
    assert (bc_key(cfg.env, cfg.policy, cfg.bc, cfg.seed), demonstrations_key(cfg.env, cfg.bc, cfg.seed)) == (
        bc,
        demos,
    )


@pytest.mark.parametrize(
    ("env", "extra"),
    [("mujoco_pick", []), ("metaworld", ["env.task=push"]), ("hopper", ["algo.reward=env"])],
)
def test_the_ppo_anchor_recipe_composes_on_every_development_env(env: str, extra: list[str], compose) -> None:
    """``algo=ppo_anchor`` (pick's learner, to be judged on the other development envs) wins over the learner an env entry chooses and keeps
    its own values there (the env's presets add their own fields: Meta-World's early stopping)."""
    algo = compose("train", [f"env={env}", "algo=ppo_anchor", *extra]).algo
    assert algo.name == "ppo_anchor" and algo.learner == "chain"
    assert (algo.action_std, algo.action_corr, algo.action_std_units) == (0.05, 1.0, "env")
    assert (algo.anchor_steps, algo.n_steps, algo.iterations, algo.lr) == (400, 144, 10, 1e-4)
    assert algo.reward == ("env" if env == "hopper" else "success")
