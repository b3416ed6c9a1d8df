"""Checkpoint -> policy -> the batched ``Sampler`` the server runs (and :mod:`diffpolicy.export` exports).

What a checkpoint must hold (written by ``diffpolicy.checkpoint.save``):

- ``state["policy"]``: the policy's ``state_dict`` (normalisers included, MiniLM excluded);
- ``config["policy"]``: :class:`~diffpolicy.config.PolicyConfig` fields as plain containers;
- ``extra["obs_spec"]``: observation key -> per-step shape list (``instruction``: any value);
- ``extra["action_dim"]``: Da.

The policy is rebuilt by :func:`diffpolicy.policy_io.policy_from` and sampled with
``DiffusionPolicy.sample(obs, deterministic=..., generator=...)`` whose ``actions`` are (B, Ta, Da) in
environment units.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpolicy import checkpoint
from diffpolicy.device import Runtime
from diffpolicy.policy_io import policy_config_from, policy_from
from diffpolicy.serving.wire import ObsSpec, obs_spec_from_shapes


def load_policy(
    path: str | Path, *, device: str | torch.device = "cpu", text_backend: str = ""
) -> tuple[torch.nn.Module, dict[str, Any], checkpoint.Checkpoint]:
    """Rebuild the policy of a checkpoint in eval mode on ``device``, for serving and export.

    ``text_backend`` '' takes the checkpoint's ``extra["text_backend"]`` (written by
    ``diffpolicy.policy_io.save_policy``), else ``minilm``. Unlike ``policy_io.load_policy`` this needs no
    ``config["env"]`` and accepts configs that lack newer PolicyConfig fields (their defaults apply); the
    policy runs eager (``compile`` off: serving and export trace the eager graph).

    Returns:
        (policy, obs_spec shapes from ``extra["obs_spec"]``, the loaded checkpoint).
    """
    ckpt = checkpoint.load(path)
    cfg = policy_config_from(ckpt, allow_missing=True)
    cfg.compile = False
    policy = policy_from(ckpt, cfg, device, text_backend=text_backend)
    return policy, dict(ckpt.extra["obs_spec"]), ckpt


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
