"""Point-cloud encoder: a shared per-point MLP with a max-pool (DP3-style) and point keypoints.

The environment's ``points`` are already the voxelised cloud (one coloured point per occupied ~1 cm voxel,
sampled to a fixed N; ``diffpolicy_envs.mujoco_pick.voxel_downsample``). This encoder keeps every point's
geometry: it never bins the points into a coarse grid, so a 4 cm cube is located from its own points.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PointCloudEncoder(nn.Module):
    """Points (M, N, 3 or 6) in the robot base frame (m, then rgb in [0, 1]) -> tokens (M, n_tokens, token_dim).

    Each point's xyz is scaled from the workspace box to [-1, 1] (colour to [-1, 1] too) and goes through a
    shared MLP, one ``Linear-LayerNorm-ReLU`` per entry of ``channels`` (DP3, Ze et al. 2024). Two readouts
    of the per-point features (M, N, C):

    - a max-pool over the points, projected to one token (DP3's global feature);
    - ``keypoints`` point keypoints: a softmax over the points of a per-point logit, and the expected xyz
      under it (M, keypoints, 3), in groups of ``keypoints / (n_tokens - 1)`` projected to one token each --
      the point-cloud analogue of the RGB encoder's spatial softmax: a keypoint that attends to one cube's
      points gives that cube's position to the precision of its points, not of a grid.

    With ``text_dim`` > 0 the instruction's vector (M, text_dim) acts twice:

    - it FiLM-modulates every layer's output, ``h * (1 + scale) + shift`` per channel (zero-initialised: the
      identity at the start);
    - it queries the points: each keypoint's logit gets a bilinear term ``<h_i, q_k(text)> / sqrt(C)``, so a
      keypoint can land on the points the instruction names. Selecting the named cube through FiLM alone was
      not learned by behaviour cloning (the BC condition located the tray to 2 mm and the named cube no
      better than a guess; docs/experiments.md); a text query over the points is the language-conditioned
      attention of CLIPort / PerAct.
    """

    def __init__(
        self,
        channels: list[int],
        low: list[float],
        high: list[float],
        token_dim: int,
        keypoints: int = 16,
        keypoint_tokens: int = 4,
        text_dim: int = 0,
    ) -> None:
        super().__init__()
        self.register_buffer("low", torch.tensor(low, dtype=torch.float32), persistent=False)
        self.register_buffer("high", torch.tensor(high, dtype=torch.float32), persistent=False)
        layers, c_in = [], 6
        for c in channels:
            layers.append(nn.ModuleDict({"lin": nn.Linear(c_in, c), "norm": nn.LayerNorm(c)}))
            c_in = c
        self.layers = nn.ModuleList(layers)
        self.text_film = nn.ModuleList(nn.Linear(text_dim, 2 * c) for c in channels) if text_dim else None
        for lin in self.text_film or ():
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        self.keypoints = keypoints
        self.kp_tokens = (
            max(t for t in range(1, keypoint_tokens + 1) if keypoints % t == 0) if keypoints else 0
        )
        self.n_tokens = 1 + self.kp_tokens
        self.global_proj = nn.Linear(c_in, token_dim)
        if keypoints:
            self.keypoint_logits = nn.Linear(c_in, keypoints)
            self.text_query = nn.Linear(text_dim, keypoints * c_in) if text_dim else None
            self.kp_proj = nn.Linear(3 * keypoints // self.kp_tokens, token_dim)
        self.token_embed = nn.Parameter(torch.zeros(self.n_tokens, token_dim))

    def forward(self, points: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        dtype = self.global_proj.weight.dtype
        h, xyz = self.point_features(points, text)
        tokens = [self.global_proj(h.amax(dim=1)).unsqueeze(1)]  # (M, 1, D)
        if self.keypoints:
            kp = attend_points(h, xyz, self.keypoint_logits, self.text_query, text)  # (M, K, 3) normalised
            groups = kp.reshape(kp.shape[0], self.kp_tokens, -1)  # (M, n_kp_tokens, 3 K / n_kp_tokens)
            tokens.append(self.kp_proj(groups.to(dtype)))
        return torch.cat(tokens, dim=1) + self.token_embed  # (M, n_tokens, D)

    def point_features(
        self, points: torch.Tensor, text: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Points (M, N, 3 or 6) -> (per-point features (M, N, C), xyz in workspace-box units [-1, 1] (M, N, 3)):
        the shared MLP's output, FiLM-modulated by ``text`` (M, text_dim) when the encoder reads it."""
        dtype = self.global_proj.weight.dtype
        span = self.high - self.low
        xyz = (points[..., :3].float() - self.low) / span * 2 - 1  # (M, N, 3): the box -> [-1, 1]
        if points.shape[-1] >= 6:
            rgb = points[..., 3:6].float() * 2 - 1  # (M, N, 3)
        else:  # an uncoloured cloud: grey
            rgb = torch.zeros_like(xyz)
        h = torch.cat([xyz, rgb], dim=-1).to(dtype)  # (M, N, 6)
        for i, layer in enumerate(self.layers):
            h = layer["norm"](layer["lin"](h))
            if self.text_film is not None:
                if text is None:
                    raise ValueError(
                        "this point encoder is text-conditioned: pass the instruction's text vector"
                    )
                scale, shift = self.text_film[i](text.to(dtype)).chunk(2, dim=-1)  # 2 x (M, C)
                h = torch.addcmul(shift[:, None], h, 1.0 + scale[:, None])
            h = F.relu(h)  # (M, N, C)
        return h, xyz


def attend_points(
    h: torch.Tensor, xyz: torch.Tensor, logits: nn.Linear, query: nn.Linear | None, text: torch.Tensor | None
) -> torch.Tensor:
    """Point attention: per-point features h (M, N, C), xyz (M, N, 3) -> K expected positions (M, K, 3), each
    under a softmax over the points of ``logits(h)`` (K outputs) plus, with a ``query`` (text_dim -> K C),
    the bilinear term ``<h_i, q_k(text)> / sqrt(C)``, so a position can land on the points the instruction
    names (float32 logits and softmax)."""
    scores = logits(h).float()  # (M, N, K)
    if query is not None:
        q = query(text.to(query.weight.dtype)).view(h.shape[0], scores.shape[-1], -1)  # (M, K, C)
        scores = scores + (h @ q.transpose(1, 2)).float() / h.shape[-1] ** 0.5
    attn = torch.softmax(scores, dim=1)  # (M, N, K) over the points
    return attn.transpose(1, 2) @ xyz.float()
