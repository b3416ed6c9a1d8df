"""Residual MLP denoiser over a flattened action chunk (DPPO's ``DiffusionMLP`` idea, for state tasks).

The network predicts the noise eps of a noisy normalised chunk x_t (B, Ta, Da) from the flattened chunk, a
step embedding and the observation conditioning vector, concatenated and fed to one input layer, then
residual blocks of two linear layers (a ReLU between and after each; DPPO's Gym actors use ReLU), then a
linear output layer in float32 (``fp32_head``).

It offers the U-Net's sampling interface (:class:`~diffpolicy.models.unet1d.ConditionalUnet1D`): because the
input layer is linear in the concatenation, ``W [x; s; c] + b = W_x x + (W_s s + W_c c + b)``, so
:meth:`MLPDenoiser.film_tables` computes the observation part once per chunk and the step part once for the
K DDIM timesteps, and :meth:`MLPDenoiser.forward_film` adds ``W_x x`` to their sum. The observation columns
of the input layer start at zero (:meth:`MLPDenoiser.zero_init_condition`, the U-Net's reason).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diffpolicy.models.unet1d import SinusoidalPosEmb


class MLPDenoiser(nn.Module):
    """eps_theta(x_t, t, cond) for chunks of Ta x Da actions with an MLP of widths ``hidden``."""

    fp32_head = True
    """The output layer runs in float32 with autocast disabled."""

    def __init__(
        self,
        action_dim: int,
        horizon: int,
        cond_dim: int,
        hidden: list[int] | tuple[int, ...] = (512, 512, 512),
        step_embed_dim: int = 16,
    ) -> None:
        super().__init__()
        if not hidden or any(h <= 0 for h in hidden):
            raise ValueError(f"hidden={list(hidden)} must be positive widths")
        self.action_dim = action_dim
        self.horizon = horizon
        self.step_embed_dim = step_embed_dim
        self.grad_checkpointing = False
        """Unused (the MLP is small); kept so the policy can set it as on the U-Net."""
        dsed = step_embed_dim
        self.step_encoder = nn.Sequential(
            SinusoidalPosEmb(dsed), nn.Linear(dsed, 2 * dsed), nn.Mish(), nn.Linear(2 * dsed, dsed)
        )
        self.x_dim = horizon * action_dim
        self.inp = nn.Linear(self.x_dim + dsed + cond_dim, hidden[0])
        """Input layer over [x_t flattened (Ta Da), step embedding, cond]."""
        self.blocks = nn.ModuleList()
        self.proj = nn.ModuleList()
        for a, b in zip(hidden[:-1], hidden[1:]):
            self.blocks.append(nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b)))
            self.proj.append(nn.Identity() if a == b else nn.Linear(a, b))
        self.out = nn.Linear(hidden[-1], self.x_dim)
        self.zero_init_condition()

    def zero_init_condition(self) -> None:
        """Zero the observation columns of the input layer (the chunk and step columns stay random)."""
        with torch.no_grad():
            self.inp.weight[:, self.x_dim + self.step_embed_dim :].zero_()

    def film_splits(self) -> list[int]:
        """Width of the precomputed part of the input layer (one block: the first hidden width)."""
        return [self.inp.out_features]

    def step_embedding(self, t: torch.Tensor) -> torch.Tensor:
        """(M,) diffusion steps -> (M, step_embed_dim)."""
        return self.step_encoder(t)

    def forward(self, x: torch.Tensor, t: torch.Tensor | int, cond: torch.Tensor) -> torch.Tensor:
        """Plain path: x (B, Ta, Da), t (B,) or scalar, cond (B, cond_dim) -> eps (B, Ta, Da)."""
        t = torch.as_tensor(t, device=x.device)
        if t.dim() == 0:
            t = t.expand(x.shape[0])
        s = self.step_embedding(t)  # (B, dsed)
        h = self.inp(torch.cat([x.flatten(1), s.to(x.dtype), cond.to(x.dtype)], dim=-1))  # (B, H0)
        return self._trunk(h, x.shape)

    def film_tables(self, cond: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cond (B, cond_dim), t (K,) -> obs part (B, H0) including the bias, step part (K, H0)."""
        xd, d = self.x_dim, self.step_embed_dim
        w = self.inp.weight  # (H0, Ta Da + dsed + cond_dim)
        step = self.step_embedding(t) @ w[:, xd : xd + d].t()
        obs = torch.addmm(self.inp.bias, cond, w[:, xd + d :].t())
        return obs, step

    def forward_film(self, x: torch.Tensor, film: torch.Tensor) -> torch.Tensor:
        """Fast path: x (B, Ta, Da), film (B, H0) from :meth:`film_tables` -> eps (B, Ta, Da)."""
        h = x.flatten(1) @ self.inp.weight[:, : self.x_dim].t() + film  # (B, H0)
        return self._trunk(h, x.shape)

    def _trunk(self, h: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        h = F.relu(h)
        for block, proj in zip(self.blocks, self.proj):
            h = F.relu(block(h) + proj(h))
        with torch.autocast(device_type=h.device.type, enabled=False):
            out = self.out(h.float())  # (B, Ta Da) in fp32
        return out.view(shape)  # (B, Ta, Da)
