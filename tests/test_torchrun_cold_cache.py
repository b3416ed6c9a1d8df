"""Two torchrun ranks from an empty cache: the ranks that wait for rank 0's BC outlive the collective timeout.

Rank 0 collects demonstrations and trains BC on first use while the other ranks wait in
:func:`diffpolicy.distributed.main_rank_first`; that wait must not be bounded by ``dist.timeout_s``, and it
must end with rank 0's error when rank 0 fails, or with a clear one when rank 0 goes quiet.

Run as a script under torchrun (``python -m torch.distributed.run ... THIS_FILE OUT``) this file is the
worker of :func:`test_main_rank_first_waits_longer_than_the_collective_timeout`.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from diffpolicy import checkpoint
from diffpolicy.distributed import DistInfo, MainRankError, _wait_for_main, main_rank_first

pytestmark = pytest.mark.dist

TIMEOUT_S = 10
"""dist.timeout_s of the end-to-end run: well below how long rank 0 needs for collection + BC."""
COLD_RUN = [
    "algo.iterations=1",
    "algo.n_steps=2",
    "algo.update_epochs=1",
    "eval_episodes=2",
    "bc.n_demos=4",
    "bc.epochs=400",  # 1600 optimiser steps: 23 s of BC on one core of the fastest machine seen (800 took 11.7 s)
    "bc.batch_size=32",
    "dist=ddp",
    f"dist.timeout_s={TIMEOUT_S}",
]
WORKER_TIMEOUT_S = 2
"""dist.timeout_s of the helper-level worker; its rank 0 works for WORKER_WORK_S."""
WORKER_WORK_S = 6


def _torchrun(*args: str, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0"]
    cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _overrides(*groups: list[str]) -> list[str]:
    """Hydra overrides with later groups replacing earlier values of the same key."""
    merged: dict[str, str] = {}
    for group in groups:
        for item in group:
            key, _, value = item.partition("=")
            merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


def test_two_ranks_train_from_an_empty_cache(tmp_path: Path) -> None:
    from test_train import TINY_POLICY, TINY_RUN

    cache, run_dir = tmp_path / "cache", tmp_path / "run"
    args = _overrides(TINY_RUN, TINY_POLICY, COLD_RUN, [f"cache_dir={cache}", f"hydra.run.dir={run_dir}"])
    run = _torchrun("-m", "diffpolicy.train", *args, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]

    # rank 0 really collected and trained for longer than the collective timeout while rank 1 waited
    rows = [json.loads(line) for line in (run_dir / "bc" / "metrics.jsonl").read_text().splitlines()]
    busy_s = rows[-1]["wall_time_s"]  # since the BC logger opened, before the demonstrations
    assert busy_s > TIMEOUT_S + 3, f"collection + BC took only {busy_s:.1f} s: raise bc.epochs"
    # one BC checkpoint in the cache, and the wait left no status file behind
    bc = [p for p in (cache / "bc").iterdir() if not p.name.endswith(".run")]
    assert len(bc) == 1 and checkpoint.exists(bc[0]), sorted(p.name for p in (cache / "bc").iterdir())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["env_steps"] > 0


def test_main_rank_first_waits_longer_than_the_collective_timeout(tmp_path: Path) -> None:
    start = time.monotonic()
    run = _torchrun(__file__, str(tmp_path), timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "rank1.txt").read_text() == "made by rank 0"
    assert time.monotonic() - start > WORKER_WORK_S
    assert not list(tmp_path.glob(".main-first-*"))


@pytest.fixture
def one_rank_group(tmp_path: Path):
    """A one-process gloo group, so that :func:`main_rank_first` takes its distributed path in-process."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield DistInfo(rank=0, world_size=1)
    finally:
        dist.destroy_process_group()


def test_a_failing_rank_0_hands_its_error_to_the_waiting_ranks(tmp_path: Path, one_rank_group) -> None:
    def work() -> None:
        raise ValueError("demonstrations are corrupt")

    with pytest.raises(ValueError, match="corrupt"):
        main_rank_first(work, one_rank_group, torch.device("cpu"), tmp_path, stall_s=5, poll_s=0.05)
    (status,) = tmp_path.glob(".main-first-*.json")
    with pytest.raises(
        MainRankError, match="rank 0 failed during BC: ValueError: demonstrations are corrupt"
    ):
        _wait_for_main(status, stall_s=5, what="BC", poll_s=0.05)


def test_rank_0_cleans_up_after_success(tmp_path: Path, one_rank_group) -> None:
    assert main_rank_first(lambda: 7, one_rank_group, torch.device("cpu"), tmp_path, stall_s=5) == 7
    assert not list(tmp_path.glob(".main-first-*")) and not list(tmp_path.glob("..main-first-*"))


def test_a_silent_rank_0_is_a_clear_error_after_the_stall_limit(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(MainRankError, match="no sign of life from rank 0 during BC.*not visible here"):
        _wait_for_main(tmp_path / ".main-first-0.json", stall_s=0.3, what="BC", poll_s=0.05)
    (tmp_path / "frozen.json").write_text(json.dumps({"state": "running", "beat": 3}))
    with pytest.raises(MainRankError, match="stopped changing"):
        _wait_for_main(tmp_path / "frozen.json", stall_s=0.3, what="BC", poll_s=0.05)
    assert time.monotonic() - start < 5


def _worker(out: Path) -> None:
    """Rank 0 writes a file after WORKER_WORK_S; rank 1 reads it; every collective times out after 2 s."""
    from diffpolicy.config import DistConfig
    from diffpolicy.distributed import process_group

    target = out / "made.txt"

    def work() -> str:
        if info.is_main:
            time.sleep(WORKER_WORK_S)
            target.write_text("made by rank 0")
        return target.read_text()

    cfg = DistConfig(name="ddp", mode="ddp", backend="gloo", timeout_s=WORKER_TIMEOUT_S)
    with process_group(cfg, "gloo") as info:
        text = main_rank_first(work, info, torch.device("cpu"), out, stall_s=WORKER_TIMEOUT_S, poll_s=0.2)
        (out / f"rank{info.rank}.txt").write_text(text)
        dist.barrier()  # a collective after the wait still works


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
