"""One behaviour-cloning optimiser step of the state task's policy, at several batch sizes.

``run()`` builds ``policy=unet_small`` (16-step chunks) for MujocoPick's state observation (34,) and 7-D
actions and times, interleaved in one process so that every batch size sees the same machine load, the step
that BC and ``algo=filtered_bc``'s continuation repeat: the DDPM loss on a batch of windows, backward,
gradient clipping, AdamW and the EMA update. This is the part that binds the default ``train`` run (78 % of
its wall time at batch 128), so its cost per batch size says what ``algo.batch_size`` buys.

Reported per batch: median seconds per step over ``repeats`` rounds (each round times every batch once, in
turn, after ``warmup`` untimed rounds), seconds per window, and ``ratio_to_reference``: the step's seconds
over those of ``reference`` (128, ``bc.batch_size`` of the state task) measured in the same rounds.

With ``peer=<dir>`` (a Stanford diffusion_policy checkout, :mod:`diffpolicy.benchmarks.peer`), each round also
times the peer's training step at the same U-Net dims, chunk and batch, as its low-dim policy trains (the
normalised observation as global condition: no encoder, where this project's step also runs its state
encoder; DDPM noise-prediction loss, AdamW, cosine schedule, its EMAModel): per batch ``peer_s_per_step`` and
``speedup_vs_peer`` (the peer's seconds over ours); ``peer`` says why the row is absent otherwise.

Two levers that BC does not take, each measured in the same rounds: ``precision=bf16`` runs both steps (ours
and the peer's) under CPU bf16 autocast; ``floor=true`` also times our step with every convolution block
reduced to its convolution (no GroupNorm, no Mish), without gradient clipping and the EMA, and with fused
AdamW (``floor_s_per_step``, ``floor_speedup_vs_peer``): a network that cannot be trained, but the same
convolutions, linears and attention, so no fusion of the work it leaves out can make the real step faster
than it. It says how much of the gap to a goal any kernel work could close.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from typing import Any

import torch

from diffpolicy.bc import adamw, ema_update
from diffpolicy.benchmarks import peer as peer_lib
from diffpolicy.config import PolicyConfig
from diffpolicy.models.unet1d import Conv1dBlock
from diffpolicy.policy_io import build_policy

STATE_DIM, ACTION_DIM, HORIZON = 34, 7, 16
"""MujocoPick-v0's state observation, its action and the default chunk length."""


