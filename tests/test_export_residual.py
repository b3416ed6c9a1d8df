"""ONNX export of a base + residual checkpoint: ``residual.onnx`` matches the PyTorch head to 1e-5, and a
control loop through ``policy.onnx`` + ``residual.onnx`` executes the actions of ``StepActor`` in the real
environment (obstacle_reach)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from diffpolicy.cli import compose  # noqa: E402
from diffpolicy.config import ExportConfig  # noqa: E402
from diffpolicy.export import ResidualGraph, main  # noqa: E402
from diffpolicy.policies.residual import StepActor  # noqa: E402
from diffpolicy.policy_io import build_policy, env_spec, load_policy  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from residual_checkpoint import residual_checkpoint  # noqa: E402
from test_train import TINY_POLICY, TINY_RUN  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _onnx_rollout(out_dir: Path, venv, seed: int, steps: int, meta: dict) -> np.ndarray:
    """The documented control loop through the two graphs: plan every Te steps, correct every step."""
    sampler = ort.InferenceSession(str(out_dir / "policy.onnx"), providers=["CPUExecutionProvider"])
    head = ort.InferenceSession(str(out_dir / "residual.onnx"), providers=["CPUExecutionProvider"])
    n, te, ta, da = venv.num_envs, meta["n_action_steps"], meta["horizon"], meta["action_dim"]
    start = meta["n_obs_steps"] - 1
    uses_cond = meta["residual"]["cond_dim"] > 0
    chunk = np.zeros((n, te, da), np.float32)
    cond = np.zeros((n, meta["residual"]["cond_dim"]), np.float32)
    phase = np.full(n, te, np.int64)
    torch.manual_seed(seed)  # x_K drawn as the base's plan draws it (global generator, rows that replan)
    obs, _ = venv.reset(seed=seed)
    executed = []
    for _ in range(steps):
        need = np.flatnonzero(phase >= te)
        if need.size:
            noise = torch.randn(need.size, ta, da).numpy()
            feed = {"state": np.asarray(obs["state"], np.float32)[need], "noise": noise}
            outs = sampler.run(["actions", "cond"] if uses_cond else ["actions"], feed)
            chunk[need] = outs[0][:, start : start + te]
            if uses_cond:
                cond[need] = outs[1]
            phase[need] = 0
        feed = {
            "state": np.asarray(obs["state"], np.float32),
            "base_action": chunk[np.arange(n), phase],
            "phase": phase,
        }
        if uses_cond:
            feed["cond"] = cond
        (action,) = head.run(["action"], feed)
        executed.append(action)
        phase += 1
        obs, _, term, trunc, _ = venv.step(action)
        phase[term | trunc] = te
    return np.stack(executed)  # (steps, N, Da)


def _torch_rollout(policy, venv, seed: int, steps: int) -> np.ndarray:
    actor = StepActor(policy, venv.num_envs, torch.device("cpu"))
    torch.manual_seed(seed)
    obs, _ = venv.reset(seed=seed)
    executed, bases = [], []
    for _ in range(steps):
        action, record = actor.act(obs, deterministic=True)
        executed.append(action)
        bases.append(record["base"].numpy())
        obs, _, term, trunc, _ = venv.step(action)
        actor.reset(term | trunc)
    return np.stack(executed), np.stack(bases)


def _check_rollout(ckpt: Path, out_dir: Path, meta: dict) -> None:
    from diffpolicy.env_factory import make_envs

    policy, env_cfg, _ = load_policy(ckpt, env_overrides={"vectorization": "sync"})
    te = policy.n_action_steps
    steps = 2 * te + 3  # two full chunks and the start of a third
    venv = make_envs(env_cfg, te, 2, seed=11, chunked=False)
    try:
        ref, base = _torch_rollout(policy, venv, 5, steps)
        got = _onnx_rollout(out_dir, venv, 5, steps, meta)
    finally:
        venv.close()
    assert got.shape == ref.shape == (steps, 2, policy.action_dim)
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # The head corrects (the executed actions are not the base's) and the loop crossed chunk boundaries.
    assert np.abs(ref).max() <= 1.0 and np.abs(ref - np.clip(base, -1, 1)).max() > 0.05


def test_export_entry_point_writes_both_graphs_and_rolls_out_like_step_actor(tmp_path):
    ckpt = residual_checkpoint(tmp_path / "ckpt")
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "diffpolicy.export",
        f"checkpoint={ckpt}",
        "dynamic_batch=true",
        f"hydra.run.dir={run}",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["residual_max_abs_err"] <= 1e-5 and summary["max_abs_err"] <= 1e-4
    assert Path(summary["residual_onnx"]) == run / "residual.onnx"
    meta = json.loads((run / "policy.json").read_text())
    assert meta["deterministic"] and meta["stochastic_steps"] == []  # the residual's base: eta = 0
    assert [i["name"] for i in meta["inputs"]] == ["state", "noise"]
    assert [o["name"] for o in meta["outputs"]] == ["actions"]
    res = meta["residual"]
    assert res["onnx"] == "residual.onnx" and res["alpha"] == 0.3 and res["cond_dim"] == 0
    assert [(i["name"], i["dtype"]) for i in res["inputs"]] == [
        ("state", "float32"), ("base_action", "float32"), ("phase", "int64"),
    ]  # fmt: skip
    assert res["outputs"] == [{"name": "action", "shape": [1, 2], "dtype": "float32"}]
    onnx.checker.check_model(str(run / "residual.onnx"))
    _check_rollout(ckpt, run, meta)


def test_head_reading_cond_gets_it_from_the_sampler_graph(tmp_path):
    ckpt = residual_checkpoint(tmp_path / "ckpt", cond=True)
    out = tmp_path / "out"
    summary = main(ExportConfig(checkpoint=str(ckpt), out=str(out), dynamic_batch=True), tmp_path)
    assert summary["residual_max_abs_err"] <= 1e-5 and summary["max_abs_err"] <= 1e-4
    meta = json.loads((out / "policy.json").read_text())
    cond_dim = meta["residual"]["cond_dim"]
    assert cond_dim > 0 and meta["outputs"][1] == {"name": "cond", "shape": [1, cond_dim], "dtype": "float32"}
    assert meta["residual"]["inputs"][-1]["name"] == "cond"
    _check_rollout(ckpt, out, meta)


def test_residual_parity_failure_fails_the_export(tmp_path):
    ckpt = residual_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"onnxruntime differs .*residual\.onnx kept"):
        main(ExportConfig(checkpoint=str(ckpt), out=str(tmp_path / "o"), residual_atol=1e-30), tmp_path)


def test_residual_graph_needs_a_residual_policy():
    cfg = compose("train", [*TINY_RUN, *TINY_POLICY])
    spec, da = env_spec(cfg.env)
    with pytest.raises(ValueError, match="only base \\+ residual"):
        ResidualGraph(build_policy(cfg.policy, spec, da))
