"""What every reader of demonstrations from elsewhere yields (:class:`SourceEpisode`) and is (:class:`DemoSource`):
the interface :func:`diffpolicy.demos.import_demos` reads through, below the format modules
(:mod:`diffpolicy.data.external`, :mod:`diffpolicy.data.lerobot`). numpy only."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from diffpolicy.data.dataset import DemoFormatError


@dataclass
class SourceEpisode:
    """One episode of L steps as a source holds it (raw units; not yet matched to an environment)."""

    name: str
    """Where it is in its source, for messages (``demo_3``, ``episode 3``)."""
    obs: dict[str, Any]
    """Observation key -> (L, ...) array, or a list of L strings for text."""
    actions: np.ndarray
    """(L, Da) in the units of the environment that recorded them."""
    rewards: np.ndarray | None
    """(L,), or None when the source has none."""
    success: bool | None = None
    seed: int | None = None
    target: np.ndarray | None = None
    """(L, 3 k) privileged positions (``target_pos``) when the source records them, else None."""
    available: tuple[str, ...] = ()
    """Every observation key the episode holds, where ``obs`` holds only those the import reads."""


def require(module: str, extra: str) -> Any:
    """Import an optional dependency; DemoFormatError naming the extra that installs it when it is missing."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise DemoFormatError(
            f'reading this dataset needs the {module!r} package: pip install -e ".[{extra}]"'
        ) from None


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (FFmpeg's: its strerror, without the file's path again)."""
    text = (getattr(err, "strerror", None) or str(err)).strip()
    return text.splitlines()[0] if text else type(err).__name__


class DemoSource:
    """Episodes of one dataset on disk; use as a context manager (closes open files)."""

    kind = ""

    def __init__(self, label: str) -> None:
        self.label = label
        self.wanted: set[str] | None = None
        """Observation keys the import reads (None: all); a source may skip decoding the others."""

    def keys(self) -> list[str] | None:
        """The observation keys an episode holds, when known before reading one (else None)."""
        return None

    def default_keys(self, key: str, available: set[str]) -> list[str] | None:
        """The dataset keys an environment observation ``key`` is read from when ``bc.obs_keys`` does not
        name them; None when the dataset holds none (the policy then goes without that modality)."""
        return [key] if key in available else None

    def __len__(self) -> int:
        raise NotImplementedError

    def episodes(self) -> Iterator[SourceEpisode]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def __enter__(self) -> DemoSource:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _fail(self, message: str) -> DemoFormatError:
        return DemoFormatError(f"{self.label}: {message}")

    def only_one(self, found: list[str], key: str, what: str) -> list[str] | None:
        """``found`` (the dataset keys that could form the observation ``key``) when it is one, None when it is
        none; several: a one-line error naming them and how to pick one (``bc.obs_keys``)."""
        if len(found) > 1:
            raise self._fail(
                f"holds {len(found)} {what} ({', '.join(found)}) and the policy reads one: name it with "
                f"+bc.obs_keys.{key}=[{found[0]}]"
            )
        return found or None

    def _check_lengths(self, name: str, length: int, arrays: dict[str, Any]) -> None:
        """Every per-step array of an episode has its L = len(actions) steps (else: truncated)."""
        if length < 1:
            raise self._fail(f"{name} has no steps")
        for key, value in arrays.items():
            if len(value) != length:
                raise self._fail(f"{name} is truncated: {length} actions but {len(value)} steps of {key}")
