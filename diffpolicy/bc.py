"""Behaviour cloning: the training loop, its EMA and schedule, and the cache of pre-trained policies.

:func:`behaviour_cloning`: normalisers fitted on the demonstrations, AdamW (``bc.lr``, weight decay
1e-6) with linear warm-up then cosine decay, gradient clipping (``bc.max_grad_norm``), an EMA copy of
the weights (``bc.ema_decay``) which is what gets saved and evaluated; ``losses/bc`` and ``train/lr`` to
TensorBoard / ``metrics.jsonl`` with a progress bar; checkpoints (:mod:`diffpolicy.policy_io`) in
``<run_dir>/checkpoints`` during training and at the end. :func:`pretrained_checkpoint` returns the cached
BC checkpoint ``<cache_dir>/bc/<key>`` for the same env / policy / BC settings and seed, training (and
caching) it first when there is none; its demonstrations are the scripted expert's or, with ``bc.demos``, a
dataset on disk (:func:`diffpolicy.demos.demonstrations`).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from diffpolicy import checkpoint
from diffpolicy.config import BCConfig, EncoderConfig, EnvConfig, PolicyConfig
from diffpolicy.data.windows import DemoWindows
from diffpolicy.demos import demonstrations, demonstrations_key
from diffpolicy.device import Runtime
from diffpolicy.diffusion.schedule import ddpm_loss
from diffpolicy.encoders.fusion import PositionHead
from diffpolicy.logger import Logger
from diffpolicy.policy_io import (
    ENCODER_FIELDS_ADDED,
    POLICY_FIELDS_ADDED,
    POLICY_FIELDS_LEGACY,
    build_policy,
    save_policy,
)

BC_WEIGHT_DECAY = 1e-6
"""AdamW weight decay of behaviour cloning."""
BC_FIELDS = {"bc_epochs": "epochs", "bc_batch_size": "batch_size", "bc_lr": "lr", "ema_decay": "ema_decay",
             "n_demos": "n_demos", "bc_max_grad_norm": "max_grad_norm"}  # fmt: skip
"""BCConfig fields that change a BC result (the cache key), under the names the keys were first made with."""
BC_FIELDS_ADDED = (
    "noise_draws", "target_aux_weight", "steps", "translate", "translate_state", "instruction", "mask_unheard",
)  # fmt: skip
"""BCConfig fields that change a BC result but entered the cache key later: keyed only when not at their
defaults, so caches written before them stay valid."""
POLICY_FIELDS_IGNORED = ("init", "compile", "grad_checkpointing")
"""PolicyConfig fields that do not change a BC result (left out of the cache key). How chains are sampled
(K', eta, the std floor) is not a policy field at all: the learner sets it on the loaded policy."""
LOG_EVERY = 10
"""Optimiser steps per logged ``losses/bc`` point (the mean over those steps)."""
PROBE_WINDOWS = 64
"""Windows in the fixed batch of :func:`condition_gap`."""


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """LR multiplier: linear warm-up over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


class EMA:
    """Exponential moving average of a module's weights, with the usual warm-up of the decay.

    ``decay_t = min(max_decay, (1 + t) / (10 + t))``; buffers (normalisers) are copied, not averaged.
    """

    def __init__(self, module: torch.nn.Module, max_decay: float) -> None:
        self.module = copy.deepcopy(module).eval().requires_grad_(False)
        self.max_decay = max_decay
        self.updates = 0

    def update(self, module: torch.nn.Module) -> None:
        ema_update(self.module, module, min(self.max_decay, (1 + self.updates) / (10 + self.updates)))
        self.updates += 1


@torch.no_grad()
def ema_update(target: torch.nn.Module, source: torch.nn.Module, decay: float) -> None:
    """target <- decay * target + (1 - decay) * source (parameters, in one multi-tensor lerp); buffers
    (normalisers) copied."""
    torch._foreach_lerp_(list(target.parameters()), [s.detach() for s in source.parameters()], 1.0 - decay)
    for t, s in zip(target.buffers(), source.buffers()):
        t.copy_(s)


def adamw(params: list[torch.nn.Parameter], lr: float, fused: bool = False) -> torch.optim.AdamW:
    """AdamW as BC and the learners' imitation steps take it: betas (0.95, 0.999), weight decay
    :data:`BC_WEIGHT_DECAY`, torch's multi-tensor implementation. ``fused=True`` (``policy.train_kernels``)
    takes torch's fused kernel where the parameters live on the CPU or a CUDA GPU (17.6 -> 4.3 ms a step for
    ``policy=unet_small``'s 5.6 M parameters on one core) and the multi-tensor one elsewhere (an NPU's
    optimiser is torch_npu's business)."""
    fused = fused and bool(params) and params[0].device.type in ("cpu", "cuda")
    return torch.optim.AdamW(
        params, lr=lr, betas=(0.95, 0.999), weight_decay=BC_WEIGHT_DECAY, fused=True if fused else None
    )


TargetHead = PositionHead
"""BC's auxiliary head (:class:`~diffpolicy.encoders.fusion.PositionHead`): the condition -> the privileged
label's positions (the named object's; Meta-World's ``label=both``: object and goal). Trained beside the
policy, never saved with it (predict-then-act keeps the same head inside the policy instead)."""


def translate_scene(
    obs: dict[str, Any], target: torch.Tensor | None, offset: torch.Tensor, state: bool
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Windows seen from a shifted scene: ``offset`` (B, 3) m is added to the points' xyz (B, To, N, 3+),
    to every xyz triple of ``target`` (B, 3 k) and, when ``state``, of the state (B, To, 3 m); a new dict
    (the batch's tensors are not modified), the other observations as they were."""
    out = dict(obs)
    if "points" in obs:
        pts = obs["points"].clone()
        pts[..., :3] += offset[:, None, None, :]
        out["points"] = pts
    if state and "state" in obs:
        s = obs["state"]
        if s.shape[-1] % 3:
            raise ValueError(f"bc.translate_state: the state has {s.shape[-1]} values, not xyz triples")
        out["state"] = (s.unflatten(-1, (-1, 3)) + offset[:, None, None, :]).flatten(-2)
    if target is not None:
        target = (target.unflatten(-1, (-1, 3)) + offset[:, None, :]).flatten(-2)
    return out, target


@torch.no_grad()
def condition_gap(policy: Any, obs: dict[str, Any], actions: torch.Tensor, seed: int = 0) -> float:
    """How much the denoiser relies on the observation: loss with shuffled conditions / loss with the right ones.

    obs (B, To, ...) and actions (B, Ta, Da) (env units) of B >= 2 windows; one fixed diffusion step
    t = T / 10 and fixed noise (``seed``), conditions encoded without augmentation and shuffled by a cyclic
    shift. About 1 means the policy ignores its observations (the collapse that used to make behaviour
    cloning unconditional); a policy that uses them scores well above 1.
    """
    cond = policy.encode(obs, augment=False)  # (B, cond_dim)
    x0 = policy.action_normalizer.normalize(actions.to(cond.device, torch.float32))
    B = x0.shape[0]
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(x0.shape, generator=gen).to(x0.device)
    t = torch.full((B,), max(1, policy.schedule.train_timesteps // 10), device=x0.device)
    right, shuffled = (
        ddpm_loss(policy.denoiser, x0, c, policy.schedule, t=t, noise=noise)
        for c in (cond, cond.roll(1, dims=0))
    )
    return float(shuffled / right.clamp_min(1e-12))


def fitted_policy(data: Any, policy_cfg: PolicyConfig, text_backend: str) -> Any:
    """A fresh policy for the demonstrations' observations, its action and state normalisers (and the
    instruction's standardisation) fitted to them."""
    policy = build_policy(policy_cfg, data.obs_spec, data.action_dim, text_backend=text_backend)
    steps = data.steps()
    state = data.data["state"][steps] if "state" in data.data else None
    positions = None
    if policy_cfg.encoder.predict_positions and data.has_target:  # predict-then-act's labelled positions
        positions = data.target(torch.arange(len(data)))
    policy.fit_normalizers(
        actions=data.data["action"][steps], state=state, positions=positions, instructions=data.texts()
    )
    return policy


def bc_budget(n_windows: int, bc_cfg: BCConfig) -> tuple[int, int, int, int]:
    """(batch size, batches per pass, optimiser steps, passes): ``bc.steps`` when positive, else ``bc.epochs``
    passes; a step budget's last pass stops where the budget ends."""
    batch_size = min(bc_cfg.batch_size, n_windows)
    per_epoch = n_windows // batch_size
    total = bc_cfg.steps or per_epoch * bc_cfg.epochs
    return batch_size, per_epoch, total, math.ceil(total / per_epoch)


def optimiser_step(
    loss: torch.Tensor, params: list[torch.nn.Parameter], optim: torch.optim.Optimizer, scaler: Any,
    max_grad_norm: float,
) -> None:  # fmt: skip
    """Backward through the (fp16-scaled) loss, clip by global norm (0: no clip), step."""
    optim.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.unscale_(optim)
    torch.nn.utils.clip_grad_norm_(params, max_grad_norm or math.inf)
    scaler.step(optim)
    scaler.update()


def target_head(
    data: Any, policy_cfg: PolicyConfig, bc_cfg: BCConfig, device: torch.device
) -> TargetHead | None:
    """BC's auxiliary head for the demonstrations' ``target_pos`` label (None when ``bc.target_aux_weight`` is
    0, or when the policy predicts the label itself: ``policy.encoder.predict_positions``); a dataset without
    the label, or one that is not xyz triples, fails here rather than mid-run."""
    enc = policy_cfg.encoder
    if enc.predict_positions and bc_cfg.target_aux_weight <= 0:
        raise ValueError(
            "policy.encoder.predict_positions needs bc.target_aux_weight > 0: it trains the position head"
        )
    if bc_cfg.target_aux_weight <= 0:
        return None
    label = data.target(torch.zeros(1, dtype=torch.long))
    if label.shape[-1] % 3:
        raise ValueError(f"the demonstrations' target_pos has {label.shape[-1]} values, not 3 per point")
    if enc.predict_positions:
        if label.shape[-1] != 3 * enc.predict_positions:
            raise ValueError(
                f"policy.encoder.predict_positions={enc.predict_positions} but the demonstrations' target_pos "
                f"holds {label.shape[-1] // 3} positions (Meta-World: env.kwargs.label=both gives 2)"
            )
        return None
    return TargetHead(
        policy_cfg.cond_dim, enc.workspace_low, enc.workspace_high, points=label.shape[-1] // 3
    ).to(device)


def training_batch(
    data: Any,
    idx: torch.Tensor,
    device: torch.device,
    bc_cfg: BCConfig,
    gen: torch.Generator,
    *,
    with_target: bool,
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Windows ``idx`` as (obs, actions (B, Ta, Da), target (B, 3 k) or None, mask (B, Ta) or None), seen from
    a scene shifted in x and y by up to ``bc.translate`` (one offset per window, drawn from ``gen``) when
    that is > 0; ``mask``: with ``bc.mask_unheard`` the chunk steps under an instruction the window has heard
    (None when all are)."""
    obs, actions = data.batch(idx, device)
    target = data.target(idx, device) if with_target else None
    mask = data.heard(idx, device) if bc_cfg.mask_unheard else None
    obs, target = shifted_scenes(obs, target, bc_cfg, gen)
    return obs, actions, target, mask


def shifted_scenes(
    obs: dict[str, Any], target: torch.Tensor | None, bc_cfg: BCConfig, gen: torch.Generator
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """BC's scene augmentation of a batch of B windows: each seen from a scene shifted in x and y by up to
    ``bc.translate`` m (one uniform offset per window, drawn from ``gen``; :func:`translate_scene`); the
    batch as it was when ``bc.translate`` is 0. Every continuation of BC trains through it, so that it keeps
    the invariance BC was given."""
    if bc_cfg.translate <= 0:
        return obs, target
    ref = obs["points"] if "points" in obs else next(v for v in obs.values() if isinstance(v, torch.Tensor))
    offset = torch.zeros(len(ref), 3)
    offset[:, :2] = (torch.rand(len(ref), 2, generator=gen) * 2 - 1) * bc_cfg.translate
    return translate_scene(obs, target, offset.to(ref.device), bc_cfg.translate_state)


def bc_losses(
    policy: Any, aux: TargetHead | None, obs: dict[str, Any], actions: torch.Tensor,
    target: torch.Tensor | None, bc_cfg: BCConfig, generator: torch.Generator | None = None,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """(BC loss, auxiliary loss, auxiliary error in m) of one batch; the last two None without ``aux``.
    ``mask`` (B, Ta) bool: the chunk steps the BC loss is taken on (None: all).

    Predict-then-act (``policy.encoder.predict_positions``): the BC loss's condition reads the labelled
    positions ``target`` (B, 3 k) m plus Gaussian noise of std ``policy.encoder.position_noise`` (drawn from
    ``generator``), and the auxiliary loss is the policy's own position prediction against the label."""
    if policy.obs_encoder.position_points:
        std = policy.cfg.encoder.position_noise
        noisy = target + torch.randn(target.shape, generator=generator).to(target.device) * std
        loss = policy.bc_loss(obs, actions, draws=bc_cfg.noise_draws, positions=noisy, mask=mask)
        aux_loss, aux_error = policy.obs_encoder.position_loss(obs, target, augment=policy.training)
        return loss, aux_loss, aux_error
    if aux is None:
        return policy.bc_loss(obs, actions, draws=bc_cfg.noise_draws, mask=mask), None, None
    loss, cond = policy.bc_loss(obs, actions, draws=bc_cfg.noise_draws, return_cond=True, mask=mask)
    aux_loss, aux_error = aux(cond, target)
    return loss, aux_loss, aux_error


def save_bc(
    root: Path, step: int, epoch: int, loss: float, ema_policy: Any, policy: Any, aux: TargetHead | None,
    optim: torch.optim.Optimizer, env_cfg: EnvConfig, policy_cfg: PolicyConfig, obs_spec: dict[str, Any],
    description: dict[str, Any],
) -> Path:  # fmt: skip
    """A BC checkpoint: the EMA weights as ``policy``; the raw weights, the auxiliary head, the optimiser and
    the RNG beside them (the last two kept)."""
    return save_policy(
        root,
        step,
        ema_policy,
        env_cfg=env_cfg,
        policy_cfg=policy_cfg,
        obs_spec=obs_spec,
        extra_state={
            "model": policy.state_dict(),
            **({"target_head": aux.state_dict()} if aux is not None else {}),
            "optim": optim.state_dict(),
            "rng": checkpoint.rng_state(),
        },
        metrics={"losses/bc": loss, "epoch": epoch},
        extra={**description, "epoch": epoch},
        keep=2,
    )


def bc_optimiser(
    policy: torch.nn.Module, aux: torch.nn.Module | None, bc_cfg: BCConfig, total: int
) -> tuple[list[torch.Tensor], torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The trained parameters (the policy's, then the auxiliary head's), AdamW over them and its schedule:
    a linear warm-up over 5 % of the ``total`` steps (at most 500), then a cosine decay."""
    params = [p for p in policy.parameters() if p.requires_grad]
    params += list(aux.parameters()) if aux is not None else []
    optim = adamw(params, bc_cfg.lr, fused=policy.cfg.train_kernels)  # every policy holds its PolicyConfig
    warmup = max(1, min(500, total // 20))
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: cosine_with_warmup(s, total, warmup))
    return params, optim, sched


class LossWindow:
    """Means over the last steps (up to :data:`LOG_EVERY`) of the BC loss and, with the auxiliary target
    head, of its loss and its error (logged in cm)."""

    def __init__(self) -> None:
        self.with_aux = False
        self.reset()

    def reset(self) -> None:
        """Start a new window."""
        self.n, self.loss, self.aux, self.aux_error = 0, 0.0, 0.0, 0.0

    def add(self, loss: float, aux_loss: torch.Tensor | None = None, aux_error: Any = None) -> None:
        """One step's BC loss (and the auxiliary head's loss and error when it exists)."""
        self.n, self.loss = self.n + 1, self.loss + loss
        if aux_loss is not None:
            self.with_aux = True
            self.aux += float(aux_loss.detach())
            self.aux_error += float(aux_error)

    def flush(self, logger: Logger, step: int, lr: float) -> None:
        """Log the window's means as ``losses/bc`` (``losses/target_aux``, ``train/target_error_cm``) and
        ``train/lr`` at ``step``, and start a new window."""
        scalars = {"losses/bc": self.loss / self.n, "train/lr": lr}
        if self.with_aux:
            scalars |= {
                "losses/target_aux": self.aux / self.n,
                "train/target_error_cm": 100 * self.aux_error / self.n,
            }
        logger.log(scalars, step)
        self.reset()


def log_epoch(
    logger: Logger, step: int, epoch: int, loss: float, ema_policy: Any, probe: tuple, seed: int
) -> float:
    """Log an epoch's mean loss and, for a diffusion policy, :func:`condition_gap` of the EMA weights on the
    fixed ``probe`` windows (returned; NaN for the Gaussian baseline, which has no denoiser)."""
    scalars = {"losses/bc_epoch": loss, "train/epoch": epoch}
    gap = float("nan")
    if hasattr(ema_policy, "denoiser"):
        gap = scalars["train/condition_gap"] = condition_gap(ema_policy, *probe, seed=seed)
    logger.log(scalars, step)
    return gap


def behaviour_cloning(
    env_cfg: EnvConfig,
    policy_cfg: PolicyConfig,
    bc_cfg: BCConfig,
    demos_path: str | Path,
    runtime: Runtime,
    logger: Logger,
    run_dir: str | Path,
    seed: int,
    *,
    text_backend: str = "minilm",
    checkpoints: int = 4,
    extra: dict[str, Any] | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Train a policy by behaviour cloning on the demonstrations at ``demos_path``.

    Runs ``bc_cfg.steps`` optimiser steps (or, when it is 0, ``bc_cfg.epochs`` passes) over all windows in
    batches of ``bc_cfg.batch_size`` (the last, incomplete batch of a pass is dropped; a step budget's last
    pass stops where the budget ends), logging ``losses/bc`` / ``train/lr`` against the optimiser
    step and ``train/condition_gap`` (:func:`condition_gap` of the EMA diffusion policy on a fixed batch) per epoch, and
    writing ``checkpoints`` intermediate checkpoints plus the final one (the EMA weights as
    ``"policy"``) under ``<run_dir>/checkpoints``.

    Args:
        env_cfg, policy_cfg, bc_cfg: the pieces of a Pretrain/TrainConfig (``cfg.bc`` is the BC budget).
        demos_path: dataset directory.
        runtime: device and precision.
        logger: metrics logger (its progress bar shows the steps).
        run_dir: where ``checkpoints/`` goes.
        seed: initialisation and batching seed.
        text_backend: instruction embedder (``minilm``; ``hash`` for fast tests).
        checkpoints: intermediate checkpoints during training (0 = only the final one).
        extra: stored in every checkpoint's ``extra`` (e.g. cache keys).

    Returns:
        ``(policy, metrics)``: the EMA policy in eval mode on ``runtime.device`` and
        ``{"final_loss", "epochs", "steps", "s_per_step", "n_windows", "n_episodes", "checkpoint",
        "condition_gap", "wall_time_s"}`` (final_loss: mean loss over the last epoch).
    """
    t0 = time.perf_counter()
    device = runtime.device
    runtime.manual_seed(seed)
    data = DemoWindows(demos_path, policy_cfg.n_obs_steps, policy_cfg.horizon, instruction=bc_cfg.instruction)
    policy = fitted_policy(data, policy_cfg, text_backend).to(device).train()
    ema = EMA(policy, bc_cfg.ema_decay)

    if bc_cfg.translate > 0 and "points" not in data.obs_spec:
        raise ValueError("bc.translate shifts point clouds, and these demonstrations observe none")
    aux = target_head(data, policy_cfg, bc_cfg, device)
    labelled = aux is not None or bool(policy_cfg.encoder.predict_positions)  # batches carry target_pos
    batch_size, per_epoch, total, epochs = bc_budget(len(data), bc_cfg)
    params, optim, sched = bc_optimiser(policy, aux, bc_cfg, total)
    scaler = runtime.grad_scaler()
    gen = torch.Generator().manual_seed(seed)
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_every = max(1, epochs // checkpoints) if checkpoints > 0 else epochs + 1
    description = {"stage": "bc", "demos": str(demos_path), "seed": seed, **(extra or {})}

    def save(step: int, epoch: int, loss: float) -> Path:
        return save_bc(ckpt_root, step, epoch, loss, ema.module, policy, aux, optim, env_cfg, policy_cfg,
                       data.obs_spec, description)  # fmt: skip

    probe_idx = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:PROBE_WINDOWS]
    probe = data.batch(probe_idx, device)  # fixed windows for condition_gap
    step, epoch_loss, gap, window = 0, float("nan"), float("nan"), LossWindow()
    t_train = time.perf_counter()
    bar = iter(logger.progress(range(total), total=total, desc="bc"))
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(data), generator=gen)
        loss_sum, n_batches = 0.0, min(per_epoch, total - step)
        for b in range(n_batches):
            next(bar, None)
            idx = order[b * batch_size : (b + 1) * batch_size]
            obs, actions, target, mask = training_batch(data, idx, device, bc_cfg, gen, with_target=labelled)
            with runtime.autocast():
                loss, aux_loss, aux_error = bc_losses(policy, aux, obs, actions, target, bc_cfg, gen, mask)
                total_loss = loss if aux_loss is None else loss + bc_cfg.target_aux_weight * aux_loss
            optimiser_step(total_loss, params, optim, scaler, bc_cfg.max_grad_norm)
            sched.step()
            ema.update(policy)
            step += 1
            value = float(loss.detach())
            if not math.isfinite(value):
                raise ValueError(f"behaviour-cloning loss is {value} at step {step}; lower bc.lr")
            loss_sum += value
            window.add(value, *((aux_loss, aux_error) if aux_loss is not None else ()))
            if window.n == LOG_EVERY or step == total:
                window.flush(logger, step, sched.get_last_lr()[0])
        epoch_loss = loss_sum / max(1, n_batches)
        gap = log_epoch(logger, step, epoch, epoch_loss, ema.module, probe, seed)
        if epoch % ckpt_every == 0 and epoch < epochs:
            save(step, epoch, epoch_loss)
    next(bar, None)  # close the progress bar
    train_s = time.perf_counter() - t_train
    final = save(step, epochs, epoch_loss)
    logger.log({"time/bc_s_per_step": train_s / max(1, step)}, step)
    policy = ema.module.eval()
    metrics = {"final_loss": epoch_loss, "epochs": epochs, "steps": step, "s_per_step": round(train_s / max(1, step), 4),
               "n_windows": len(data), "n_episodes": data.n_episodes, "checkpoint": str(final),
               "condition_gap": round(gap, 3), "wall_time_s": round(time.perf_counter() - t0, 2)}  # fmt: skip
    return policy, metrics


# ------------------------------------------------------------------------------------------------- cache
def bc_key(env_cfg: EnvConfig, policy_cfg: PolicyConfig, bc_cfg: BCConfig, seed: int) -> str:
    """Short hash naming a cached BC checkpoint: the demonstrations' key, the policy and the BC settings
    (``bc.n_demos`` only when the expert's demonstrations are collected)."""
    defaults = dataclasses.asdict(PolicyConfig())
    policy = {
        k: v
        for k, v in dataclasses.asdict(policy_cfg).items()
        if k not in POLICY_FIELDS_IGNORED
        and not (k in POLICY_FIELDS_ADDED and v == POLICY_FIELDS_LEGACY.get(k, defaults[k]))
    }  # fields added later stay out of the key at their old behaviour, so caches written before stay valid
    encoder_defaults = dataclasses.asdict(EncoderConfig())
    policy["encoder"] = {
        k: v
        for k, v in policy["encoder"].items()
        if not (k in ENCODER_FIELDS_ADDED and v == encoder_defaults[k])
    }
    bc = {
        old: getattr(bc_cfg, new) for old, new in BC_FIELDS.items() if not (bc_cfg.demos and new == "n_demos")
    }
    bc_defaults = BCConfig()
    bc.update(
        {k: getattr(bc_cfg, k) for k in BC_FIELDS_ADDED if getattr(bc_cfg, k) != getattr(bc_defaults, k)}
    )
    blob = json.dumps(
        {"demos": demonstrations_key(env_cfg, bc_cfg, seed), "policy": policy, "bc": bc, "seed": seed},
        sort_keys=True,
        default=str,
    )
    return f"{env_cfg.name}-{policy_cfg.name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def pretrained_checkpoint(
    env_cfg: EnvConfig,
    policy_cfg: PolicyConfig,
    bc_cfg: BCConfig,
    runtime: Runtime,
    cache_dir: str | Path,
    *,
    seed: int = 0,
    logger: Logger | None = None,
    run_dir: str | Path | None = None,
    text_backend: str = "minilm",
    progress: bool = True,
    timings: dict[str, float] | None = None,
) -> Path:
    """The cached BC checkpoint for these settings (``<cache_dir>/bc/<bc_key>``), trained first if missing.

    Demonstrations come from :func:`diffpolicy.demos.demonstrations` (``bc_cfg.demos`` imported, else
    ``bc_cfg.n_demos`` expert episodes from ``seed``). Training logs and intermediate checkpoints go to ``run_dir`` (default
    ``<cache_dir>/bc/<key>.run``); only the finished checkpoint is written into the cache, so an interrupted
    run never leaves a half-trained one there. ``progress`` shows progress bars when no ``logger`` is given.
    ``timings``, when given, receives the seconds spent here: ``collect`` (reading or collecting the
    demonstrations) and ``bc`` (training); neither when the checkpoint was cached.
    """
    root = Path(cache_dir) / "bc" / bc_key(env_cfg, policy_cfg, bc_cfg, seed)
    if checkpoint.exists(root):
        return checkpoint.resolve(root)
    run_dir = Path(run_dir) if run_dir is not None else root.with_name(root.name + ".run")
    own_logger = logger is None
    logger = logger or Logger(run_dir, tensorboard=False, progress=progress)
    timings = timings if timings is not None else {}
    try:
        t0 = time.perf_counter()
        demos, _ = demonstrations(env_cfg, bc_cfg, seed, cache_dir, progress=logger.progress)
        timings["collect"] = time.perf_counter() - t0
        policy, metrics = behaviour_cloning(
            env_cfg, policy_cfg, bc_cfg, demos, runtime, logger, run_dir, seed, text_backend=text_backend
        )
        timings["bc"] = time.perf_counter() - t0 - timings["collect"]
    finally:
        if own_logger:
            logger.close()
    return publish(policy, env_cfg, policy_cfg, root, metrics, demos)


def publish(
    policy: Any,
    env_cfg: EnvConfig,
    policy_cfg: PolicyConfig,
    root: Path,
    metrics: dict[str, Any],
    demos: Path,
) -> Path:
    """Write a finished BC policy into the cache root ``root`` (no-op if another run already did)."""
    if checkpoint.exists(root):
        return checkpoint.resolve(root)
    return save_policy(
        root,
        int(metrics["steps"]),
        policy,
        env_cfg=env_cfg,
        policy_cfg=policy_cfg,
        metrics={"losses/bc": metrics["final_loss"]},
        extra={"stage": "bc", "demos": str(demos), "source": metrics["checkpoint"]},
    )
