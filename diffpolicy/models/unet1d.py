"""Conditional 1-D U-Net denoiser over an action chunk (after Chi et al.'s ConditionalUnet1D).

The network predicts the noise eps of a noisy normalised chunk x_t (B, Ta, Da) at diffusion step t given the
observation conditioning vector (B, cond_dim). The condition fed to every residual block is the
concatenation [step embedding(t), obs cond] and enters by

- ``film``: Conv -> GroupNorm -> Mish, then per-channel ``scale * h + shift`` (Chi et al.), or
- ``adanorm``: Conv -> GroupNorm without affine -> ``(1 + scale) * h + shift`` -> Mish.

Because Mish acts elementwise, a block's condition projection splits exactly into a step part and an
observation part: ``W [mish(s); mish(c)] + b = W_s mish(s) + W_c mish(c) + b``. :meth:`ConditionalUnet1D.film_tables`
uses this to compute, once per sampled chunk, the observation part for the batch and the step part for the
K fixed DDIM timesteps; each denoising step then only adds two rows (:meth:`ConditionalUnet1D.forward_film`).
The observation columns of every FiLM projection start at zero (:meth:`ConditionalUnet1D.zero_init_condition`).
The last 1x1 convolution always runs in float32 outside autocast (``fp32_head``), so PPO log-probabilities
are computed from an fp32 noise prediction.

With ``prediction="sample"`` the trunk predicts the clean chunk x0 and the network returns the noise that
chunk implies at step t, ``eps = (x_t - sqrt(a_t) x0_hat) / sqrt(1 - a_t)``: callers (the DDPM loss, the
DDIM steps, the chain log-probs) see an epsilon-predictor either way, and a DDIM step's x0_hat is the trunk's
output. The two per-step coefficients ride along in the step part of :meth:`ConditionalUnet1D.film_tables`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from diffpolicy.ops import group_norm_mish


class SinusoidalPosEmb(nn.Module):
    """Transformer-style sinusoidal embedding of a (possibly fractional) step index: (M,) -> (M, dim)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        half = dim // 2
        scale = math.log(10000) / max(half - 1, 1)
        self.register_buffer("freqs", torch.exp(torch.arange(half) * -scale), persistent=False)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        arg = t.float()[:, None] * self.freqs[None, :]  # (M, dim/2)
        return torch.cat([arg.sin(), arg.cos()], dim=-1)


