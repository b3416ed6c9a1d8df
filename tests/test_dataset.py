"""Demonstration format: round trip, chunking, windows with padding, atomic writes, bad metadata, normalizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffpolicy.data.dataset import (
    DemoDataset,
    DemoFormatError,
    DemoReader,
    DemoWriter,
    Normalizer,
    read_meta,
)

LENGTHS = (5, 9, 3)
TEXTS = ("put the red cube in the tray", "move the blue block to the tray", "the green cube goes in the tray")


def _episode(i: int, length: int) -> dict:
    steps = np.arange(length, dtype=np.float64)
    return {
        # action[t] = (episode, step): windows can be checked exactly
        "action": np.stack([np.full(length, i), steps], axis=1),
        "state": np.stack([steps * 0.5, -steps, np.full(length, 3.0)], axis=1).astype(np.float32),
        "rgb": np.full((length, 4, 4, 3), 10 * i, np.uint8)
        + np.arange(length, dtype=np.uint8)[:, None, None, None],
        "instruction": TEXTS[i],
    }


@pytest.fixture
def dataset_path(tmp_path):
    path = tmp_path / "demos"
    with DemoWriter(path, env_id="MujocoPick-v0", chunk_len=4, attrs={"obs_mode": "multimodal"}) as writer:
        for i, n in enumerate(LENGTHS):
            writer.add_episode(_episode(i, n), seed=100 + i, success=i != 1)
    return path


def test_round_trip(dataset_path):
    meta = read_meta(dataset_path)
    assert meta["num_steps"] == sum(LENGTHS) and meta["episode_ends"] == [5, 14, 17]
    assert meta["seeds"] == [100, 101, 102] and meta["success"] == [True, False, True]
    assert meta["fields"]["action"] == {"dtype": "f4", "shape": [2]}  # float64 stored as float32
    assert meta["fields"]["rgb"] == {"dtype": "u1", "shape": [4, 4, 3]}
    assert meta["attrs"] == {"obs_mode": "multimodal"} and meta["instructions"] == list(TEXTS)
    # 17 steps in chunks of 4 -> 5 files per field, memory-mappable
    assert sorted(p.name for p in (dataset_path / "state").iterdir()) == [f"{i:06d}.npy" for i in range(5)]
    assert isinstance(np.load(dataset_path / "rgb" / "000000.npy", mmap_mode="r"), np.memmap)
    reader = DemoReader(dataset_path)
    for i, n in enumerate(LENGTHS):
        ep, ref = reader.episode(i), _episode(i, n)
        np.testing.assert_array_equal(ep["action"], ref["action"].astype(np.float32))
        np.testing.assert_array_equal(ep["state"], ref["state"])
        np.testing.assert_array_equal(ep["rgb"], ref["rgb"])
        assert ep["instruction"] == [TEXTS[i]] * n


def test_reader_crosses_chunk_boundaries(dataset_path):
    reader = DemoReader(dataset_path)
    whole = np.concatenate([_episode(i, n)["state"] for i, n in enumerate(LENGTHS)])
    np.testing.assert_array_equal(reader.read("state", 3, 13), whole[3:13])
    np.testing.assert_array_equal(reader.take("state", np.array([16, 0, 7, 7])), whole[[16, 0, 7, 7]])
    with pytest.raises(IndexError):
        reader.read("state", 0, 18)


def test_windows_pad_history_and_future(dataset_path):
    ds = DemoDataset(dataset_path, obs_horizon=2, action_horizon=4)
    assert len(ds) == sum(LENGTHS)
    # first step of episode 1 (global 5): history repeats its first obs, no action padding
    s = ds[5]
    np.testing.assert_array_equal(s["obs"]["state"].numpy(), _episode(1, 9)["state"][[0, 0]])
    assert s["action"].shape == (4, 2) and s["action"].dtype == torch.float32
    np.testing.assert_array_equal(s["action"].numpy(), [[1, 0], [1, 1], [1, 2], [1, 3]])
    assert not s["action_is_pad"].any()
    assert s["obs"]["instruction"] == TEXTS[1]
    # step 7 of 9 of episode 1 (global 12): two real actions then the last one (step 8) repeated
    s = ds[12]
    np.testing.assert_array_equal(s["action"].numpy(), [[1, 7], [1, 8], [1, 8], [1, 8]])
    assert s["action_is_pad"].tolist() == [False, False, True, True]
    np.testing.assert_array_equal(s["obs"]["rgb"].numpy(), _episode(1, 9)["rgb"][[6, 7]])
    # never leaks into the next episode: last step of episode 0 (global 4)
    np.testing.assert_array_equal(ds[4]["action"].numpy(), [[0, 4]] * 4)


def test_default_action_horizon_and_dataloader(dataset_path):
    ds = DemoDataset(dataset_path, obs_keys=["state", "instruction"])
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=6, shuffle=False)))
    assert batch["action"].shape == (6, 64, 2)  # Ta = 64 by default
    assert batch["obs"]["state"].shape == (6, 1, 3)  # To = 1
    assert len(batch["obs"]["instruction"]) == 6
    with pytest.raises(ValueError, match="obs_keys"):
        DemoDataset(dataset_path, obs_keys=["points"])


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    path = tmp_path / "demos"
    with pytest.raises(RuntimeError, match="boom"), DemoWriter(path, chunk_len=2) as writer:
        writer.add_episode(_episode(0, 5))
        assert not path.exists()  # nothing visible before close()
        raise RuntimeError("boom")
    assert not path.exists() and list(tmp_path.iterdir()) == []


def test_writer_rejects_inconsistent_episodes(tmp_path):
    with DemoWriter(tmp_path / "d") as writer:
        writer.add_episode(_episode(0, 3))
        bad = _episode(1, 3)
        bad["state"] = bad["state"][:, :2]
        with pytest.raises(ValueError, match="state"):
            writer.add_episode(bad)
        short = _episode(1, 3)
        short["rgb"] = short["rgb"][:2]
        with pytest.raises(ValueError, match="steps"):
            writer.add_episode(short)
    with pytest.raises(FileExistsError):
        DemoWriter(tmp_path / "d")


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda p: (p / "meta.json").unlink(), "not found"),
        (lambda p: (p / "meta.json").write_text('{"format": "diffpolicy-demos", "vers'), "corrupt"),
        (lambda p: (p / "meta.json").write_text("[1, 2]"), "not a diffpolicy-demos"),
        (lambda p: _edit_meta(p, version=99), "version"),
        (lambda p: _edit_meta(p, episode_ends=[5, 14, 16]), "inconsistent"),
        (lambda p: (p / "state" / "000002.npy").unlink(), "missing"),
    ],
)
def test_bad_meta_or_chunks_raise_one_clear_error(dataset_path, damage, match):
    damage(dataset_path)
    with pytest.raises(DemoFormatError, match=match) as err:
        DemoReader(dataset_path)
    assert "\n" not in str(err.value)


def _edit_meta(path, **changes):
    meta = json.loads((path / "meta.json").read_text())
    meta.update(changes)
    (path / "meta.json").write_text(json.dumps(meta))


def test_normalizer_fit_apply_save(dataset_path, tmp_path):
    reader = DemoReader(dataset_path)
    norm = Normalizer.fit(reader)
    assert norm.stats["action"] == {"min": [0.0, 0.0], "max": [2.0, 8.0]}
    state = reader.read("state", 0, reader.num_steps)
    z = norm.normalize("state", state)
    assert z.min() == pytest.approx(-1.0) and z.max() == pytest.approx(1.0)
    np.testing.assert_allclose(z[:, 2], 0.0)  # constant dimension -> 0
    np.testing.assert_allclose(norm.unnormalize("state", z), state, atol=1e-6)
    t = torch.tensor(state)
    torch.testing.assert_close(norm.normalize("state", t), torch.tensor(z))
    norm.save(tmp_path / "norm.json")
    again = Normalizer.load(tmp_path / "norm.json")
    np.testing.assert_array_equal(
        again.normalize("action", reader.read("action", 0, 5)),
        norm.normalize("action", reader.read("action", 0, 5)),
    )
    ds = DemoDataset(reader, action_horizon=3, normalizer=norm)
    assert float(ds[0]["action"].abs().max()) <= 1.0
    assert float(ds[0]["obs"]["state"].abs().max()) <= 1.0
