"""Checkpoint -> policy -> the batched ``Sampler`` the server runs (and :mod:`diffpolicy.export` exports).

What a checkpoint must hold (written by ``diffpolicy.checkpoint.save``):

- ``state["policy"]``: the policy's ``state_dict`` (normalisers included, MiniLM excluded);
- ``config["policy"]``: :class:`~diffpolicy.config.PolicyConfig` fields as plain containers;
- ``extra["obs_spec"]``: observation key -> per-step shape list (``instruction``: any value);
- ``extra["action_dim"]``: Da.

The policy is rebuilt by :func:`diffpolicy.policy_io.load_policy` (``deploy=True``) and sampled with
``DiffusionPolicy.sample(obs, deterministic=..., generator=...)`` whose ``actions`` are (B, Ta, Da) in
environment units.

A base + residual checkpoint (``state["residual"]``, ``algo=residual``) becomes a :class:`ResidualSampler`
instead: its head corrects every control step's action using that step's state, so one chunk per request
cannot carry it; the sampler answers one corrected action per request and keeps each session's base chunk
(see its docstring).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpolicy.device import Runtime
from diffpolicy.policy_io import apply_protocol, load_policy, sampling_protocol
from diffpolicy.serving.wire import ObsSpec, obs_spec_from_shapes


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
            deterministic: take every DDIM step's mean instead of sampling (noise-free; not DDIM eta 0 unless
                the policy's eta is 0).
            seed: seed of the sampling generator (same seed + same requests = same actions).
        """
        self.policy = policy
        self.runtime = runtime or Runtime(device=policy.device)
        self.deterministic = deterministic
        self.obs_spec: ObsSpec = obs_spec_from_shapes(obs_shapes, policy.n_obs_steps)
        self.action_shape = (int(policy.horizon), int(policy.action_dim))
        self.generator = torch.Generator(device=self.runtime.device).manual_seed(seed)
        self.dialogue = bool(getattr(getattr(policy, "obs_encoder", None), "text_memory", 0))
        """The policy reads a dialogue (an instruction memory): the server keeps each session's utterances and
        passes the whole dialogue as ``instruction`` (:class:`~diffpolicy.serving.dialogue.Dialogues`)."""

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


@dataclass
class _Session:
    chunk: torch.Tensor
    """(Te, Da) base actions of the session's current decision, env units."""
    cond: torch.Tensor
    """(cond_dim,) the base's condition of that decision."""
    phase: int = 0
    """Next row of ``chunk`` to execute (Te: used up, replan)."""


def _rows(obs_batch: dict[str, Any], idx: list[int]) -> dict[str, Any]:
    """Rows ``idx`` of a collated batch (tensors indexed, texts picked)."""
    return {k: [v[i] for i in idx] if isinstance(v, list) else v[idx] for k, v in obs_batch.items()}