class Conv1dBlock(nn.Module):
    """Conv1d -> GroupNorm -> Mish over (B, C, Ta). With ``norm_kernel`` GroupNorm and Mish are one operator
    (:func:`diffpolicy.ops.group_norm_mish`: a compiled kernel on the CPU in float32, ATen's ops elsewhere)."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        kernel_size: int,
        n_groups: int,
        affine: bool = True,
        norm_kernel: bool = False,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, kernel_size, padding=kernel_size // 2)
        self.norm = nn.GroupNorm(n_groups, c_out, affine=affine)
        self.norm_kernel = norm_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = self.norm
        if self.norm_kernel:
            return group_norm_mish(self.conv(x), norm.weight, norm.bias, norm.num_groups, norm.eps)
        return F.mish(norm(self.conv(x)))


class CondResBlock1d(nn.Module):
    """Residual block with the condition injected between its two convolutions (FiLM or AdaNorm)."""

    def __init__(
        self,
        c_in: int,
        c_out: int,
        cond_dim: int,
        kernel_size: int,
        n_groups: int,
        conditioning: str,
        norm_kernel: bool = False,
    ) -> None:
        super().__init__()
        self.conditioning = conditioning
        self.c_out = c_out
        film = conditioning == "film"
        self.block0 = Conv1dBlock(c_in, c_out, kernel_size, n_groups, affine=film, norm_kernel=norm_kernel)
        self.block1 = Conv1dBlock(c_out, c_out, kernel_size, n_groups, norm_kernel=norm_kernel)
        self.cond_proj = nn.Linear(cond_dim, 2 * c_out)
        """Maps mish(condition) to [scale, shift], each (B, c_out)."""
        self.residual = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor, film: torch.Tensor) -> torch.Tensor:
        """x (B, c_in, L), film (B, 2 c_out) = cond_proj(mish(condition)) -> (B, c_out, L)."""
        scale = film[:, : self.c_out, None]  # (B, c_out, 1)
        shift = film[:, self.c_out :, None]
        b0 = self.block0
        if self.conditioning == "film":
            h = torch.addcmul(shift, b0(x), scale)
        else:
            h = b0.norm(b0.conv(x))
            h = F.mish(torch.addcmul(shift + h, h, scale))  # (1 + scale) h + shift
        return self.block1(h) + self.residual(x)


class ConditionalUnet1D(nn.Module):
    """eps_theta(x_t, t, cond): (B, Ta, Da), (B,) or scalar, (B, cond_dim) -> (B, Ta, Da).

    ``fold`` consecutive action steps share one position of the U-Net's first level (:attr:`fold`);
    ``prediction`` says what the trunk predicts (:attr:`prediction`; ``sample`` needs the schedule's
    ``alphas_cumprod`` (T,)); ``norm_kernel`` runs every block's GroupNorm + Mish as one operator
    (:class:`Conv1dBlock`)."""

    fp32_head = True
    """The final 1x1 convolution runs in float32 with autocast disabled."""

    def __init__(
        self,
        action_dim: int,
        cond_dim: int,
        down_dims: list[int] | tuple[int, ...] = (64, 128, 256),
        kernel_size: int = 5,
        n_groups: int = 8,
        step_embed_dim: int = 128,
        conditioning: str = "film",
        fold: int = 1,
        prediction: str = "epsilon",
        alphas_cumprod: torch.Tensor | None = None,
        norm_kernel: bool = False,
    ) -> None:
        super().__init__()
        if conditioning not in ("film", "adanorm"):
            raise ValueError(f"conditioning={conditioning!r} is not allowed; choose film or adanorm")
        if fold < 1:
            raise ValueError(f"fold={fold} must be >= 1")
        if prediction not in ("epsilon", "sample"):
            raise ValueError(f"prediction={prediction!r} is not allowed; choose epsilon or sample")
        if prediction == "sample" and alphas_cumprod is None:
            raise ValueError("prediction='sample' needs the schedule's alphas_cumprod")
        self.action_dim = action_dim
        self.fold = fold
        """Action steps folded into one U-Net position: the chunk (B, Ta, Da) enters as (B, f Da, Ta / f)
        and the last 1x1 convolution emits f Da channels that unfold back, so every level runs at 1/f of the
        chunk's time resolution (a Ta = 64 chunk at fold 4 costs about what a 16-step one does)."""
        self.prediction = prediction
        """epsilon: the trunk predicts the noise; sample: it predicts x0 and the output is the implied noise.
        A folded chunk carries f Da channels of nearly white noise per position, which the trunk would have
        to pass through its 64-channel levels to predict; its clean chunk is smooth (docs/experiments.md)."""
        if prediction == "sample":
            a = alphas_cumprod.double()
            inv = (1 - a).rsqrt()
            # (T, 2): eps = x_t * [0] - x0_hat * [1]; derived from the schedule, so not saved
            self.register_buffer("x0_coefs", torch.stack([inv, a.sqrt() * inv], -1).float(), persistent=False)
        self.step_embed_dim = step_embed_dim
        self.grad_checkpointing = False
        """Recompute residual blocks in backward (set by the policy; only active in training with grad)."""
        dsed = step_embed_dim
        self.step_encoder = nn.Sequential(
            SinusoidalPosEmb(dsed), nn.Linear(dsed, 4 * dsed), nn.Mish(), nn.Linear(4 * dsed, dsed)
        )
        total_cond = dsed + cond_dim
        dims = [fold * action_dim, *down_dims]
        in_out = list(zip(dims[:-1], dims[1:]))

        def block(a: int, b: int) -> CondResBlock1d:
            return CondResBlock1d(a, b, total_cond, kernel_size, n_groups, conditioning, norm_kernel)

        self.down = nn.ModuleList()
        self.downsample = nn.ModuleList()
        for i, (a, b) in enumerate(in_out):
            last = i == len(in_out) - 1
            self.down.append(nn.ModuleList([block(a, b), block(b, b)]))
            self.downsample.append(nn.Identity() if last else nn.Conv1d(b, b, 3, stride=2, padding=1))
        mid = down_dims[-1]
        self.mid = nn.ModuleList([block(mid, mid), block(mid, mid)])
        self.up = nn.ModuleList()
        self.upsample = nn.ModuleList()
        for a, b in reversed(in_out[1:]):  # one upsampling per downsampling
            self.up.append(nn.ModuleList([block(2 * b, a), block(a, a)]))
            self.upsample.append(nn.ConvTranspose1d(a, a, 4, stride=2, padding=1))
        self.final_block = Conv1dBlock(
            down_dims[0], down_dims[0], kernel_size, n_groups, norm_kernel=norm_kernel
        )
        self.final_proj = nn.Conv1d(down_dims[0], fold * action_dim, 1)
        self.zero_init_condition()

    def zero_init_condition(self) -> None:
        """Zero the observation columns of every block's FiLM projection (the step columns stay random).

        With random columns, a fresh network turns every difference between observations into noise on its
        output; behaviour cloning then lowers the loss fastest by making the encoder's output constant, and
        the policy ends up unconditional (measured on MujocoPick: the fused condition varied 3 % across
        observations and the loss was the same with shuffled conditions). Starting from zero (as
        adaLN-Zero does in DiT), the observation enters only along directions that lower the loss.
        """
        with torch.no_grad():
            for b in self.res_blocks():
                b.cond_proj.weight[:, self.step_embed_dim :].zero_()

    # ----------------------------------------------------------------------------------------- blocks
    def res_blocks(self) -> list[CondResBlock1d]:
        """All conditioned residual blocks in execution order (down, mid, up)."""
        out: list[CondResBlock1d] = [b for pair in self.down for b in pair]
        out += list(self.mid)
        out += [b for pair in self.up for b in pair]
        return out

    def film_splits(self) -> list[int]:
        """Widths 2 c_out of every block's [scale, shift], in :meth:`res_blocks` order; with
        ``prediction="sample"`` a last width 2 holds the step's two x0 -> eps coefficients."""
        return [2 * b.c_out for b in self.res_blocks()] + ([2] if self.prediction == "sample" else [])

    def step_embedding(self, t: torch.Tensor) -> torch.Tensor:
        """(M,) diffusion steps -> (M, step_embed_dim)."""
        return self.step_encoder(t)

    # ---------------------------------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, t: torch.Tensor | int, cond: torch.Tensor) -> torch.Tensor:
        """Plain path: x (B, Ta, Da), t (B,) or scalar, cond (B, cond_dim) -> eps (B, Ta, Da)."""
        t = torch.as_tensor(t, device=x.device)
        if t.dim() == 0:
            t = t.expand(x.shape[0])
        c = F.mish(torch.cat([self.step_embedding(t), cond.to(x.dtype)], dim=-1))  # (B, dsed + cond_dim)
        films = [b.cond_proj(c) for b in self.res_blocks()]
        if self.prediction == "sample":
            films.append(self.x0_coefs[t.long()])  # (B, 2)
        return self._trunk(x, films)

    def film_tables(self, cond: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Split FiLM projections of all blocks, computed once per chunk.

        cond (B, cond_dim), t (K,) -> obs part (B, R) including biases, step part (K, R), where R is the sum
        of :meth:`film_splits`. The [scale, shift] of step k is ``obs + step[k]`` for every block at once
        (and, for ``prediction="sample"``, step k's coefficients: the obs part holds zeros there).
        """
        d = self.step_embed_dim
        s = F.mish(self.step_embedding(t))  # (K, dsed)
        c = F.mish(cond)  # (B, cond_dim)
        obs, step = [], []
        for b in self.res_blocks():
            w = b.cond_proj.weight  # (2 c_out, dsed + cond_dim)
            step.append(s @ w[:, :d].t())
            obs.append(torch.addmm(b.cond_proj.bias, c, w[:, d:].t()))
        if self.prediction == "sample":
            step.append(self.x0_coefs[t.long()])  # fp32 even under autocast
            obs.append(c.new_zeros(c.shape[0], 2))
        return torch.cat(obs, dim=-1), torch.cat(step, dim=-1)

    def forward_film(self, x: torch.Tensor, film: torch.Tensor) -> torch.Tensor:
        """Fast path: x (B, Ta, Da), film (B, R) from :meth:`film_tables` -> eps (B, Ta, Da)."""
        return self._trunk(x, list(film.split(self.film_splits(), dim=-1)))

    def _run(self, blk: CondResBlock1d, h: torch.Tensor, film: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(blk, h, film, use_reentrant=False)
        return blk(h, film)

    def _trunk(self, x: torch.Tensor, films: list[torch.Tensor]) -> torch.Tensor:
        b, ta, da = x.shape
        if ta % self.fold:
            raise ValueError(f"a chunk of {ta} steps cannot be folded {self.fold} steps to a position")
        h = x.reshape(b, ta // self.fold, self.fold * da).transpose(1, 2)  # (B, f Da, Ta / f)
        it = iter(films)
        skips = []
        for (b0, b1), down in zip(self.down, self.downsample):
            h = self._run(b1, self._run(b0, h, next(it)), next(it))
            skips.append(h)  # the last level's skip meets the mid output; the first level's is unused
            h = down(h)
        for blk in self.mid:
            h = self._run(blk, h, next(it))
        for (b0, b1), up in zip(self.up, self.upsample):
            h = torch.cat([h, skips.pop()], dim=1)  # (B, 2 C, L)
            h = self._run(b1, self._run(b0, h, next(it)), next(it))
            h = up(h)
        h = self.final_block(h)
        with torch.autocast(device_type=h.device.type, enabled=False):
            out = self.final_proj(h.float())  # (B, f Da, Ta / f) in fp32
        out = out.transpose(1, 2).reshape(b, ta, da)
        return out if self.prediction == "epsilon" else sample_to_eps(x, out, next(it))


def sample_to_eps(x: torch.Tensor, x0_hat: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
    """The noise a predicted clean chunk implies: x_t, x0_hat (B, Ta, Da), coefs (B, 2) = [1 / sqrt(1 - a_t),
    sqrt(a_t) / sqrt(1 - a_t)] -> eps (B, Ta, Da) in fp32."""
    c = coefs.float()
    return x.float() * c[:, :1, None] - x0_hat.float() * c[:, 1:, None]
