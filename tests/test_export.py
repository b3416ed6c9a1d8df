"""ONNX export of the whole DDIM sampler: onnxruntime matches PyTorch to 1e-4 for the same noise."""

from __future__ import annotations

import dataclasses
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

from diffpolicy import checkpoint  # noqa: E402
from diffpolicy.config import EncoderConfig, ExportConfig, PolicyConfig  # noqa: E402
from diffpolicy.export import (  # noqa: E402
    SamplerGraph,
    check_parity,
    export_onnx,
    parity_inputs,
)
from diffpolicy.policies import make_policy  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ATOL = 1e-4


def _tiny_cfg(**over) -> PolicyConfig:
    enc = EncoderConfig(
        token_dim=16,
        fusion_heads=2,
        state_hidden=16,
        rgb_channels=[8, 8],
        rgb_keypoints=8,
        point_channels=[8, 8],
    )
    base = dict(
        down_dims=[8, 16],
        n_groups=4,
        cond_dim=16,
        horizon=8,
        n_action_steps=4,
        ddim_steps=3,
        train_timesteps=20,
        step_embed_dim=16,
        kernel_size=3,
        encoder=enc,
    )
    return PolicyConfig(**{**base, **over})


def _policy(cfg: PolicyConfig, shapes: dict, eta: float = 1.0) -> torch.nn.Module:
    """A tiny policy whose last 2 DDIM steps are sampled (K' = 2, as a chain learner leaves it)."""
    policy = make_policy(cfg, shapes, 3, text_backend="hash")
    policy.set_sampling(ft_steps=2, eta=eta, min_std=0.01, freeze=False)
    policy.fit_normalizers(actions=torch.randn(64, 3) * 2 + 1, state=torch.randn(64, 5))
    return policy.eval()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_multimodal_sampler_matches_pytorch(tmp_path):
    shapes = {"rgb": [16, 16, 3], "points": [64, 3], "state": [5], "instruction": None}
    policy = _policy(_tiny_cfg(n_obs_steps=2), shapes)
    path = tmp_path / "policy.onnx"
    graph, spec = export_onnx(policy, shapes, path, batch_size=2)
    onnx.checker.check_model(str(path))
    names = [i["name"] for i in spec["inputs"]]
    assert names == ["rgb", "points", "state", "instruction_embedding", "noise", "step_noise"]
    rgb = {"name": "rgb", "shape": [2, 2, 16, 16, 3], "dtype": "uint8"}  # (B, To, H, W, 3)
    assert spec["inputs"][0] == rgb
    assert spec["inputs"][-1]["shape"] == [2, 3, 8, 3]  # (B, S, Ta, Da): every step is stochastic (eta = 1)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == names
    assert [i.shape for i in session.get_inputs()] == [i["shape"] for i in spec["inputs"]]
    parity = check_parity(graph, path, spec, seed=3)
    assert parity["max_abs_err"] <= ATOL

    # Same inputs through the ONNX graph and the traced module, different noise -> different actions.
    feed, _, _ = parity_inputs(graph, spec, seed=4)
    a = session.run(["actions"], feed)[0]
    feed["step_noise"] = feed["step_noise"] + 1.0
    assert np.abs(session.run(["actions"], feed)[0] - a).max() > 1e-3


@pytest.mark.parametrize("standardize", [False, True])
def test_deterministic_export_has_no_step_noise_and_dynamic_batch(tmp_path, standardize):
    shapes = {"state": [5], "instruction": None}
    cfg = _tiny_cfg()
    cfg = dataclasses.replace(cfg, encoder=dataclasses.replace(cfg.encoder, text_standardize=standardize))
    policy = _policy(cfg, shapes)
    policy.fit_normalizers(instructions=["pick the red cube", "pick the blue cube", "open the drawer"])
    path = tmp_path / "det.onnx"
    graph, spec = export_onnx(policy, shapes, path, batch_size=1, deterministic=True, dynamic_batch=True)
    assert [i["name"] for i in spec["inputs"]] == ["state", "instruction_embedding", "noise"]
    spec3 = {**spec, "inputs": [{**i, "shape": [3, *i["shape"][1:]]} for i in spec["inputs"]]}
    feed, obs, generator = parity_inputs(graph, spec3, seed=5)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = session.run(["actions"], feed)[0]  # B = 3 through a graph traced at B = 1
    ref = policy.sample(obs, deterministic=True, generator=generator).actions.numpy()
    assert out.shape == (3, 8, 3) and np.abs(out - ref).max() <= ATOL


