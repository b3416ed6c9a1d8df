"""Multi-head attention and the pre-norm transformer block that the fusion and the instruction memory share."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    """Multi-head attention with separate query / key-value inputs: (B, Lq, D), (B, Lk, D) -> (B, Lq, D).

    ``mask`` (B, Lk) bool, optional: which keys may be attended to (True); every query needs at least one.
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, Lq, D = q.shape
        h = self.heads
        qh = self.q(q).view(B, Lq, h, D // h).transpose(1, 2)  # (B, h, Lq, D/h)
        k, v = self.kv(kv).view(B, kv.shape[1], 2, h, D // h).permute(2, 0, 3, 1, 4)  # 2 x (B, h, Lk, D/h)
        attn_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, Lk)
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=attn_mask)  # (B, h, Lq, D/h)
        return self.out(o.transpose(1, 2).reshape(B, Lq, D))


class AttentionBlock(nn.Module):
    """Pre-norm transformer block; self-attention when ``kv`` is None, else cross-attention to ``kv`` (whose
    keys ``mask`` (B, Lk) may restrict)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm_q = nn.LayerNorm(dim)
        self.norm_kv = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(
        self, x: torch.Tensor, kv: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        q = self.norm_q(x)
        x = x + self.attn(q, q if kv is None else self.norm_kv(kv), mask)
        return x + self.mlp(self.norm_mlp(x))
