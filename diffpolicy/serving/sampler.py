"""Checkpoint -> policy -> the batched ``Sampler`` the server runs (and :mod:`diffpolicy.export` exports).

What a checkpoint must hold (written by ``diffpolicy.checkpoint.save``):

- ``state["policy"]``: the policy's ``state_dict`` (normalisers included, MiniLM excluded);
- ``config["policy"]``: :class:`~diffpolicy.config.PolicyConfig` fields as plain containers;
- ``extra["obs_spec"]``: observation key -> per-step shape list (``instruction``: any value);
- ``extra["action_dim"]``: Da.

The policy is rebuilt with :func:`diffpolicy.policy.make_policy` and sampled with
``DiffusionPolicy.sample(obs, deterministic=..., generator=...)`` whose ``actions`` are (B, Ta, Da) in
environment units.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpolicy import checkpoint
from diffpolicy.checkpoint import CheckpointError
from diffpolicy.config import PolicyConfig
from diffpolicy.device import Runtime
from diffpolicy.serving.wire import ObsSpec, obs_spec_from_shapes


def policy_config(raw: dict[str, Any]) -> PolicyConfig:
    """A checkpoint's ``config["policy"]`` -> validated PolicyConfig (CheckpointError on unknown fields)."""
    known = {f.name for f in dataclasses.fields(PolicyConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise CheckpointError(f"checkpoint's policy config has unknown fields {unknown} (newer code?)")
    return PolicyConfig(**raw)


def load_policy(
    path: str | Path, *, device: str | torch.device = "cpu", text_backend: str = ""
) -> tuple[torch.nn.Module, dict[str, Any], checkpoint.Checkpoint]:
    """Rebuild the policy of a checkpoint in eval mode on ``device``.

    ``text_backend`` '' takes the checkpoint's ``extra["text_backend"]`` (written by
    ``diffpolicy.policy_io.save_policy``), else ``minilm``. Unlike ``policy_io.load_policy`` this needs no
    ``config["env"]`` and accepts configs that lack newer PolicyConfig fields (their defaults apply).

    Returns:
        (policy, obs_spec shapes from ``extra["obs_spec"]``, the loaded checkpoint).
    """
    from diffpolicy.policy import make_policy

    ckpt = checkpoint.load(path)
    if "policy" not in ckpt.state:
        raise CheckpointError(f"checkpoint {ckpt.path} holds no 'policy' weights (has {sorted(ckpt.state)})")
    for key in ("obs_spec", "action_dim"):
        if key not in ckpt.extra:
            raise CheckpointError(
                f"checkpoint {ckpt.path} lacks extra['{key}'] (written by an older trainer?)"
            )
    if "policy" not in ckpt.config:
        raise CheckpointError(f"checkpoint {ckpt.path} lacks config['policy']")
    cfg = policy_config(dict(ckpt.config["policy"]))
    cfg.compile = False  # serving and export trace the eager graph
    shapes = dict(ckpt.extra["obs_spec"])
    backend = text_backend or str(ckpt.extra.get("text_backend", "minilm"))
    policy = make_policy(cfg, shapes, int(ckpt.extra["action_dim"]), text_backend=backend)
    checkpoint.load_state(policy, ckpt.state["policy"], name="policy")
    return policy.to(device).eval(), shapes, ckpt


class PolicySampler:
    """A trained policy as a server ``Sampler``: numpy batch in, (B, Ta, Da) float32 actions out.

    ``obs_spec`` lists every modality of the checkpoint's obs_spec (the server requires all of them, even
    one the encoders ignore, e.g. ``rgb`` with ``encoder.use_rgb=false``), with a leading To axis when
    the policy keeps To > 1 observation steps. Only the batching worker's thread calls :meth:`act`.
    """

    def __init__(
        self,
        policy: torch.nn.Module,
        obs_shapes: dict[str, Any],
        *,
        runtime: Runtime | None = None,
        deterministic: bool = False,
        seed: int = 0,
    ) -> None:
        """
        Args:
            policy: a ``DiffusionPolicy`` (or any ``PolicyBase``) in eval mode.
            obs_shapes: the checkpoint's ``extra["obs_spec"]`` (key -> per-step shape).
            runtime: device and precision (default: the policy's device, fp32).
            deterministic: take every DDIM step's mean instead of sampling (eta = 0 behaviour).
            seed: seed of the sampling generator (same seed + same requests = same actions).
        """
        self.policy = policy
        self.runtime = runtime or Runtime(device=policy.device)
        self.deterministic = deterministic
        self.obs_spec: ObsSpec = obs_spec_from_shapes(obs_shapes, policy.n_obs_steps)
        self.action_shape = (int(policy.horizon), int(policy.action_dim))
        self.generator = torch.Generator(device=self.runtime.device).manual_seed(seed)

    def to_torch(self, obs_batch: dict[str, np.ndarray | list[str]]) -> dict[str, Any]:
        """Numpy batch -> the policy's observation dict on its device (texts stay a list of B strings)."""
        dev = self.runtime.device
        return {
            k: v
            if isinstance(v, list)
            else torch.from_numpy(np.ascontiguousarray(v)).to(dev, non_blocking=True)
            for k, v in obs_batch.items()
        }

    def act(self, obs_batch: dict[str, np.ndarray | list[str]]) -> np.ndarray:
        """obs_batch: tensors (B, *shape), texts list of B strings -> actions (B, Ta, Da) float32."""
        obs = self.to_torch(obs_batch)
        with self.runtime.autocast():
            out = self.policy.sample(obs, deterministic=self.deterministic, generator=self.generator)
        return out.actions.float().cpu().numpy()  # (B, Ta, Da)


def sampler_from_checkpoint(
    path: str | Path,
    *,
    runtime: Runtime | None = None,
    text_backend: str = "",
    deterministic: bool = False,
    seed: int = 0,
) -> PolicySampler:
    """Load a checkpoint and wrap its policy for the server."""
    device = runtime.device if runtime is not None else torch.device("cpu")
    policy, shapes, _ = load_policy(path, device=device, text_backend=text_backend)
    return PolicySampler(policy, shapes, runtime=runtime, deterministic=deterministic, seed=seed)
