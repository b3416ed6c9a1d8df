"""Self-describing, atomically written checkpoints.

Layout of one checkpoint (a directory, never modified after it is complete)::

    <root>/step_00000040/
        tensors.safetensors   every tensor: model weights, optimiser moments, RNG states
        meta.json             format, step, config, metrics, the tree structure, sha256 of the tensors file
    <root>/latest             JSON pointer {"name": "step_00000040"}, replaced atomically

A checkpoint is written into a temporary directory, fsync'ed, renamed into place, and only then does
``latest`` move to it (``os.replace`` of a small file). A crash at any point leaves ``latest`` on the
previous complete checkpoint; leftovers of an interrupted write are removed by the next save.

Nested state (an optimiser's ``state_dict``, RNG states) is flattened: tensors go to safetensors under
path keys, everything else stays in ``meta.json`` with a placeholder. Loading verifies the checksum and the
structure, and :func:`load_state` checks every key and shape before touching a module, so a corrupt,
missing or mismatched checkpoint raises :class:`CheckpointError` with one line and changes nothing.
No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT = "diffpolicy-checkpoint/1"
TENSORS = "tensors.safetensors"
META = "meta.json"
LATEST = "latest"
_TENSOR_TAG = "__tensor__"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or does not match what it is loaded into."""


@dataclass
class Checkpoint:
    """A loaded checkpoint: named state trees plus its description."""

    path: Path
    step: int
    state: dict[str, Any]
    """Named trees (``{"policy": state_dict, "optim": ..., "rng": ...}``) with tensors restored."""
    config: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- flattening
