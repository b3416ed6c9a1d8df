"""The time-aligned sensor buffer on synthetic streams: 30 Hz camera, 10 Hz control, text at any time."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from diffpolicy.data.sync import MissingModalityError, StreamSpec, SyncBuffer

CAM_DT = 1 / 30
CTRL_DT = 1 / 10


def _buffer(**over) -> SyncBuffer:
    specs = {
        "rgb": StreamSpec(max_lag=0.1, capacity=16),
        "state": StreamSpec(max_lag=0.05, capacity=16),
        "instruction": StreamSpec(max_lag=None, capacity=4),
    }
    specs.update(over)
    return SyncBuffer(specs)


def test_30hz_camera_10hz_control_alignment():
    buf = _buffer()
    buf.push("instruction", 0.0, "pick the red cube")
    cam_i = 0
    for k in range(1, 31):
        t = k * CTRL_DT
        while cam_i * CAM_DT <= t + 1e-9:  # every camera frame up to the tick has arrived
            buf.push("rgb", cam_i * CAM_DT, cam_i)
            cam_i += 1
        buf.push("state", t - 0.002, k)
        obs = buf.tick(t)
        expected = max(j for j in range(cam_i) if j * CAM_DT <= t)
        assert obs.values["rgb"] == expected
        assert obs.values["state"] == k
        assert obs.values["instruction"] == "pick the red cube"
        assert obs.lag("rgb") <= CAM_DT + 1e-9
        assert obs.missing == ()
    stats = buf.stats("rgb")
    assert stats["superseded"] > 0 and stats["dropped_stale"] == 0 and stats["ticks_missing"] == 0
    assert buf.ticks_missing == 0 and buf.dropped_out_of_order == 0
    assert len(buf) <= 16 + 16 + 4


def test_jittered_camera_never_newer_than_tick_nor_older_than_lag():
    rng = np.random.default_rng(0)
    buf = _buffer(
        state=StreamSpec(max_lag=None, required=False),
        instruction=StreamSpec(max_lag=None, required=False),
    )
    stamps = np.arange(0, 5, CAM_DT) + rng.uniform(-0.008, 0.008, size=len(np.arange(0, 5, CAM_DT)))
    arrivals = stamps + rng.uniform(0.0, 0.02, size=len(stamps))  # transport delay; may reorder
    order = np.argsort(arrivals)
    j = 0
    for k in range(1, 48):
        t = k * CTRL_DT
        while j < len(order) and arrivals[order[j]] <= t:
            buf.push("rgb", float(stamps[order[j]]), float(stamps[order[j]]))
            j += 1
        obs = buf.tick(t)
        got = obs.values["rgb"]
        arrived = stamps[arrivals <= t]
        best = arrived[arrived <= t].max()
        assert got == pytest.approx(best)  # the newest frame not newer than the tick
        assert t - 0.1 <= got <= t


def test_out_of_order_frames_inserted_or_dropped():
    buf = _buffer(state=StreamSpec(required=False), instruction=StreamSpec(max_lag=None, required=False))
    buf.push("rgb", 0.10, "b")
    assert buf.push("rgb", 0.05, "a")  # late but still useful: inserted by timestamp
    buf.push("rgb", 0.20, "d")
    buf.push("rgb", 0.15, "c")
    assert buf.tick(0.16).values["rgb"] == "c"
    assert not buf.push("rgb", 0.12, "late")  # older than what the tick consumed
    assert not buf.push("rgb", 0.15, "dup")  # not newer than the consumed frame
    assert buf.stats("rgb")["dropped_out_of_order"] == 2
    assert buf.tick(0.20).values["rgb"] == "d"
    assert buf.stats("rgb")["superseded"] == 2  # "a" and "b" were never used


def test_lag_limit_drops_stale_and_reports_missing():
    buf = _buffer(rgb=StreamSpec(max_lag=0.1, required=False), state=StreamSpec(required=False))
    buf.push("instruction", 0.0, "go")
    buf.push("rgb", 0.0, "f0")
    assert buf.tick(0.05).values["rgb"] == "f0"
    obs = buf.tick(0.2)  # f0 is now 200 ms old: reused frames expire too
    assert obs.values["rgb"] is None and "rgb" in obs.missing and obs.stamps["rgb"] is None
    assert buf.stats("rgb")["ticks_missing"] == 1
    buf.push("rgb", 0.25, "f1")
    obs = buf.tick(0.5)  # f1 arrived, but it is 250 ms old at the tick: stale, never used
    assert obs.values["rgb"] is None
    assert buf.stats("rgb")["dropped_stale"] == 1
    assert not buf.push("rgb", 0.3, "f2")  # older than last tick - lag on arrival
    assert buf.stats("rgb")["dropped_stale"] == 2
    assert buf.dropped_stale == 2 and buf.ticks_missing >= 2


def test_missing_required_modality_raises_with_reason():
    buf = _buffer()
    buf.push("rgb", 0.0, "f0")
    buf.push("instruction", 0.0, "go")
    with pytest.raises(MissingModalityError, match="'state' is missing.*no frame received") as err:
        buf.tick(0.05)
    assert err.value.stream == "state"
    assert buf.stats("state")["ticks_missing"] == 1
    assert buf.stats("rgb")["ticks_missing"] == 0
    buf.push("state", 0.3, "s")
    with pytest.raises(MissingModalityError, match="'rgb'.*lag limit 100.0 ms"):
        buf.tick(0.31)


def test_text_latest_instruction_without_lag_limit():
    buf = _buffer(
        rgb=StreamSpec(required=False),
        state=StreamSpec(required=False),
        instruction=StreamSpec(max_lag=None, required=False),
    )
    buf.push("instruction", 1.0, "pick")
    assert buf.tick(0.5).values["instruction"] is None  # only in the future
    assert buf.tick(100.0).values["instruction"] == "pick"  # no lag limit
    buf.push("instruction", 150.0, "place")
    assert buf.tick(120.0).values["instruction"] == "pick"
    assert buf.tick(150.0).values["instruction"] == "place"


def test_bounded_ring_overflow_and_validation():
    buf = SyncBuffer({"rgb": StreamSpec(max_lag=None, capacity=3)})
    for i in range(5):
        buf.push("rgb", float(i), i)
    assert len(buf) == 3 and buf.stats("rgb")["dropped_overflow"] == 2
    assert not buf.push("rgb", -1.0, "old")  # older than everything in a full ring
    assert buf.tick(10.0).values["rgb"] == 4
    with pytest.raises(ValueError, match="back in time"):
        buf.tick(9.0)
    with pytest.raises(KeyError, match="unknown stream 'depth'"):
        buf.push("depth", 1.0, None)
    with pytest.raises(ValueError, match="max_lag"):
        StreamSpec(max_lag=-1.0)
    with pytest.raises(ValueError, match="finite"):
        buf.push("rgb", float("nan"), 0)
    buf.reset_counters()
    assert buf.stats() == dict.fromkeys(buf.stats(), 0)
    buf.clear()
    assert len(buf) == 0
    with pytest.raises(MissingModalityError, match="no frame received"):
        buf.tick(0.0)  # clear() also forgets the tick history, so t=0 is allowed again


def test_concurrent_producers():
    buf = SyncBuffer({"rgb": StreamSpec(max_lag=None, capacity=1000)})

    def produce(offset: float) -> None:
        for i in range(200):
            buf.push("rgb", offset + 2 * i * 1e-3, i)

    threads = [threading.Thread(target=produce, args=(o,)) for o in (0.0, 1e-3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(buf) == 400 and buf.stats("rgb")["received"] == 400
