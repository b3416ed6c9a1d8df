"""Mid-level fusion of all observation modalities into one conditioning vector (B, cond_dim).

Every present modality becomes tokens of width token_dim (RGB keypoint groups, the point cloud's max-pooled
feature and point-keypoint groups, one state token per history step); tokens of history step s get a learned step embedding, and each modality a learned
type embedding. A learned readout token and all visual + state tokens go through ``fusion_layers``
pre-norm self-attention blocks (cross-modal mixing); the instruction token then attends to the fused tokens
(cross-attention, text as query). The readout and text outputs are concatenated and projected to cond_dim.
With ``text_film`` the instruction also FiLM-modulates the RGB encoder's feature maps and the point encoder's
per-point features before their keypoints and max-pool are taken: which cube to pick is decided from the
text, and attention alone did not learn that selection (cloned policies reached the cube when the target
colour was fixed, 32/32, and not when it varied).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from diffpolicy.config import EncoderConfig
from diffpolicy.encoders.attention import AttentionBlock
from diffpolicy.encoders.memory import InstructionMemory
from diffpolicy.encoders.pointcloud import PointCloudEncoder, attend_points
from diffpolicy.encoders.rgb import RGBEncoder
from diffpolicy.encoders.text import TextEncoder
from diffpolicy.modalities import MODALITIES, TENSOR_KEYS
from diffpolicy.normalizer import MinMaxNormalizer


def spec_shape(value: Any) -> tuple[int, ...]:
    """Shape from an obs_spec entry: a tuple/list, anything with ``.shape`` (gymnasium space, array), or None."""
    if value is None or isinstance(value, bool):
        return ()
    shape = getattr(value, "shape", value)
    return tuple(int(s) for s in shape) if shape is not None else ()


class StateEncoder(nn.Module):
    """Proprioception MLP: (M, Ds) normalised -> (M, 1, token_dim)."""

    def __init__(self, state_dim: int, hidden: int, token_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(state_dim, hidden), nn.Mish(), nn.Linear(hidden, token_dim))

    def forward(self, state: torch.Tensor) -> torch.Tensor:
        return self.net(state).unsqueeze(1)


POSITION_HIDDEN = 256
"""Hidden width of predict-then-act's position head and of its condition MLP."""
POSITION_MIN_SPAN = 0.05
"""Smallest range (m) of a position coordinate as the condition normalises it: a coordinate the demonstrations
barely vary (a goal's height) would otherwise turn a millimetre of perception error into whole units."""