def test_folded_sample_predicting_policy_exports_with_parity(tmp_path):
    """The default's denoiser shape (chunk folded 2 steps to a position here, the trunk predicting x0, whose
    conversion coefficients ride in the FiLM tables): onnxruntime matches PyTorch, sampled and noise-free."""
    shapes = {"state": [5], "instruction": None}
    policy = _policy(_tiny_cfg(horizon=16, fold=2, prediction="sample"), shapes)
    assert policy.denoiser.fold == 2 and policy.denoiser.prediction == "sample"
    for deterministic in (False, True):
        path = tmp_path / f"fold{int(deterministic)}.onnx"
        graph, spec = export_onnx(policy, shapes, path, batch_size=2, deterministic=deterministic)
        assert check_parity(graph, path, spec, seed=6, deterministic=deterministic)["max_abs_err"] <= ATOL


def test_frozen_base_denoiser_runs_the_first_steps(tmp_path):
    """K' < K with a frozen pre-trained base (as fine-tuning leaves it): the graph runs the base on the first
    K - K' steps, as ``policy.sample`` does, so onnxruntime still matches PyTorch once the fine-tuned
    denoiser has moved away from the base."""
    shapes = {"state": [5], "instruction": None}
    policy = _policy(_tiny_cfg(ddim_steps=4), shapes)
    policy.freeze_base()
    with torch.no_grad():
        for p in policy.denoiser.parameters():
            p.add_(0.1 * torch.randn_like(p))
    assert policy.base_denoiser is not None
    path = tmp_path / "base.onnx"
    graph, spec = export_onnx(policy, shapes, path, batch_size=2)
    assert check_parity(graph, path, spec, seed=6)["max_abs_err"] <= ATOL
    policy._base = []  # the same weights without the base: the actions differ
    feed, obs, generator = parity_inputs(graph, spec, seed=6)
    without = policy.sample(obs, generator=generator).actions.numpy()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(["actions"], feed)[0] - without).max() > 1e-3


def test_eta_zero_base_steps_take_their_mean():
    policy = _policy(_tiny_cfg(ddim_steps=4), {"state": [5]}, eta=0.0)
    graph = SamplerGraph(policy, {"state": [5]})
    assert graph.stochastic_steps == [2, 3]  # only the fine-tuned steps have std >= min_std
    assert graph.input_names == ["state", "noise", "step_noise"]


def test_gaussian_policy_is_refused():
    policy = make_policy(_tiny_cfg(kind="gaussian"), {"state": [5]}, 3, text_backend="hash")
    with pytest.raises(ValueError, match="only diffusion policies"):
        SamplerGraph(policy, {"state": [5]})


def test_config_validation():
    with pytest.raises(ValueError, match="checkpoint is required"):
        ExportConfig()
    with pytest.raises(ValueError, match="opset=9"):
        ExportConfig(checkpoint="x", opset=9)


