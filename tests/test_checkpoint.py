"""Checkpoints: round trip, atomic 'latest', and one-line errors that change nothing."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from diffpolicy import checkpoint as ck


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _trained_state():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_round_trip_restores_weights_optimizer_and_rng(tmp_path) -> None:
    model, opt = _trained_state()
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    state = {"policy": model.state_dict(), "optim": opt.state_dict(), "rng": ck.rng_state()}
    ck.save(tmp_path, 7, state, config={"lr": 0.01}, metrics={"losses/bc": 0.5})
    expected = (random.random(), np.random.rand(), torch.rand(1).item())

    loaded = ck.load(tmp_path)
    assert loaded.step == 7 and loaded.config == {"lr": 0.01} and loaded.metrics == {"losses/bc": 0.5}
    fresh, fresh_opt = _model(), torch.optim.AdamW(_model().parameters(), lr=1e-2)
    ck.load_state(fresh, loaded.state["policy"])
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh_opt.load_state_dict(loaded.state["optim"])
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])
    ck.set_rng_state(loaded.state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_latest_points_at_newest_and_old_ones_pruned(tmp_path) -> None:
    model = _model()
    for step in range(5):
        ck.save(tmp_path, step, {"policy": model.state_dict()}, keep=2)
    assert ck.load(tmp_path).step == 4
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000003", "step_00000004"]
    assert ck.load(tmp_path / "latest").step == 4  # the pointer itself, as train's summary names it


def test_crash_mid_write_keeps_previous_latest(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    ck.save(tmp_path, 1, {"policy": model.state_dict()})

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "_sha256", boom)
    with pytest.raises(OSError):
        ck.save(tmp_path, 2, {"policy": model.state_dict()})
    monkeypatch.undo()
    assert ck.load(tmp_path).step == 1
    assert not list(tmp_path.glob(".tmp-*")) and not (tmp_path / "step_00000002").exists()


def test_leftover_temp_dir_is_ignored_then_cleaned(tmp_path) -> None:
    model = _model()
    ck.save(tmp_path, 1, {"policy": model.state_dict()})
    (tmp_path / ".tmp-crashed").mkdir()
    (tmp_path / ".tmp-crashed" / "tensors.safetensors").write_bytes(b"partial")
    assert ck.load(tmp_path).step == 1
    ck.save(tmp_path, 2, {"policy": model.state_dict()})
    assert not (tmp_path / ".tmp-crashed").exists()


def test_corrupt_tensors_fail_with_one_line(tmp_path) -> None:
    path = ck.save(tmp_path, 1, {"policy": _model().state_dict()})
    blob = bytearray((path / ck.TENSORS).read_bytes())
    blob[-5] ^= 0xFF
    (path / ck.TENSORS).write_bytes(bytes(blob))
    with pytest.raises(ck.CheckpointError, match="checksum") as info:
        ck.load(tmp_path)
    assert "\n" not in str(info.value)


def test_corrupt_meta_and_missing(tmp_path) -> None:
    path = ck.save(tmp_path, 1, {"policy": _model().state_dict()})
    (path / ck.META).write_text("{not json")
    with pytest.raises(ck.CheckpointError, match="not valid JSON"):
        ck.load(path)
    with pytest.raises(ck.CheckpointError, match="does not exist"):
        ck.load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ck.CheckpointError, match="neither"):
        ck.load(tmp_path / "empty")
    (tmp_path / ck.LATEST).write_text(json.dumps({"nope": 1}))
    with pytest.raises(ck.CheckpointError, match="pointer"):
        ck.load(tmp_path)


def test_mismatched_architecture_changes_nothing(tmp_path) -> None:
    ck.save(tmp_path, 1, {"policy": _model().state_dict()})
    other = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ck.CheckpointError, match="shape"):
        ck.load_state(other, ck.load(tmp_path).state["policy"], name="policy")
    smaller = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pytest.raises(ck.CheckpointError, match="unexpected"):
        ck.load_state(smaller, ck.load(tmp_path).state["policy"])
    for k, v in other.state_dict().items():
        assert torch.equal(v, before[k])


def test_unstorable_value_is_refused(tmp_path) -> None:
    with pytest.raises(ck.CheckpointError, match="cannot store"):
        ck.save(tmp_path, 1, {"bad": object()})
    assert not ck.exists(tmp_path)
