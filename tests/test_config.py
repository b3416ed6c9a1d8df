"""Config composition and validation: every group composes, bad values fail with one line naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from diffpolicy import config as C
from diffpolicy.cli import CONF_DIR

NEED_CHECKPOINT = ("evaluate", "export", "serve")
"""Entry points whose config requires ``checkpoint=PATH``."""


def test_defaults_are_valid() -> None:
    for cls in (*C.GROUPS.values(), *(c for n, c in C.PRIMARY.items() if n not in NEED_CHECKPOINT)):
        cls()  # __post_init__ accepts its own defaults


@pytest.mark.parametrize("group", sorted(C.GROUPS))
def test_every_group_entry_composes(group: str, compose) -> None:
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        cfg = compose("train", [f"{group}={path.stem}"])
        assert isinstance(getattr(cfg, group), C.GROUPS[group])


def test_train_composes_typed(compose) -> None:
    cfg = compose("train", ["algo.lr=1e-4", "env.num_envs=2", "policy=unet_large"])
    assert isinstance(cfg, C.TrainConfig)
    assert cfg.algo.lr == pytest.approx(1e-4)
    assert cfg.env.num_envs == 2
    assert cfg.policy.down_dims == [256, 512, 1024]


@pytest.mark.parametrize("name", ["train", "pretrain", "collect", "bench"])
def test_primary_configs_compose(name: str, compose) -> None:
    assert isinstance(compose(name), C.PRIMARY[name])


@pytest.mark.parametrize("name", NEED_CHECKPOINT)
def test_checkpoint_entry_points_compose_and_require_one(name: str, compose) -> None:
    """evaluate, export and serve are typed configs of config.py too, validated when composed."""
    assert isinstance(compose(name, ["checkpoint=somewhere"]), C.PRIMARY[name])
    with pytest.raises(ValueError, match="checkpoint is required"):
        compose(name)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("algo.gamma=1.5", "algo.gamma"),
        ("algo.clip=sometimes", "algo.clip"),
        ("env.num_envs=0", "env.num_envs"),
        ("policy.ft_steps=50", "policy.ft_steps"),
        ("policy.kernel_size=4", "policy.kernel_size"),
        ("device.precision=fp8", "device.precision"),
        ("env.obs_mode=lidar", "env.obs_mode"),
    ],
)
def test_out_of_range_names_the_field(override: str, field: str, compose) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")) as info:
        compose("train", [override])
    assert "\n" not in str(info.value)


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
    ok = dataclasses.replace(C.AlgoConfig(), lr=1e-3)
    assert ok.lr == 1e-3


def test_cache_dir_outside_hydra_is_a_path(monkeypatch) -> None:
    monkeypatch.delenv("DIFFPOLICY_CACHE", raising=False)
    assert C.TrainConfig().cache_dir == "runs/cache" and C.PretrainConfig().cache_dir == "runs/cache"
    monkeypatch.setenv("DIFFPOLICY_CACHE", "/data/cache")
    assert C.TrainConfig().cache_dir == "/data/cache"
    assert C.TrainConfig(cache_dir="mine").cache_dir == "mine"