def _flatten(tree: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """Move tensors of ``tree`` into ``tensors`` (key = path) and return a JSON-able skeleton."""
    if isinstance(tree, torch.Tensor):
        tensors[prefix] = tree.detach().to("cpu").contiguous()
        return {_TENSOR_TAG: prefix}
    if isinstance(tree, np.ndarray):
        tensors[prefix] = torch.from_numpy(np.ascontiguousarray(tree))
        return {_TENSOR_TAG: prefix, "numpy": True}
    if isinstance(tree, dict):
        return {
            "__dict__": [[_key(k), _flatten(v, f"{prefix}/{_key(k)[1]}", tensors)] for k, v in tree.items()]
        }
    if isinstance(tree, list | tuple):
        items = [_flatten(v, f"{prefix}/{i}", tensors) for i, v in enumerate(tree)]
        return {"__tuple__" if isinstance(tree, tuple) else "__list__": items}
    if isinstance(tree, np.generic):
        return tree.item()
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    raise CheckpointError(f"cannot store a {type(tree).__name__} at '{prefix}' in a checkpoint")


def _key(k: Any) -> list[Any]:
    if isinstance(k, bool | int | str):
        return ["int" if isinstance(k, int) and not isinstance(k, bool) else "str", str(k)]
    raise CheckpointError(f"checkpoint dict keys must be str or int, got {type(k).__name__}")


def _unflatten(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(node, dict):
        if _TENSOR_TAG in node:
            key = node[_TENSOR_TAG]
            if key not in tensors:
                raise CheckpointError(f"checkpoint is inconsistent: tensor '{key}' is missing")
            t = tensors[key]
            return t.numpy() if node.get("numpy") else t
        if "__dict__" in node:
            return {
                (int(v) if kind == "int" else v): _unflatten(val, tensors)
                for (kind, v), val in node["__dict__"]
            }
        if "__list__" in node:
            return [_unflatten(v, tensors) for v in node["__list__"]]
        if "__tuple__" in node:
            return tuple(_unflatten(v, tensors) for v in node["__tuple__"])
    return node


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------- saving
def save(
    root: str | Path,
    step: int,
    state: dict[str, Any],
    *,
    config: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    keep: int = 3,
) -> Path:
    """Write checkpoint ``step`` under ``root`` atomically and point ``latest`` at it.

    Args:
        root: checkpoint directory (created if needed).
        step: iteration number; names the checkpoint ``step_%08d``.
        state: named trees of tensors / numbers / strings (``state_dict()`` s, RNG states, ...).
        config: the run's configuration as plain containers.
        metrics: metrics at this step.
        extra: anything else JSON-able (e.g. the pre-training cache key).
        keep: keep this many newest checkpoints (plus the one ``latest`` points at); 0 keeps all.

    Returns:
        The directory of the new checkpoint.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(".tmp-*"):  # an interrupted earlier write
        shutil.rmtree(leftover, ignore_errors=True)
    name = f"step_{step:08d}"
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _flatten(state, "s", tensors)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        save_file(tensors, str(tmp / TENSORS))
        meta = {
            "format": FORMAT,
            "step": int(step),
            "config": config or {},
            "metrics": metrics or {},
            "extra": extra or {},
            "tree": skeleton,
            "sha256": _sha256(tmp / TENSORS),
            "torch": torch.__version__,
        }
        (tmp / META).write_text(json.dumps(meta, indent=1, default=_json_default))
        for f in (TENSORS, META):
            with open(tmp / f, "rb+") as fh:
                os.fsync(fh.fileno())
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(json.dumps({"name": name, "step": int(step)}))
    with open(pointer, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    if keep > 0:
        for old in sorted(root.glob("step_*"))[:-keep]:
            if old.name != name:
                shutil.rmtree(old, ignore_errors=True)
    return final


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


# -------------------------------------------------------------------------------------------------- loading
def resolve(path: str | Path) -> Path:
    """A checkpoint directory from itself, a root holding ``latest``, or that ``latest`` pointer (the path
    ``train`` prints); CheckpointError if none."""
    path = Path(path)
    if path.name == LATEST and path.is_file():
        path = path.parent
    if (path / META).is_file():
        return path
    pointer = path / LATEST
    if pointer.is_file():
        try:
            name = json.loads(pointer.read_text())["name"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint pointer {pointer} is corrupt ({exc})") from None
        return path / name
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}: the path does not exist")
    raise CheckpointError(f"no checkpoint at {path}: neither {META} nor a '{LATEST}' pointer is there")


def exists(path: str | Path) -> bool:
    """True when :func:`resolve` would find a checkpoint (does not verify it)."""
    try:
        return (resolve(path) / META).is_file()
    except CheckpointError:
        return False


def load(path: str | Path, *, map_location: str | torch.device = "cpu") -> Checkpoint:
    """Load and verify a checkpoint directory (or the one ``latest`` under a root points at)."""
    ckpt_dir = resolve(path)
    meta_path, tensors_path = ckpt_dir / META, ckpt_dir / TENSORS
    if not meta_path.is_file() or not tensors_path.is_file():
        raise CheckpointError(f"checkpoint {ckpt_dir} is incomplete: {META} or {TENSORS} is missing")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: {META} is not valid JSON ({exc})") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {ckpt_dir} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if _sha256(tensors_path) != meta.get("sha256"):
        raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: {TENSORS} does not match its checksum")
    try:
        tensors = load_file(str(tensors_path), device=str(map_location))
    except Exception as exc:
        raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: {type(exc).__name__}: {exc}") from None
    state = _unflatten(meta["tree"], tensors)
    return Checkpoint(
        path=ckpt_dir,
        step=int(meta["step"]),
        state=state,
        config=meta.get("config", {}),
        metrics=meta.get("metrics", {}),
        extra=meta.get("extra", {}),
    )


def load_state(module: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, name: str = "model") -> None:
    """``module.load_state_dict(state_dict)`` after checking every key and shape; changes nothing on error."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(own))
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise CheckpointError(
            f"checkpoint does not match the {name}: {what} (different architecture or config?)"
        )
    for key, value in state_dict.items():
        if tuple(own[key].shape) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint does not match the {name}: '{key}' has shape {tuple(value.shape)}, "
                f"the {name} expects {tuple(own[key].shape)}"
            )
    module.load_state_dict(state_dict)


# ------------------------------------------------------------------------------------------------------ RNG
def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch (CPU) generator states, storable with :func:`save`."""
    np_state = np.random.get_state()
    return {
        "python": [list(random.getstate()[1]), random.getstate()[0], random.getstate()[2]],
        "numpy": {
            "keys": np_state[1],
            "pos": int(np_state[2]),
            "gauss": [int(np_state[3]), float(np_state[4])],
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    py = state["python"]
    random.setstate((py[1], tuple(py[0]), py[2]))
    np_s = state["numpy"]
    np.random.set_state(("MT19937", np.asarray(np_s["keys"], dtype=np.uint32), np_s["pos"], *np_s["gauss"]))
    torch.set_rng_state(state["torch"].to(torch.uint8))