def test_export_entry_point(tmp_path):
    shapes = {"state": [5], "instruction": None}
    cfg = _tiny_cfg()
    policy = _policy(cfg, shapes)
    ckpt = checkpoint.save(
        tmp_path / "ckpt",
        7,
        {"policy": policy.state_dict()},
        config={"policy": dataclasses.asdict(cfg)},
        extra={"obs_spec": shapes, "action_dim": 3},
    )
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "diffpolicy.export", f"checkpoint={ckpt}", "batch_size=2", "text_backend=hash",
        f"hydra.run.dir={run}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["max_abs_err"] <= ATOL and Path(summary["onnx"]) == run / "policy.onnx"
    meta = json.loads((run / "policy.json").read_text())
    assert meta["step"] == 7 and meta["ddim_steps"] == 3 and meta["outputs"][0]["shape"] == [2, 8, 3]
    session = ort.InferenceSession(str(run / "policy.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == [i["name"] for i in meta["inputs"]]

    bad = subprocess.run(
        [sys.executable, "-m", "diffpolicy.export", f"checkpoint={tmp_path / 'no'}", f"hydra.run.dir={run}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.startswith("error: no checkpoint")


@pytest.mark.parametrize("head", ["fused", "points"])
def test_predict_then_act_policy_exports_with_parity(tmp_path, head):
    """policy.encoder.predict_positions: the graph runs perception, the position head (on the fused features
    or on the cloud's points) and the condition MLP as the module does (acting reads the prediction)."""
    shapes = {"rgb": [16, 16, 3], "points": [64, 3], "state": [5], "instruction": None}
    cfg = _tiny_cfg()
    enc = dataclasses.replace(cfg.encoder, predict_positions=2, position_head=head)
    cfg = dataclasses.replace(cfg, encoder=enc)
    policy = _policy(cfg, shapes)
    policy.fit_normalizers(positions=torch.rand(64, 6) * 0.3)
    path = tmp_path / "policy.onnx"
    graph, spec = export_onnx(policy, shapes, path, batch_size=2)
    assert check_parity(graph, path, spec, seed=3)["max_abs_err"] <= ATOL


@pytest.mark.parametrize("standardize", [False, True])
def test_dialogue_policy_exports_its_memory_with_parity(tmp_path, standardize):
    """A policy with an instruction memory: the turns' embeddings and their mask are the graph's text inputs,
    the memory (and the embeddings' standardisation) is in the graph, and dialogues of different lengths in
    one batch match PyTorch."""
    shapes = {"rgb": [16, 16, 3], "points": [64, 3], "state": [5], "instruction": None}
    cfg = _tiny_cfg()
    cfg = dataclasses.replace(
        cfg, encoder=dataclasses.replace(cfg.encoder, text_memory=2, text_memory_turns=4,
                                         text_standardize=standardize)
    )  # fmt: skip
    policy = _policy(cfg, shapes)
    policy.fit_normalizers(instructions=["put the red cube in the yellow tray", "no, the blue one", "a\nb"])
    with torch.no_grad():  # a fresh U-Net ignores its condition: give the observation a say
        for block in policy.denoiser.res_blocks():
            block.cond_proj.weight.normal_(0.0, 0.5)
        memory = policy.obs_encoder.text  # and the dialogue's context (zero when built) a say
        for layer in (memory.attn.out, memory.mlp[-1]):
            layer.weight.normal_(0.0, 0.3)
    path = tmp_path / "dialogue.onnx"
    graph, spec = export_onnx(policy, shapes, path, batch_size=3)
    names = [i["name"] for i in spec["inputs"]]
    assert names == [
        "rgb",
        "points",
        "state",
        "instruction_turns",
        "instruction_turns_mask",
        "noise",
        "step_noise",
    ]
    assert spec["inputs"][3]["shape"] == [3, 4, 384] and spec["inputs"][4]["shape"] == [3, 4]
    dialogues = ["put the red cube in the yellow tray", "put the red cube in the yellow tray\nno, the blue one",
                 "a\nb\nc\nd\ne"]  # fmt: skip
    feed, obs, generator = parity_inputs(graph, spec, seed=2, instructions=dialogues)
    np.testing.assert_array_equal(feed["instruction_turns_mask"], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = session.run(["actions"], feed)[0]
    ref = policy.sample(obs, generator=generator).actions.numpy()
    assert np.abs(out - ref).max() <= ATOL
    feed["instruction_turns_mask"][1, 1] = 0.0  # forget the correction: another chunk
    assert np.abs(session.run(["actions"], feed)[0][1] - out[1]).max() > 1e-4
