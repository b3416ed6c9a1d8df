"""Demonstration format: round trip, chunking, windows with padding, atomic writes, bad metadata, normalizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffpolicy.data.dataset import DemoFormatError, DemoReader, DemoWriter, read_meta
from diffpolicy.data.windows import DemoWindows
from diffpolicy.normalizer import MinMaxNormalizer

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
    """Windows of the kept episodes 0 (5 steps) and 2 (3 steps; episode 1 failed): To = 2 observations ending
    at step t, the first one repeated before the episode's start; Ta = 4 actions from t, the last one
    repeated past the episode's end, never reaching into the next episode."""
    ds = DemoWindows(dataset_path, obs_horizon=2, action_horizon=4)
    assert len(ds) == 5 + 3 and ds.n_episodes == 2 and ds.action_dim == 2
    assert ds.obs_spec == {"state": [3], "rgb": [4, 4, 3], "instruction": []}
    ep0, ep2 = _episode(0, 5), _episode(2, 3)
    obs, actions = ds.batch(torch.tensor([1, 4, 5, 7]))
    assert actions.shape == (4, 4, 2) and actions.dtype == torch.float32
    np.testing.assert_array_equal(obs["rgb"][0].numpy(), ep0["rgb"][[0, 1]])  # step 1 of episode 0
    np.testing.assert_array_equal(actions[0].numpy(), [[0, 1], [0, 2], [0, 3], [0, 4]])
    np.testing.assert_array_equal(actions[1].numpy(), [[0, 4]] * 4)  # its last step: no leak into episode 1
    np.testing.assert_array_equal(obs["state"][2].numpy(), ep2["state"][[0, 0]])  # first step of episode 2
    np.testing.assert_array_equal(actions[2].numpy(), [[2, 0], [2, 1], [2, 2], [2, 2]])
    np.testing.assert_array_equal(obs["state"][3].numpy(), ep2["state"][[1, 2]])
    assert obs["instruction"] == [TEXTS[0], TEXTS[0], TEXTS[2], TEXTS[2]]


def test_windows_serve_the_asked_fields(dataset_path):
    ds = DemoWindows(dataset_path, obs_horizon=1, action_horizon=6, obs_keys=["state", "instruction"])
    obs, actions = ds.batch(torch.arange(6))
    assert set(obs) == {"state", "instruction"} and obs["state"].shape == (6, 1, 3)
    assert actions.shape == (6, 6, 2) and len(obs["instruction"]) == 6


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


def test_normalizer_fit_apply_and_state_dict(dataset_path):
    """The policy's min/max normaliser fitted on the stored states: [-1, 1] over the data, a constant
    dimension to 0 and back, and its statistics saved with the module's state_dict."""
    state = torch.from_numpy(DemoReader(dataset_path).read("state", 0, sum(LENGTHS)))  # (17, 3)
    norm = MinMaxNormalizer(3).fit(state)
    torch.testing.assert_close(norm.low, torch.tensor([0.0, -8.0, 3.0]))
    torch.testing.assert_close(norm.high, torch.tensor([4.0, 0.0, 3.0]))
    z = norm.normalize(state)
    assert z.min() == pytest.approx(-1.0) and z.max() == pytest.approx(1.0)
    torch.testing.assert_close(z[:, 2], torch.zeros(len(state)))  # constant dimension -> 0
    torch.testing.assert_close(norm.unnormalize(z), state)
    again = MinMaxNormalizer(3)
    again.load_state_dict(norm.state_dict())
    torch.testing.assert_close(again.normalize(state), z)
    with pytest.raises(ValueError, match="empty"):
        MinMaxNormalizer(3).fit(state[:0])
