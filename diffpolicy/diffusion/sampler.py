"""DDIM sampling of an action chunk with every fine-tuned step's Gaussian exposed.

:func:`ddim_sample` is the fast loop used by the policy and the benchmark: the FiLM projections of all U-Net
blocks are computed once per chunk (:meth:`ConditionalUnet1D.film_tables`), every buffer is allocated
before the loop, and each step writes in place (static shapes, no per-step allocation apart from the
denoiser's own activations). The denoiser call of each step is chosen by ``backend``:

- ``eager``: :meth:`ConditionalUnet1D.forward_film` (any device, autocast, dtype);
- ``fast``: :class:`~diffpolicy.diffusion.fast.FastUnet1D`, prepacked oneDNN / GEMM convolutions on
  token-major activations (CPU, fp32, no grad, no autocast; otherwise ``eager``);
- ``compiled``: the ``fast`` network through ``torch.compile`` (Inductor fuses the elementwise work); on
  other devices ``torch.compile(forward_film)``. If compilation fails it warns once and uses ``fast``;
- ``auto`` (default): ``fast`` where it is valid, else ``eager``.

All backends compute the same function (fp32 summation order aside, ~1e-6). :func:`ddim_sample_reference`
is the plain eager loop (denoiser's ordinary forward, out-of-place step) that tests compare against.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffpolicy.diffusion.fast import fast_path_available, fast_unet
from diffpolicy.diffusion.schedule import NoiseSchedule, ddim_step_mean_std
from diffpolicy.models.unet1d import ConditionalUnet1D

SAMPLER_BACKENDS = ("auto", "eager", "fast", "compiled")
"""Choices of :func:`ddim_sample`'s ``backend`` (see the module docstring)."""

FilmFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(x (B, Ta, Da), film (B, R)) -> eps (B, Ta, Da)."""

_compile_failed = False  # set once torch.compile has failed in this process (warned once)
_compiled_eager: Callable | None = None  # torch.compile(ConditionalUnet1D.forward_film), built on first use
_warm_shapes: weakref.WeakKeyDictionary[ConditionalUnet1D, set] = weakref.WeakKeyDictionary()
"""(B, Ta, device, fast) already compiled per denoiser."""


@dataclass
class ChainOutput:
    """Result of one DDIM run in normalised action units."""

    x0: torch.Tensor
    """(B, Ta, Da) final sample."""
    chain: torch.Tensor | None
    """(B, K'+1, Ta, Da) latents x_{K'} .. x_0 of the fine-tuned steps (None unless asked for)."""
    means: torch.Tensor | None
    """(B, K', Ta, Da) mean of each fine-tuned step's Gaussian (None unless the chain was asked for)."""
    stds: torch.Tensor
    """(1, K', 1, 1) std of each fine-tuned step's Gaussian (broadcastable to ``means``)."""


def _initial(
    shape: tuple[int, ...],
    device: torch.device,
    noise: torch.Tensor | None,
    generator: torch.Generator | None,
    copy: bool = True,
) -> torch.Tensor:
    """x_K (B, Ta, Da) float32: ``noise`` (copied unless ``copy`` is False, so that writing into x in place
    never changes the caller's tensor), else drawn from ``generator``."""
    if noise is None:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if not copy:
        return noise.float()
    return torch.empty(shape, device=device, dtype=torch.float32).copy_(noise)


def sampler_forward(
    denoiser: ConditionalUnet1D,
    cond: torch.Tensor,
    horizon: int,
    backend: str = "auto",
    film_dim: int | None = None,
) -> FilmFn:
    """The per-step denoiser call ``(x, film) -> eps`` of ``backend`` for this cond (B, cond_dim).

    ``compiled`` compiles on the first use of each (B, Ta) (tens of seconds on the CPU, then cached by
    Inductor on disk) through one warm-up call on zeros, so a failure falls back before the sampler draws
    any random number.
    """
    global _compile_failed
    if backend not in SAMPLER_BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed; choose one of {', '.join(SAMPLER_BACKENDS)}")
    fast_ok = fast_path_available(denoiser, cond)
    if backend == "eager" or (backend != "compiled" and not fast_ok):
        return denoiser.forward_film
    uncompiled = fast_unet(denoiser, horizon) if fast_ok else denoiser.forward_film
    if backend != "compiled" or _compile_failed:
        return uncompiled
    warm = _warm_shapes.setdefault(denoiser, set())
    key = (cond.shape[0], horizon, cond.device, fast_ok)
    try:
        fn = uncompiled.compiled() if fast_ok else _compiled_forward_film(denoiser)
        if key not in warm:  # compile now, before the sampler consumes any randomness
            B, R = cond.shape[0], film_dim if film_dim is not None else sum(denoiser.film_splits())
            fn(cond.new_zeros(B, horizon, denoiser.action_dim), cond.new_zeros(B, R))
            warm.add(key)
        if fast_ok:
            return _without_guards(fn)
    except Exception as exc:  # no C++ compiler, unsupported backend or device
        _compile_failed = True
        warnings.warn(
            f"torch.compile of the sampler failed ({type(exc).__name__}: {exc}); sampling uncompiled "
            "from now on",
            stacklevel=3,
        )
        return uncompiled
    return fn


def _without_guards(fn: FilmFn) -> FilmFn:
    """Call a warmed compiled fast network with Dynamo's guards reduced to those that tell entries apart.

    Evaluating the guards over every attribute the network reads (about a hundred packed convolutions) cost
    ~0.3 ms per denoiser call on 2 cores, 8% of a small K = 10 chunk. Skipping them is safe here because the
    shape (B, Ta) was compiled by the warm-up above, the packed weights are graph inputs read from the
    instance at call time (so two networks of the same architecture share one graph correctly), and the
    guards that differ between cache entries (input and weight shapes, kernel choices) still run.
    """

    def call(x: torch.Tensor, film: torch.Tensor) -> torch.Tensor:
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
            return fn(x, film)

    return call


def _compiled_forward_film(denoiser: ConditionalUnet1D) -> FilmFn:
    """torch.compile of :meth:`ConditionalUnet1D.forward_film` (devices without the fast path)."""
    global _compiled_eager
    if _compiled_eager is None:
        _compiled_eager = torch.compile(ConditionalUnet1D.forward_film, dynamic=False)
    compiled = _compiled_eager
    return lambda x, film: compiled(denoiser, x, film)


def ddim_sample(
    denoiser: ConditionalUnet1D,
    schedule: NoiseSchedule,
    cond: torch.Tensor,
    horizon: int,
    *,
    deterministic: bool = False,
    return_chain: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    forward_film: FilmFn | None = None,
    backend: str = "auto",
    base_denoiser: ConditionalUnet1D | None = None,
    noise_clip: float = 0.0,
    step_noise: torch.Tensor | None = None,
    inplace: bool = True,
) -> ChainOutput:
    """Run the K DDIM steps from x_K = ``noise`` (or N(0, I)) for cond (B, cond_dim).

    Each step k draws x_{k-1} = mean_k + std_k z (z ~ N(0, I) from ``generator``, or the next (B, Ta, Da)
    slice of ``step_noise`` (B, S, Ta, Da) when given; clamped to [-``noise_clip``, ``noise_clip``] when that
    is > 0, DPPO's ``randn_clip_value``) unless ``deterministic`` (then x_{k-1} = mean_k) or std_k is 0
    (eta = 0 on a base step). The S steps that draw are those with std_k > 0, in sampling order: with
    ``noise`` and ``step_noise`` as inputs the loop is a pure function of tensors, which
    :class:`diffpolicy.export.SamplerGraph` traces into an ONNX graph. The denoiser runs through ``backend``
    (``auto`` | ``eager`` | ``fast`` | ``compiled``, see the module docstring) unless ``forward_film`` is
    given, which then replaces ``denoiser.forward_film``. With ``base_denoiser`` (a frozen copy of the
    pre-trained network, DPPO's ``actor``) the first K - K' steps run through it and only the K' fine-tuned
    steps through ``denoiser``, so fine-tuning cannot move the latent x_{K'} the fine-tuned chain starts
    from. ``inplace`` (default) writes every step into buffers allocated before the loop; False computes
    each step out of place (ONNX cannot export in-place writes; the results are the same). Call under
    no_grad / inference_mode.
    """
    B, Da, K, Kp = cond.shape[0], denoiser.action_dim, schedule.ddim_steps, schedule.ft_steps
    first = schedule.first_ft_step
    obs_film, step_film = denoiser.film_tables(cond, schedule.timesteps)  # (B, R), (K, R)
    fwd = forward_film or sampler_forward(denoiser, cond, horizon, backend, obs_film.shape[1])
    base = None  # (obs film, step films, forward) of the frozen network for steps [0, K - K')
    if base_denoiser is not None and first > 0:
        base_obs, base_step = base_denoiser.film_tables(cond, schedule.timesteps[:first])  # (B, R), (K-K', R)
        base = base_obs, base_step, sampler_forward(base_denoiser, cond, horizon, backend, base_obs.shape[1])
    x = _initial((B, horizon, Da), cond.device, noise, generator, copy=inplace)  # (B, Ta, Da)
    # Buffers every step writes into (None: out of place); z_buf only where z is drawn here.
    film_buf = torch.empty_like(obs_film) if inplace else None  # (B, R)
    bufs = (torch.empty_like(x), torch.empty_like(x)) if inplace else None  # x0, mean: (B, Ta, Da)
    x_buf = x if inplace else None
    z_buf = torch.empty_like(x) if inplace and not deterministic and step_noise is None else None
    chain = means = None
    if return_chain:
        chain = torch.empty((B, Kp + 1, horizon, Da), device=x.device, dtype=x.dtype)
        means = torch.empty((B, Kp, horizon, Da), device=x.device, dtype=x.dtype)
        if first == 0:
            chain[:, 0].copy_(x)
    drawn = 0  # stochastic steps so far (the index into step_noise)
    for i in range(K):
        obs_i, step_i, fwd_i = base if base is not None and i < first else (obs_film, step_film, fwd)
        film = torch.add(obs_i, step_i[i], out=film_buf)  # (B, R)
        eps = fwd_i(x, film)
        mean, std = ddim_step_mean_std(x, eps, schedule.step_coefs(i), schedule.clip_sample, out=bufs)
        if deterministic or std == 0.0:
            x = mean if x_buf is None else x_buf.copy_(mean)
        else:
            if step_noise is None:
                z = torch.randn(x.shape, generator=generator, device=x.device, out=z_buf)
            else:
                z = step_noise[:, drawn]  # (B, Ta, Da), an input: never written
            drawn += 1
            if noise_clip > 0:
                z = z.clamp(-noise_clip, noise_clip) if z_buf is None else z.clamp_(-noise_clip, noise_clip)
            x = torch.add(mean, z, alpha=std, out=x_buf)
        if return_chain:
            j = i - first
            if j >= 0:
                means[:, j].copy_(mean)
                chain[:, j + 1].copy_(x)
            elif i + 1 == first:
                chain[:, 0].copy_(x)
    return ChainOutput(x0=x, chain=chain, means=means, stds=schedule.std[first:].view(1, Kp, 1, 1))


def ddim_sample_reference(
    denoiser: ConditionalUnet1D,
    schedule: NoiseSchedule,
    cond: torch.Tensor,
    horizon: int,
    *,
    deterministic: bool = False,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    base_denoiser: ConditionalUnet1D | None = None,
    noise_clip: float = 0.0,
) -> torch.Tensor:
    """The plain eager DDIM loop (no precomputation, out-of-place): -> x0 (B, Ta, Da).

    Draws the same random numbers in the same order as :func:`ddim_sample`, so both agree for a fixed
    ``generator`` / ``noise``; ``base_denoiser`` and ``noise_clip`` mean what they mean there.
    """
    B, Da = cond.shape[0], denoiser.action_dim
    x = _initial((B, horizon, Da), cond.device, noise, generator)
    for i in range(schedule.ddim_steps):
        t = schedule.timesteps[i].expand(B)
        net = base_denoiser if base_denoiser is not None and i < schedule.first_ft_step else denoiser
        eps = net(x, t, cond)
        coefs = schedule.step_coefs(torch.full((B,), i, device=x.device))
        mean, std = ddim_step_mean_std(x, eps, coefs, schedule.clip_sample)
        if deterministic or float(schedule.std[i]) == 0.0:
            x = mean
        else:
            z = torch.randn(x.shape, generator=generator, device=x.device)
            x = mean + std * (z.clamp(-noise_clip, noise_clip) if noise_clip > 0 else z)
    return x
