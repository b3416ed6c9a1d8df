"""Rollout storage for PPO: a ring buffer preallocated on the device for every field.

Symbols (DESIGN.md): T decisions per environment per iteration, N environments, K' fine-tuned denoising
steps, Ta action horizon, Da action dimension.

Every field named in ``specs`` gets one (T, N, *shape) tensor allocated once, on the given device, when the
buffer is built. :meth:`RolloutBuffer.add` copies one decision's values into the slot at ``ptr`` in place
(``Tensor.copy_``), so a running rollout allocates no storage; when the buffer is full the oldest decision is
overwritten. Text instructions are stored as int64 ids into a vocabulary the buffer keeps (tensors cannot
hold strings); :meth:`RolloutBuffer.decode` maps ids back.

Typical PPO use: build with :func:`ppo_specs`, ``add`` T decisions per iteration (``ptr`` returns to 0, so
:meth:`get` is zero-copy), compute advantages over ``get()``'s (T, N) rewards/values/dones, then iterate
:meth:`minibatches` with the advantages and returns passed as ``extra``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

TEXT = str
"""Use as the dtype of a spec to store text (one string per environment) as vocabulary ids."""

FieldSpec = tuple[Sequence[int], Any]
"""(per-decision-per-env shape, dtype): dtype is a ``torch.dtype``, its name (``"uint8"``) or :data:`TEXT`."""

PPO_FIELDS = ("chains", "logprobs", "values", "rewards", "bootstraps", "dones")
"""Fields :func:`ppo_specs` adds to the observation fields."""


def ppo_specs(
    obs_specs: Mapping[str, FieldSpec], *, ft_steps: int, horizon: int, action_dim: int
) -> dict[str, FieldSpec]:
    """Specs for a PPO rollout: the observation fields plus chains, log-probs, values, rewards and dones.

    Args:
        obs_specs: observation fields, e.g. ``{"rgb": ((H, W, 3), torch.uint8), "points": ((P, 3),
            torch.float32), "state": ((Ds,), torch.float32), "instruction": ((), TEXT)}``.
        ft_steps: K'.
        horizon: Ta.
        action_dim: Da.

    Returns:
        specs with ``chains`` (K'+1, Ta, Da), ``logprobs`` (K',), ``values``, ``rewards``, ``bootstraps`` (the
        part of a reward that is a time-limit cut's bootstrap value) and ``dones`` (scalars
        per decision), all float32.
    """
    clash = sorted(set(obs_specs) & set(PPO_FIELDS))
    if clash:
        raise ValueError(f"observation fields {clash} clash with the PPO fields {PPO_FIELDS}; rename them")
    f32 = torch.float32
    return {
        **obs_specs,
        "chains": ((ft_steps + 1, horizon, action_dim), f32),
        "logprobs": ((ft_steps,), f32),
        "values": ((), f32),
        "rewards": ((), f32),
        "bootstraps": ((), f32),
        "dones": ((), f32),
    }


def _dtype(name: str, dtype: Any) -> torch.dtype | None:
    """torch dtype of a spec, or None for text."""
    if dtype is TEXT or dtype == "text":
        return None
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"field {name!r}: dtype {dtype!r} is not a torch dtype, a dtype name or TEXT")


class RolloutBuffer:
    """Ring buffer of the last T decisions of N environments, every field preallocated on ``device``.

    Args:
        n_steps: T, decisions kept per environment.
        num_envs: N.
        specs: field name -> (shape, dtype); the field is stored as (T, N, *shape). A dtype of :data:`TEXT`
            (or ``"text"``) with shape ``()`` stores one string per environment as an int64 vocabulary id.
        device: where every field lives.

    Attributes:
        ptr: slot the next :meth:`add` writes (0 <= ptr < T).
        full: True once T decisions have been added (from then on the oldest is overwritten).
        vocab: list of the strings seen in text fields; id i means ``vocab[i]``.
    """

    def __init__(
        self,
        n_steps: int,
        num_envs: int,
        specs: Mapping[str, FieldSpec],
        device: torch.device | str = "cpu",
    ):
        if n_steps <= 0 or num_envs <= 0:
            raise ValueError(f"n_steps={n_steps} and num_envs={num_envs} must both be > 0")
        if not specs:
            raise ValueError("specs is empty; give at least one field")
        self.n_steps, self.num_envs = n_steps, num_envs
        self.device = torch.device(device)
        self.ptr, self.full = 0, False
        self.vocab: list[str] = []
        self._ids: dict[str, int] = {}
        self._text: set[str] = set()
        self._storage: dict[str, Tensor] = {}
        for name, (shape, dtype) in specs.items():
            td = _dtype(name, dtype)
            shape = tuple(int(s) for s in shape)
            if td is None:
                if shape != ():
                    raise ValueError(f"text field {name!r} must have shape () (one string per env)")
                self._text.add(name)
                td = torch.int64
            self._storage[name] = torch.zeros((n_steps, num_envs, *shape), dtype=td, device=self.device)
        # (N,) host staging row for text ids, reused every add; filled through numpy so that writing an id
        # creates no torch scalar tensor.
        self._id_np = np.zeros(num_envs, dtype=np.int64)
        self._id_row = torch.from_numpy(self._id_np)

    # ------------------------------------------------------------------ writing
    @property
    def fields(self) -> tuple[str, ...]:
        """Field names in spec order."""
        return tuple(self._storage)

    @property
    def storage(self) -> Mapping[str, Tensor]:
        """The preallocated (T, N, ...) tensors in slot order (not time order; see :meth:`get`)."""
        return self._storage

    def __len__(self) -> int:
        """Decisions per environment currently held (T once full)."""
        return self.n_steps if self.full else self.ptr

    def encode(self, texts: Sequence[str]) -> list[int]:
        """Vocabulary ids of ``texts``, adding unseen strings to the vocabulary."""
        out = []
        for s in texts:
            i = self._ids.get(s)
            if i is None:
                i = self._ids[s] = len(self.vocab)
                self.vocab.append(s)
            out.append(i)
        return out

    def decode(self, ids: Tensor | Sequence[int]) -> list[str]:
        """Strings of vocabulary ``ids`` (any shape; flattened)."""
        flat = ids.reshape(-1).tolist() if isinstance(ids, Tensor) else list(ids)
        return [self.vocab[i] for i in flat]

    def add(self, **fields: Any) -> None:
        """Copy one decision of every field into slot ``ptr`` in place, then advance ``ptr`` (ring).

        Every field of the specs must be given, each as a tensor / array broadcastable to (N, *shape) (any
        device or dtype: ``copy_`` converts) or, for text fields, a sequence of N strings.
        """
        missing = set(self._storage) - set(fields)
        unknown = set(fields) - set(self._storage)
        if missing or unknown:
            raise KeyError(
                f"add() needs exactly the fields {sorted(self._storage)}; "
                f"missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        slot = self.ptr
        # Asynchronous only host -> accelerator; a copy into host memory must finish before add returns.
        non_blocking = self.device.type != "cpu"
        for name, value in fields.items():
            dst = self._storage[name][slot]  # (N, *shape) view
            if name in self._text:
                if len(value) != self.num_envs:
                    raise ValueError(f"text field {name!r} needs {self.num_envs} strings, got {len(value)}")
                self._id_np[:] = self.encode(value)
                dst.copy_(self._id_row)  # blocking: the staging row is reused next add
            elif isinstance(value, np.ndarray):
                dst.copy_(torch.from_numpy(value), non_blocking=non_blocking)
            elif isinstance(value, Tensor):
                dst.copy_(value.detach(), non_blocking=non_blocking)
            else:
                dst.fill_(value)
        self.ptr = (slot + 1) % self.n_steps
        if self.ptr == 0:
            self.full = True

    def reset(self) -> None:
        """Forget the stored decisions (storage and vocabulary are kept)."""
        self.ptr, self.full = 0, False

    # ------------------------------------------------------------------ reading
    def get(self) -> dict[str, Tensor]:
        """The held decisions in time order, oldest first: field -> (len(self), N, *shape).

        Views of the storage (no copy) when the oldest decision sits in slot 0, which is the normal PPO
        case (T adds per iteration); after a partial wrap the two halves are concatenated (one copy).
        """
        if not self.full:
            return {k: v[: self.ptr] for k, v in self._storage.items()}
        if self.ptr == 0:
            return dict(self._storage)
        p = self.ptr
        return {k: torch.cat((v[p:], v[:p])) for k, v in self._storage.items()}

    def minibatches(
        self,
        batch_size: int,
        generator: torch.Generator | None = None,
        *,
        extra: Mapping[str, Tensor] | None = None,
        drop_last: bool = False,
    ) -> Iterator[dict[str, Tensor]]:
        """Shuffled minibatches over the flattened (T*N) decisions.

        Args:
            batch_size: B, decisions per minibatch.
            generator: torch generator for the permutation (on the CPU; seeds reproduce the order).
            extra: more (T, N, ...) tensors in time order (e.g. ``advantages``, ``returns``) gathered with
                the same indices.
            drop_last: skip a final minibatch smaller than ``batch_size``.

        Yields:
            field -> (B, *shape) gathered rows, plus ``indices`` (B,) into the flattened T*N decisions
            (time-major: index = t * N + n).
        """
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be > 0")
        data = self.get()
        if extra:
            clash = sorted(set(extra) & set(data))
            if clash:
                raise ValueError(f"extra fields {clash} clash with stored fields")
            data.update(extra)
        steps = len(self)
        total = steps * self.num_envs
        flat = {}
        for k, v in data.items():
            if tuple(v.shape[:2]) != (steps, self.num_envs):
                raise ValueError(
                    f"field {k!r} has shape {tuple(v.shape)}; expected ({steps}, {self.num_envs}, ...)"
                )
            flat[k] = v.reshape(total, *v.shape[2:])  # (T*N, *shape); a view for contiguous storage
        perm = torch.randperm(total, generator=generator).to(self.device)
        for start in range(0, total, batch_size):
            idx = perm[start : start + batch_size]  # (B,)
            if drop_last and idx.numel() < batch_size:
                return
            batch = {k: v.index_select(0, idx.to(v.device)) for k, v in flat.items()}
            batch["indices"] = idx
            yield batch

    def nbytes(self) -> int:
        """Bytes of preallocated storage."""
        return sum(v.numel() * v.element_size() for v in self._storage.values())
