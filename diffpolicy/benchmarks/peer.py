"""The peer the sampler and BC-step benchmarks measure against: Stanford diffusion_policy's U-Net, read from a
local copy the user names.

The peer's code is neither a dependency nor in this repository (github.com/real-stanford/diffusion_policy is
not on a package registry, and ``lerobot``, which carries the same U-Net, pins a torch older than this
project's). ``peer=<dir>`` on the benchmark's command line, or the ``DIFFPOLICY_PEER_DP`` environment variable,
names a checkout; :func:`load` imports its ``ConditionalUnet1D`` and ``EMAModel`` from there, and diffusers
(``pip install -e .[peer]``) supplies the DDIM and DDPM schedulers, as in that repository. When either is
absent, :func:`missing` returns the one line a benchmark reports instead of the peer's row.

What the peer runs, as its own policies do (``DiffusionUnetLowdimPolicy`` with ``obs_as_global_cond``):

- sampling (:func:`sampler`): ``scheduler.set_timesteps(K)``, then per step the conditioning assignment
  (an all-false mask here), the U-Net and ``DDIMScheduler.step``, under ``torch.inference_mode``;
- one training step (:func:`train_step`): the affine normalisation of observations and actions (what its
  ``LinearNormalizer`` computes), DDPM's ``add_noise``, the U-Net, the MSE to the noise, backward, AdamW,
  the cosine lr scheduler and its ``EMAModel.step`` (power 0.75, as its configs).
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

ENV_VAR = "DIFFPOLICY_PEER_DP"
"""Environment variable naming the local diffusion_policy checkout when ``peer=`` is not given."""
UNET_MODULE = "diffusion_policy.model.diffusion.conditional_unet1d"
EMA_MODULE = "diffusion_policy.model.diffusion.ema_model"
TRAIN_TIMESTEPS = 100
"""The peer's ``num_train_timesteps`` in its low-dim and image configs; this project's schedules use 100 too."""


def root(path: str | os.PathLike[str] | None = None) -> Path | None:
    """The checkout ``path`` names, else ``$DIFFPOLICY_PEER_DP``, else None."""
    given = str(path) if path else os.environ.get(ENV_VAR, "")
    return Path(given).expanduser() if given else None


def missing(path: str | os.PathLike[str] | None = None) -> str | None:
    """Why the peer cannot run (one line), or None when it can."""
    where = root(path)
    if where is None:
        return f"peer skipped: name a diffusion_policy checkout with peer=<dir> or {ENV_VAR}"
    if not (where / Path(*UNET_MODULE.split("."))).with_suffix(".py").is_file():
        return f"peer skipped: {where} has no {UNET_MODULE.replace('.', '/')}.py (not a diffusion_policy checkout)"
    for module in ("diffusers", "einops"):
        try:
            importlib.import_module(module)
        except ImportError:
            return f"peer skipped: the peer needs {module} (pip install -e .[peer])"
    return None


def load(path: str | os.PathLike[str] | None = None) -> SimpleNamespace:
    """The peer's classes from the checkout: ``ConditionalUnet1D``, ``EMAModel``, ``DDIMScheduler``,
    ``DDPMScheduler`` and ``get_scheduler``. Raises ``RuntimeError`` with :func:`missing`'s line when absent,
    or when another ``diffusion_policy`` package shadows the named checkout."""
    reason = missing(path)
    if reason:
        raise RuntimeError(reason)
    where = root(path).resolve()
    sys.path.insert(0, str(where))
    try:
        unet = importlib.import_module(UNET_MODULE)
        ema = importlib.import_module(EMA_MODULE)
    finally:
        sys.path.remove(str(where))
    if where not in Path(unet.__file__).resolve().parents:
        raise RuntimeError(f"peer: {UNET_MODULE} was imported from {unet.__file__}, not from {where}")
    from diffusers import DDIMScheduler, DDPMScheduler
    from diffusers.optimization import get_scheduler

    return SimpleNamespace(
        ConditionalUnet1D=unet.ConditionalUnet1D,
        EMAModel=ema.EMAModel,
        DDIMScheduler=DDIMScheduler,
        DDPMScheduler=DDPMScheduler,
        get_scheduler=get_scheduler,
    )


def unet(peer: SimpleNamespace, action_dim: int, cond_dim: int, down_dims: list[int]) -> torch.nn.Module:
    """The peer's U-Net at this project's dims: kernel 5, 8 groups, step embedding 128, FiLM with scale
    (``cond_predict_scale``), the condition as global conditioning."""
    return peer.ConditionalUnet1D(
        input_dim=action_dim,
        global_cond_dim=cond_dim,
        diffusion_step_embed_dim=128,
        down_dims=list(down_dims),
        kernel_size=5,
        n_groups=8,
        cond_predict_scale=True,
    )


def _scheduler_kwargs() -> dict[str, Any]:
    return dict(
        num_train_timesteps=TRAIN_TIMESTEPS,
        beta_schedule="squaredcos_cap_v2",
        clip_sample=True,
        prediction_type="epsilon",
    )


def sampler(peer: SimpleNamespace, model: torch.nn.Module, k: int) -> Callable[..., torch.Tensor]:
    """``sample(noise (B, Ta, Da), cond (B, cond_dim)) -> (B, Ta, Da)``: the peer's DDIM chain (eta 0) in K
    steps, as its ``conditional_sample`` runs it. Call under ``torch.inference_mode``."""
    scheduler = peer.DDIMScheduler(**_scheduler_kwargs(), set_alpha_to_one=True, steps_offset=0)
    model.eval()

    def sample(noise: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        trajectory = noise.clone()
        condition = torch.zeros_like(trajectory)
        mask = torch.zeros_like(trajectory, dtype=torch.bool)
        scheduler.set_timesteps(k)
        for t in scheduler.timesteps:
            trajectory[mask] = condition[mask]
            out = model(trajectory, t, global_cond=cond)
            trajectory = scheduler.step(out, t, trajectory).prev_sample
        trajectory[mask] = condition[mask]
        return trajectory

    return sample


def train_step(
    peer: SimpleNamespace, model: torch.nn.Module, lr: float = 1e-4, generator: torch.Generator | None = None
) -> Callable[[torch.Tensor, torch.Tensor], float]:
    """``step(obs (B, To, Do), actions (B, Ta, Da)) -> loss``: one optimiser step of the peer's training loop
    (AdamW lr 1e-4, betas (0.95, 0.999), weight decay 1e-6; cosine schedule with 500 warm-up steps; EMA)."""
    model.train()
    averaged = peer.EMAModel(copy.deepcopy(model), power=0.75)
    noise_scheduler = peer.DDPMScheduler(**_scheduler_kwargs())
    optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.95, 0.999), eps=1e-8, weight_decay=1e-6)
    lr_schedule = peer.get_scheduler(
        "cosine", optimizer=optim, num_warmup_steps=500, num_training_steps=1_000_000
    )
    obs_scale, act_scale = 0.5, 1.0  # its LinearNormalizer's affine maps (x * scale + offset)

    def step(obs: torch.Tensor, actions: torch.Tensor) -> float:
        nobs = obs * obs_scale + 0.1
        trajectory = actions * act_scale
        cond = nobs.reshape(nobs.shape[0], -1)
        noise = torch.randn(trajectory.shape, generator=generator)
        t = torch.randint(0, TRAIN_TIMESTEPS, (trajectory.shape[0],), generator=generator).long()
        noisy = noise_scheduler.add_noise(trajectory, noise, t)
        loss = F.mse_loss(model(noisy, t, global_cond=cond), noise)
        loss.backward()
        optim.step()
        optim.zero_grad()
        lr_schedule.step()
        averaged.step(model)
        return float(loss.detach())

    return step
