"""Save and load a policy as a self-describing checkpoint (the one format every entry point reads).

A policy checkpoint is a :mod:`diffpolicy.checkpoint` directory whose

- ``state["policy"]`` is the policy's ``state_dict`` (normalisers included, the frozen MiniLM excluded),
  next to any other named trees the caller adds (optimiser, EMA, RNG states);
- ``config["env"]`` / ``config["policy"]`` are the :class:`~diffpolicy.config.EnvConfig` and
  :class:`~diffpolicy.config.PolicyConfig` fields as plain containers;
- ``extra["obs_spec"]`` maps each observation key to its per-step shape (``instruction`` -> ``[]``) and
  ``extra["action_dim"]`` is Da.

:func:`load_policy` rebuilds both dataclasses (re-running their validation), the policy with
:func:`~diffpolicy.policies.make_policy` and its weights with :func:`~diffpolicy.checkpoint.load_state`, which
checks every key and shape first; ``deploy=True`` (serving and export) reads the policy alone. Anything that
does not fit raises :class:`CheckpointError` in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from diffpolicy import checkpoint
from diffpolicy.checkpoint import Checkpoint, CheckpointError
from diffpolicy.config import (
    ENV_FIELDS_ADDED,
    ENV_RUNTIME_FIELDS,
    PROTOCOLS,
    EncoderConfig,
    EnvConfig,
    PolicyConfig,
)

POLICY_FIELDS_ADDED = (
    "denoiser", "mlp_dims", "unexecuted_weight", "fold", "prediction", "train_kernels", "plan_slots",
)  # fmt: skip
"""PolicyConfig fields newer than some checkpoints: a checkpoint that lacks them gets their defaults (and at
their defaults they stay out of the BC cache key, :func:`diffpolicy.bc.bc_key`, so older caches stay valid)."""
POLICY_FIELDS_LEGACY: dict[str, Any] = {"unexecuted_weight": 1.0}
"""Fields of :data:`POLICY_FIELDS_ADDED` whose derived value can differ from how checkpoints written before
them behaved: such a checkpoint gets this value, and at this value the field stays out of the BC cache key."""
POLICY_FIELDS_MOVED = ("ft_steps", "ft_fraction", "min_std", "eta")
"""PolicyConfig fields that moved to the sampling learner's config (``algo.*``, :class:`SamplingConfig`): a
checkpoint written before records them in ``config["policy"]``; they are read from there as its sampling."""
ENCODER_FIELDS_ADDED = (
    "blank_text", "fusion", "predict_positions", "position_noise", "position_head", "text_memory",
    "text_memory_turns", "text_standardize",
)  # fmt: skip
"""EncoderConfig fields newer than some checkpoints, treated as :data:`POLICY_FIELDS_ADDED` are."""


def sampling_protocol(
    ckpt: Checkpoint, deterministic: bool | None, protocol: str = ""
) -> tuple[bool, str, str]:
    """How ``evaluate``, ``export`` and ``serve`` sample a checkpoint's policy: ``(deterministic, protocol,
    source)``. A named ``protocol`` wins, then an explicit ``deterministic`` (source ``override``); else the
    protocol the checkpoint's figure was reported under (``checkpoint``); else, for a checkpoint that records
    none (BC checkpoints, older runs), ``exploration`` (``default``). Apply it with :func:`apply_protocol`."""
    if protocol:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")
        if deterministic is not None and deterministic != PROTOCOLS[protocol]:
            raise ValueError(f"protocol={protocol} and deterministic={deterministic} disagree; give one")
        return PROTOCOLS[protocol], protocol, "override"
    if deterministic is not None:
        return bool(deterministic), "noise_free" if deterministic else "exploration", "override"
    recorded = ckpt.extra.get("protocol")
    if recorded is None:
        return False, "exploration", "default"
    if recorded not in PROTOCOLS:
        raise CheckpointError(
            f"checkpoint {ckpt.path}: extra['protocol']={recorded!r} is not one of {', '.join(PROTOCOLS)}"
        )
    return PROTOCOLS[recorded], recorded, "checkpoint"


def apply_protocol(policy: Any, protocol: str) -> None:
    """Make ``policy`` sample under ``protocol`` where its schedule must change (``dppo``: the natural stds;
    ``ddim``: eta 0); ``noise_free`` / ``exploration`` need only the ``deterministic`` flag. A per-step policy (base + residual)
    always acts noise-free and is left as it is."""
    schedule = getattr(policy, "schedule", None)
    if protocol == "dppo" and schedule is not None:
        policy.schedule = schedule.with_natural_std()
    elif protocol == "ddim" and schedule is not None:
        policy.schedule = schedule.with_eta(0.0)


@contextmanager
def sampling_under(policy: Any, protocol: str) -> Iterator[bool]:
    """Within the block ``policy`` samples under ``protocol`` (:func:`apply_protocol`); yields the
    ``deterministic`` flag to sample with, and gives the policy its own schedule back on exit."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol={protocol!r} is not one of {', '.join(PROTOCOLS)}")
    schedule = getattr(policy, "schedule", None)
    apply_protocol(policy, protocol)
    try:
        yield PROTOCOLS[protocol]
    finally:
        if schedule is not None:
            policy.schedule = schedule


