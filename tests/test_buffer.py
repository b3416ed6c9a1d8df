"""The rollout buffer: preallocated on the device, written in place, ring order, minibatches, text ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from diffpolicy.rl.buffer import TEXT, RolloutBuffer, ppo_specs

T, N, Kp, Ta, Da = 4, 3, 2, 8, 7


def _specs() -> dict:
    obs = {
        "rgb": ((6, 6, 3), torch.uint8),
        "points": ((5, 3), torch.float32),
        "state": ((9,), "float32"),
        "instruction": ((), TEXT),
    }
    return ppo_specs(obs, ft_steps=Kp, horizon=Ta, action_dim=Da)


def _step(i: int, device: torch.device) -> dict:
    """One decision whose every entry equals i (text: one of two instructions)."""
    return {
        "rgb": torch.full((N, 6, 6, 3), i % 256, dtype=torch.uint8, device=device),
        "points": torch.full((N, 5, 3), float(i), device=device),
        "state": np.full((N, 9), i, dtype=np.float32),
        "instruction": ["pick the red cube" if (i + n) % 2 else "pick the blue cube" for n in range(N)],
        "chains": torch.full((N, Kp + 1, Ta, Da), float(i), device=device),
        "logprobs": torch.full((N, Kp), float(i), device=device),
        "values": torch.full((N,), float(i), device=device),
        "rewards": torch.full((N,), float(i), device=device),
        "bootstraps": torch.zeros(N, device=device),
        "dones": torch.zeros(N, device=device),
    }


class _AllocationSpy(TorchDispatchMode):
    """Records every aten op and any output whose storage is not one of the known storages."""

    def __init__(self, known: set[int]):
        super().__init__()
        self.known, self.ops, self.fresh = known, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append(str(func))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.known:
                self.fresh.append(str(func))
        return out


def test_fields_are_preallocated_on_device_with_the_spec_shapes(device) -> None:
    buf = RolloutBuffer(T, N, _specs(), device)
    st = buf.storage
    assert st["rgb"].shape == (T, N, 6, 6, 3) and st["rgb"].dtype == torch.uint8
    assert st["chains"].shape == (T, N, Kp + 1, Ta, Da)
    assert st["logprobs"].shape == (T, N, Kp)
    assert st["values"].shape == st["rewards"].shape == st["dones"].shape == (T, N)
    assert st["instruction"].dtype == torch.int64
    assert all(v.device.type == device.type for v in st.values())
    assert buf.nbytes() == sum(v.numel() * v.element_size() for v in st.values())


def test_add_reuses_storage_across_wraps_and_allocates_nothing(device) -> None:
    buf = RolloutBuffer(T, N, _specs(), device)
    ptrs = {k: v.data_ptr() for k, v in buf.storage.items()}
    steps = [_step(i, device) for i in range(3 * T + 1)]
    for i, fields in enumerate(steps):
        inputs = {v.untyped_storage().data_ptr() for v in fields.values() if isinstance(v, torch.Tensor)}
        inputs.add(fields["state"].ctypes.data)  # the numpy array that from_numpy wraps
        known = {v.untyped_storage().data_ptr() for v in buf.storage.values()} | inputs
        known.add(buf._id_row.untyped_storage().data_ptr())
        with _AllocationSpy(known) as spy:
            buf.add(**fields)
        assert not spy.fresh, f"add {i} allocated through {spy.fresh}"
        assert any("copy_" in op for op in spy.ops)
    assert {k: v.data_ptr() for k, v in buf.storage.items()} == ptrs
    assert buf.full and buf.ptr == 1


def test_ring_overwrites_the_oldest_and_get_is_time_ordered(device) -> None:
    buf = RolloutBuffer(T, N, _specs(), device)
    for i in range(2):
        buf.add(**_step(i, device))
    assert not buf.full and len(buf) == 2
    assert buf.get()["values"][:, 0].tolist() == [0.0, 1.0]
    for i in range(2, T + 3):  # 7 adds in all: slots hold 4, 5, 6, 3 -> time order 3, 4, 5, 6
        buf.add(**_step(i, device))
    assert buf.full and buf.ptr == 3 and len(buf) == T
    data = buf.get()
    assert data["values"][:, 1].tolist() == [3.0, 4.0, 5.0, 6.0]
    assert data["chains"][:, 2, -1, -1, -1].tolist() == [3.0, 4.0, 5.0, 6.0]
    assert data["rgb"][:, 0, 0, 0, 0].tolist() == [3, 4, 5, 6]
    assert buf.decode(data["instruction"][0]) == _step(3, device)["instruction"]


def test_get_is_a_view_when_aligned(device) -> None:
    buf = RolloutBuffer(T, N, _specs(), device)
    for i in range(T):
        buf.add(**_step(i, device))
    assert buf.ptr == 0
    data = buf.get()
    assert all(data[k].data_ptr() == buf.storage[k].data_ptr() for k in buf.fields)


def test_minibatches_cover_every_decision_once_with_extra_fields(device) -> None:
    buf = RolloutBuffer(T, N, _specs(), device)
    for i in range(T):
        buf.add(**_step(i, device))
    adv = torch.arange(T * N, dtype=torch.float32, device=device).view(T, N)
    gen = torch.Generator().manual_seed(3)
    batches = list(buf.minibatches(5, gen, extra={"advantages": adv}))
    assert [b["indices"].numel() for b in batches] == [5, 5, 2]
    idx = torch.cat([b["indices"] for b in batches]).cpu()
    assert sorted(idx.tolist()) == list(range(T * N))
    for b in batches:
        t = (b["indices"] // N).float()  # decision index of each row (time-major flattening)
        assert torch.equal(b["advantages"], b["indices"].float())
        assert torch.equal(b["values"], t) and torch.equal(b["chains"][:, 0, 0, 0], t)
        assert b["chains"].shape[1:] == (Kp + 1, Ta, Da) and b["rgb"].dtype == torch.uint8
    again = list(buf.minibatches(5, torch.Generator().manual_seed(3), extra={"advantages": adv}))
    assert all(torch.equal(a["indices"], b["indices"]) for a, b in zip(batches, again))
    assert len(list(buf.minibatches(5, gen, drop_last=True))) == 2


def test_text_vocabulary_round_trips() -> None:
    buf = RolloutBuffer(2, 2, {"instruction": ((), "text")})
    buf.add(instruction=["open the drawer", "pick the cube"])
    buf.add(instruction=["pick the cube", "pick the cube"])
    assert buf.vocab == ["open the drawer", "pick the cube"]
    assert buf.storage["instruction"].tolist() == [[0, 1], [1, 1]]
    assert (
        buf.decode(buf.get()["instruction"]) == ["open the drawer", "pick the cube"] + ["pick the cube"] * 2
    )


def test_add_rejects_missing_or_unknown_fields() -> None:
    buf = RolloutBuffer(2, 2, {"values": ((), torch.float32), "rewards": ((), torch.float32)})
    with pytest.raises(KeyError, match="missing"):
        buf.add(values=torch.zeros(2))
    with pytest.raises(KeyError, match="unknown"):
        buf.add(values=torch.zeros(2), rewards=torch.zeros(2), extra=torch.zeros(2))
    with pytest.raises(ValueError, match="clash"):
        ppo_specs({"values": ((), torch.float32)}, ft_steps=1, horizon=2, action_dim=1)
