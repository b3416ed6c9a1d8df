"""RGB encoder: a small ResNet with GroupNorm, spatial-softmax keypoints and random-shift augmentation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def random_shift(img: torch.Tensor, pad: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """DrQ-style augmentation: replicate-pad by ``pad`` pixels and crop back at a random offset per image.

    img (M, C, H, W) float -> (M, C, H, W); vectorised with one gather (no loop over the batch).
    """
    if pad <= 0:
        return img
    M, C, H, W = img.shape
    padded = F.pad(img, (pad, pad, pad, pad), mode="replicate")  # (M, C, H+2p, W+2p)
    shift = torch.randint(0, 2 * pad + 1, (M, 2), device=img.device, generator=generator)
    rows = shift[:, 0:1] + torch.arange(H, device=img.device)  # (M, H)
    cols = shift[:, 1:2] + torch.arange(W, device=img.device)  # (M, W)
    m = torch.arange(M, device=img.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[m, rows[:, :, None], cols[:, None, :]]  # (M, H, W, C)
    return out.permute(0, 3, 1, 2).contiguous()  # NCHW strides (see RGBEncoder.forward)


class ResBlock2d(nn.Module):
    """Pre-activation-free basic block: conv-GN-Mish-conv-GN (+ projected skip), then Mish."""

    def __init__(self, c_in: int, c_out: int, stride: int, n_groups: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.gn1 = nn.GroupNorm(n_groups, c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.gn2 = nn.GroupNorm(n_groups, c_out)
        self.skip = (
            nn.Identity()
            if stride == 1 and c_in == c_out
            else nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.GroupNorm(n_groups, c_out)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.mish(self.gn1(self.conv1(x)))
        return F.mish(self.gn2(self.conv2(h)) + self.skip(x))


class SpatialSoftmax(nn.Module):
    """Expected image coordinates of per-channel softmax maps: (M, C, H, W) -> (M, C, 2) in [-1, 1]."""

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__()
        self.log_temperature = nn.Parameter(torch.tensor(float(temperature)).log())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        M, C, H, W = x.shape
        attn = torch.softmax(x.flatten(2).float() / self.log_temperature.exp(), dim=-1)  # (M, C, H W)
        ys = torch.linspace(-1, 1, H, device=x.device)
        xs = torch.linspace(-1, 1, W, device=x.device)
        grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), dim=-1).reshape(H * W, 2)  # (H W, 2)
        return attn @ grid  # (M, C, 2)


def _groups(c: int, want: int = 8) -> int:
    g = min(want, c)
    while c % g:
        g -= 1
    return g


class RGBEncoder(nn.Module):
    """Images (M, H, W, 3) uint8 -> tokens (M, n_tokens, token_dim).

    Stem conv (stride 2) then one residual block per entry of ``channels`` (stride 2 after the first), a
    1x1 conv to ``keypoints`` heat maps, spatial softmax -> (keypoints, 2) coordinates, split into
    ``n_tokens`` groups, each group projected to one token. Random shift by ``shift`` pixels in training.

    With ``text_dim`` > 0 a text vector (M, text_dim) FiLM-modulates every residual block's output,
    ``h * (1 + scale) + shift`` per channel (language-conditioned vision as in RT-1): the instruction can
    then steer the keypoints toward the object it names. The modulation starts at the identity (zero init).
    """

    def __init__(
        self,
        channels: list[int],
        keypoints: int,
        token_dim: int,
        shift: int = 4,
        n_tokens: int = 4,
        text_dim: int = 0,
    ) -> None:
        super().__init__()
        self.shift = shift
        self.n_tokens = max(t for t in range(1, n_tokens + 1) if keypoints % t == 0)
        c0 = channels[0]
        self.stem = nn.Sequential(
            nn.Conv2d(3, c0, 3, stride=2, padding=1, bias=False), nn.GroupNorm(_groups(c0), c0)
        )
        blocks, c_in = [], c0
        for i, c in enumerate(channels):
            blocks.append(ResBlock2d(c_in, c, 1 if i == 0 else 2, _groups(c)))
            c_in = c
        self.blocks = nn.Sequential(*blocks)
        self.text_film = nn.ModuleList(nn.Linear(text_dim, 2 * c) for c in channels) if text_dim else None
        for lin in self.text_film or ():
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.keypoint_conv = nn.Conv2d(c_in, keypoints, 1)
        self.softmax = SpatialSoftmax()
        per = keypoints // self.n_tokens
        self.proj = nn.Linear(2 * per, token_dim)
        self.token_embed = nn.Parameter(torch.zeros(self.n_tokens, token_dim))

    def preprocess(
        self, img: torch.Tensor, augment: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """(M, H, W, 3) uint8 -> (M, 3, H, W) float in [-1, 1], randomly shifted when ``augment``."""
        # contiguous NCHW: channels-last strides from the permute crash GroupNorm/conv backward on torch 2.13 CPU
        x = img.permute(0, 3, 1, 2).contiguous().float().div_(127.5).sub_(1.0)
        return random_shift(x, self.shift, generator) if augment else x

    def tokens(self, x: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """Preprocessed images (M, 3, H, W) [+ text (M, text_dim)] -> tokens (M, n_tokens, token_dim)."""
        h = F.mish(self.stem(x))
        for i, block in enumerate(self.blocks):
            h = block(h)
            if self.text_film is not None:
                if text is None:
                    raise ValueError(
                        "this RGB encoder is text-conditioned: pass the instruction's text vector"
                    )
                scale, shift = self.text_film[i](text.to(h.dtype)).chunk(2, dim=-1)  # 2 x (M, C)
                h = torch.addcmul(shift[..., None, None], h, 1.0 + scale[..., None, None])
        kp = self.softmax(self.keypoint_conv(h))  # (M, keypoints, 2)
        groups = kp.reshape(kp.shape[0], self.n_tokens, -1)  # (M, n_tokens, 2 keypoints / n_tokens)
        return self.proj(groups.to(self.proj.weight.dtype)) + self.token_embed

    def forward(
        self,
        img: torch.Tensor,
        augment: bool = False,
        generator: torch.Generator | None = None,
        text: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.tokens(self.preprocess(img, augment, generator), text)
