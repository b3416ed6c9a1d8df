"""Point-cloud encoder: batched voxelisation into a G^3 occupancy grid, then a 3-D convolutional encoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def voxelize(points: torch.Tensor, low: torch.Tensor, high: torch.Tensor, grid: int) -> torch.Tensor:
    """Occupancy of a G^3 grid over the box [low, high): points (M, N, 3) (m) -> (M, 1, G, G, G) float.

    Axis order of the grid is (x, y, z). Points outside the box or non-finite are dropped. One vectorised
    scatter on the points' device: out-of-box points are routed to a spare slot that is cut off afterwards,
    so shapes stay static (no boolean indexing, no loop over M).
    """
    M, N, _ = points.shape
    G = grid
    rel = (points.float() - low) / (high - low) * G  # (M, N, 3) in voxel units
    inside = ((rel >= 0) & (rel < G)).all(dim=-1)  # (M, N); NaN compares False
    idx = rel.nan_to_num(0.0).clamp(0, G - 1).long()  # (M, N, 3)
    flat = (idx[..., 0] * G + idx[..., 1]) * G + idx[..., 2]  # (M, N)
    flat = flat + torch.arange(M, device=points.device)[:, None] * G**3
    flat = torch.where(inside, flat, torch.full_like(flat, M * G**3))  # spare slot for dropped points
    occ = torch.zeros(M * G**3 + 1, device=points.device, dtype=torch.float32)
    occ.scatter_(0, flat.reshape(-1), 1.0)
    return occ[:-1].view(M, 1, G, G, G)


class PointCloudEncoder(nn.Module):
    """Points (M, N, 3) in the robot base frame (m) -> tokens (M, n_tokens, token_dim).

    Voxelises into a G^3 occupancy grid over the workspace box, then one stride-2 Conv3d-GroupNorm-Mish
    stage per entry of ``channels``; each remaining cell of the final (G / 2^S)^3 grid becomes a token
    (with a learned position embedding).
    """

    def __init__(
        self, channels: list[int], grid: int, low: list[float], high: list[float], token_dim: int
    ) -> None:
        super().__init__()
        self.grid = grid
        self.register_buffer("low", torch.tensor(low, dtype=torch.float32), persistent=False)
        self.register_buffer("high", torch.tensor(high, dtype=torch.float32), persistent=False)
        layers, c_in, side = [], 1, grid
        for c in channels:
            g = min(8, c)
            while c % g:
                g -= 1
            layers += [nn.Conv3d(c_in, c, 3, stride=2, padding=1), nn.GroupNorm(g, c), nn.Mish()]
            c_in, side = c, (side + 1) // 2
        self.net = nn.Sequential(*layers)
        self.n_tokens = side**3
        self.proj = nn.Linear(c_in, token_dim)
        self.pos_embed = nn.Parameter(torch.zeros(self.n_tokens, token_dim))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        occ = voxelize(points, self.low, self.high, self.grid)  # (M, 1, G, G, G)
        h = self.net(occ.to(self.proj.weight.dtype))  # (M, C, g, g, g)
        tokens = h.flatten(2).transpose(1, 2)  # (M, g^3, C)
        return self.proj(F.layer_norm(tokens, tokens.shape[-1:])) + self.pos_embed
