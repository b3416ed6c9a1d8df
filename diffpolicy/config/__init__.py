"""Typed configuration: one dataclass per component, validated once in ``__post_init__``.

YAML files under ``conf/`` only compose and override these. Every dataclass is registered in Hydra's
ConfigStore by :func:`register_configs` (called by the entry points; this module itself never imports Hydra
so that library code can build configs in plain Python).

Symbols follow DESIGN.md: B batch, To observation history, Ta action horizon, Da action dimension,
Te executed actions per decision, K denoising steps, K' fine-tuned steps, T decisions per iteration.
"""

from __future__ import annotations

from diffpolicy.config.common import (
    ENV_DEFAULTS,
    ENV_FIELDS_ADDED,
    ENV_RUNTIME_FIELDS,
    MISSING_PATH,
    OBS_MODE_DEFAULTS,
    PICK_WORKSPACE,
    PROTOCOLS,
    TEST_SEED,
    VAL_SEED,
    check_splits,
    default_cache_dir,
)
from diffpolicy.config.components import (
    BCConfig,
    DeviceConfig,
    DistConfig,
    EncoderConfig,
    EnvConfig,
    LogConfig,
    PolicyConfig,
)
from diffpolicy.config.jobs import (
    DEFAULT_PORT,
    DERIVED,
    GROUPS,
    POLICY_DERIVED,
    PRIMARY,
    TEXT_BACKENDS,
    BenchConfig,
    CollectConfig,
    EvaluateConfig,
    ExportConfig,
    PretrainConfig,
    ServeConfig,
    TrainConfig,
    derive_from_obs_mode,
    register_configs,
    replace,
)
from diffpolicy.config.learners import (
    LEARNERS,
    ChainConfig,
    FilteredBCConfig,
    FPOConfig,
    LearnerConfig,
    PPOConfig,
    ResidualConfig,
    SamplingConfig,
    as_learner,
)

__all__ = [
    "BCConfig",
    "BenchConfig",
    "ChainConfig",
    "CollectConfig",
    "DEFAULT_PORT",
    "DERIVED",
    "DeviceConfig",
    "DistConfig",
    "ENV_DEFAULTS",
    "ENV_FIELDS_ADDED",
    "ENV_RUNTIME_FIELDS",
    "EncoderConfig",
    "EnvConfig",
    "EvaluateConfig",
    "ExportConfig",
    "FPOConfig",
    "FilteredBCConfig",
    "GROUPS",
    "LEARNERS",
    "LearnerConfig",
    "LogConfig",
    "MISSING_PATH",
    "OBS_MODE_DEFAULTS",
    "PICK_WORKSPACE",
    "PROTOCOLS",
    "POLICY_DERIVED",
    "PPOConfig",
    "SamplingConfig",
    "PRIMARY",
    "PolicyConfig",
    "PretrainConfig",
    "ResidualConfig",
    "ServeConfig",
    "TEST_SEED",
    "TEXT_BACKENDS",
    "TrainConfig",
    "VAL_SEED",
    "as_learner",
    "check_splits",
    "default_cache_dir",
    "derive_from_obs_mode",
    "register_configs",
    "replace",
]
