"""Multi-stage tasks: training a sub-task selector from labelled demonstrations, saving and loading it, and the
hierarchy of a selector above a low-level policy (library code: ``pretrain policy=selector`` and
``evaluate selector=PATH`` call it).

The demonstrations of a multi-stage task (``env.kwargs.task=stages``) record each step's sub-task as a
one-step instruction (``subtask``). The selector learns, by cross-entropy, to name it from the observation and
the task's instruction; the low-level policy is a diffusion policy cloned with those labels as its
instruction (``bc.instruction=subtask``); :class:`~diffpolicy.policies.selector.HierarchicalPolicy` joins them.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from diffpolicy import checkpoint
from diffpolicy.bc import adamw, bc_budget, cosine_with_warmup
from diffpolicy.config import BCConfig, EncoderConfig, EnvConfig, PolicyConfig
from diffpolicy.data.dataset import SUBTASK_KEY, DemoWriter
from diffpolicy.data.windows import DemoWindows
from diffpolicy.device import Runtime
from diffpolicy.logger import Logger
from diffpolicy.policies.selector import HierarchicalPolicy, SubtaskSelector

KIND = "selector"
"""``extra["kind"]`` of a selector checkpoint."""
WARMUP_FRACTION = 0.05
"""Share of the optimiser steps over which the learning rate warms up."""


def train_selector(
    env_cfg: EnvConfig,
    policy_cfg: PolicyConfig,
    bc_cfg: BCConfig,
    demos_path: str | Path,
    runtime: Runtime,
    logger: Logger,
    run_dir: str | Path,
    seed: int,
    *,
    corrections: list[str] | tuple[str, ...] = (),
    text_backend: str = "minilm",
    extra: dict[str, Any] | None = None,
) -> tuple[SubtaskSelector, dict[str, Any]]:
    """Train a :class:`SubtaskSelector` on the demonstrations' sub-task labels, and on a person's corrections.

    Every stored step of a kept episode is one example (its observation at To = 1 and its ``subtask`` label);
    the vocabulary is the labels' distinct strings (the corrections' included), sorted. ``corrections`` (datasets written by
    :func:`write_corrections`) join the examples: each corrected decision with the sub-task the person meant
    (Yell At Your Robot's loop: the high level learns again from what it was corrected on). ``bc.epochs`` / ``bc.steps`` / ``bc.batch_size`` /
    ``bc.lr`` set the budget as for BC; the encoders are ``policy.encoder``'s, their output ``policy.cond_dim``
    wide; RGB is randomly shifted in training as in BC. Logs ``losses/selector`` and ``train/selector_accuracy``
    (the batch's) and saves ``<run_dir>/checkpoints`` with the weights as ``"selector"``.

    Returns:
        ``(selector, metrics)``: the selector in eval mode and ``{"final_loss", "train_accuracy", "epochs",
        "steps", "vocabulary", "n_windows", "n_corrections", "n_episodes", "checkpoint", "wall_time_s"}``.
    """
    t0 = time.perf_counter()
    runtime.manual_seed(seed)
    device = runtime.device
    data = DemoWindows(demos_path, 1, 1)
    pool = _Pool([data, *(_corrections(path, data) for path in corrections)])
    labels = [s for part in pool.parts for s in part.subtask(torch.arange(len(part)))]
    vocabulary = sorted(set(labels))  # a correction may name a sub-task the demonstrations never did
    target = torch.tensor([vocabulary.index(s) for s in labels])  # (N,)
    slots = policy_cfg.plan_slots
    if slots != 0:  # a planned selector learns each demonstrated step's slot; a correction's is unknown (-1)
        slot_of = torch.cat([data.subtask_order(), torch.full((len(pool) - len(data),), -1)])  # (N,)
        most = int(slot_of.max()) + 1  # the most sub-tasks a demonstrated episode has
        if slots is not None and most > slots:
            raise ValueError(
                f"a demonstrated episode has {most} sub-tasks, more than policy.plan_slots={slots}"
            )
        slots = most if slots is None else slots
    selector = SubtaskSelector(
        policy_cfg.encoder, data.obs_spec, vocabulary, policy_cfg.cond_dim, text_backend, slots
    )
    if selector.obs_encoder.state_dim:
        selector.obs_encoder.state_normalizer.fit(data.data["state"][data.steps()])
    selector.fit_text(data.texts())
    selector = selector.to(device).train()
    batch_size, per_epoch, total, epochs = bc_budget(len(pool), bc_cfg)
    optim = adamw(list(selector.parameters()), bc_cfg.lr)
    warmup = max(1, int(WARMUP_FRACTION * total))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: cosine_with_warmup(s, total, warmup))
    gen = torch.Generator().manual_seed(seed)
    step, loss_sum, hits, seen = 0, 0.0, 0, 0
    bar = iter(logger.progress(range(total), total=total, desc="selector"))
    for _ in range(epochs):
        order = torch.randperm(len(pool), generator=gen)
        for b in range(min(per_epoch, total - step)):
            next(bar, None)
            idx = order[b * batch_size : (b + 1) * batch_size].sort().values
            obs = pool.batch(idx, device)
            with runtime.autocast():
                if slots:
                    logits, loss = _planned_loss(
                        selector, obs, target[idx].to(device), slot_of[idx].to(device), gen
                    )
                else:
                    logits = selector(obs, True, gen)
                    loss = F.cross_entropy(logits.float(), target[idx].to(device))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            if bc_cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(selector.parameters(), bc_cfg.max_grad_norm)
            optim.step()
            sched.step()
            step += 1
            value = float(loss.detach())
            if not math.isfinite(value):
                raise ValueError(f"the selector's loss is {value} at step {step}; lower bc.lr")
            correct = int((logits.argmax(-1).cpu() == target[idx]).sum())
            loss_sum, hits, seen = loss_sum + value * len(idx), hits + correct, seen + len(idx)
            logger.log({"losses/selector": value, "train/selector_accuracy": correct / len(idx)}, step)
    next(bar, None)
    selector.eval()
    metrics = {
        "final_loss": round(loss_sum / max(1, seen), 5),
        "train_accuracy": round(hits / max(1, seen), 4),
        "epochs": epochs,
        "steps": step,
        "vocabulary": vocabulary,
        "n_windows": len(data),
        "n_corrections": len(pool) - len(data),
        "n_episodes": data.n_episodes,
    }
    sources = {"demos": str(demos_path), "corrections": [str(c) for c in corrections]}
    path = save_selector(Path(run_dir) / "checkpoints", selector, env_cfg, policy_cfg, data.obs_spec, step,
                         metrics, {**sources, "seed": seed, **(extra or {})},
                         text_backend=text_backend)  # fmt: skip
    metrics.update(checkpoint=str(path), wall_time_s=round(time.perf_counter() - t0, 2))
    return selector, metrics


def _planned_loss(
    selector: SubtaskSelector,
    obs: dict[str, Any],
    target: torch.Tensor,
    order: torch.Tensor,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A planned selector's (:class:`SubtaskSelector` ``plan_slots``) log-probabilities (B, V) and loss on
    labels ``target`` (B,) at slots ``order`` (B,): where the slot is known (a demonstration's step), the
    negative log-likelihood of both factors, slot and sub-task in it; where it is not (-1, a person's
    correction), of the marginal."""
    slot, plan = selector.factors(obs, True, gen)  # (B, S), (B, S, V)
    marginal = selector.marginal(slot, plan)  # (B, V)
    rows = torch.arange(len(target), device=target.device)
    known = order >= 0
    at = order.clamp_min(0)
    joint = slot[rows, at] + plan[rows, at, target]  # (B,)
    nll = torch.where(known, -joint, -marginal[rows, target])
    return marginal, nll.mean()


class _Pool:
    """Windows of several datasets as one index: i < len(parts[0]) in the first, the next ones in the second..."""

    def __init__(self, parts: list[DemoWindows]) -> None:
        self.parts = parts
        self.starts = [0]
        for part in parts:
            self.starts.append(self.starts[-1] + len(part))

    def __len__(self) -> int:
        return self.starts[-1]

    def batch(self, idx: torch.Tensor, device: torch.device) -> dict[str, Any]:
        """The observations (To = 1) of the sorted global indices ``idx``, in that order."""
        pieces = []
        for part, lo, hi in zip(self.parts, self.starts, self.starts[1:]):
            local = idx[(idx >= lo) & (idx < hi)] - lo
            if len(local):
                pieces.append(part.batch(local, device)[0])
        if len(pieces) == 1:
            return pieces[0]
        return {
            k: torch.cat([p[k] for p in pieces]) if torch.is_tensor(pieces[0][k]) else sum((p[k] for p in pieces), [])
            for k in pieces[0]
        }  # fmt: skip


def _corrections(path: str | Path, demos: DemoWindows) -> DemoWindows:
    """A corrections dataset as windows, checked against the demonstrations it joins."""
    data = DemoWindows(path, 1, 1)
    if data.obs_spec != demos.obs_spec:
        raise ValueError(
            f"corrections at {path} observe {data.obs_spec}, the demonstrations {demos.obs_spec}: "
            "they come from another task or observation mode"
        )
    return data


def write_corrections(corrections: list[dict[str, Any]], out: str | Path, env_cfg: EnvConfig) -> Path | None:
    """A person's corrections (:attr:`HierarchicalPolicy.corrections`) as a dataset that
    ``pretrain policy=selector selector_corrections=[...]`` trains on: each corrected decision one
    one-step episode (its observation, the dialogue, the first action taken and, as its ``subtask`` label,
    the sub-task the person meant). None when there is none to write."""
    if not corrections:
        return None
    writer = DemoWriter(out, env_id=env_cfg.id, attrs={"env": dataclasses.asdict(env_cfg), "corrections": True,
                                                       "obs_every": 1})  # fmt: skip
    try:
        for record in corrections:
            episode = {k: np.asarray(v)[None] for k, v in record.items() if isinstance(v, np.ndarray)}
            said = {"instruction": record["instruction"]} if "instruction" in record else {}
            writer.add_episode({**episode, **said, SUBTASK_KEY: record[SUBTASK_KEY]})
        return writer.close()
    except BaseException:
        writer.abort()
        raise


@torch.no_grad()
def label_accuracy(selector: SubtaskSelector, demos_path: str | Path, batch_size: int = 64) -> float:
    """Share of the stored steps of ``demos_path`` (labelled demonstrations, e.g. the expert's on validation
    seeds) whose sub-task the selector names."""
    data = DemoWindows(demos_path, 1, 1)
    hits = 0
    for start in range(0, len(data), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(data)))
        obs, _ = data.batch(idx, selector.device)
        hits += sum(a == b for a, b in zip(selector.select(obs), data.subtask(idx)))
    return round(hits / len(data), 4)


def save_selector(
    root: Path,
    selector: SubtaskSelector,
    env_cfg: EnvConfig,
    policy_cfg: PolicyConfig,
    obs_spec: dict[str, Any],
    step: int,
    metrics: dict[str, Any],
    extra: dict[str, Any],
    *,
    text_backend: str,
) -> Path:
    """A selector checkpoint: its weights, the configs it was built from, its vocabulary and obs_spec."""
    spec = {k: [] if k == "instruction" else [int(s) for s in v] for k, v in obs_spec.items()}
    return checkpoint.save(
        root,
        step,
        {"selector": selector.state_dict()},
        config={"env": dataclasses.asdict(env_cfg), "policy": dataclasses.asdict(policy_cfg)},
        metrics=metrics,
        extra={
            **extra,
            "kind": KIND,
            "vocabulary": selector.vocabulary,
            "obs_spec": spec,
            "hidden": int(policy_cfg.cond_dim),
            "plan_slots": selector.plan_slots,
            "text_backend": text_backend,
        },  # fmt: skip
    )


def load_selector(path: str | Path, device: str | torch.device = "cpu") -> SubtaskSelector:
    """The selector of a checkpoint written by :func:`train_selector`, in eval mode on ``device``."""
    ckpt = checkpoint.load(path)
    if ckpt.extra.get("kind") != KIND:
        raise checkpoint.CheckpointError(
            f"{ckpt.path} is not a selector checkpoint (python -m diffpolicy.pretrain policy=selector writes one)"
        )
    names = {f.name for f in dataclasses.fields(EncoderConfig)}
    encoder = EncoderConfig(**{k: v for k, v in ckpt.config["policy"]["encoder"].items() if k in names})
    selector = SubtaskSelector(
        encoder, ckpt.extra["obs_spec"], list(ckpt.extra["vocabulary"]), int(ckpt.extra["hidden"]),
        text_backend=ckpt.extra.get("text_backend", "minilm"), plan_slots=int(ckpt.extra.get("plan_slots", 0)),
    )  # fmt: skip
    checkpoint.load_state(selector, ckpt.state["selector"], name="selector")
    return selector.to(device).eval()


def hierarchy(low: torch.nn.Module, selector_path: str | Path, person: bool = False) -> HierarchicalPolicy:
    """The selector at ``selector_path`` above the low-level policy ``low`` (on ``low``'s device); ``person``:
    a simulated person corrects its choices (:class:`HierarchicalPolicy`)."""
    selector = load_selector(selector_path, next(low.parameters()).device)
    missing = sorted(set(selector.obs_encoder.modalities) - set(low.obs_spec))
    if missing:
        raise ValueError(f"the selector reads {missing}, which the low-level policy's observation lacks")
    return HierarchicalPolicy(selector, low, person=person)
