"""Encoder forward + backward throughput per modality at the BC batch size (samples per second).

``run()`` builds the default ``policy.encoder`` (EncoderConfig) for MujocoPick's multimodal observation --
rgb (84, 84, 3) uint8, points (512, 6), state (10,), an instruction -- and times, interleaved in one process
so that all see the same machine load:

- each modality's encoder alone (``rgb``: preprocessing, augmentation and the ResNet; ``points``: the
  per-point MLP and its readouts; ``state``: normalisation and the MLP; ``text``: the frozen MiniLM behind
  its cache, plus the trainable projection), with the text FiLM where the full encoder uses it;
- the whole :class:`~diffpolicy.encoders.fusion.ObservationEncoder` (all encoders, fusion attention, head);
- the U-Net denoiser of ``policy=unet_small`` on a 16-step chunk (the reference: the rest of a BC step).

A timed call is forward, a scalar loss, backward, zeroed gradients; samples/s = batch / median seconds over
``repeats`` after ``warmup`` calls. ``share_of_bc_step`` is each part's seconds over (whole encoder + U-Net).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from diffpolicy.config import EncoderConfig, PolicyConfig
from diffpolicy.encoders.fusion import ObservationEncoder
from diffpolicy.models.unet1d import ConditionalUnet1D

SPEC = {"rgb": (84, 84, 3), "points": (512, 6), "state": (10,), "instruction": None}
"""MujocoPick-v0's multimodal observation, one step."""


def _obs(batch: int, g: torch.Generator) -> dict[str, Any]:
    colours = ("red", "green", "blue")
    return {
        "rgb": torch.randint(0, 256, (batch, 1, 84, 84, 3), dtype=torch.uint8, generator=g),
        "points": torch.cat(
            [torch.rand(batch, 1, 512, 3, generator=g) * 0.6, torch.rand(batch, 1, 512, 3)], -1
        ),
        "state": torch.randn(batch, 1, 10, generator=g),
        "instruction": [f"put the {colours[i % 3]} cube in the tray" for i in range(batch)],
    }


def _timed(fn: Callable[[], torch.Tensor], params: list[torch.nn.Parameter]) -> float:
    start = time.perf_counter()
    fn().float().square().mean().backward()
    for p in params:
        p.grad = None
    return time.perf_counter() - start


def run(repeats: int = 5, threads: int = 2, **kwargs: Any) -> dict:
    """Samples/s of every modality's encoder, the whole encoder and the U-Net, forward + backward.

    kwargs: ``batch`` (128, the state task's ``bc.batch_size``; multimodal BC uses 64), ``warmup`` (2),
    ``text_backend`` (``minilm``; ``hash`` skips loading MiniLM), and any EncoderConfig field (e.g.
    ``rgb_channels=[16,32,64]``).
    """
    batch = int(kwargs.pop("batch", 128))
    warmup = int(kwargs.pop("warmup", 2))
    text_backend = str(kwargs.pop("text_backend", "minilm"))
    enc_cfg = EncoderConfig(**kwargs)
    pol = PolicyConfig()
    torch.manual_seed(0)
    encoder = ObservationEncoder(enc_cfg, SPEC, 1, pol.cond_dim, text_backend=text_backend).train()
    unet = ConditionalUnet1D(7, pol.cond_dim, pol.down_dims, pol.kernel_size, pol.n_groups).train()
    g = torch.Generator().manual_seed(0)
    obs = _obs(batch, g)
    with torch.no_grad():
        encoder.state_normalizer.fit(obs["state"].flatten(0, 1))
    text_vec = encoder.text(obs["instruction"])[:, 0].detach() if encoder.use_text else None  # (B, D)

    def rgb() -> torch.Tensor:
        enc = encoder.encoders["rgb"]
        x = enc.preprocess(obs["rgb"][:, 0], augment=True, generator=g)
        return enc.tokens(x, text_vec if "rgb" in encoder.filmed else None)

    def points() -> torch.Tensor:
        return encoder.encoders["points"](
            obs["points"][:, 0], text_vec if "points" in encoder.filmed else None
        )

    def state() -> torch.Tensor:
        return encoder.encoders["state"](encoder.state_normalizer.normalize(obs["state"][:, 0]))

    def text() -> torch.Tensor:
        return encoder.text(obs["instruction"])

    x = torch.randn(batch, pol.horizon, 7, generator=g)
    t = torch.randint(0, 100, (batch,), generator=g)
    cond = torch.randn(batch, pol.cond_dim, generator=g)
    parts: dict[str, Callable[[], torch.Tensor]] = {
        "rgb": rgb,
        "points": points,
        "state": state,
        "text": text,
        "encoder": lambda: encoder(obs, augment=True, generator=g),
        "unet": lambda: unet(x, t, cond),
    }
    params = list(encoder.parameters()) + list(unet.parameters())
    for _ in range(warmup):
        for fn in parts.values():
            _timed(fn, params)
    seconds: dict[str, list[float]] = {k: [] for k in parts}
    for _ in range(repeats):  # interleaved: every part sees the same load
        for k, fn in parts.items():
            seconds[k].append(_timed(fn, params))
    med = {k: statistics.median(v) for k, v in seconds.items()}
    step = med["encoder"] + med["unet"]
    return {
        "batch": batch,
        "samples_per_s": {k: round(batch / v, 1) for k, v in med.items()},
        "ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "share_of_bc_step": {k: round(v / step, 3) for k, v in med.items() if k != "unet"}
        | {"unet": round(med["unet"] / step, 3)},
        "params": {
            k: sum(p.numel() for p in m.parameters())
            for k, m in [*encoder.encoders.items(), ("encoder", encoder), ("unet", unet)]
        },
        "encoder": {k: v for k, v in vars(enc_cfg).items() if not k.startswith("_")},
        "text_backend": text_backend,
    }
