"""Training-stability guards: gradient-spike monitor, non-finite guard with in-memory state snapshot, rollback.

None of them is silent: each returns what it found and, given a :class:`diffpolicy.logger.Logger`, records
it with ``logger.event(kind, message, step)`` (kinds ``grad_spike``, ``nonfinite``, ``restore``,
``rollback``). Typical update step::

    loss.backward()
    if not nan_guard(loss, params, logger=log, step=it):
        snapshot.restore(step=it)            # last good weights and optimiser moments
        optimizer.zero_grad(set_to_none=True)
        continue
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    z, spike = monitor.update(norm, step=it)
    optimizer.step()
    snapshot.capture()                       # copies into the same preallocated clones every time
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

EventSink = Callable[[str, str, int], None]
"""``callback(kind, message, step)`` receiving every event."""


def _emit(logger: Any, callback: EventSink | None, kind: str, message: str, step: int, **fields: Any) -> None:
    if logger is not None:
        logger.event(kind, message, step, **fields)
    if callback is not None:
        callback(kind, message, step)


def global_grad_norm(params: Iterable[Tensor]) -> Tensor:
    """L2 norm over all parameters' gradients (a float32 scalar on their device; 0 when none has a grad)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))


class GradMonitor:
    """Z-score of the global gradient norm against a sliding window of recent norms.

    ``z = (norm - mean) / std`` over the last ``window`` accepted norms; a spike is ``z > sigma`` or a
    non-finite norm. Spikes are not added to the window, so one spike does not hide the next. No spike is
    declared until ``min_history`` norms have been seen.

    Args:
        window: norms kept in the window.
        sigma: z-score above which an update is a spike.
        logger: optional :class:`diffpolicy.logger.Logger`; spikes become ``grad_spike`` events.
        callback: optional ``callback(kind, message, step)`` called on every spike.
        min_history: norms needed before z-scores are computed (default min(window, 5)).
    """

    def __init__(
        self,
        window: int = 20,
        sigma: float = 3.0,
        *,
        logger: Any = None,
        callback: EventSink | None = None,
        min_history: int | None = None,
    ):
        if window < 2:
            raise ValueError(f"window={window} must be >= 2 to estimate a std")
        if sigma <= 0:
            raise ValueError(f"sigma={sigma} must be > 0")
        self.window, self.sigma = window, sigma
        self.min_history = min(window, 5) if min_history is None else max(2, min(min_history, window))
        self.logger, self.callback = logger, callback
        self.history: deque[float] = deque(maxlen=window)
        self.spikes = 0
        self.updates = 0

    def update(self, norm: Tensor | float, step: int | None = None) -> tuple[float, bool]:
        """Score one gradient norm; returns ``(z, is_spike)`` (z is 0 until the window has enough norms)."""
        value = float(norm)
        step = self.updates if step is None else step
        self.updates += 1
        if not math.isfinite(value):
            self.spikes += 1
            _emit(
                self.logger,
                self.callback,
                "grad_spike",
                f"non-finite gradient norm {value}",
                step,
                norm=value,
            )
            return math.inf, True
        z = 0.0
        if len(self.history) >= self.min_history:
            n = len(self.history)
            mean = sum(self.history) / n
            std = math.sqrt(sum((h - mean) ** 2 for h in self.history) / (n - 1))
            z = (value - mean) / max(std, 1e-12 * max(abs(mean), 1.0))
        spike = z > self.sigma
        if spike:
            self.spikes += 1
            msg = f"gradient norm {value:.4g} is {z:.1f} sigma above the last {len(self.history)} updates"
            _emit(self.logger, self.callback, "grad_spike", msg, step, norm=value, z=z)
        else:
            self.history.append(value)
        return z, spike


