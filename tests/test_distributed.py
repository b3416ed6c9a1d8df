"""Two gloo processes on the CPU: averaged gradients equal the single-process gradient; a failing rank ends
the job."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffpolicy.config import DistConfig
from diffpolicy.distributed import (
    DistInfo,
    average_gradients,
    broadcast_parameters,
    mean_metrics,
    process_group,
    seed_for_rank,
)

WORKER = Path(__file__).with_name("dist_worker.py")
pytestmark = pytest.mark.dist


def _torchrun(out: Path, mode: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0"]
    cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", str(WORKER), str(out), mode]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_averaged_gradient_equals_single_process_on_concatenated_batch(tmp_path: Path) -> None:
    run = _torchrun(tmp_path, "grad")
    assert run.returncode == 0, run.stderr[-2000:]
    r0, r1 = (load_file(str(tmp_path / f"rank{r}.safetensors")) for r in (0, 1))
    sys.path.insert(0, str(WORKER.parent))
    from dist_worker import model_and_batch

    model, x, y = model_and_batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(r0[f"grad.{name}"], p.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r1[f"grad.{name}"], p.grad, atol=1e-5, rtol=1e-5)
        assert torch.equal(r0[f"param.{name}"], r1[f"param.{name}"])
    assert torch.equal(r0["loss"], r1["loss"])


def test_failing_rank_fails_the_job_in_bounded_time(tmp_path: Path) -> None:
    start = time.monotonic()
    run = _torchrun(tmp_path, "fail", timeout=90)
    assert run.returncode != 0
    assert "rank 1 failed on purpose" in run.stderr + run.stdout
    assert time.monotonic() - start < 90


def test_single_process_helpers_are_identities() -> None:
    with process_group(DistConfig(), "gloo") as info:
        assert info == DistInfo() and info.is_main and not info.enabled
        lin = torch.nn.Linear(2, 2)
        lin(torch.ones(1, 2)).sum().backward()
        grads = [p.grad.clone() for p in lin.parameters()]
        average_gradients(list(lin.parameters()), info)
        broadcast_parameters([lin], info)
        assert all(torch.equal(p.grad, g) for p, g in zip(lin.parameters(), grads))
        assert mean_metrics({"a/b": 2.0}, info, torch.device("cpu")) == {"a/b": 2.0}
    assert seed_for_rank(5, 0) == 5 and seed_for_rank(5, 2) == 2005


def test_ddp_without_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with (
        pytest.raises(ValueError, match="torchrun"),
        process_group(DistConfig(name="ddp", mode="ddp"), "gloo"),
    ):
        pass


def test_kl_early_stop_is_decided_on_every_rank_alike(tmp_path: Path) -> None:
    """Rank 0 sees KL 0 (under target_kl), rank 1 sees 1 (over): a stop on the rank's own KL would let rank 0
    go on to a pass whose collectives rank 1 never joins. Both stop after the first pass, on the mean."""
    run = _torchrun(tmp_path, "kl")
    assert run.returncode == 0, run.stderr[-2000:]
    assert [(tmp_path / f"epochs_rank{r}.txt").read_text() for r in (0, 1)] == ["1 True", "1 True"]


def _train_on_two_ranks(tmp_path: Path, *extra: str) -> tuple[dict, dict]:
    """One tiny fine-tuning iteration (``tests/dist_train_worker.py``) on two gloo ranks from the same
    untrained checkpoint (``tmp_path/init``) with the overrides ``extra``; -> each rank's parameters after it."""
    from test_train import TINY_POLICY, TINY_RUN

    from diffpolicy.cli import compose
    from diffpolicy.policy_io import build_policy, env_spec, save_policy

    cfg = compose("train", [*TINY_RUN, *TINY_POLICY])
    spec, da = env_spec(cfg.env)
    torch.manual_seed(0)
    save_policy(
        tmp_path / "init", 0, build_policy(cfg.policy, spec, da), env_cfg=cfg.env, policy_cfg=cfg.policy
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=0"]
    cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]
    cmd += [str(WORKER.with_name("dist_train_worker.py")), str(tmp_path), str(tmp_path / "init"), *extra]
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return tuple(load_file(str(tmp_path / f"params_rank{r}.safetensors")) for r in (0, 1))


def test_one_ppo_iteration_on_two_ranks_leaves_identical_parameters(tmp_path: Path) -> None:
    r0, r1 = _train_on_two_ranks(tmp_path)
    assert r0.keys() == r1.keys()
    for key in r0:
        assert torch.equal(r0[key], r1[key]), key
    from diffpolicy import checkpoint

    init = checkpoint.load(tmp_path / "init").state["policy"]
    changed = [k for k in init if f"policy.{k}" in r0 and not torch.equal(init[k], r0[f"policy.{k}"])]
    assert changed, "PPO did not change the policy"
    assert (tmp_path / "summary.txt").read_text().startswith("{")


def test_fpo_iteration_on_two_ranks_leaves_identical_parameters(tmp_path: Path) -> None:
    """FPO's epochs stop on the KL averaged over ranks (``rl.epochs.KLEpochs``), so both ranks run the same
    steps and end with the same weights (a stop on a rank's own KL could strand the other in an all-reduce)."""
    extra = ["algo=fpo", "algo.n_steps=6", "algo.minibatch_size=4", "algo.update_epochs=3", "algo.lr=1e-3"]
    extra += ["algo.target_kl=1e-4", "algo.mc_draws=2"]
    r0, r1 = _train_on_two_ranks(tmp_path, *extra)
    for key in r0:
        assert torch.equal(r0[key], r1[key]), key
    from diffpolicy import checkpoint

    init = checkpoint.load(tmp_path / "init").state["policy"]
    assert any(not torch.equal(init[k], r0[f"policy.{k}"]) for k in init if f"policy.{k}" in r0)


def test_residual_iteration_on_two_ranks_leaves_identical_heads(tmp_path: Path) -> None:
    """The evidence, the step it earns and the trust region agree across ranks (each measures its own batch)."""
    extra = ["algo=residual", "algo.n_steps=12", "algo.minibatch_size=12", "algo.residual_hidden=[16,16]"]
    extra += ["algo.signal_margin=1e-6"]  # any evidence earns a step: the trust-region path runs
    r0, r1 = _train_on_two_ranks(tmp_path, *extra)
    for key in r0:
        assert torch.equal(r0[key], r1[key]), key
    last = [k for k in r0 if k.startswith("policy.head.mean_net.") and k.endswith(".weight")][-1]
    assert r0[last].abs().max() > 0, "the residual head did not move"
