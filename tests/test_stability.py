"""Stability guards: gradient-spike z-scores, non-finite guard + in-memory snapshot restore, rollback."""

from __future__ import annotations

import json
import math

import pytest
import torch

from diffpolicy.logger import Logger
from diffpolicy.rl.stability import (
    GradMonitor,
    RollbackGuard,
    StateSnapshot,
    global_grad_norm,
    nan_guard,
)


def _events(path) -> list[dict]:
    return [r for r in map(json.loads, (path / "metrics.jsonl").read_text().splitlines()) if "event" in r]


def test_grad_monitor_flags_a_spike_and_logs_it(tmp_path) -> None:
    seen = []
    with Logger(tmp_path, tensorboard=False, progress=False) as log:
        mon = GradMonitor(window=10, sigma=3.0, logger=log, callback=lambda *e: seen.append(e))
        norms = [1.0, 1.1, 0.9, 1.05, 0.95, 1.0, 1.02]
        for i, n in enumerate(norms):
            z, spike = mon.update(torch.tensor(n), step=i)
            assert not spike
        z, spike = mon.update(10.0, step=7)
        mean = sum(norms) / len(norms)
        std = math.sqrt(sum((n - mean) ** 2 for n in norms) / (len(norms) - 1))
        assert spike and z == pytest.approx((10.0 - mean) / std)
        assert len(mon.history) == len(norms)  # the spike is kept out of the window
        z, spike = mon.update(1.0, step=8)
        assert not spike and abs(z) < 1
        z, spike = mon.update(float("nan"), step=9)
        assert spike and z == math.inf
    events = _events(tmp_path)
    assert [e["event"] for e in events] == ["grad_spike", "grad_spike"] and events[0]["step"] == 7
    assert [e[0] for e in seen] == ["grad_spike", "grad_spike"] and mon.spikes == 2


def test_grad_monitor_window_slides_and_waits_for_history() -> None:
    mon = GradMonitor(window=4, sigma=2.0)
    assert mon.update(100.0) == (0.0, False)  # too little history to judge
    for n in [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]:
        mon.update(n)
    assert list(mon.history) == [3.0, 4.0, 5.0, 6.0]


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _step(model, opt, x, scale=1.0) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    loss = model(x).square().mean() * scale
    loss.backward()
    return loss


def test_nan_guard_detects_non_finite_loss_and_grads(tmp_path) -> None:
    model, opt = _model_and_opt()
    x = torch.randn(8, 3)
    loss = _step(model, opt, x)
    assert nan_guard(loss, model.parameters())
    assert global_grad_norm(model.parameters()).item() > 0
    with Logger(tmp_path, tensorboard=False, progress=False) as log:
        next(model.parameters()).grad[0, 0] = float("inf")
        assert not nan_guard(loss, model.parameters(), logger=log, step=3)
        assert not nan_guard(torch.tensor(float("nan")), [], logger=log, step=4)
    assert [(e["event"], e["step"]) for e in _events(tmp_path)] == [("nonfinite", 3), ("nonfinite", 4)]


def test_snapshot_restores_weights_buffers_and_optimiser_in_place(tmp_path) -> None:
    model, opt = _model_and_opt()
    x = torch.randn(8, 3)
    snap = StateSnapshot({"policy": model}, [opt])
    with pytest.raises(RuntimeError, match="capture"):
        snap.restore()
    snap.capture()  # before the first step: the optimiser has no state yet
    first_ptrs = {id(c): c.data_ptr() for s in snap._module_clones.values() for c in s.values()}
    for _ in range(3):
        _step(model, opt, x)
        opt.step()
    good_params = {k: v.clone() for k, v in model.state_dict().items()}
    good_opt = {k: v.clone() for k, v in opt.state[next(model.parameters())].items()}
    snap.capture()
    clone_ptrs = {k: c.data_ptr() for k, c in snap._module_clones["policy"].items()}
    assert set(first_ptrs.values()) == set(clone_ptrs.values())  # module clones reused, not reallocated
    snap.capture()
    assert {k: c.data_ptr() for k, c in snap._module_clones["policy"].items()} == clone_ptrs

    live_ptrs = {k: v.data_ptr() for k, v in model.state_dict().items()}
    loss = _step(model, opt, x, scale=float("nan"))  # a bad step goes through anyway
    assert not nan_guard(loss, model.parameters())
    opt.step()
    assert any(torch.isnan(v).any() for v in model.state_dict().values() if v.is_floating_point())
    with Logger(tmp_path, tensorboard=False, progress=False) as log:
        snap.logger = log
        snap.restore(step=5)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, good_params[k])
        assert v.data_ptr() == live_ptrs[k]
    for k, v in opt.state[next(model.parameters())].items():
        torch.testing.assert_close(v, good_opt[k])
    assert _events(tmp_path)[0]["event"] == "restore" and snap.restores == 1
    assert snap.nbytes() > 0

    # Restoring the pre-training capture empties the optimiser state again.
    fresh, fresh_opt = _model_and_opt()
    early = StateSnapshot([fresh], [fresh_opt])
    early.capture()
    _step(fresh, fresh_opt, x)
    fresh_opt.step()
    early.restore()
    assert len(fresh_opt.state) == 0


def test_snapshot_restores_learning_rate() -> None:
    model, opt = _model_and_opt()
    snap = StateSnapshot([model], [opt])
    snap.capture()
    opt.param_groups[0]["lr"] = 123.0
    snap.restore()
    assert opt.param_groups[0]["lr"] == 1e-2


def test_rollback_guard(tmp_path) -> None:
    with Logger(tmp_path, tensorboard=False, progress=False) as log:
        guard = RollbackGuard(0.3, logger=log)
        assert not guard.update(0.2, step=0).rollback
        assert not guard.update(0.7, step=5).rollback
        d = guard.update(0.45, step=10)  # within 0.3 of the best 0.7: stable
        assert not d.rollback and d.stable_step == 10 and d.best == 0.7 and d.best_step == 5
        d = guard.update(0.35, step=15)  # 0.35 < 0.7 - 0.3
        assert d.rollback and d.stable_step == 10 and d.success == 0.35
        assert guard.update(float("nan"), step=20).rollback
    events = _events(tmp_path)
    assert [(e["event"], e["step"], e["to_step"]) for e in events] == [
        ("rollback", 15, 10),
        ("rollback", 20, 10),
    ]
    assert guard.rollbacks == 2
    with pytest.raises(ValueError):
        RollbackGuard(1.5)


def test_rollback_guard_on_returns_is_relative_to_the_best() -> None:
    """Without a success notion the guard judges the mean return and tolerates a fall of ``drop`` x |best|:
    the Hopper residual case (BC 2320, fine-tuned 1129) is caught; a return that is negative is judged on its
    magnitude too."""
    guard = RollbackGuard(0.3, relative=True)
    assert not guard.update(2320.0, step=0).rollback  # the BC policy: the first verdict
    assert not guard.update(2250.0, step=1).rollback  # within 30 % of 2320
    d = guard.update(1129.0, step=2)  # 1129 < 2320 - 696
    assert d.rollback and d.stable_step == 1
    negative = RollbackGuard(0.3, relative=True)
    negative.update(-50.0, step=0)
    assert not negative.update(-60.0, step=1).rollback  # -60 >= -50 - 15
    assert negative.update(-70.0, step=2).rollback
    assert RollbackGuard(0.3).update(2320.0, 0).rollback is False  # absolute: success rates