def nan_guard(loss: Tensor, params: Iterable[Tensor], *, logger: Any = None, step: int = 0) -> bool:
    """True when ``loss`` and every parameter gradient are finite (one device sync).

    On False, records a ``nonfinite`` event with the logger; the caller then skips the optimiser step and
    restores its last good :class:`StateSnapshot`.
    """
    flags = [torch.isfinite(loss.detach()).all()]
    flags += [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    ok = bool(torch.stack([f.to(flags[0].device) for f in flags]).all())
    if not ok and logger is not None:
        lv = float(loss.detach().float()) if loss.numel() == 1 else float("nan")
        logger.event("nonfinite", f"non-finite loss ({lv}) or gradient: step skipped", step, loss=lv)
    return ok


class StateSnapshot:
    """Last good copy of modules' and optimisers' state, kept in memory on the same device.

    :meth:`capture` copies every parameter, buffer and optimiser-state tensor into clones allocated at the
    first capture and reused (``copy_``) afterwards; a clone is reallocated only if its source changes
    shape, dtype or device (e.g. an optimiser initialising its moments lazily). :meth:`restore` copies the
    clones back in place (the module's and optimiser's tensors keep their identity).

    Args:
        modules: modules to snapshot, as a mapping name -> module or a sequence.
        optimizers: optimisers to snapshot (state tensors and param-group hyper-parameters).
        logger: optional logger; restores become ``restore`` events.
    """

    def __init__(
        self,
        modules: Mapping[str, nn.Module] | Sequence[nn.Module],
        optimizers: Sequence[torch.optim.Optimizer] = (),
        *,
        logger: Any = None,
    ):
        self.modules = (
            dict(modules) if isinstance(modules, Mapping) else {str(i): m for i, m in enumerate(modules)}
        )
        self.optimizers = list(optimizers)
        self.logger = logger
        self._module_clones: dict[str, dict[str, Tensor]] = {}
        # per optimiser: per param index -> {key: tensor clone or plain value}
        self._opt_states: list[list[dict[str, Any]]] = []
        self._opt_groups: list[list[dict[str, Any]]] = []
        self.captured = False
        self.restores = 0

    @staticmethod
    def _into(store: dict[str, Any], key: str, value: Tensor) -> None:
        held = store.get(key)
        if (
            isinstance(held, Tensor)
            and held.shape == value.shape
            and held.dtype == value.dtype
            and held.device == value.device
        ):
            held.copy_(value)
        else:
            store[key] = value.detach().clone()

    @torch.no_grad()
    def capture(self) -> None:
        """Copy the current state into the preallocated clones."""
        for name, module in self.modules.items():
            store = self._module_clones.setdefault(name, {})
            for key, t in module.state_dict(keep_vars=True).items():
                self._into(store, key, t.detach())
        while len(self._opt_states) < len(self.optimizers):
            self._opt_states.append([])
            self._opt_groups.append([])
        for i, opt in enumerate(self.optimizers):
            params = [p for g in opt.param_groups for p in g["params"]]
            states = self._opt_states[i]
            while len(states) < len(params):
                states.append({})
            for j, p in enumerate(params):
                src = opt.state.get(p, {})
                dst = states[j]
                for key in [k for k in dst if k not in src]:
                    del dst[key]
                for key, v in src.items():
                    if isinstance(v, Tensor):
                        self._into(dst, key, v)
                    else:
                        dst[key] = copy.deepcopy(v)
            self._opt_groups[i] = [
                {k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups
            ]
        self.captured = True

    @torch.no_grad()
    def restore(self, step: int = 0) -> None:
        """Copy the last captured state back in place (raises if nothing was captured)."""
        if not self.captured:
            raise RuntimeError("StateSnapshot.restore() before any capture(); call capture() first")
        for name, module in self.modules.items():
            store = self._module_clones[name]
            for key, t in module.state_dict(keep_vars=True).items():
                t.detach().copy_(store[key])
        for i, opt in enumerate(self.optimizers):
            params = [p for g in opt.param_groups for p in g["params"]]
            for j, p in enumerate(params):
                saved = self._opt_states[i][j]
                if not saved:
                    opt.state.pop(p, None)
                    continue
                live = opt.state[p]
                for key in [k for k in live if k not in saved]:
                    del live[key]
                for key, v in saved.items():
                    cur = live.get(key)
                    if isinstance(v, Tensor):
                        if isinstance(cur, Tensor) and cur.shape == v.shape and cur.dtype == v.dtype:
                            cur.copy_(v)
                        else:
                            live[key] = v.clone()
                    else:
                        live[key] = copy.deepcopy(v)
            for group, saved_group in zip(opt.param_groups, self._opt_groups[i]):
                group.update(copy.deepcopy(saved_group))
        self.restores += 1
        if self.logger is not None:
            self.logger.event("restore", "restored the last good model and optimiser state", step)

    def nbytes(self) -> int:
        """Bytes held by the tensor clones."""
        total = sum(t.numel() * t.element_size() for s in self._module_clones.values() for t in s.values())
        for states in self._opt_states:
            for s in states:
                total += sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, Tensor))
        return total


@dataclass
class RollbackDecision:
    """What :meth:`RollbackGuard.update` concluded."""

    rollback: bool
    """True when the success rate fell more than ``drop`` below its best."""
    success: float
    """The success rate just reported."""
    best: float
    """Best success rate so far."""
    best_step: int
    """Step at which the best was reached."""
    stable_step: int
    """Latest step whose success rate was within ``drop`` of the best (the checkpoint to return to)."""


class RollbackGuard:
    """Say when to roll back to the last stable checkpoint: value < best - drop (a success rate), or, with
    ``relative``, value < best - drop * |best| (a mean return, on an environment without a success notion).

    Args:
        drop: tolerated fall below the best (e.g. 0.3: 0.3 of success rate, or 30 % of the best return).
        relative: judge a return: the fall is a fraction of the best's magnitude.
        logger: optional logger; rollbacks become ``rollback`` events.
    """

    def __init__(self, drop: float, *, relative: bool = False, logger: Any = None):
        if not 0 <= drop <= 1:
            raise ValueError(f"drop={drop} must lie in [0, 1]")
        self.drop = drop
        self.relative = relative
        self.logger = logger
        self.best = -math.inf
        self.best_step = -1
        self.stable_step = -1
        self.rollbacks = 0

    def update(self, success: float, step: int) -> RollbackDecision:
        """Record the judged value (a success rate, or a mean return with ``relative``) at ``step`` (the
        iteration of a checkpoint; 0 for the pre-trained policy) and decide."""
        success = float(success)
        if success > self.best:
            self.best, self.best_step = success, step
        margin = self.drop * abs(self.best) if self.relative else self.drop
        rollback = not success >= self.best - margin  # a NaN value also rolls back
        if rollback:
            self.rollbacks += 1
            if self.logger is not None:
                what = "return" if self.relative else "success"
                self.logger.event(
                    "rollback",
                    f"{what} {success:.3f} fell below best {self.best:.3f} - {margin:.3g}; "
                    f"roll back to step {self.stable_step}",
                    step,
                    success=success,
                    best=self.best,
                    to_step=self.stable_step,
                )
        else:
            self.stable_step = step
        return RollbackDecision(rollback, success, self.best, self.best_step, self.stable_step)
