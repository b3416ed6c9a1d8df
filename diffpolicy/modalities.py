"""The observation modalities a policy understands: one registry that every module reads.

Adding a modality means adding a :class:`Modality` here (and an encoder for it); the rollout code, the
demonstration writer, the PPO buffer and the fusion order all follow this table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Modality:
    """One observation key."""

    key: str
    """Name in the environment's Dict observation."""
    dtype: torch.dtype | None
    """Storage dtype of one step's tensor; None for text (a string per step)."""
    rank: int
    """Rank of one step's value: rgb (H, W, 3) 3, points (N, 6) 2, state (Ds,) 1, instruction (a string) 0."""


MODALITIES: dict[str, Modality] = {
    m.key: m
    for m in (
        Modality("rgb", torch.uint8, 3),
        Modality("points", torch.float32, 2),
        Modality("state", torch.float32, 1),
        Modality("instruction", None, 0),
    )
}
"""Every modality, in the order the fusion stacks their tokens."""
KEYS = tuple(MODALITIES)
"""Observation keys a policy understands: rgb, points, state, instruction."""
TENSOR_KEYS = tuple(k for k, m in MODALITIES.items() if m.dtype is not None)
"""Keys whose values are tensors (encoded into tokens): rgb, points, state."""
TEXT_KEYS = tuple(k for k, m in MODALITIES.items() if m.dtype is None)
"""Keys whose values are strings: instruction."""
