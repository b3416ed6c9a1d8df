"""Imitation of demonstrations plus kept successful episodes: the windows it draws and the BC steps it takes.

Shared by success-filtered self-imitation (``algo=filtered_bc``, where it is the whole update) and the chain
learner's imitation anchor (``algo.anchor_steps``, beside the PPO loss). A window is an observation at a
decision (To = 1) and the Ta actions executed from there on, as a demonstration gives them at the steps where
the policy replans; :func:`imitation_steps` continues BC on batches drawn uniformly (or by weight) from the
demonstrations and every kept window, each seen from a scene shifted as BC shifts it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from diffpolicy.bc import bc_losses, shifted_scenes
from diffpolicy.config import BCConfig
from diffpolicy.data.dataset import TARGET_KEY
from diffpolicy.distributed import DistInfo, average_gradients


class WindowStore:
    """Windows (observation at a decision, the Ta actions executed from it) from successful episodes.

    ``obs[key]`` (N, 1, ...) tensors on the CPU (``instruction``: a list of N strings); ``actions``
    (N, Ta, Da) float32, env units; ``weights`` (N,) float32, how often the continuation draws each window
    relative to a demonstration's (1; ``algo.keep=advantage``: its scene's advantage).
    """

    def __init__(self, horizon: int) -> None:
        self.horizon = horizon
        self.obs: dict[str, Any] = {}
        self.actions = torch.zeros(0)
        self.weights = torch.zeros(0)
        self._chunks: list[tuple[dict[str, Any], torch.Tensor]] = []
        self._chunk_weights: list[torch.Tensor] = []

    def __len__(self) -> int:
        return len(self.actions) + sum(len(a) for _, a in self._chunks)

    def add_episode(self, decisions: list[tuple[dict[str, Any], np.ndarray]], weight: float = 1.0) -> int:
        """One successful episode: ``decisions`` [(obs of one env at that decision, executed (e, Da))], each
        window drawn with ``weight``; -> windows added."""
        executed = np.concatenate([a for _, a in decisions])  # (L, Da): every control step of the episode
        starts = np.cumsum([0] + [len(a) for _, a in decisions[:-1]])  # (D,) step index of each decision
        idx = np.minimum(starts[:, None] + np.arange(self.horizon), len(executed) - 1)  # (D, Ta)
        actions = torch.from_numpy(executed[idx].astype(np.float32))  # (D, Ta, Da)
        obs: dict[str, Any] = {}
        for key in decisions[0][0]:
            values = [o[key] for o, _ in decisions]
            obs[key] = (
                [str(v) for v in values]
                if key == "instruction"
                else torch.from_numpy(np.stack(values))[:, None]
            )  # (D, 1, ...)
        self._chunks.append((obs, actions))
        self._chunk_weights.append(torch.full((len(actions),), float(weight)))
        return len(actions)

    def _consolidate(self) -> None:
        if self._chunks:
            self.obs, self.actions = concat_batches([(self.obs, self.actions), *self._chunks])
            self.weights = torch.cat([self.weights, *self._chunk_weights])
            self._chunks, self._chunk_weights = [], []

    @property
    def uniform(self) -> bool:
        """True when every window is drawn alike (no ``keep=advantage`` weights)."""
        self._consolidate()
        return bool(torch.all(self.weights == 1.0))

    def batch(self, idx: torch.Tensor, device: torch.device) -> tuple[dict[str, Any], torch.Tensor]:
        """Windows ``idx`` (B,) -> (obs (B, 1, ...) on ``device``, actions (B, Ta, Da))."""
        self._consolidate()
        obs = {
            key: ([value[int(i)] for i in idx] if key == "instruction" else value[idx].to(device))
            for key, value in self.obs.items()
        }
        return obs, self.actions[idx].to(device)

    def state(self) -> dict[str, Any]:
        self._consolidate()
        return {"obs": self.obs, "actions": self.actions, "weights": self.weights}

    def load(self, state: dict[str, Any]) -> None:
        self.obs, self.actions = dict(state["obs"]), state["actions"]
        self._chunks, self._chunk_weights = [], []
        self.weights = state.get("weights", torch.ones(len(self.actions)))  # checkpoints before the weights


def concat_batches(parts: list[tuple[dict[str, Any], torch.Tensor]]) -> tuple[dict[str, Any], torch.Tensor]:
    """Join (obs, actions) batches with the same keys along B."""
    parts = [p for p in parts if len(p[1])]
    keys = parts[0][0].keys()
    obs = {
        k: (
            [s for o, _ in parts for s in o[k]] if k == "instruction" else torch.cat([o[k] for o, _ in parts])
        )
        for k in keys
    }
    return obs, torch.cat([a for _, a in parts])


def imitation_steps(
    model: Any,
    optim: torch.optim.Optimizer,
    params: list[torch.Tensor],
    demos: Any,
    kept: WindowStore,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    labelled: bool,
    bc_cfg: BCConfig,
    runtime: Any,
    info: DistInfo,
    generator: torch.Generator,
    max_grad_norm: float = 0.0,
    after_step: Callable[[], None] | None = None,
) -> list[float]:
    """``steps`` AdamW steps of BC's loss on ``model`` over windows of the demonstrations (``demos``: a
    :class:`~diffpolicy.data.windows.DemoWindows`) and ``kept``; -> the loss of every step.

    The lr warms up linearly over the first twentieth of the steps to ``lr``. A batch of ``batch_size`` (at
    most every window) is drawn uniformly over demonstrations and kept windows, or, where ``kept`` holds
    weights (``algo.keep=advantage``), in proportion to them with a demonstration weighing 1. With
    ``labelled`` (predict-then-act and labels on both sides) the loss is BC's with the labelled positions and
    the position head's auxiliary term (``bc.target_aux_weight``). ``after_step`` runs after every optimiser
    step (the EMA's follow). Gradients are averaged over ranks; a non-finite loss raises."""
    n_demo, n_kept = len(demos), len(kept)
    batch = min(batch_size, n_demo + n_kept)
    warmup = max(1, steps // 20)
    device = runtime.device
    draw = None if not n_kept or kept.uniform else torch.cat([torch.ones(n_demo), kept.weights])
    values: list[float] = []
    for k in range(steps):
        for group in optim.param_groups:
            group["lr"] = lr * min(1.0, (k + 1) / warmup)
        idx = (
            torch.randint(0, n_demo + n_kept, (batch,), generator=generator)
            if draw is None
            else torch.multinomial(draw, batch, replacement=True, generator=generator)
        )
        demo_idx = idx[idx < n_demo]
        demo_obs, demo_actions = demos.batch(demo_idx, device)
        if labelled:
            demo_obs[TARGET_KEY] = demos.target(demo_idx, device)[:, None]  # (b, 1, 3 k)
        parts = [(demo_obs, demo_actions)]
        if n_kept:
            parts.append(kept.batch(idx[idx >= n_demo] - n_demo, device))
        obs, actions = concat_batches(parts)
        target = obs.pop(TARGET_KEY)[:, 0] if labelled else None  # (B, 3 k) m
        obs, target = shifted_scenes(obs, target, bc_cfg, generator)  # BC's augmentation, kept windows too
        with runtime.autocast():
            if labelled:
                loss, aux_loss, _ = bc_losses(model, None, obs, actions, target, bc_cfg, generator)
                loss = loss + bc_cfg.target_aux_weight * aux_loss
            else:
                loss = model.bc_loss(obs, actions)
        optim.zero_grad(set_to_none=True)
        loss.backward()
        average_gradients(params, info)
        torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf)
        optim.step()
        if after_step is not None:
            after_step()
        value = float(loss.detach())
        if not math.isfinite(value):
            raise ValueError(f"the imitation loss is {value} at step {k + 1}; lower the learning rate")
        values.append(value)
    return values


def loss_summary(values: list[float]) -> dict[str, float]:
    """The mean loss of a round's steps and of its first and last tenth (is it still learning?)."""
    tenth = max(1, len(values) // 10)
    return {
        "mean": sum(values) / max(1, len(values)),
        "first": sum(values[:tenth]) / tenth,
        "last": sum(values[-tenth:]) / tenth,
    }


def successful_episodes(
    data: dict[str, torch.Tensor],
    keys: list[str],
    actions: np.ndarray,
    decode: Callable[[torch.Tensor], list[str]],
) -> list[list[tuple[dict[str, Any], np.ndarray]]]:
    """The successful episodes in a rollout's (T, N) decisions, each as [(the observation of one decision,
    the actions it executed (e, Da))], ready for :meth:`WindowStore.add_episode`.

    ``data`` holds the observation fields ``keys`` (T, N, ...), ``dones``, ``success`` and ``executed``
    (T, N); ``actions`` (T, N, Ta, Da) are each decision's chunk in env units. An episode runs from a
    decision after a done (or the rollout's start) to the next done; it is kept when one of its decisions
    reached success. One the rollout cut before its end is kept up to its last successful decision."""
    dones = data["dones"].cpu().numpy() > 0.5
    success = data["success"].cpu().numpy() > 0.5
    executed = data["executed"].cpu().numpy().astype(np.int64)
    T, N = dones.shape
    fields = {k: data[k] if k == "instruction" else data[k].cpu().numpy() for k in keys}

    def seen(t: int, n: int) -> dict[str, Any]:
        return {
            k: (decode(v[t, n : n + 1])[0] if k == "instruction" else np.array(v[t, n]))
            for k, v in fields.items()
        }

    episodes = []
    for n in range(N):
        start = 0
        for t in range(T):
            if not (dones[t, n] or t == T - 1):
                continue
            hits = np.flatnonzero(success[start : t + 1, n])
            if hits.size:
                stop = t if dones[t, n] else start + int(hits[-1])
                episodes.append(
                    [(seen(u, n), actions[u, n, : max(1, executed[u, n])]) for u in range(start, stop + 1)]
                )
            start = t + 1
    return episodes