class _BoxPositions(nn.Module):
    """``points`` xyz positions predicted in the workspace box's units (each coordinate scaled from ``low`` ..
    ``high`` (m) to [-1, 1]); subclasses say from what (:meth:`box`)."""

    def __init__(self, low: list[float], high: list[float], points: int) -> None:
        super().__init__()
        self.points = points
        self.register_buffer("low", torch.tensor(low, dtype=torch.float32), persistent=False)
        self.register_buffer("high", torch.tensor(high, dtype=torch.float32), persistent=False)

    def box(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The head's inputs -> the positions (B, points, 3) in box units."""
        raise NotImplementedError

    def metres(self, box: torch.Tensor) -> torch.Tensor:
        """Positions (B, points, 3) in box units -> (B, 3 points) m."""
        return ((box + 1) / 2 * (self.high - self.low) + self.low).flatten(-2)

    def box_loss(self, box: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Predicted (B, points, 3) box units against ``target`` (B, 3 points) m -> (mean squared error in box
        units, mean error per point (m) detached)."""
        span = self.high - self.low
        goal = (target.float().unflatten(-1, (self.points, 3)) - self.low) / span * 2 - 1
        error = ((box.detach() - goal) * span / 2).norm(dim=-1).mean()
        return F.mse_loss(box, goal), error

    def predict(self, *inputs: torch.Tensor) -> torch.Tensor:
        """The head's inputs -> the positions (B, 3 points) in m."""
        return self.metres(self.box(*inputs))

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's inputs then ``target`` (B, 3 points) m -> (mean squared error in box units, mean error
        per point (m) detached)."""
        *inputs, target = inputs
        return self.box_loss(self.box(*inputs), target)


class PositionHead(_BoxPositions):
    """The condition (B, cond_dim) -> ``points`` xyz positions, regressed in box units: BC's auxiliary head,
    and predict-then-act's position head inside the encoder (``policy.encoder.position_head=fused``)."""

    def __init__(
        self, cond_dim: int, low: list[float], high: list[float], hidden: int = 256, points: int = 1
    ) -> None:
        super().__init__(low, high, points)
        self.net = nn.Sequential(nn.Linear(cond_dim, hidden), nn.Mish(), nn.Linear(hidden, 3 * points))

    def box(self, cond: torch.Tensor) -> torch.Tensor:
        """cond (B, cond_dim) -> the positions (B, points, 3) in box units."""
        return self.net(cond.float()).unflatten(-1, (self.points, 3))


class PointPositionHead(_BoxPositions):
    """Per-point features (B, N, C) and the points' xyz (B, N, 3, box units) -> ``points`` positions, each the
    expected xyz under a softmax over the cloud's points plus a learned offset (box units, zero at the start)
    (``policy.encoder.position_head=points``).

    A position is a weighted mean of points the camera saw, so on a new scene it moves with the object's
    points instead of being regressed from a global feature that ten scenes let memorise them. The logits are
    the point keypoints' (:func:`~diffpolicy.encoders.pointcloud.attend_points`: a linear map of each point's
    features, plus the instruction's query); the offset covers a surface's depth (the camera sees one side)."""

    def __init__(
        self, channels: int, low: list[float], high: list[float], points: int = 1, text_dim: int = 0
    ) -> None:
        super().__init__(low, high, points)
        self.logits = nn.Linear(channels, points)
        self.text_query = nn.Linear(text_dim, points * channels) if text_dim else None
        self.offset = nn.Parameter(torch.zeros(points, 3))

    def box(self, h: torch.Tensor, xyz: torch.Tensor, text: torch.Tensor | None = None) -> torch.Tensor:
        """h (B, N, C), xyz (B, N, 3) box units, text (B, text_dim) -> the positions (B, points, 3) in box
        units."""
        return attend_points(h, xyz, self.logits, self.text_query, text) + self.offset


class ObservationEncoder(nn.Module):
    """Observation dict -> cond (B, cond_dim).

    obs["rgb"] (B, To, H, W, 3) uint8, obs["points"] (B, To, N, 6) float32 (xyz in m, robot base frame, then
    rgb in [0, 1]; an (N, 3) cloud is read as grey),
    obs["state"] (B, To, Ds) float32 (raw units; normalised here), obs["instruction"] list of B strings.
    The modalities used are those present in ``obs_spec`` (key -> per-step shape; for ``instruction`` any
    value) and enabled in ``cfg``. A missing To axis is accepted and read as To = 1.
    """

    def __init__(
        self,
        cfg: EncoderConfig,
        obs_spec: Mapping[str, Any],
        n_obs_steps: int,
        cond_dim: int,
        *,
        text_backend: str = "minilm",
    ) -> None:
        super().__init__()
        D = cfg.token_dim
        self.grad_checkpointing = False
        """Recompute encoder / fusion activations in backward (training with grad only)."""
        self.n_obs_steps = n_obs_steps
        self.modalities: list[str] = []
        self.encoders = nn.ModuleDict()
        self.use_text = "instruction" in obs_spec and cfg.use_text
        self.text_memory = cfg.text_memory if self.use_text else 0
        """k > 0: the instruction is a dialogue read through an :class:`InstructionMemory` of k tokens."""
        self.blank_text = cfg.blank_text
        """Every instruction is read as '' (the text ablation)."""
        film = self.use_text and cfg.text_film
        if "rgb" in obs_spec and cfg.use_rgb:
            self.encoders["rgb"] = RGBEncoder(
                cfg.rgb_channels, cfg.rgb_keypoints, D, cfg.random_shift, text_dim=D if film else 0
            )
        if "points" in obs_spec and cfg.use_points:
            self.encoders["points"] = PointCloudEncoder(
                cfg.point_channels,
                cfg.workspace_low,
                cfg.workspace_high,
                D,
                keypoints=cfg.point_keypoints,
                text_dim=D if film else 0,
            )
        self.state_dim = 0
        if "state" in obs_spec:
            self.state_dim = spec_shape(obs_spec["state"])[-1]
            self.state_normalizer = MinMaxNormalizer(self.state_dim)
            if cfg.use_state:
                self.encoders["state"] = StateEncoder(self.state_dim, cfg.state_hidden, D)
        if self.use_text:
            if cfg.text_memory:
                self.text = InstructionMemory(
                    D, cfg.text_memory, cfg.text_memory_turns, cfg.fusion_heads, backend=text_backend,
                    standardize=cfg.text_standardize,
                )  # fmt: skip
            else:
                self.text = TextEncoder(D, backend=text_backend, standardize=cfg.text_standardize)
            if cfg.fusion == "attention":
                self.cross = AttentionBlock(D, cfg.fusion_heads)
        if not self.encoders and not self.use_text:
            raise ValueError(f"obs_spec {sorted(obs_spec)} has no modality enabled by policy.encoder.use_*")
        self.modalities = [k for k in TENSOR_KEYS if k in self.encoders]
        self.filmed = {k for k in ("rgb", "points") if film and k in self.encoders}
        """Modalities whose encoder the instruction FiLM-modulates."""
        self.fusion = cfg.fusion
        self.step_embed = nn.Parameter(torch.zeros(n_obs_steps, D))
        self.type_embed = nn.ParameterDict({k: nn.Parameter(torch.zeros(D)) for k in self.modalities})
        attention = self.fusion == "attention"
        self.readout = nn.Parameter(torch.randn(D) * 0.02) if attention else None
        self.layers = nn.ModuleList(
            AttentionBlock(D, cfg.fusion_heads) for _ in range(cfg.fusion_layers if attention else 0)
        )
        # The readout token alone tends to average the modalities away (BC then learns an almost
        # unconditional policy), so the head reads every fused token: 1 readout + L modality tokens. No
        # LayerNorm before it: normalising the concatenation let training shrink the observation-dependent
        # part relative to a growing constant (the condition collapsed to ~3 % variation).
        # With ``concat`` fusion (DP3's and diffusion_policy's) the tokens are concatenated as they are, and the
        # instruction's vector with them: no readout, no attention.
        self.n_tokens = int(attention) + n_obs_steps * sum(
            getattr(self.encoders[k], "n_tokens", 1) for k in self.modalities
        )
        # the instruction's tokens after attending (k of a dialogue's memory, else 1), or its vector (concat)
        text_in = 0 if not self.use_text else D * ((cfg.text_memory or 1) if attention else 1)
        out_in = self.n_tokens * D + text_in
        self.head = nn.Linear(out_in, cond_dim)
        self.position_points = cfg.predict_positions
        """Predict-then-act (``policy.encoder.predict_positions``): positions predicted from the fused
        perception; the condition then comes from proprioception, them and the instruction (0: off)."""
        if self.position_points:
            k = self.position_points
            self.position_normalizer = MinMaxNormalizer(3 * k)
            """The positions as the condition reads them: the demonstrations' range of each coordinate,
            widened to at least :data:`POSITION_MIN_SPAN` (fitted with the other normalisers)."""
            self.position_source = cfg.position_head
            """``fused``: the positions are regressed from the fused perception; ``points``: read off the point
            cloud by :class:`PointPositionHead` (the other modalities then feed no position)."""
            if cfg.position_head == "points":
                if "points" not in self.encoders:
                    raise ValueError(
                        "policy.encoder.position_head=points needs the points modality (env.obs_mode=multimodal, "
                        "use_points=true); use position_head=fused"
                    )
                self.position_head = PointPositionHead(
                    cfg.point_channels[-1], cfg.workspace_low, cfg.workspace_high, points=k,
                    text_dim=D if "points" in self.filmed else 0,
                )  # fmt: skip
            else:
                self.position_head = PositionHead(
                    cond_dim, cfg.workspace_low, cfg.workspace_high, POSITION_HIDDEN, points=k
                )
            act_in = n_obs_steps * self.state_dim + 3 * k + (D if self.use_text else 0)
            self.act_head = nn.Sequential(
                nn.Linear(act_in, POSITION_HIDDEN), nn.Mish(),
                nn.Linear(POSITION_HIDDEN, POSITION_HIDDEN), nn.Mish(),
                nn.Linear(POSITION_HIDDEN, cond_dim),
            )  # fmt: skip

    @property
    def acting_keys(self) -> list[str]:
        """The observation tensors acting reads: every modality's, plus proprioception where predict-then-act's
        condition reads it; with positions off the point cloud, the cloud and proprioception alone."""
        keys = list(self.modalities)
        if self.position_points:
            if self.position_source == "points":
                keys = ["points"]
            if self.state_dim and "state" not in keys:
                keys.append("state")
        return keys

    def _ckpt(self, fn: Any, *args: Any) -> torch.Tensor:
        if self.grad_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def _batch(self, obs: Mapping[str, Any]) -> int:
        missing = [k for k in self.modalities if k not in obs]
        if missing or (self.use_text and "instruction" not in obs):
            raise KeyError(f"observation lacks {missing or ['instruction']} that this policy was built with")
        return obs[self.modalities[0]].shape[0] if self.modalities else len(obs["instruction"])

    def forward(
        self,
        obs: Mapping[str, Any],
        augment: bool = False,
        generator: torch.Generator | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Observation dict -> cond (B, cond_dim). Predict-then-act (:attr:`position_points` k > 0): the
        condition of proprioception, the instruction and ``positions`` (B, 3 k) m when given (BC's labels;
        perception is then not run), else the positions :meth:`predict_positions` reads off perception."""
        q = self._text(obs)
        if not self.position_points:
            return self._fused(obs, augment, generator, q)
        if positions is None:
            positions = self.position_head.predict(*self._position_inputs(obs, augment, generator, q))
        elif positions.shape[-1] != 3 * self.position_points:
            raise ValueError(
                f"positions have {positions.shape[-1]} values; the policy predicts {self.position_points} xyz"
            )
        return self._act_condition(obs, positions, q)

    def predict_positions(
        self, obs: Mapping[str, Any], augment: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Predict-then-act: the k positions perception reads, (B, 3 k) in m."""
        return self.position_head.predict(*self._position_inputs(obs, augment, generator, self._text(obs)))

    def position_loss(
        self,
        obs: Mapping[str, Any],
        target: torch.Tensor,
        augment: bool = False,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Predict-then-act: the prediction against the labelled positions ``target`` (B, 3 k) m -> (mean
        squared error in workspace-box units [-1, 1] (differentiable), mean distance per position in m
        (detached))."""
        return self.position_head(*self._position_inputs(obs, augment, generator, self._text(obs)), target)

    def _position_inputs(
        self,
        obs: Mapping[str, Any],
        augment: bool,
        generator: torch.Generator | None,
        q: torch.Tensor | None,
    ) -> tuple[Any, ...]:
        """What the position head reads: the fused perception (B, cond_dim), or the latest cloud's per-point
        features (B, N, C), its xyz in box units (B, N, 3) and the instruction's vector (B, D) or None."""
        if self.position_source != "points":
            return (self._fused(obs, augment, generator, q),)
        if "points" not in obs:
            raise KeyError("observation lacks ['points'] that this policy reads its positions from")
        cloud = self._history("points", obs["points"], obs["points"].shape[0])[:, -1]  # (B, N, 3|6): latest
        text = q[:, 0] if q is not None and "points" in self.filmed else None
        h, xyz = self.encoders["points"].point_features(cloud, text)
        return h, xyz, text

    def _act_condition(
        self, obs: Mapping[str, Any], positions: torch.Tensor, q: torch.Tensor | None
    ) -> torch.Tensor:
        """Predict-then-act's condition: normalised proprioception (B, To Ds), positions (B, 3 k) m
        (normalised by :attr:`position_normalizer`) and the instruction's vector (B, D) -> (B, cond_dim)."""
        parts = []
        if self.state_dim:
            state = self._history("state", obs["state"], positions.shape[0])  # (B, To, Ds)
            parts.append(self.state_normalizer.normalize(state.float()).flatten(1))
        parts.append(self.position_normalizer.normalize(positions.to(self.head.weight.device).float()))
        if q is not None:
            parts.append(q[:, 0].float())
        return self.act_head(torch.cat(parts, dim=-1))

    def fit_text(self, instructions: list[str]) -> None:
        """Fit the instruction's standardisation (``encoder.text_standardize``) to the training instructions:
        each utterance of a dialogue (memory) or each whole instruction (one sentence). No-op otherwise."""
        if self.use_text:
            self.text.fit(instructions)

    def _text(self, obs: Mapping[str, Any]) -> torch.Tensor | None:
        """The instruction's tokens (B, k, D) (k = 1: the sentence; else the dialogue's memory), or None. FiLM
        and the condition read the first: the sentence's token, or the memory's (the latest utterance plus
        what the dialogue adds)."""
        if not self.use_text:
            return None
        if "instruction" not in obs:
            raise KeyError("observation lacks ['instruction'] that this policy was built with")
        instr = obs["instruction"]
        instr = [str(s) for s in (instr.tolist() if isinstance(instr, np.ndarray) else instr)]
        if self.blank_text:
            instr = [""] * len(instr)
        return self.text(instr)  # (B, k, D)

    def _history(self, k: str, value: Any, B: int) -> torch.Tensor:
        """obs[k] as (B, n_obs_steps, ...): a missing To axis read as To = 1, a short history padded by
        repeating its oldest step (episode start)."""
        x = torch.as_tensor(value, device=self.head.weight.device)
        if x.dim() == MODALITIES[k].rank + 1:
            x = x.unsqueeze(1)  # (B, 1, ...) when the To axis is missing
        To = x.shape[1]
        if To > self.n_obs_steps:
            raise ValueError(
                f"obs[{k!r}] has To={To} steps but the policy keeps n_obs_steps={self.n_obs_steps}"
            )
        if To < self.n_obs_steps:
            pad = x[:, :1].expand(B, self.n_obs_steps - To, *x.shape[2:])
            x = torch.cat([pad, x], dim=1)
        return x

    def _fused(
        self,
        obs: Mapping[str, Any],
        augment: bool,
        generator: torch.Generator | None,
        q: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every enabled modality's tokens fused (and the instruction ``q`` (B, 1, D) attending) -> (B,
        cond_dim): the condition itself, or what predict-then-act reads the positions from."""
        B = self._batch(obs)
        tokens = []
        for k in self.modalities:
            x = self._history(k, obs[k], B)  # (B, To, ...)
            To = x.shape[1]
            flat = x.reshape(B * To, *x.shape[2:])  # (B To, ...)
            text = q[:, 0].repeat_interleave(To, dim=0) if k in self.filmed else None  # (B To, D)
            if k == "state":
                t = self._ckpt(self.encoders[k], self.state_normalizer.normalize(flat.float()))
            elif k == "rgb":
                enc = self.encoders[k]  # augmentation stays outside the recomputed part
                t = self._ckpt(enc.tokens, enc.preprocess(flat, augment, generator), text)
            else:
                t = self._ckpt(self.encoders[k], flat, text)
            t = t.view(B, To, -1, t.shape[-1])  # (B, To, n_k, D)
            t = t + self.step_embed[self.n_obs_steps - To :, None, :] + self.type_embed[k]
            tokens.append(t.flatten(1, 2))  # (B, To n_k, D)
        readout = [] if self.readout is None else [self.readout.expand(B, 1, -1)]
        seq = torch.cat([*readout, *tokens], dim=1)  # (B, [1 +] L, D)
        for layer in self.layers:
            seq = self._ckpt(layer, seq)
        if seq.shape[1] != self.n_tokens:
            r = len(readout)
            raise ValueError(
                f"observation gives {seq.shape[1] - r} tokens, the policy expects {self.n_tokens - r} "
                f"(To={self.n_obs_steps} steps of every modality)"
            )
        out = seq.flatten(1)  # (B, n_tokens D): the readout (attention) and every modality token
        if q is not None:
            if self.readout is None:  # concat: the instruction's vector itself
                text = q[:, 0].to(out.dtype)
            else:  # attention: the instruction attends to the fused tokens
                text = self._ckpt(self.cross, q.to(seq.dtype), seq).flatten(1)  # (B, k D)
            out = torch.cat([out, text], dim=-1)
        return self.head(out)