def save_policy(
    root: str | Path,
    step: int,
    policy: Any,
    *,
    env_cfg: EnvConfig,
    policy_cfg: PolicyConfig,
    obs_spec: dict[str, list[int]] | None = None,
    extra_state: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 3,
) -> Path:
    """Write ``policy`` (and optional extra state) as checkpoint ``step`` under ``root``; returns its directory.

    Args:
        root: checkpoint root (``latest`` points at the newest complete checkpoint).
        step: step number naming the checkpoint.
        policy: a ``PolicyBase`` (diffusion or Gaussian).
        env_cfg: the environment it was trained on.
        policy_cfg: the configuration it was built from.
        obs_spec: modality -> per-step shape; defaults to ``policy.obs_spec`` (set by :func:`build_policy`)
            or, failing that, the spaces of ``env_cfg``'s environment.
        extra_state: more named trees (``{"optim": ..., "ema": ...}``), stored beside ``"policy"``.
        metrics: metrics at this step (stored in ``meta.json``).
        extra: more JSON-able description (cache keys, seeds); ``obs_spec`` / ``action_dim`` are added.
        keep: newest checkpoints kept under ``root`` (0 keeps all).
    """
    extra_state = dict(extra_state or {})
    if "policy" in extra_state:
        raise ValueError(
            "extra_state must not contain 'policy'; the policy weights are stored under that name"
        )
    spec = obs_spec if obs_spec is not None else policy_obs_spec(policy, env_cfg)
    return checkpoint.save(
        root,
        step,
        {"policy": policy.state_dict(), **extra_state},
        config={
            "env": asdict(env_cfg),
            "policy": asdict(policy_cfg),
            **({"sampling": dict(policy.sampling)} if hasattr(policy, "sampling") else {}),
        },
        metrics=metrics,
        extra={
            "obs_spec": spec,
            "action_dim": int(policy.action_dim),
            "text_backend": text_backend_of(policy),
            **(extra or {}),
        },
        keep=keep,
    )


def text_backend_of(policy: Any) -> str:
    """Instruction embedder a policy uses (``minilm`` | ``hash``; ``minilm`` when it reads no text)."""
    text = getattr(policy.obs_encoder, "text", None)
    return str(getattr(text, "backend_name", "minilm"))


def env_spec(env_cfg: EnvConfig) -> tuple[dict[str, list[int]], int]:
    """(obs_spec, Da) of ``env_cfg``'s environment, read from the spaces of one freshly built instance."""
    from diffpolicy.env_factory import env_kwargs, obs_spec
    from diffpolicy_envs.adapters import make_env

    env = make_env(env_cfg.id, **env_kwargs(env_cfg, 1))
    try:
        return obs_spec(env.observation_space), int(env.action_space.shape[-1])
    finally:
        env.close()


def build_policy(
    policy_cfg: PolicyConfig,
    obs_spec: dict[str, list[int]],
    action_dim: int,
    *,
    text_backend: str = "minilm",
) -> Any:
    """``make_policy`` that also records ``obs_spec`` on the policy (``policy.obs_spec``) for saving."""
    from diffpolicy.policies import make_policy

    policy = make_policy(policy_cfg, obs_spec, action_dim, text_backend=text_backend)
    policy.obs_spec = {k: [] if k == "instruction" else [int(s) for s in v] for k, v in obs_spec.items()}
    return policy


def policy_obs_spec(policy: Any, env_cfg: EnvConfig | None = None) -> dict[str, list[int]]:
    """The obs_spec a policy was built with: ``policy.obs_spec`` if recorded, else read from ``env_cfg``."""
    spec = getattr(policy, "obs_spec", None)
    if spec is not None:
        return dict(spec)
    if env_cfg is None:
        raise ValueError(
            "the policy does not record its obs_spec; pass obs_spec= or build it with build_policy"
        )
    return env_spec(env_cfg)[0]


