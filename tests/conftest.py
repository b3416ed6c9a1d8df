"""Test-wide settings: CPU by default, ``pytest --device=cuda|npu`` runs the same suite on an accelerator."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import pytest
import torch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        choices=("cpu", "cuda", "npu"),
        help="device every test runs on (default cpu); the suite skips device-only tests elsewhere",
    )


def pytest_configure(config: pytest.Config) -> None:
    os.environ["DIFFPOLICY_TEST_DEVICE"] = config.getoption("--device")
    # The tests' tensors are tiny: one intra-op thread is faster, and stable when the machine is busy.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def device_type(pytestconfig: pytest.Config) -> str:
    """The device type this run tests (``cpu`` unless ``--device`` says otherwise)."""
    return pytestconfig.getoption("--device")


@pytest.fixture(scope="session")
def runtime(device_type: str):
    """A resolved :class:`diffpolicy.device.Runtime` for the test device (skips if it is unusable)."""
    from diffpolicy.config import DeviceConfig
    from diffpolicy.device import DeviceError, Runtime

    try:
        return Runtime.from_config(DeviceConfig(type=device_type))
    except DeviceError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def device(runtime) -> torch.device:
    """The ``torch.device`` tests put their tensors on."""
    return runtime.device


@pytest.fixture
def compose(device_type: str):
    """``compose(name, overrides)`` -> typed config, with the test device appended as an override."""
    from diffpolicy.cli import compose as _compose

    def _make(config_name: str, overrides: list[str] | None = None):
        extra = [] if config_name in ("collect",) else [f"device={device_type}"]
        return _compose(config_name, [*(overrides or []), *extra])

    return _make


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def init_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An (untrained) tiny policy checkpoint to start PPO from, so the tests need no BC run."""
    from test_train import TINY_POLICY, TINY_RUN

    from diffpolicy.cli import compose as compose_cfg
    from diffpolicy.policy_io import build_policy, env_spec, save_policy

    cfg = compose_cfg("train", [*TINY_RUN, *TINY_POLICY])
    spec, da = env_spec(cfg.env)
    torch.manual_seed(0)
    policy = build_policy(cfg.policy, spec, da)
    root = tmp_path_factory.mktemp("init")
    save_policy(root, 0, policy, env_cfg=cfg.env, policy_cfg=cfg.policy)
    return root
