"""Min/max normalisation to [-1, 1] (actions and proprioception), stored as state_dict buffers."""

from __future__ import annotations

import torch
from torch import nn


class MinMaxNormalizer(nn.Module):
    """Per-dimension affine map of (..., D) from [low, high] to [-1, 1] and back.

    ``low`` / ``high`` are persistent buffers (saved with the policy). Dimensions whose range is below
    ``eps`` (constant in the data) map to 0 and back to their constant. Before :meth:`fit`, the map is the
    identity (low = -1, high = 1).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.register_buffer("low", -torch.ones(dim))
        self.register_buffer("high", torch.ones(dim))

    @torch.no_grad()
    def fit(self, data: torch.Tensor, min_span: float = 0.0) -> MinMaxNormalizer:
        """Set low/high to the per-dimension min/max of data (..., D) (any leading shape), each range widened
        about its centre to at least ``min_span`` (so that a coordinate that barely varies in the data does
        not turn a small error into whole units); returns self."""
        flat = torch.as_tensor(data).reshape(-1, self.dim).to(self.low.device, torch.float32)
        if flat.shape[0] == 0:
            raise ValueError("cannot fit a normalizer on an empty tensor")
        low, high = flat.min(dim=0).values, flat.max(dim=0).values
        pad = (min_span - (high - low)).clamp_min(0.0) / 2
        self.low.copy_(low - pad)
        self.high.copy_(high + pad)
        return self

    def _scale_center(self) -> tuple[torch.Tensor, torch.Tensor]:
        span = self.high - self.low
        scale = torch.where(span > self.eps, 2.0 / span.clamp_min(self.eps), torch.ones_like(span))
        return scale, (self.high + self.low) / 2

    @property
    def scale(self) -> torch.Tensor:
        """(D,) normalised units per raw unit: 2 / range, 1 on a constant dimension."""
        return self._scale_center()[0]

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """(..., D) raw units -> (..., D) in [-1, 1] on the fitted range."""
        scale, center = self._scale_center()
        return (x - center) * scale

    def unnormalize(self, y: torch.Tensor) -> torch.Tensor:
        """(..., D) normalised -> (..., D) raw units."""
        scale, center = self._scale_center()
        return y / scale + center