def _dataclass_from(
    cls: type, raw: Any, what: str, path: Path, *, allow_missing: bool = False, defaultable: tuple = ()
) -> Any:
    """Plain dict -> ``cls`` with exactly its fields (CheckpointError naming the odd fields otherwise).

    ``allow_missing`` lets fields the checkpoint lacks take their defaults (older checkpoints);
    ``defaultable`` names fields that may be missing anyway (how to run, not what was trained).
    """
    if not isinstance(raw, dict):
        raise CheckpointError(f"checkpoint {path}: config['{what}'] is not a mapping")
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - fields)
    if unknown:
        raise CheckpointError(
            f"checkpoint {path}: config['{what}'] has unknown fields {unknown} (written by other code?)"
        )
    missing = sorted(fields - set(raw) - set(defaultable))
    if missing and not allow_missing:
        raise CheckpointError(
            f"checkpoint {path}: config['{what}'] lacks fields {missing} (written by older code?)"
        )
    values = dict(raw)
    if cls is PolicyConfig and "encoder" in raw:
        values["encoder"] = _dataclass_from(
            EncoderConfig,
            raw["encoder"],
            f"{what}.encoder",
            path,
            allow_missing=allow_missing,
            defaultable=ENCODER_FIELDS_ADDED,
        )
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path}: config['{what}'] is invalid ({exc})") from None


def policy_config_from(ckpt: Checkpoint, *, allow_missing: bool = False) -> PolicyConfig:
    """The PolicyConfig a checkpoint was written with (validated again); ``allow_missing`` gives fields the
    checkpoint lacks their defaults."""
    if "policy" not in ckpt.config:
        raise CheckpointError(f"checkpoint {ckpt.path} lacks config['policy'] (not a policy checkpoint?)")
    raw = ckpt.config["policy"]
    if isinstance(raw, dict):
        raw = {**{k: v for k, v in POLICY_FIELDS_LEGACY.items() if k not in raw}, **raw}
        raw = {k: v for k, v in raw.items() if k not in POLICY_FIELDS_MOVED}
    return _dataclass_from(
        PolicyConfig,
        raw,
        "policy",
        ckpt.path,
        allow_missing=allow_missing,
        defaultable=POLICY_FIELDS_ADDED,
    )


def configs_from(ckpt: Checkpoint) -> tuple[EnvConfig, PolicyConfig]:
    """The EnvConfig and PolicyConfig a checkpoint was written with (validated again)."""
    if "env" not in ckpt.config:
        raise CheckpointError(f"checkpoint {ckpt.path} lacks config['env'] (not a policy checkpoint?)")
    policy_cfg = policy_config_from(ckpt)
    env_cfg = _dataclass_from(
        EnvConfig, ckpt.config["env"], "env", ckpt.path, defaultable=(*ENV_RUNTIME_FIELDS, *ENV_FIELDS_ADDED)
    )
    return env_cfg, policy_cfg


def load_policy(
    path: str | Path,
    device: str | torch.device = "cpu",
    *,
    env_overrides: dict[str, Any] | None = None,
    text_backend: str | None = None,
    deploy: bool = False,
) -> tuple[Any, EnvConfig | None, Checkpoint]:
    """Rebuild the policy of a checkpoint (directory or root with ``latest``) on ``device``, in eval mode.

    Args:
        path: checkpoint directory, or a root whose ``latest`` pointer names one.
        device: where to put the policy.
        env_overrides: EnvConfig fields to change (e.g. ``{"num_envs": 8}``); validated again.
        text_backend: instruction embedder (``minilm`` | ``hash``); default (None or ''): the one the
            checkpoint was trained with (``extra["text_backend"]``), else ``minilm``.
        deploy: for serving and export, which need the policy only: ``config["env"]`` is not read (None is
            returned in its place), PolicyConfig fields an older checkpoint lacks take their defaults, and
            the policy runs eager (``compile`` off: serving and export trace the eager graph).

    Returns:
        ``(policy, env_cfg, ckpt)``: the policy with the checkpoint's weights, the environment it was
        trained on (with the overrides applied; None with ``deploy``) and the loaded checkpoint (other
        state, metrics, extra).

    Raises:
        CheckpointError: missing / corrupt checkpoint, unknown or missing config fields, or weights that do
            not match the rebuilt policy (nothing is modified in that case).
    """
    ckpt = checkpoint.load(path)
    if deploy:
        policy_cfg = dataclasses.replace(policy_config_from(ckpt, allow_missing=True), compile=False)
        return policy_from(ckpt, policy_cfg, device, text_backend=text_backend), None, ckpt
    env_cfg, policy_cfg = configs_from(ckpt)
    if env_overrides:
        unknown = sorted(set(env_overrides) - {f.name for f in dataclasses.fields(EnvConfig)})
        if unknown:
            raise ValueError(f"env_overrides has unknown EnvConfig fields {unknown}")
        env_cfg = dataclasses.replace(env_cfg, **env_overrides)
    return policy_from(ckpt, policy_cfg, device, text_backend=text_backend), env_cfg, ckpt


