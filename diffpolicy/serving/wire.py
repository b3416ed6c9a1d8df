"""What travels over the wire: the observation spec, array <-> ``Tensor`` messages, request validation.

An observation is one robot's observation with **no batch axis**: every tensor modality has exactly the
per-request shape of its :class:`Modality` (``(Ds,)`` for ``state``, ``(H, W, 3)`` for ``rgb``,
``(To, ...)`` when the policy keeps To > 1 history steps) and its dtype; text modalities are one string.
The server stacks requests into the batch the sampler sees: tensors ``(B, *shape)``, texts ``list[str]``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffpolicy.serving import policy_pb2 as pb

TEXT = "text"
"""``Modality.dtype`` of a text modality (one string per request)."""
DTYPES = ("float32", "uint8", TEXT)
"""Allowed ``Modality.dtype`` values."""
MAX_TEXT_CHARS = 1024
"""Longest instruction accepted (characters)."""


class InvalidObservation(ValueError):
    """A request that does not match the spec; the message says which modality and why."""


@dataclass(frozen=True)
class Modality:
    """One expected input of the policy."""

    name: str
    """Observation key (``state``, ``rgb``, ``points``, ``instruction``, ...)."""
    shape: tuple[int, ...] = ()
    """Per-request shape, no batch axis (empty for text)."""
    dtype: str = "float32"
    """float32 | uint8 | text."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"modality {self.name!r}: dtype={self.dtype!r} must be one of {', '.join(DTYPES)}"
            )
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(s <= 0 for s in self.shape):
            raise ValueError(f"modality {self.name!r}: shape {self.shape} must be positive")

    @property
    def is_text(self) -> bool:
        return self.dtype == TEXT


ObsSpec = dict[str, Modality]
"""Modality name -> :class:`Modality`."""


def obs_spec_from_shapes(shapes: Mapping[str, Any], n_obs_steps: int = 1) -> ObsSpec:
    """The spec of a checkpoint's ``extra["obs_spec"]`` (name -> per-step shape list).

    ``instruction`` (any value) is text; ``rgb`` is uint8; every other modality is float32. With
    ``n_obs_steps`` To > 1 each tensor modality gains a leading To axis.
    """
    spec: ObsSpec = {}
    for name, shape in shapes.items():
        if name == "instruction":
            spec[name] = Modality(name, (), TEXT)
            continue
        shape = tuple(int(s) for s in (shape.shape if hasattr(shape, "shape") else shape))
        if n_obs_steps > 1:
            shape = (n_obs_steps, *shape)
        spec[name] = Modality(name, shape, "uint8" if name == "rgb" else "float32")
    return spec


def spec_to_pb(spec: ObsSpec) -> list[pb.Modality]:
    return [pb.Modality(name=m.name, shape=list(m.shape), dtype=m.dtype) for m in spec.values()]


def spec_from_pb(modalities: Any) -> ObsSpec:
    return {m.name: Modality(m.name, tuple(m.shape), m.dtype) for m in modalities}


def to_tensor(array: np.ndarray) -> pb.Tensor:
    """A numpy array (float32 / uint8) -> ``Tensor`` message (C order, little-endian)."""
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return pb.Tensor(
        shape=list(array.shape), dtype=array.dtype.name, data=np.ascontiguousarray(array).tobytes()
    )


def from_tensor(msg: pb.Tensor, what: str = "tensor") -> np.ndarray:
    """``Tensor`` message -> numpy array (a read-only view of its bytes); InvalidObservation if malformed."""
    if msg.dtype not in ("float32", "uint8"):
        raise InvalidObservation(f"{what} has dtype {msg.dtype!r}; send float32 or uint8")
    dtype = np.dtype(msg.dtype).newbyteorder("<")
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise InvalidObservation(f"{what} has a negative dimension in shape {shape}")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(msg.data) != expected:
        raise InvalidObservation(
            f"{what} declares shape {shape} {msg.dtype} ({expected} bytes) but carries {len(msg.data)} bytes"
        )
    return np.frombuffer(msg.data, dtype=dtype).reshape(shape)


def encode_observation(obs: Mapping[str, Any], spec: ObsSpec | None = None) -> pb.Observation:
    """A dict of one observation -> ``Observation``; strings go to ``texts``, arrays to ``tensors``.

    With ``spec``, arrays are cast to the spec's dtype (so a float64 state is sent as float32); shapes and
    values are not checked here (the server does that).
    """
    msg = pb.Observation()
    for name, value in obs.items():
        if isinstance(value, str):
            msg.texts[name] = value
            continue
        array = np.asarray(value)
        if spec is not None and name in spec and not spec[name].is_text:
            array = array.astype(spec[name].dtype, copy=False)
        elif array.dtype not in (np.float32, np.uint8):
            array = array.astype(np.float32)
        msg.tensors[name].CopyFrom(to_tensor(array))
    return msg


def decode_observation(
    msg: pb.Observation, spec: ObsSpec, optional_texts: tuple[str, ...] = ()
) -> dict[str, np.ndarray | str]:
    """Validate one request against ``spec``; raise InvalidObservation naming the first problem.

    Checks: every modality present (text in ``texts``, tensors in ``tensors``), no unknown modality, exact
    shape and dtype, finite floats, text non-empty and at most MAX_TEXT_CHARS characters. A text named in
    ``optional_texts`` may be left out (a dialogue server's ``instruction``: only what is newly said); it is
    then absent from the result.
    """
    out: dict[str, np.ndarray | str] = {}
    unknown = sorted((set(msg.tensors) | set(msg.texts)) - set(spec))
    if unknown:
        raise InvalidObservation(f"unknown modality {unknown}; this policy expects {sorted(spec)}")
    for name, m in spec.items():
        if m.is_text:
            if name not in msg.texts:
                if name in optional_texts:
                    continue
                raise InvalidObservation(f"missing text modality '{name}'")
            text = msg.texts[name]
            if not text.strip() or len(text) > MAX_TEXT_CHARS:
                raise InvalidObservation(f"text '{name}' must have 1..{MAX_TEXT_CHARS} characters")
            out[name] = text
            continue
        if name not in msg.tensors:
            where = " (sent as text)" if name in msg.texts else ""
            raise InvalidObservation(f"missing modality '{name}'{where}; expected {m.dtype} {m.shape}")
        array = from_tensor(msg.tensors[name], f"modality '{name}'")
        if array.shape != m.shape:
            raise InvalidObservation(f"modality '{name}' has shape {array.shape}, expected {m.shape}")
        if array.dtype.name != m.dtype:
            raise InvalidObservation(f"modality '{name}' has dtype {array.dtype.name}, expected {m.dtype}")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise InvalidObservation(f"modality '{name}' contains NaN or inf")
        out[name] = array
    return out


def collate(observations: list[Mapping[str, Any]], spec: ObsSpec) -> dict[str, np.ndarray | list[str]]:
    """Stack validated observations into a batch: tensors (B, *shape), texts list of B strings."""
    batch: dict[str, np.ndarray | list[str]] = {}
    for name, m in spec.items():
        values = [o[name] for o in observations]
        batch[name] = list(values) if m.is_text else np.stack(values)  # (B, *shape)
    return batch