class _ConvOnly(Conv1dBlock):
    """A :class:`Conv1dBlock` whose GroupNorm and Mish cost nothing (``floor=true``): its convolution alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


def _policy(cfg: PolicyConfig, floor: bool = False) -> Any:
    """The state task's policy (seeded, normalisers fitted, training mode); ``floor``: every
    :class:`Conv1dBlock` reduced to its convolution."""
    torch.manual_seed(0)
    policy = build_policy(cfg, {"state": [STATE_DIM]}, ACTION_DIM, text_backend="hash")
    g = torch.Generator().manual_seed(0)
    policy.fit_normalizers(
        actions=torch.rand(512, ACTION_DIM, generator=g) * 2 - 1,
        state=torch.randn(512, STATE_DIM, generator=g),
    )
    if floor:
        for module in policy.modules():
            if type(module) is Conv1dBlock:
                module.__class__ = _ConvOnly
    return policy.train()


def _variant(text: Any) -> PolicyConfig:
    """``"64/4"`` -> horizon 64, fold 4; ``"64/4/sample"`` also predicts the clean chunk
    (``policy.prediction``); validated as a policy config would be."""
    parts = str(text).split("/")
    try:
        h, f = int(parts[0]), int(parts[1])
        if len(parts) > 3:
            raise ValueError
    except (ValueError, IndexError):
        raise ValueError(
            f"bc_step variant {text!r}: write <horizon>/<fold>[/<prediction>], e.g. 64/4 or 64/4/sample"
        ) from None
    return PolicyConfig(horizon=h, fold=f, prediction=parts[2] if len(parts) == 3 else "epsilon")


def run(repeats: int = 5, threads: int = 2, **kwargs: Any) -> dict:
    """Seconds per BC step at each batch size (kwargs: ``batches`` ([32, 64, 128]), ``reference`` (128),
    ``warmup`` (2), ``horizon`` (16), ``fold`` (1: ``policy.fold``), ``prediction`` (epsilon:
    ``policy.prediction``), ``dims`` ([64, 128, 256]: ``policy.down_dims``, the peer's U-Net the same; ``[256,
    512, 1024]`` with ``cond_dim=512 step_embed_dim=256`` is ``policy=unet_large``), ``variants ([]: other chunk shapes ``"<horizon>/<fold>[/<prediction>]"``, e.g.
    ``["64/1", "64/4/sample"]``, each timed at the reference batch in the same rounds and reported as its
    ratio to the main policy's step), ``train_kernels`` (False: ``policy.train_kernels``, the GroupNorm +
    Mish operator and fused AdamW), ``fused`` (AdamW's fused kernel alone; default: as ``train_kernels``),
    ``precision`` (fp32 | bf16: CPU autocast of both steps), ``floor`` (False: also time the
    floor, see the module docstring), ``peer`` (a diffusion_policy checkout; else ``$DIFFPOLICY_PEER_DP``))."""
    batches = [int(b) for b in kwargs.pop("batches", [32, 64, 128])]
    reference = int(kwargs.pop("reference", 128))
    warmup = int(kwargs.pop("warmup", 2))
    horizon = int(kwargs.pop("horizon", HORIZON))
    fold = int(kwargs.pop("fold", 1))
    prediction = str(kwargs.pop("prediction", "epsilon"))
    dims = [int(d) for d in kwargs.pop("dims", PolicyConfig().down_dims)]
    widths = {k: int(kwargs.pop(k)) for k in ("cond_dim", "step_embed_dim") if k in kwargs}
    variants = {str(v): _variant(v) for v in kwargs.pop("variants", [])}
    peer_path = kwargs.pop("peer", None)
    train_kernels = bool(kwargs.pop("train_kernels", False))
    fused = bool(kwargs.pop("fused", train_kernels))
    precision = str(kwargs.pop("precision", "fp32"))
    floor = bool(kwargs.pop("floor", False))
    if kwargs:
        raise ValueError(
            "bc_step takes batches, reference, warmup, horizon, fold, prediction, dims, cond_dim, step_embed_dim, "
            f"variants, train_kernels, fused, precision, floor and peer; got {sorted(kwargs)}"
        )
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"bc_step precision={precision!r}: fp32 | bf16")
    skipped = peer_lib.missing(peer_path)
    if reference not in batches:
        batches.append(reference)

    def autocast() -> contextlib.AbstractContextManager:
        if precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16)

    cfg = PolicyConfig(
        horizon=horizon,
        fold=fold,
        prediction=prediction,
        down_dims=dims,
        train_kernels=train_kernels,
        **widths,
    )
    policy = _policy(cfg)
    g = torch.Generator().manual_seed(0)
    ema = copy.deepcopy(policy).eval()
    params = [p for p in policy.parameters() if p.requires_grad]
    optim = adamw(params, 3e-4, fused=fused)
    states = {b: torch.randn(b, 1, STATE_DIM, generator=g) for b in batches}
    chunks = {
        h: torch.rand(max(batches), h, ACTION_DIM, generator=g) * 2 - 1
        for h in {horizon, *(v.horizon for v in variants.values())}
    }

    def timed(model: Any, optim: torch.optim.Optimizer, average: Any = None, chunk: int = horizon) -> Any:
        """``step(b) -> seconds`` of one BC step of ``model`` on ``chunk``-step windows; with ``average`` (the
        EMA copy) the step also clips the gradients and updates the EMA, as BC does (the floor does neither)."""
        params = [p for p in model.parameters() if p.requires_grad]

        def step(b: int) -> float:
            obs, actions = {"state": states[b]}, chunks[chunk][:b]
            start = time.perf_counter()
            with autocast():
                loss = model.bc_loss(obs, actions, generator=g)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            if average is not None:
                torch.nn.utils.clip_grad_norm_(params, 10.0)
            optim.step()
            if average is not None:
                ema_update(average, model, 0.995)
            return time.perf_counter() - start

        return step

    step = timed(policy, optim, ema)
    floor_step = None
    if floor:
        bare = _policy(cfg, floor=True)
        floor_step = timed(bare, adamw([p for p in bare.parameters() if p.requires_grad], 3e-4, fused=True))

    variant_steps = {}
    for name, vcfg in variants.items():
        vcfg.train_kernels = train_kernels
        model = _policy(vcfg)
        average = copy.deepcopy(model).eval()
        opt = adamw([p for p in model.parameters() if p.requires_grad], 3e-4, fused=fused)
        variant_steps[name] = timed(model, opt, average, chunk=vcfg.horizon)

    peer_step = None
    if not skipped:
        peer = peer_lib.load(peer_path)
        torch.manual_seed(0)
        peer_unet = peer_lib.unet(peer, ACTION_DIM, STATE_DIM, cfg.down_dims)
        peer_update = peer_lib.train_step(peer, peer_unet, generator=g)

        def peer_step(b: int) -> float:
            start = time.perf_counter()
            with autocast():
                peer_update(states[b], chunks[horizon][:b])
            return time.perf_counter() - start

    times: dict[int, list[float]] = {b: [] for b in batches}
    peer_times: dict[int, list[float]] = {b: [] for b in batches}
    floor_times: dict[int, list[float]] = {b: [] for b in batches}
    variant_times: dict[str, list[float]] = {k: [] for k in variant_steps}
    for r in range(warmup + repeats):
        for k, vstep in variant_steps.items():
            t = vstep(reference)
            if r >= warmup:
                variant_times[k].append(t)
        for b in batches:
            t = step(b)
            t_peer = peer_step(b) if peer_step else None
            t_floor = floor_step(b) if floor_step else None
            if r >= warmup:
                times[b].append(t)
                if t_peer is not None:
                    peer_times[b].append(t_peer)
                if t_floor is not None:
                    floor_times[b].append(t_floor)
    ref = statistics.median(times[reference])
    rows = {
        str(b): {
            "s_per_step": round(statistics.median(times[b]), 4),
            "ms_per_window": round(1000 * statistics.median(times[b]) / b, 3),
            "ratio_to_reference": round(statistics.median(times[b]) / ref, 3),
        }
        for b in sorted(batches)
    }
    out = {
        "policy": cfg.name,
        "down_dims": dims,
        "horizon": horizon,
        "fold": fold,
        "prediction": prediction,
        "reference_batch": reference,
        "batches": rows,
    }
    if variant_steps:
        out["variants"] = {
            k: {
                "s_per_step": round(statistics.median(v), 4),
                "ratio_to_main": round(statistics.median(v) / ref, 3),
            }
            for k, v in variant_times.items()
        }
    out["train_kernels"] = train_kernels
    out["adamw_fused"] = bool(optim.defaults.get("fused"))
    out["precision"] = precision
    if floor_step is not None:
        for b in batches:
            rows[str(b)]["floor_s_per_step"] = round(statistics.median(floor_times[b]), 4)
    if peer_step is None:
        out["peer"] = skipped
        return out
    out["peer"] = (
        "Stanford diffusion_policy ConditionalUnet1D low-dim training step (diffusers DDPM, EMAModel)"
    )
    for b in batches:
        peer_s = statistics.median(peer_times[b])
        rows[str(b)]["peer_s_per_step"] = round(peer_s, 4)
        rows[str(b)]["speedup_vs_peer"] = round(peer_s / statistics.median(times[b]), 3)
        if floor_step is not None:
            rows[str(b)]["floor_speedup_vs_peer"] = round(peer_s / statistics.median(floor_times[b]), 3)
    out["min_speedup_vs_peer"] = min(r["speedup_vs_peer"] for r in rows.values())
    return out