def sampling_of(ckpt: Checkpoint) -> dict[str, Any]:
    """How the checkpoint's policy sampled its chains (K', eta, std floor, and the measured noise scale when
    it records one): ``config["sampling"]``, or, in a checkpoint written before the learner owned them, the
    :data:`POLICY_FIELDS_MOVED` of ``config["policy"]``; {} when neither records them (the policy's own
    defaults then hold)."""
    if isinstance(ckpt.config.get("sampling"), dict):
        raw = ckpt.config["sampling"]
    else:
        raw = ckpt.config.get("policy") if isinstance(ckpt.config.get("policy"), dict) else {}
    if not all(k in raw for k in ("ft_steps", "eta", "min_std")):
        return {}
    try:
        out = {"ft_steps": int(raw["ft_steps"]), "eta": float(raw["eta"]), "min_std": float(raw["min_std"])}
        for key in ("noise_scale", "action_std", "action_corr"):
            if key in raw:
                out[key] = float(raw[key])
        if raw.get("action_std_env"):
            out["action_std_env"] = True
        return out
    except (TypeError, ValueError):
        raise CheckpointError(f"checkpoint {ckpt.path}: its sampling {raw} is not K', eta, min_std") from None


def policy_from(
    ckpt: Checkpoint,
    policy_cfg: PolicyConfig,
    device: str | torch.device = "cpu",
    *,
    text_backend: str | None = None,
) -> Any:
    """The policy of a loaded checkpoint, built from ``policy_cfg``, with its weights, on ``device``, in eval
    mode (``text_backend`` None or '': the checkpoint's ``extra["text_backend"]``, else ``minilm``)."""
    if "policy" not in ckpt.state:
        raise CheckpointError(f"checkpoint {ckpt.path} holds no 'policy' weights (has {sorted(ckpt.state)})")
    for key in ("obs_spec", "action_dim"):
        if key not in ckpt.extra:
            raise CheckpointError(f"checkpoint {ckpt.path} lacks extra['{key}'] (not a policy checkpoint?)")
    spec = {k: [] if k == "instruction" else list(v) for k, v in dict(ckpt.extra["obs_spec"]).items()}
    backend = text_backend or str(ckpt.extra.get("text_backend", "minilm"))
    policy = build_policy(policy_cfg, spec, int(ckpt.extra["action_dim"]), text_backend=backend)
    checkpoint.load_state(policy, ckpt.state["policy"], name="policy")
    sampling = sampling_of(ckpt)
    if sampling and hasattr(policy, "set_sampling"):
        policy.set_sampling(**sampling, freeze=False)
    if "base_denoiser" in ckpt.state and hasattr(policy, "freeze_base"):  # K' < K: the frozen early steps
        policy.freeze_base()
        if policy.base_denoiser is None:
            raise CheckpointError(f"checkpoint {ckpt.path} holds a base denoiser but its policy has K' = K")
        checkpoint.load_state(policy.base_denoiser, ckpt.state["base_denoiser"], name="base_denoiser")
    if "residual" in ckpt.state:  # base + residual (algo=residual): the head rides beside the base
        policy = residual_from(ckpt, policy)
    return policy.to(device).eval()


def residual_from(ckpt: Checkpoint, base: Any) -> Any:
    """Wrap ``base`` with the checkpoint's residual head into a ``ResidualPolicy`` (weights loaded)."""
    from diffpolicy.models.residual import ResidualHead
    from diffpolicy.policies.residual import ResidualPolicy

    desc = ckpt.extra.get("residual")
    if not isinstance(desc, dict) or not {"alpha", "hidden", "cond_dim"} <= set(desc):
        raise CheckpointError(
            f"checkpoint {ckpt.path} has residual weights but no extra['residual'] description"
        )
    head = ResidualHead(
        int(base.obs_spec["state"][-1]),
        int(base.action_dim),
        int(base.n_action_steps),
        cond_dim=int(desc["cond_dim"]),
        hidden=tuple(int(h) for h in desc["hidden"]),
        alpha=float(desc["alpha"]),
    )
    checkpoint.load_state(head, ckpt.state["residual"], name="residual")
    return ResidualPolicy(base, head)