class ResidualSampler:
    """A base + residual policy as a per-step server ``Sampler``: one corrected action (1, Da) per request.

    Each session (one robot's episode, the request's ``Observation.session``) keeps its base chunk, cond and
    phase, as :class:`diffpolicy.policies.residual.StepActor` keeps them per environment: a request whose session is
    new or has executed its Te actions first replans (the base's deterministic DDIM, x_K from this
    sampler's seeded generator), then gets clip(base[phase] + alpha * tanh(mean(x)), -1, 1) with x built
    from its own state: the deterministic action ``StepActor.act(deterministic=True)`` executes. Requests
    of one session in the same batch are served one after another, in arrival order. At most
    ``max_sessions`` sessions are kept; the least recently served is forgotten first (it replans on its
    next request). Only the batching worker's thread calls :meth:`act`.
    """

    per_step = True

    def __init__(
        self,
        policy: torch.nn.Module,
        obs_shapes: dict[str, Any],
        *,
        runtime: Runtime | None = None,
        seed: int = 0,
        max_sessions: int = 4096,
    ) -> None:
        """
        Args:
            policy: a :class:`diffpolicy.policies.residual.ResidualPolicy` in eval mode.
            obs_shapes: the checkpoint's ``extra["obs_spec"]`` (key -> per-step shape).
            runtime: device and precision of the base's sampling (default: the policy's device, fp32).
            seed: seed of the generator of the base's x_K.
            max_sessions: sessions kept at most (least recently served forgotten first).
        """
        if policy.base.n_obs_steps != 1:
            raise ValueError("a base + residual policy acts on one observation step (To = 1)")
        if max_sessions < 1:
            raise ValueError(f"max_sessions={max_sessions} must be >= 1")
        self.policy = policy
        self.runtime = runtime or Runtime(device=policy.device)
        self.obs_spec: ObsSpec = obs_spec_from_shapes(obs_shapes, 1)
        self.action_shape = (1, int(policy.action_dim))
        self.seed = seed
        self.generator = torch.Generator(device=self.runtime.device).manual_seed(seed)
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, _Session] = OrderedDict()

    def clear_sessions(self) -> None:
        """Forget every session and restart the generator from the seed (after warm-up, so that what the
        server answers does not depend on how it was warmed up)."""
        self.sessions.clear()
        self.generator.manual_seed(self.seed)

    def act(self, obs_batch: dict[str, np.ndarray | list[str]], sessions: list[str]) -> np.ndarray:
        """obs_batch: tensors (B, *shape), texts list of B strings; sessions: B ids -> actions (B, 1, Da)."""
        out = np.empty((len(sessions), *self.action_shape), np.float32)
        rows = list(range(len(sessions)))
        while rows:  # rounds of distinct sessions: a session's later request sees its earlier one's step
            seen: set[str] = set()
            now, later = [], []
            for i in rows:
                (later if sessions[i] in seen else now).append(i)
                seen.add(sessions[i])
            out[now, 0] = self._step(_rows(obs_batch, now), [sessions[i] for i in now])
            rows = later
        return out

    @torch.no_grad()
    def _step(self, obs_batch: dict[str, Any], sessions: list[str]) -> np.ndarray:
        """One control step of distinct sessions: -> (n, Da) float32 env units."""
        from diffpolicy.policies.base import to_policy_obs

        policy, head, dev = self.policy, self.policy.head, self.runtime.device
        te = policy.n_action_steps
        fresh = [j for j, s in enumerate(sessions) if s not in self.sessions or self.sessions[s].phase >= te]
        if fresh:
            obs = to_policy_obs(_rows(obs_batch, fresh), dev)
            with self.runtime.autocast():
                actions, out = policy.base.plan(
                    obs, deterministic=True, return_chain=False, generator=self.generator
                )  # (n, Te, Da): as ResidualPolicy.plan, with this sampler's generator
            for j, chunk, cond in zip(fresh, actions.float(), out.cond.float()):
                self.sessions[sessions[j]] = _Session(chunk, cond)
        states = [self.sessions[s] for s in sessions]
        base = torch.stack([s.chunk[s.phase] for s in states])  # (n, Da)
        phase = torch.tensor([s.phase for s in states], device=dev)
        cond = torch.stack([s.cond for s in states]) if head.cond_dim else None
        state = torch.as_tensor(np.asarray(obs_batch["state"]), device=dev, dtype=torch.float32)
        u, _ = head.sample(head.inputs(policy.state_input(state), base, phase, cond), deterministic=True)
        action = head.correct(base, u)
        for name, sess in zip(sessions, states):
            sess.phase += 1
            self.sessions.move_to_end(name)
        while len(self.sessions) > self.max_sessions:
            self.sessions.popitem(last=False)
        return action.cpu().numpy()


def sampler_from_checkpoint(
    path: str | Path,
    *,
    runtime: Runtime | None = None,
    text_backend: str = "",
    deterministic: bool | None = None,
    seed: int = 0,
    max_sessions: int = 4096,
) -> PolicySampler | ResidualSampler:
    """Load a checkpoint and wrap its policy for the server (a base + residual one per control step;
    ``deterministic`` does not apply to it: its base and head are always deterministic). ``deterministic``
    None samples under the checkpoint's protocol (:func:`diffpolicy.policy_io.sampling_protocol`)."""
    device = runtime.device if runtime is not None else torch.device("cpu")
    policy, _, ckpt = load_policy(path, device, text_backend=text_backend, deploy=True)
    shapes = dict(ckpt.extra["obs_spec"])
    if getattr(policy, "acts_per_step", False):
        return ResidualSampler(policy, shapes, runtime=runtime, seed=seed, max_sessions=max_sessions)
    noise_free, protocol, _ = sampling_protocol(ckpt, deterministic)
    apply_protocol(policy, protocol)
    return PolicySampler(policy, shapes, runtime=runtime, deterministic=noise_free, seed=seed)
