"""Typed configuration: one dataclass per component, validated once in ``__post_init__``.

YAML files under ``conf/`` only compose and override these. Every dataclass is registered in Hydra's
ConfigStore by :func:`register_configs` (called by the entry points; this module itself never imports Hydra
so that library code can build configs in plain Python).

Symbols follow DESIGN.md: B batch, To observation history, Ta action horizon, Da action dimension,
Te executed actions per decision, K denoising steps, K' fine-tuned steps, T decisions per iteration.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

MISSING_PATH = ""


def _choice(name: str, value: Any, allowed: tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if allow_zero and value < 0 or not allow_zero and value <= 0:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name}={value!r} is out of range; it must be {bound}")


def check_splits(val_seed: int, val_episodes: int, test_seed: int, test_episodes: int) -> None:
    """ValueError when the validation and test seed ranges are negative or overlap."""
    _positive("val_seed", val_seed, allow_zero=True)
    _positive("val_episodes", val_episodes, allow_zero=True)
    _positive("eval_seed", test_seed, allow_zero=True)
    if (
        val_episodes
        and test_episodes
        and val_seed < test_seed + test_episodes
        and test_seed < val_seed + val_episodes
    ):
        raise ValueError(
            f"validation seeds {val_seed}..{val_seed + val_episodes - 1} overlap the test seeds "
            f"{test_seed}..{test_seed + test_episodes - 1}; choose disjoint val_seed and eval_seed"
        )


def default_cache_dir() -> str:
    """Where demonstrations and BC checkpoints are cached: ``$DIFFPOLICY_CACHE``, else ``runs/cache``."""
    return os.environ.get("DIFFPOLICY_CACHE") or "runs/cache"


def _unit(name: str, value: float, *, open_low: bool = False) -> None:
    low_ok = value > 0 if open_low else value >= 0
    if not (low_ok and value <= 1):
        low = "(0" if open_low else "[0"
        raise ValueError(f"{name}={value!r} is out of range; it must lie in {low}, 1]")


ENV_RUNTIME_FIELDS = ("num_envs", "vectorization", "workers")
"""EnvConfig fields that say how environments run, not what they hold: left out of the demonstration cache
key, and given their defaults when a checkpoint written before they existed lacks them."""
ENV_FIELDS_ADDED = {"task": ""}
"""EnvConfig fields added after checkpoints and caches existed -> their default: left out of the cache keys
while at it (so existing caches keep their keys), and given it when an older checkpoint lacks them."""

VAL_SEED = 100_000
"""First validation seed: every choice (settings, sweeps, reachability, rollback) reads episodes from here."""
TEST_SEED = 1_000_000
"""First test seed: the reported figure, evaluated once at the end; disjoint from the demonstrations (0, 1,
...), validation (100 000 + i) and training rollouts (10 000 000 and above). Figures reported before the split
(docs/experiments.md, before 2026-12-02) were measured on 100 000 + i, the seeds settings were chosen on."""


PICK_WORKSPACE = ([-0.1, -0.45, -0.05], [0.8, 0.45, 0.6])
"""MujocoPick's point workspace (robot base frame, m): the corners point positions are scaled from."""

OBS_MODE_DEFAULTS: dict[str, dict[str, Any]] = {
    "state": {
        "policy.encoder.use_state": True,
        "policy.encoder.workspace_low": PICK_WORKSPACE[0],
        "policy.encoder.workspace_high": PICK_WORKSPACE[1],
        "bc.epochs": 80,
        "bc.steps": 0,
        "bc.batch_size": 128,
        "bc.n_demos": 40,
        "bc.target_aux_weight": 0.0,
        "bc.translate": 0.0,
        "bc.translate_state": False,
    },
    "multimodal": {
        "policy.encoder.workspace_low": PICK_WORKSPACE[0],
        "policy.encoder.workspace_high": PICK_WORKSPACE[1],
        "policy.encoder.use_state": False,
        "bc.epochs": 18,
        "bc.steps": 0,
        "bc.batch_size": 64,
        "bc.n_demos": 100,
        "bc.target_aux_weight": 1.0,
        "bc.translate": 0.0,
        "bc.translate_state": False,
    },
}
"""``env.obs_mode`` -> the values its null fields are derived to, the best BC recipe measured on mujoco_pick
(docs/experiments.md). state: 80 epochs of batch 128 with the state token (2026-11-30, the imprecise
demonstrator: 0.89-0.90 held-out against 0.73 at 40 epochs) on 40 precise demonstrations, the default task,
whose BC (0.795) algo=filtered_bc lifts to 0.98 (2026-12-01, the pick task's figure). multimodal: 100
demonstrations, no proprioception token, 18 epochs of batch 64 and the auxiliary target loss (2026-12-01
late: 1.00 held-out over 200 seeds in 1962 steps, 26 min on a slow 2-core machine; 0.99 at 40 epochs; 0.71 at
40 without the auxiliary loss, 0.025 with the state token).
A component built without an environment (``EncoderConfig()``, ``BCConfig()`` in Python) takes the state
values."""

ENV_DEFAULTS: dict[str, dict[str, Any]] = {
    "metaworld": {
        "policy.encoder.use_state": True,
        "policy.encoder.workspace_low": [-0.7, 0.2, 0.0],
        "policy.encoder.workspace_high": [0.7, 1.2, 0.7],
        "bc.epochs": 100,
        "bc.steps": 3000,
        "bc.batch_size": 64,
        "bc.n_demos": 10,
        "bc.target_aux_weight": 1.0,
    },
    "metaworld:multimodal": {
        "bc.translate": 0.1,
        "bc.translate_state": True,
    },
}
"""``env.name`` -> derived values that replace :data:`OBS_MODE_DEFAULTS`' for that environment, in either obs
mode (``<env.name>:<obs_mode>``: in that mode only). metaworld, the same for all 50 tasks, chosen on the
validation seeds of two development tasks, assembly and coffee-push (docs/experiments.md, 2026-12-02): DP3's 10
demonstrations; the proprioception token (hand and finger pads only, DP3's ``agent_pos``: no object pose); the
workspace is the env's point crop (world frame, ``diffpolicy_envs.meta_world.POINT_BOX_*``); 3000 optimiser
steps of batch 64 whatever the demonstrations' length (coffee-push 0.16 at 800 steps -> 0.36 at 3000); the
auxiliary target loss on the task's goal (``env.kwargs.label: goal``, the env's privileged label: assembly
0.18 without it -> 0.96); multimodal only: the scene shifted by up to 10 cm in x and y with the proprioception
and the label (``bc.translate``: coffee-push 0.36 -> 0.46 at 5 cm -> 0.56 at 10 cm, assembly 1.00 at both),
since 10 placements alone let BC memorise its scenes (10 of 10 training seeds, 0.36 validation) where the
39-D state policy generalises (0.94)."""


def _derive_state_defaults(cfg: Any, prefix: str) -> None:
    """Give ``cfg``'s null :data:`OBS_MODE_DEFAULTS` fields (``<prefix>.<name>``) their state values and note
    their names in ``cfg._derived`` (a slot, so outside ``asdict`` and ``vars``), so that a config holding an
    environment (:func:`derive_from_obs_mode`) derives them again from its ``env.obs_mode`` while a value that
    was set stays."""
    derived = []
    for path, value in OBS_MODE_DEFAULTS["state"].items():
        owner, _, name = path.rpartition(".")
        if owner == prefix and getattr(cfg, name) is None:
            setattr(cfg, name, list(value) if isinstance(value, list) else value)
            derived.append(name)
    cfg._derived = frozenset(derived)


@dataclass
class EnvConfig:
    """Which environment to train on and how to run it."""

    name: str = "mujoco_pick"
    """Config-group entry: mujoco_pick | obstacle_reach | hopper (Gymnasium's Hopper-v5, demonstrated by a
    medium-quality PPO actor) | metaworld (any of Meta-World's 50 v3 tasks, ``env.task``) | gym."""
    task: str = ""
    """env=metaworld: the v3 task (``stick-pull`` or ``stick-pull-v3``; the 50 names are
    ``diffpolicy_envs.meta_world.TASKS``); unused by the other environments."""
    id: str = "diffpolicy_envs:MujocoPick-v0"
    """gymnasium id passed to ``gymnasium.make``."""
    num_envs: int = 4
    """Parallel environments per process (B during rollouts)."""
    vectorization: str = "sync"
    """Vector env: sync (all envs in this process) | async (the envs split over ``workers`` subprocesses,
    each stepping its share in turn; same results as sync)."""
    workers: int = 0
    """vectorization=async: worker processes (at most num_envs); 0 = one per CPU (``os.cpu_count()``)."""
    obs_mode: str = "multimodal"
    """multimodal (rgb, points, instruction, state) | state (state + target identity only)."""
    image_size: int = 84
    """Side of the square RGB observation in pixels."""
    n_points: int = 512
    """Points in the point-cloud observation (N)."""
    max_episode_steps: int = 120
    """Time limit in control steps."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments forwarded to the environment constructor."""
    expert: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the scripted expert that records the demonstrations (MujocoPick: ``place_bias``
    (x, y) and ``place_noise``, in metres, the constant and per-episode offsets of an imprecise
    demonstrator's release point; ``max_speed``, metres per step, a cautious demonstrator's tool speed)."""
    demo_failures: bool = False
    """Keep the expert's failed episodes in the demonstration set (its whole record, like D4RL's medium
    datasets); false keeps only successes. Behaviour cloning skips failed episodes either way."""

    def __post_init__(self) -> None:
        _choice("env.name", self.name, ("mujoco_pick", "obstacle_reach", "hopper", "metaworld", "gym"))
        if self.name == "metaworld":
            from diffpolicy_envs.meta_world import TASKS, task_name

            if not self.task:
                raise ValueError(
                    f"env=metaworld needs env.task=<name>, one of Meta-World's 50 v3 tasks: {', '.join(TASKS)}"
                )
            self.task = task_name(self.task)
        _choice("env.vectorization", self.vectorization, ("sync", "async"))
        _choice("env.obs_mode", self.obs_mode, ("multimodal", "state"))
        if not self.id:
            raise ValueError("env.id is empty; give a gymnasium id such as Pendulum-v1")
        _positive("env.num_envs", self.num_envs)
        _positive("env.workers", self.workers, allow_zero=True)
        _positive("env.image_size", self.image_size)
        _positive("env.n_points", self.n_points)
        _positive("env.max_episode_steps", self.max_episode_steps)


@dataclass
class EncoderConfig:
    """Observation encoders and their fusion into one conditioning vector."""

    __slots__ = ("__dict__", "__weakref__", "_derived")  # _derived: not a field, and not in vars() either

    use_rgb: bool = True
    """Encode the RGB image (ignored when the environment has no ``rgb``)."""
    use_points: bool = True
    """Encode the coloured, voxelised point cloud (ignored when the environment has no ``points``)."""
    use_text: bool = True
    """Encode the instruction with the frozen MiniLM (ignored when the environment has no ``instruction``)."""
    blank_text: bool = False
    """Ablation: the encoder reads every instruction as the empty string, in training and when acting (the
    architecture stays, the named cube is no longer given): what the text is for."""
    use_state: bool | None = None
    """Encode the proprioceptive ``state`` (its normaliser is fitted either way: the residual head reads it).
    Null: derived from ``env.obs_mode`` (:data:`OBS_MODE_DEFAULTS`): true for state, false for multimodal,
    where the state token let BC skip locating the named cube (0.025 held-out with it, 0.71 without)."""
    rgb_channels: list[int] = field(default_factory=lambda: [16, 32, 64])
    """Channels of the ResNet-style RGB stages."""
    rgb_keypoints: int = 32
    """Spatial-softmax keypoints of the RGB encoder."""
    random_shift: int = 4
    """Pixels of random-shift augmentation during training (0 disables)."""
    point_channels: list[int] = field(default_factory=lambda: [32, 64, 128])
    """Widths of the shared per-point MLP (DP3-style), max-pooled over the points."""
    point_keypoints: int = 16
    """Point keypoints: softmax-weighted mean positions over the points (0 disables)."""
    workspace_low: list[float] | None = None
    """Lower corner of the workspace box (the points' frame, m) that point positions are scaled from. Null:
    derived from the environment (:data:`OBS_MODE_DEFAULTS`, :data:`ENV_DEFAULTS`): MujocoPick's
    [-0.1, -0.45, -0.05] (robot base frame), Meta-World's point crop [-0.7, 0.2, 0.0] (world frame)."""
    workspace_high: list[float] | None = None
    """Upper corner of the workspace box (m); null: derived as ``workspace_low`` (MujocoPick [0.8, 0.45, 0.6],
    Meta-World [0.7, 1.2, 0.7])."""
    token_dim: int = 128
    """Width of the per-modality tokens mixed by cross-modal attention."""
    fusion: str = "attention"
    """How the modality tokens become the condition: ``attention`` (a readout token and the tokens through
    ``fusion_layers`` self-attention blocks, the instruction attending to them) or ``concat`` (the tokens and
    the instruction's vector concatenated as they are, DP3's and diffusion_policy's fusion)."""
    fusion_heads: int = 4
    """Attention heads in the fusion block."""
    fusion_layers: int = 1
    """Cross-modal attention layers."""
    state_hidden: int = 128
    """Hidden width of the proprioception MLP."""
    text_film: bool = True
    """The instruction FiLM-modulates the RGB encoder's and the point encoder's features (language-conditioned
    perception), so their keypoints can follow the object it names; without it the text only attends to the
    fused tokens."""

    def __post_init__(self) -> None:
        _derive_state_defaults(self, "policy.encoder")
        if len(self.rgb_channels) == 0:
            raise ValueError("policy.encoder.rgb_channels is empty; give at least one stage width")
        _positive("policy.encoder.rgb_keypoints", self.rgb_keypoints)
        _positive("policy.encoder.random_shift", self.random_shift, allow_zero=True)
        if len(self.point_channels) == 0:
            raise ValueError("policy.encoder.point_channels is empty; give at least one MLP width")
        _positive("policy.encoder.point_keypoints", self.point_keypoints, allow_zero=True)
        _choice("policy.encoder.fusion", self.fusion, ("attention", "concat"))
        if len(self.workspace_low) != 3 or len(self.workspace_high) != 3:
            raise ValueError("policy.encoder.workspace_low/high must each have 3 values (x, y, z in m)")
        if any(lo >= hi for lo, hi in zip(self.workspace_low, self.workspace_high)):
            raise ValueError("policy.encoder.workspace_low must be below workspace_high on every axis")
        _positive("policy.encoder.token_dim", self.token_dim)
        _positive("policy.encoder.fusion_heads", self.fusion_heads)
        if self.token_dim % self.fusion_heads:
            raise ValueError(
                f"policy.encoder.token_dim={self.token_dim} must be divisible by fusion_heads={self.fusion_heads}"
            )
        _positive("policy.encoder.fusion_layers", self.fusion_layers)
        _positive("policy.encoder.state_hidden", self.state_hidden)


@dataclass
class PolicyConfig:
    """The diffusion policy: encoders, 1-D U-Net denoiser and DDPM/DDIM schedule."""

    name: str = "unet_small"
    """Config-group entry: unet_small | unet_large | gaussian (the MLP baseline)."""
    kind: str = "diffusion"
    """diffusion | gaussian (a Gaussian MLP baseline with the same encoders)."""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """Observation encoders."""
    cond_dim: int = 256
    """Width of the fused conditioning vector fed to every residual block."""
    denoiser: str = "unet"
    """unet (the conditional 1-D U-Net) | mlp (a residual MLP over the flattened chunk, DPPO's choice for
    state tasks: ``mlp_dims``, ``step_embed_dim``; ``down_dims``, ``kernel_size`` and ``n_groups`` unused)."""
    mlp_dims: list[int] = field(default_factory=lambda: [512, 512, 512])
    """Hidden widths of the MLP denoiser (``denoiser=mlp``)."""
    down_dims: list[int] = field(default_factory=lambda: [64, 128, 256])
    """Channel widths of the U-Net levels."""
    kernel_size: int = 5
    """Temporal convolution kernel of the U-Net."""
    n_groups: int | None = None
    """GroupNorm groups in the U-Net (null: the largest count up to 8 that divides every width of
    ``down_dims``; 8 for the shipped U-Nets)."""
    step_embed_dim: int = 128
    """Sinusoidal diffusion-step embedding width."""
    conditioning: str = "film"
    """film (per-channel scale and shift) | adanorm (normalise, then condition-predicted affine)."""
    horizon: int = 64
    """Ta: actions per sampled chunk."""
    n_obs_steps: int = 1
    """To: observation history steps."""
    n_action_steps: int | None = None
    """Te: actions of a chunk executed before replanning (null: 8, or Ta when the chunk is shorter)."""
    unexecuted_weight: float | None = None
    """Weight of the BC loss on the chunk's steps outside the executed window [To - 1, To - 1 + Te),
    relative to the executed ones (1: the plain mean over all Ta steps; 0: only executed steps are
    learned); the loss is divided by the weights' sum, so its scale stays that of a mean. Null: derived so
    that the executed steps carry half the loss, Te / (Ta - Te) rounded to 3 decimals, at most 1 (1 for the
    16-step chunks, 0.143 for 64-step ones: their BC 0.585 -> 0.87 held-out, docs/experiments.md 2026-12-01
    night)."""
    train_timesteps: int = 100
    """Diffusion steps of the DDPM training schedule."""
    ddim_steps: int | None = None
    """K: DDIM steps when sampling (null: 10, or ``train_timesteps`` when the schedule has fewer)."""
    ft_steps: int | None = None
    """K': last DDIM steps that PPO fine-tunes, K' <= K (null: ``ft_fraction`` of K, else all K steps, which
    fine-tunes the whole chain). A value given here wins over ``ft_fraction``."""
    ft_fraction: float | None = None
    """K' / K when ``ft_steps`` is null, in (0, 1]: K' = round(ft_fraction * K), at least 1 (DPPO's half
    chain: 0.5, so K' follows any ``ddim_steps``); null: K' = K."""
    min_std: float = 0.01
    """Lower bound on the std of every stochastic DDIM step (exploration), in normalised action units."""
    eta: float = 1.0
    """DDIM stochasticity for fine-tuned steps (0 = deterministic)."""
    clip_sample: float = 1.0
    """Predicted x0 is clipped to [-clip_sample, clip_sample]."""
    gaussian_hidden: list[int] = field(default_factory=lambda: [512, 512])
    """Hidden widths of the Gaussian MLP baseline."""
    freeze_encoders: bool = False
    """Keep encoder weights fixed (the text encoder is always frozen)."""
    grad_checkpointing: bool = False
    """Recompute encoder/denoiser activations in backward to save memory."""
    compile: bool = False
    """torch.compile the sampling loop where the backend allows."""
    init: str = MISSING_PATH
    """Start from this checkpoint instead of pre-training ('' = pre-train or reuse the cached one)."""

    def __post_init__(self) -> None:
        _choice("policy.kind", self.kind, ("diffusion", "gaussian"))
        _choice("policy.conditioning", self.conditioning, ("film", "adanorm"))
        _choice("policy.denoiser", self.denoiser, ("unet", "mlp"))
        if not self.mlp_dims or any(d <= 0 for d in self.mlp_dims):
            raise ValueError(f"policy.mlp_dims={self.mlp_dims} must be positive widths")
        if isinstance(self.encoder, dict):
            self.encoder = EncoderConfig(**self.encoder)
        if not self.down_dims:
            raise ValueError("policy.down_dims is empty; give at least one level width")
        if any(d <= 0 for d in self.down_dims):
            raise ValueError(f"policy.down_dims={self.down_dims} must be positive widths")
        if self.n_groups is None:  # derived: GroupNorm needs a count that divides every width
            self.n_groups = max(g for g in range(1, 9) if all(d % g == 0 for d in self.down_dims))
        _positive("policy.n_groups", self.n_groups)
        if any(d % self.n_groups for d in self.down_dims):
            raise ValueError(
                f"policy.down_dims={self.down_dims} must be multiples of policy.n_groups={self.n_groups}"
            )
        _positive("policy.cond_dim", self.cond_dim)
        if self.kernel_size <= 0 or self.kernel_size % 2 == 0:
            raise ValueError(f"policy.kernel_size={self.kernel_size} must be a positive odd number")
        _positive("policy.horizon", self.horizon)
        if self.denoiser == "unet" and self.horizon % (2 ** (len(self.down_dims) - 1)):
            raise ValueError(
                f"policy.horizon={self.horizon} must be divisible by 2^(len(policy.down_dims)-1)="
                f"{2 ** (len(self.down_dims) - 1)}"
            )
        _positive("policy.n_obs_steps", self.n_obs_steps)
        if self.n_action_steps is None:
            self.n_action_steps = min(8, self.horizon)
        if not 0 < self.n_action_steps <= self.horizon:
            raise ValueError(
                f"policy.n_action_steps={self.n_action_steps} must lie in [1, horizon={self.horizon}]"
            )
        if self.unexecuted_weight is None:  # derived: the executed steps carry half of the loss
            rest = self.horizon - self.n_action_steps
            self.unexecuted_weight = (
                1.0 if rest <= self.n_action_steps else round(self.n_action_steps / rest, 3)
            )
        _unit("policy.unexecuted_weight", self.unexecuted_weight)
        _positive("policy.train_timesteps", self.train_timesteps)
        if self.ddim_steps is None:
            self.ddim_steps = min(10, self.train_timesteps)
        if not 0 < self.ddim_steps <= self.train_timesteps:
            raise ValueError(
                f"policy.ddim_steps={self.ddim_steps} must lie in [1, train_timesteps={self.train_timesteps}]"
            )
        if self.ft_fraction is not None:
            _unit("policy.ft_fraction", self.ft_fraction, open_low=True)
        if self.ft_steps is None:  # derived from K, so that any ddim_steps works
            share = 1.0 if self.ft_fraction is None else self.ft_fraction
            self.ft_steps = min(self.ddim_steps, max(1, math.floor(share * self.ddim_steps + 0.5)))
        if not 0 < self.ft_steps <= self.ddim_steps:
            raise ValueError(f"policy.ft_steps={self.ft_steps} must lie in [1, ddim_steps={self.ddim_steps}]")
        _positive("policy.min_std", self.min_std)
        _unit("policy.eta", self.eta)
        _positive("policy.clip_sample", self.clip_sample)


@dataclass
class BCConfig:
    """Behaviour cloning (``bc.*``), before any fine-tuning: from the scripted expert's demonstrations, or from
    a dataset on disk (``bc.demos``)."""

    __slots__ = ("__dict__", "__weakref__", "_derived")  # _derived: not a field, and not in vars() either

    epochs: int | None = None
    """Epochs over the demonstrations (null: derived from ``env.obs_mode``, :data:`OBS_MODE_DEFAULTS`).
    state: 80; on mujoco_pick's imprecise demo set (3040 steps, ~9 min on 2 cores) held-out success was 0.90
    at 80 epochs against 0.73 at 40, whose failures were mostly missed grasps: 40 epochs left BC
    under-trained. multimodal: 18 (1962 steps of batch 64 with the auxiliary target loss: 1.00 held-out, 0.99
    at 40 epochs)."""
    steps: int | None = None
    """Optimiser steps of behaviour cloning; when positive it is the budget and ``bc.epochs`` is ignored (the
    windows are reshuffled every pass and the last pass stops mid-way), so that tasks whose demonstrations
    are short get the same training as the others. 0: ``bc.epochs`` passes. Null: derived from ``env.name``
    and ``env.obs_mode`` (:data:`ENV_DEFAULTS`, :data:`OBS_MODE_DEFAULTS`)."""
    batch_size: int | None = None
    """Batch size in windows (null: derived from ``env.obs_mode``: 128 for state, 64 for multimodal, the
    batches of the measured runs, :data:`OBS_MODE_DEFAULTS`)."""
    lr: float = 1e-3
    """Peak learning rate (AdamW, linear warm-up then cosine decay)."""
    max_grad_norm: float = 10.0
    """Gradient clipping by global norm (0 disables); a safety net, separate from PPO's ``algo.max_grad_norm``
    (1.0 slowed behaviour cloning down several-fold)."""
    ema_decay: float = 0.995
    """EMA decay of the weights; the EMA copy is what is saved and evaluated."""
    n_demos: int | None = None
    """Demonstration episodes collected from the scripted expert (with ``bc.demos``: every episode of the
    dataset is used instead). Null: derived from ``env.obs_mode`` (:data:`OBS_MODE_DEFAULTS`): 40 for state
    (BC 0.795 on mujoco_pick, fine-tuned to 0.95), 100 for multimodal (its measured recipe: 1.00 held-out)."""
    demos: str = ""
    """Clone these demonstrations instead of the scripted expert's: a robomimic-style HDF5 file
    (``data/demo_N/{obs/<key>, actions, rewards, dones}``), a local Minari dataset (``minari:ID``, or its
    directory) or a dataset in this project's format (:mod:`diffpolicy.demos`); '' collects from the expert.
    Checked against the environment's spaces and converted into the cache once."""
    noise_draws: int = 1
    """(step, noise) draws of the denoising loss per encoded observation: the encoders run once per window
    and the denoiser on ``noise_draws`` noised copies of its chunk (lower-variance encoder gradients, at the
    denoiser's cost only)."""
    target_aux_weight: float | None = None
    """Weight of an auxiliary loss during BC: an MLP head on the condition predicts the named object's
    position (the demonstrations' privileged ``target_pos``, scaled to the encoder's workspace box; mean
    squared error), so the encoders must locate what the instruction names. Training-time only: the head is
    not part of the saved policy. 0 disables; needs demonstrations that record ``target_pos`` (MujocoPick).
    Null: derived from ``env.obs_mode`` (:data:`OBS_MODE_DEFAULTS`): 0 for state (the state holds the
    target's position), 1 for multimodal (0.99 held-out against 0.71 without, docs/experiments.md 2026-12-01 late)."""
    translate: float | None = None
    """Scene translation augmentation (m): every window's observed positions -- the points' xyz, the
    privileged label and, with ``bc.translate_state``, the state -- are shifted by one offset drawn
    uniformly from [-translate, translate] in x and y, the actions kept. Valid where actions are
    displacements that depend on relative positions only (Meta-World's hand deltas and its scripted
    policies), so that 10 demonstrations show many placements; the RGB image is not shifted. 0 disables.
    Null: derived (:data:`ENV_DEFAULTS`; 0 elsewhere)."""
    translate_state: bool | None = None
    """``bc.translate``: the state token is xyz triples in the points' frame (Meta-World's 9-D
    proprioception: hand and finger pads) and is shifted with them; false leaves it as recorded. Null:
    derived, as ``bc.translate``."""
    obs_keys: dict[str, list[str]] = field(default_factory=dict)
    """``bc.demos``: environment observation key -> the dataset's keys whose per-step values, flattened and
    concatenated in this order, form it (``+bc.obs_keys.state=[qpos,qvel]``); a key not named here is read
    from the dataset key of the same name."""

    def __post_init__(self) -> None:
        _derive_state_defaults(self, "bc")
        for name in ("epochs", "batch_size", "n_demos"):
            _positive(f"bc.{name}", getattr(self, name))
        _positive("bc.steps", self.steps, allow_zero=True)
        for key, sources in self.obs_keys.items():
            if not sources:
                raise ValueError(f"bc.obs_keys.{key} is empty; name the dataset keys that form {key!r}")
        _positive("bc.lr", self.lr)
        _positive("bc.max_grad_norm", self.max_grad_norm, allow_zero=True)
        _positive("bc.noise_draws", self.noise_draws)
        _positive("bc.target_aux_weight", self.target_aux_weight, allow_zero=True)
        _positive("bc.translate", self.translate, allow_zero=True)
        _unit("bc.ema_decay", self.ema_decay)


@dataclass
class LearnerConfig:
    """What every learner reads (``algo.*``): its name, how long it runs, its step size and the rollback guard.

    Each learner has its own subclass and YAML under ``conf/algo/`` (whose ``defaults`` name the schema), so
    ``algo=<learner> --cfg job`` shows only the fields that learner reads, and a field of another learner is
    an unknown key.
    """

    name: str = "learner"
    """Config-group entry."""
    head: str = "chain"
    """What is trained: chain (PPO on the last K' denoising steps, DPPO) | residual (the diffusion policy
    frozen, a Gaussian MLP correcting each control step's action) | filtered_bc (BC continued on the policy's
    own successful episodes, rl/filtered_bc.py) | fpo (PPO with the denoising-loss ratio, rl/fpo.py)."""
    iterations: int = 60
    """Iterations (rollout + update)."""
    lr: float = 1e-4
    """Learning rate of what is trained (the denoiser, the residual head, the whole policy)."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 disables)."""
    rollback_drop: float = 0.3
    """Roll back to the last stable checkpoint when the judged success rate (``algo.rollback_episodes``)
    falls this far below its best."""
    rollback_episodes: int = 0
    """What the rollback guard judges at each checkpoint: 0, the training rollouts' episodes since the last
    checkpoint (seeds 10 000 000 + ..., free); n > 0, n validation episodes (seeds ``val_seed`` + i, the same
    n every time, the held-out protocol), at the cost of their env steps, which the summary counts apart."""

    judged_noise_free: ClassVar[bool] = False
    """The learner's policy acts with every DDIM step's mean, so BC and its result are judged that way
    (:func:`diffpolicy.evaluation.held_out`); a class constant of the learner, not a field."""

    def __post_init__(self) -> None:
        _choice("algo.head", self.head, HEADS)
        _positive("algo.rollback_episodes", self.rollback_episodes, allow_zero=True)
        _positive("algo.iterations", self.iterations)
        _positive("algo.lr", self.lr)
        _positive("algo.max_grad_norm", self.max_grad_norm, allow_zero=True)
        _unit("algo.rollback_drop", self.rollback_drop)


HEADS = ("chain", "residual", "filtered_bc", "fpo")
"""The learners' heads (``algo.head``)."""


@dataclass
class PPOConfig(LearnerConfig):
    """The fields of every PPO learner (chain and residual heads): rollout size, critic, GAE, clipping."""

    n_steps: int = 16
    """T: decisions (chain) or control steps (residual) per environment per iteration."""
    update_epochs: int = 4
    """Passes over each iteration's rollout."""
    minibatch_size: int = 64
    """Samples per minibatch."""
    critic_lr: float = 3e-4
    """Critic learning rate."""
    gamma: float = 0.99
    """Discount between decisions (chain) or control steps (residual)."""
    gae_lambda: float = 0.95
    """GAE lambda."""
    advantage: str = "gae"
    """gae (critic + GAE) | grpo (chain only: group-relative, G envs share a seed, no critic)."""
    clip_eps: float = 0.01
    """PPO clip range (chain: at the first fine-tuned denoising step)."""
    norm_adv: bool = True
    """Normalise advantages per minibatch."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    target_kl: float = 0.05
    """Stop the update epochs early when the approximate KL exceeds this (0 disables)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("algo.advantage", self.advantage, ("gae", "grpo"))
        for name in ("n_steps", "update_epochs", "minibatch_size", "critic_lr", "clip_eps"):
            _positive(f"algo.{name}", getattr(self, name))
        for name in ("vf_coef", "target_kl"):
            _positive(f"algo.{name}", getattr(self, name), allow_zero=True)
        for name in ("gamma", "gae_lambda"):
            _unit(f"algo.{name}", getattr(self, name))


@dataclass
class ChainConfig(PPOConfig):
    """PPO on the last K' denoising steps of the diffusion policy (``algo=ppo | grpo | dppo``)."""

    name: str = "ppo"
    clip_eps_final: float | None = None
    """Clip range at the final denoising step (linear from ``clip_eps`` in between); null = ``clip_eps``."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    denoise_gamma: float = 1.0
    """Discount along the denoising steps (1 = none)."""
    logprob_min_std: float = 0.0
    """Floor on the std of the Gaussians in the PPO ratio's log-probs (DPPO's min_logprob_denoising_std);
    0 uses the exact sampling std. With a small sampling floor the last steps' log-probs dominate the
    gradient with noise that barely changes the outcome; a floor of 0.1 weighs all steps alike."""
    logprob_clamp: list[float] = field(default_factory=list)
    """[low, high] clamp of every per-element (one action entry of one step) log-prob, in nats, before the
    average over the executed Te x Da entries (DPPO: [-5, 2]); [] disables."""
    noise_clip: float = 0.0
    """Clamp of each standard-normal draw z of a stochastic DDIM step to [-noise_clip, noise_clip], in units
    of that step's std, before x = mean + std z (DPPO's randn_clip_value: 3); 0 disables."""
    clip: str = "ppo"
    """ppo (min of clipped and unclipped surrogate) | unconditional (StableDRL: always clip the ratio)."""
    normalize: str = "mean"
    """mean (average over samples) | self (self-normalised weights: divide by the sum of clipped ratios)."""
    group_size: int = 4
    """G: environments per group for algo.advantage=grpo."""
    group_std: bool = True
    """algo.advantage=grpo: divide each group's centred returns by the group's std (False: Dr. GRPO, centre
    only, so groups whose returns barely differ weigh little)."""
    critic_warmup: int = 0
    """algo.advantage=gae: iterations at the start that train only the critic (DPPO's n_critic_warmup_itr), so
    that the first policy updates do not follow the advantages of an untrained value function."""
    reg: str = "none"
    """Regulariser toward the pre-trained policy, on the minibatch's stored chains: none | kl (closed-form KL of
    each step's Gaussians, which share their std: squared mean gap / 2 sigma^2) | bc (squared gap between the
    step means and the frozen pre-trained policy's, unscaled by sigma)."""
    reg_coef: float = 0.0
    """Weight of the regulariser."""
    grad_monitor_window: int = 20
    """Updates in the gradient-norm z-score window."""
    grad_spike_sigma: float = 3.0
    """Warn when the gradient norm's z-score exceeds this."""
    finetune_encoders: bool = False
    """PPO also updates the observation encoders (re-encodes every minibatch: several times slower on a CPU);
    when False the encoders stay as pre-trained and the update reuses each decision's stored condition."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head != "chain":
            raise ValueError(f"algo.head={self.head!r}: a chain learner's head is chain")
        if self.clip_eps_final is None:
            self.clip_eps_final = self.clip_eps
        _positive("algo.clip_eps_final", self.clip_eps_final)
        _choice("algo.clip", self.clip, ("ppo", "unconditional"))
        _choice("algo.normalize", self.normalize, ("mean", "self"))
        _choice("algo.reg", self.reg, ("none", "kl", "bc"))
        _positive("algo.group_size", self.group_size)
        _positive("algo.grad_monitor_window", self.grad_monitor_window)
        _positive("algo.grad_spike_sigma", self.grad_spike_sigma)
        for name in ("weight_decay", "reg_coef", "logprob_min_std", "noise_clip", "critic_warmup"):
            _positive(f"algo.{name}", getattr(self, name), allow_zero=True)
        clamp = list(self.logprob_clamp)
        if clamp and not (len(clamp) == 2 and clamp[0] < clamp[1]):
            raise ValueError(
                f"algo.logprob_clamp={clamp} is not allowed; give [] (off) or [low, high] with low < high"
            )
        _unit("algo.denoise_gamma", self.denoise_gamma)


@dataclass
class ResidualConfig(PPOConfig):
    """Residual PPO over control steps on the frozen BC policy (``algo=residual``)."""

    name: str = "residual"
    head: str = "residual"
    judged_noise_free: ClassVar[bool] = True  # its base samples every DDIM step's mean
    residual_alpha: float = 0.1
    """Bound of the correction alpha * tanh(u), env action units ([-1, 1] per dimension)."""
    residual_hidden: list[int] = field(default_factory=lambda: [256, 256])
    """Hidden widths of the residual's mean network and of its critic."""
    residual_init_std: float = 0.2
    """Initial std of u (before the tanh); alpha * std is the initial action noise."""
    ent_coef: float = 0.0
    """Weight of the Gaussian's entropy bonus."""
    residual_l2: float = 0.0
    """Weight of the pull toward the base policy, mean ||tanh(mu)||^2 of the correction."""
    residual_update: str = "trust_region"
    """trust_region (one step down the policy gradient pooled over the batches gathered since the policy last
    moved, sized to w * max_drift of executed-action change) | ppo (clipped PPO epochs on each batch at Adam
    learning rate lr * w)."""
    signal_shuffles: int = 4
    """Reference advantages (sign flips or shuffles) whose RMS drift is the noise level of
    ``losses/signal_drift``."""
    signal_reference: str = "signs"
    """signs (flip each advantage's sign at random: every sample keeps its own |A|) | shuffle (permute the
    advantages over the batch)."""
    signal_scaled_lr: bool = True
    """Scale the actor's learning rate by w = clamp(1 - (signal_margin / signal_drift)^2, 0, 1) each update,
    so updates without evidence do not move the policy (false: always the full lr)."""
    signal_margin: float = 1.25
    """signal_drift at and below which w = 0 (1 = plain James-Stein shrinkage)."""
    max_drift: float = 0.01
    """Trust region, largest RMS change of the executed correction per update (env action units; 0
    disables)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head != "residual":
            raise ValueError(f"algo.head={self.head!r}: the residual learner's head is residual")
        if self.advantage != "gae":
            raise ValueError(
                f"algo.head=residual needs algo.advantage=gae (a critic), got {self.advantage!r}"
            )
        _positive("algo.residual_alpha", self.residual_alpha)
        _positive("algo.residual_init_std", self.residual_init_std)
        if not self.residual_hidden or any(h <= 0 for h in self.residual_hidden):
            raise ValueError(f"algo.residual_hidden={self.residual_hidden} must be positive widths")
        _choice("algo.residual_update", self.residual_update, ("trust_region", "ppo"))
        _choice("algo.signal_reference", self.signal_reference, ("signs", "shuffle"))
        _positive("algo.signal_shuffles", self.signal_shuffles)
        _positive("algo.signal_margin", self.signal_margin)
        for name in ("ent_coef", "residual_l2", "max_drift"):
            _positive(f"algo.{name}", getattr(self, name), allow_zero=True)


@dataclass
class FilteredBCConfig(LearnerConfig):
    """Success-filtered self-imitation (``algo=filtered_bc``): roll out, keep the successes, continue BC."""

    name: str = "filtered_bc"
    head: str = "filtered_bc"
    judged_noise_free: ClassVar[bool] = True  # its rollouts act noise-free by default (algo.explore)
    iterations: int = 10
    lr: float = 3e-4
    max_grad_norm: float = 10.0
    round_episodes: int = 192
    """Episodes rolled out per round (iteration), on fresh training scenes."""
    bc_steps: int = 400
    """BC optimiser steps per round on the demonstrations + kept successes (batch ``batch_size``)."""
    batch_size: int | None = None
    """Windows per continuation step (null: ``bc.batch_size``, the batch the base was cloned with)."""
    explore: str = "chunk"
    """How rollouts sample: chunk (the deterministic chain plus Gaussian action noise of std ``explore_std``
    drawn once per decision and held over its executed steps: reaches 55 % of the scenes the deterministic
    20-demonstration BC fails, and lifted the 40-demonstration BC 0.795 -> 0.98 in 10 rounds, docs/experiments.md)
    | chain (the stochastic chain: reaches 40 %; 0.465 -> 0.585 in 12 rounds from 20 demonstrations) |
    deterministic (every DDIM step's mean, as evaluated: collects only scenes the policy already solves)."""
    explore_std: float = 0.05
    """``explore=chunk``: std of the held action noise, env units (actions are clipped to [-1, 1])."""
    keep: str = "auto"
    """Which of a round's episodes are imitated: success (those that reached the goal) | top (the
    ``keep_fraction`` of the round's episodes with the highest return: %BC, for envs without a success notion
    such as Hopper) | auto (success where the env reports it, else top)."""
    keep_fraction: float = 0.25
    """``keep=top``: the fraction of each round's episodes kept, by return (at least one)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("algo.keep", self.keep, ("auto", "success", "top"))
        if not 0.0 < self.keep_fraction <= 1.0:
            raise ValueError(f"algo.keep_fraction={self.keep_fraction} must lie in (0, 1]")
        if self.head != "filtered_bc":
            raise ValueError(f"algo.head={self.head!r}: the filtered_bc learner's head is filtered_bc")
        _choice("algo.explore", self.explore, ("deterministic", "chain", "chunk"))
        _positive("algo.explore_std", self.explore_std, allow_zero=True)
        _positive("algo.round_episodes", self.round_episodes)
        _positive("algo.bc_steps", self.bc_steps)
        if self.batch_size is not None:
            _positive("algo.batch_size", self.batch_size)


def as_learner(algo: Any) -> LearnerConfig:
    """``algo`` as its head's learner config: a bare :class:`LearnerConfig` (or a dict) becomes the
    :data:`LEARNERS` class of its ``head``, keeping the shared fields; a learner config is returned as is."""
    if isinstance(algo, dict):
        algo = dict(algo)
        _choice("algo.head", algo.get("head", "chain"), HEADS)
        return LEARNERS[algo.get("head", "chain")](**algo)
    if type(algo) is LearnerConfig:
        shared = {f.name: getattr(algo, f.name) for f in dataclasses.fields(LearnerConfig)}
        cls = LEARNERS[algo.head]
        if shared["name"] == LearnerConfig.name:
            shared["name"] = cls.name
        return cls(**shared)
    return algo


@dataclass
class FPOConfig(PPOConfig):
    """PPO with the denoising-loss ratio (``algo=fpo``, FPO): the whole denoiser trained with BC's loss."""

    name: str = "fpo"
    head: str = "fpo"
    mc_draws: int = 8
    """M: (t, eps) draws per decision in the ratio exp(mean_i [l_old(i) - l_theta(i)])."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head != "fpo":
            raise ValueError(f"algo.head={self.head!r}: the fpo learner's head is fpo")
        if self.advantage != "gae":
            raise ValueError(f"algo=fpo needs algo.advantage=gae (a critic), got {self.advantage!r}")
        _positive("algo.mc_draws", self.mc_draws)


LEARNERS: dict[str, type] = {
    "chain": ChainConfig,
    "fpo": FPOConfig,
    "residual": ResidualConfig,
    "filtered_bc": FilteredBCConfig,
}
"""Schema of each learner (``conf/algo/<x>.yaml`` names ``<schema>`` in its defaults): head -> dataclass,
registered as ``algo/<head>_schema``."""


@dataclass
class DeviceConfig:
    """Where to run and at which precision."""

    type: str = "auto"
    """auto (npu, then cuda, then cpu) | cpu | cuda | npu."""
    index: int = -1
    """Card index; -1 uses LOCAL_RANK under torchrun, else 0."""
    precision: str = "fp32"
    """fp32 | bf16 | fp16 autocast for encoders and denoiser (log-probs, losses, value head stay fp32)."""
    threads: int = 0
    """CPU intra-op threads (0 keeps torch's default)."""
    deterministic: bool = False
    """Ask torch for deterministic algorithms."""

    def __post_init__(self) -> None:
        _choice("device.type", self.type, ("auto", "cpu", "cuda", "npu"))
        _choice("device.precision", self.precision, ("fp32", "bf16", "fp16"))
        if self.index < -1:
            raise ValueError(f"device.index={self.index} must be -1 (auto) or a card number >= 0")
        _positive("device.threads", self.threads, allow_zero=True)


@dataclass
class DistConfig:
    """Data parallelism over processes started by torchrun."""

    name: str = "none"
    """Config-group entry: none | ddp | atlas800t."""
    mode: str = "none"
    """none (one process) | ddp (DistributedDataParallel over torchrun's processes)."""
    backend: str = "auto"
    """auto (from the device: hccl / nccl / gloo) | gloo | nccl | hccl."""
    timeout_s: int = 300
    """Collective timeout in seconds: a stuck rank fails the job after this long, never hangs it."""
    hccl_connect_timeout_s: int = 1200
    """HCCL_CONNECT_TIMEOUT on Ascend (s)."""
    hccl_buffsize_mb: int = 200
    """HCCL_BUFFSIZE on Ascend (MB per communication buffer)."""
    visible_devices: str = ""
    """ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES to export ('' leaves it alone)."""

    def __post_init__(self) -> None:
        _choice("dist.mode", self.mode, ("none", "ddp"))
        _choice("dist.backend", self.backend, ("auto", "gloo", "nccl", "hccl"))
        _positive("dist.timeout_s", self.timeout_s)
        _positive("dist.hccl_connect_timeout_s", self.hccl_connect_timeout_s)
        _positive("dist.hccl_buffsize_mb", self.hccl_buffsize_mb)


@dataclass
class LogConfig:
    """Where and how often to report."""

    tensorboard: bool = True
    """Write TensorBoard event files in the run directory."""
    progress: bool = True
    """Show a tqdm progress bar on long loops (rank 0, interactive or not)."""
    every: int = 1
    """Log metrics every this many iterations."""

    def __post_init__(self) -> None:
        _positive("log.every", self.every)


def derive_from_obs_mode(
    env: EnvConfig, policy: PolicyConfig, bc: BCConfig, demos: str = ""
) -> tuple[PolicyConfig, BCConfig]:
    """``(policy, bc)`` with the fields that were left null (:data:`OBS_MODE_DEFAULTS`) derived from
    ``env.obs_mode`` and, where it has its own (:data:`ENV_DEFAULTS`), ``env.name`` (then
    ``<env.name>:<env.obs_mode>``); a value set on the command line, in a YAML or in Python stays. Called by the configs that hold an environment and a BC
    (``train``, ``pretrain``), so ``env.obs_mode=multimodal`` alone gives the measured multimodal recipe. With
    demonstrations from elsewhere (``bc.demos``, or ``demos``) the auxiliary target loss is derived off: only
    the scripted expert records its privileged label."""
    values = {
        **OBS_MODE_DEFAULTS[env.obs_mode],
        **ENV_DEFAULTS.get(env.name, {}),
        **ENV_DEFAULTS.get(f"{env.name}:{env.obs_mode}", {}),
    }
    values = {k: list(v) if isinstance(v, list) else v for k, v in values.items()}
    encoder = {n: values[f"policy.encoder.{n}"] for n in getattr(policy.encoder, "_derived", ())}
    if encoder:
        policy = dataclasses.replace(policy, encoder=dataclasses.replace(policy.encoder, **encoder))
    changes = {n: values[f"bc.{n}"] for n in getattr(bc, "_derived", ())}
    if (bc.demos or demos) and "target_aux_weight" in changes:
        changes["target_aux_weight"] = 0.0  # a dataset from elsewhere has no privileged target label
    return policy, dataclasses.replace(bc, **changes) if changes else bc


@dataclass
class TrainConfig:
    """``python -m diffpolicy.train``: collect, pre-train, fine-tune with PPO, evaluate."""

    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algo: LearnerConfig = field(default_factory=LearnerConfig)
    """The learner: a :data:`LEARNERS` schema chosen by ``algo=<entry>`` (a bare LearnerConfig built in
    Python becomes its head's learner with defaults)."""
    bc: BCConfig = field(default_factory=BCConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)
    seed: int = 0
    """Base seed (rank r uses seed + 1000 r)."""
    resume: bool = False
    """Continue from the latest checkpoint in the run directory."""
    checkpoint_every: int = 5
    """Write a checkpoint every this many PPO iterations."""
    eval_episodes: int = 200
    """Test episodes (seeds ``eval_seed + i``), evaluated once for BC and once after fine-tuning: the
    reported figure, on seeds no choice reads."""
    eval_seed: int = TEST_SEED
    """First test seed (:data:`TEST_SEED`; disjoint from demonstration, validation and training seeds)."""
    val_episodes: int | None = None
    """Validation episodes (seeds ``val_seed + i``) evaluated beside the test ones: the figure every choice
    (a setting, a sweep, a round count) is made on; null: as many as ``eval_episodes``; 0 skips them."""
    val_seed: int = VAL_SEED
    """First validation seed (:data:`VAL_SEED`)."""
    eval_deterministic: bool = False
    """Evaluate every DDIM step's mean only, rather than the stochastic chain that the chain learner fine-tunes
    (the default, so that BC and PPO are judged as the policy that is trained). A residual head's base always
    samples deterministically. ``pretrain`` has the same field, evaluated the same way
    (:func:`diffpolicy.evaluation.held_out`), so their success rates compare."""
    cache_dir: str = ""
    """Where demonstrations and the pre-trained checkpoint are cached between runs ('' = $DIFFPOLICY_CACHE,
    else runs/cache)."""
    video_episodes: int = 2
    """Episodes recorded to mp4 after fine-tuning."""

    def __post_init__(self) -> None:
        if isinstance(self.env, EnvConfig):
            self.policy, self.bc = derive_from_obs_mode(self.env, self.policy, self.bc)
        self.cache_dir = self.cache_dir or default_cache_dir()
        _positive("seed", self.seed, allow_zero=True)
        _positive("checkpoint_every", self.checkpoint_every)
        _positive("eval_episodes", self.eval_episodes)
        _positive("video_episodes", self.video_episodes, allow_zero=True)
        if self.val_episodes is None:
            self.val_episodes = self.eval_episodes
        self.algo = as_learner(self.algo)
        val_used = max(self.val_episodes, self.algo.rollback_episodes)  # the guard reads the first n of them
        check_splits(self.val_seed, val_used, self.eval_seed, self.eval_episodes)
        if isinstance(self.algo, PPOConfig) and isinstance(self.env, EnvConfig):
            if self.algo.advantage == "grpo" and self.env.num_envs % self.algo.group_size:
                raise ValueError(
                    f"env.num_envs={self.env.num_envs} must be a multiple of algo.group_size={self.algo.group_size}"
                )


@dataclass
class CollectConfig:
    """``python -m diffpolicy.collect``: roll out the scripted expert and write a demonstration dataset."""

    env: EnvConfig = field(default_factory=EnvConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    n_episodes: int = 100
    """Demonstration episodes to record."""
    seed: int = 0
    """First episode seed (episode i uses seed + i)."""
    out: str = ""
    """Output: the dataset directory (format=native; '' writes ``demos`` in the run directory) or the HDF5 file
    (format=robomimic; '' writes ``demos.hdf5`` in the run directory)."""
    format: str = "native"
    """native (this project's chunked store) | robomimic (robomimic-style HDF5 for other tools; the native
    store is kept beside it in the run directory)."""
    keep_failures: bool | None = None
    """Also store episodes where the expert failed (null: the environment's ``env.demo_failures``; true or
    false overrides it)."""

    def __post_init__(self) -> None:
        _positive("n_episodes", self.n_episodes)
        _positive("seed", self.seed, allow_zero=True)
        _choice("format", self.format, ("native", "robomimic"))


@dataclass
class PretrainConfig:
    """``python -m diffpolicy.pretrain``: behaviour cloning from demonstrations."""

    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algo: LearnerConfig = field(default_factory=LearnerConfig)
    """The learner ``train`` would start from this BC (decides how BC is evaluated: as that learner acts)."""
    bc: BCConfig = field(default_factory=BCConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    log: LogConfig = field(default_factory=LogConfig)
    seed: int = 0
    """Seed for initialisation and batching."""
    demos: str = ""
    """The same as ``bc.demos`` (which ``train`` shares), kept for older command lines."""
    cache_dir: str = ""
    """Where demonstrations are cached between runs ('' = $DIFFPOLICY_CACHE, else runs/cache)."""
    eval_episodes: int = 0
    """Test episodes evaluated after training (0 skips them): the reported figure."""
    eval_seed: int = TEST_SEED
    """First test seed (:data:`TEST_SEED`), as ``train``'s."""
    val_episodes: int = 0
    """Validation episodes evaluated after training (0 skips them): what BC settings are chosen on."""
    val_seed: int = VAL_SEED
    """First validation seed (:data:`VAL_SEED`), as ``train``'s."""
    eval_deterministic: bool = False
    """As ``train``'s: every DDIM step's mean (always so with ``algo.head=residual``, whose base samples that
    way), else the stochastic chain the chain learner fine-tunes."""

    def __post_init__(self) -> None:
        if isinstance(self.env, EnvConfig):  # first: the replace below would make the derived values set ones
            self.policy, self.bc = derive_from_obs_mode(self.env, self.policy, self.bc, self.demos)
        self.cache_dir = self.cache_dir or default_cache_dir()
        self.algo = as_learner(self.algo)  # its class says how BC is judged (judged_noise_free)
        _positive("seed", self.seed, allow_zero=True)
        _positive("eval_episodes", self.eval_episodes, allow_zero=True)
        check_splits(self.val_seed, self.val_episodes, self.eval_seed, self.eval_episodes)
        if self.demos and isinstance(self.bc, BCConfig) and self.bc.demos != self.demos:
            if self.bc.demos:
                raise ValueError(
                    f"demos={self.demos} and bc.demos={self.bc.demos} differ; give only bc.demos"
                )
            self.bc = dataclasses.replace(self.bc, demos=self.demos)


@dataclass
class EvaluateConfig:
    """``python -m diffpolicy.evaluate``: success rate of a checkpoint on held-out seeds."""

    checkpoint: str = ""
    """Checkpoint directory to evaluate (required)."""
    n_episodes: int = 100
    """Episodes evaluated (seeds ``eval_seed + i``)."""
    num_envs: int = 4
    """Parallel environments."""
    split: str = "test"
    """Which seeds: test (:data:`TEST_SEED` + i, the reported figure, as ``train``'s test evaluation) | val
    (:data:`VAL_SEED` + i, the seeds choices are made on: the reachability measurement needs them)."""
    eval_seed: int | None = None
    """First seed; null: the split's (a number overrides it, and the summary says so)."""
    video_episodes: int = 2
    """Episodes recorded to mp4."""
    deterministic: bool | None = None
    """true: every DDIM step's mean (``noise_free``); false: the stochastic chain the rollouts sample
    (``exploration``); null: the protocol the checkpoint's figure was reported under (``extra["protocol"]``,
    written by ``train``; exploration for a checkpoint that records none). The summary names it."""
    protocol: str = ""
    """A named evaluation protocol, ``noise_free`` | ``exploration`` | ``dppo`` (DPPO's deterministic: each
    step's own std floored at 1e-3, none at the last; :data:`diffpolicy.policy_io.PROTOCOLS`); '' defers to
    ``deterministic``, then to the checkpoint."""
    reachability_tries: int = 0
    """Exploratory episodes per failed held-out scene for the reachability measurement (0 skips it)."""
    explore_std: float = 0.0
    """Reachability: std of Gaussian action noise (env units) on the deterministic chain; 0 explores with the
    stochastic chain instead."""
    explore_hold: str = "step"
    """Reachability: step (fresh noise every control step, as a per-step residual explores) | chunk (one
    draw per decision, held over its Te steps: temporally correlated)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint is required: pass checkpoint=PATH to a checkpoint directory")
        _choice("split", self.split, ("test", "val"))
        _choice("protocol", self.protocol, ("", "noise_free", "exploration", "dppo"))
        if self.eval_seed is None:
            self.eval_seed = TEST_SEED if self.split == "test" else VAL_SEED
        _positive("eval_seed", self.eval_seed, allow_zero=True)
        if self.reachability_tries > 0 and self.split != "val":
            raise ValueError(
                "reachability_tries chooses exploration settings, so it runs on validation seeds: add split=val"
            )
        _positive("reachability_tries", self.reachability_tries, allow_zero=True)
        _positive("explore_std", self.explore_std, allow_zero=True)
        _choice("explore_hold", self.explore_hold, ("step", "chunk"))
        _positive("n_episodes", self.n_episodes)
        _positive("num_envs", self.num_envs)
        _positive("video_episodes", self.video_episodes, allow_zero=True)


@dataclass
class BenchConfig:
    """``python -m diffpolicy.bench NAME``: micro- and macro-benchmarks printed as JSON."""

    repeats: int = 5
    """Repetitions; the median is reported."""
    threads: int = 2
    """torch intra-op threads."""
    device: DeviceConfig = field(default_factory=DeviceConfig)
    options: dict[str, Any] = field(default_factory=dict)
    """Benchmark-specific options (``+options.key=value``)."""

    def __post_init__(self) -> None:
        _positive("repeats", self.repeats)
        _positive("threads", self.threads)


TEXT_BACKENDS = ("", "minilm", "hash")
"""Instruction embedders of a deployed policy: '' (the checkpoint's, else minilm) | minilm | hash (tests)."""


def _text_backend(value: str) -> None:
    if value not in TEXT_BACKENDS:
        raise ValueError(f"text_backend={value!r} is not allowed; choose '', minilm or hash")


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
    deterministic: bool | None = None
    """true: every DDIM step takes its mean, no ``step_noise`` input (always so for base + residual
    checkpoints); false: the stochastic chain; null: the checkpoint's protocol (as ``evaluate``)."""
    opset: int = 17
    """ONNX opset version."""
    check: bool = True
    """Run the file with onnxruntime and compare it with PyTorch for the same noise."""
    atol: float = 1e-4
    """Largest absolute difference of the sampler's parity check."""
    residual_atol: float = 1e-5
    """Largest absolute difference of the residual head's parity check (base + residual checkpoints)."""
    seed: int = 0
    """Seed of the parity check's observations and noise."""
    text_backend: str = ""
    """Instruction embedder: '' (the checkpoint's, else minilm) | minilm (shipped MiniLM) | hash (tests)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint is required: pass checkpoint=PATH to a checkpoint directory")
        _positive("batch_size", self.batch_size)
        if not 11 <= self.opset <= 20:
            raise ValueError(f"opset={self.opset} is out of range; it must lie in [11, 20]")
        _positive("atol", self.atol)
        _positive("residual_atol", self.residual_atol)
        _positive("seed", self.seed, allow_zero=True)
        _text_backend(self.text_backend)


DEFAULT_PORT = 50051
"""The policy server's TCP port unless ``port=`` says otherwise."""


@dataclass
class ServeConfig:
    """``python -m diffpolicy.serve``: serve a checkpoint's policy over gRPC."""

    checkpoint: str = ""
    """Checkpoint directory (or a root holding ``latest``) to serve (required)."""
    host: str = "127.0.0.1"
    """Interface to bind: 127.0.0.1 (this machine only) | 0.0.0.0 (every interface)."""
    port: int = DEFAULT_PORT
    """TCP port (0 picks a free one, reported in the ready line and endpoint.json)."""
    max_batch: int = 16
    """Most concurrent requests answered by one batched policy call."""
    max_wait_ms: float = 10.0
    """Longest a request waits for others to join its batch (ms); a lone client never waits."""
    workers: int = 64
    """gRPC handler threads = requests in flight at most (more get RESOURCE_EXHAUSTED)."""
    warmup_rounds: int = 2
    """Extra warm-up calls at batch 1 and max_batch."""
    warmup_sizes: str = "all"
    """all (every batch size 1..max_batch; NPU / GPU compile new shapes) | ends (1 and max_batch)."""
    request_timeout_s: float = 30.0
    """Longest one request waits for its action chunk (s)."""
    grace_s: float = 10.0
    """On SIGTERM / SIGINT, time given to requests in flight before the server exits (s)."""
    deterministic: bool | None = None
    """true: every DDIM step's mean; false: the stochastic chain; null: the checkpoint's protocol (as
    ``evaluate``; base + residual: always the mean)."""
    seed: int = 0
    """Seed of the sampling generator."""
    max_sessions: int = 4096
    """Base + residual: sessions whose chunk is kept at most (the least recently served is forgotten)."""
    text_backend: str = ""
    """Instruction embedder: '' (the checkpoint's, else minilm) | minilm (shipped MiniLM) | hash (tests)."""
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint is required: pass checkpoint=PATH to a checkpoint directory")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} is out of range; it must lie in [0, 65535] (0 = any free)")
        for name in ("max_batch", "workers", "request_timeout_s", "max_sessions"):
            _positive(name, getattr(self, name))
        for name in ("max_wait_ms", "warmup_rounds", "grace_s", "seed"):
            _positive(name, getattr(self, name), allow_zero=True)
        if self.workers < self.max_batch:
            raise ValueError(
                f"workers={self.workers} must be >= max_batch={self.max_batch} to ever fill a batch"
            )
        _choice("warmup_sizes", self.warmup_sizes, ("all", "ends"))
        _text_backend(self.text_backend)


GROUPS: dict[str, type] = {
    "env": EnvConfig,
    "policy": PolicyConfig,
    "algo": LearnerConfig,
    "device": DeviceConfig,
    "dist": DistConfig,
}
"""Config groups under ``conf/`` and the dataclass that backs each."""

PRIMARY: dict[str, type] = {
    "train": TrainConfig,
    "collect": CollectConfig,
    "pretrain": PretrainConfig,
    "evaluate": EvaluateConfig,
    "bench": BenchConfig,
    "export": ExportConfig,
    "serve": ServeConfig,
}
"""Primary config per entry point (``conf/<name>.yaml``) and its dataclass."""


POLICY_DERIVED = ("n_groups", "n_action_steps", "ddim_steps", "ft_steps", "unexecuted_weight")
"""PolicyConfig fields whose null default :meth:`PolicyConfig.__post_init__` derives from other fields."""
DERIVED: dict[type, tuple[str, ...]] = {
    PolicyConfig: POLICY_DERIVED,
    EncoderConfig: ("use_state", "workspace_low", "workspace_high"),
    BCConfig: (
        "epochs",
        "steps",
        "batch_size",
        "n_demos",
        "target_aux_weight",
        "translate",
        "translate_state",
    ),
}
"""Fields whose null default is derived when the config is built: from the component's own fields, or from
``env.obs_mode`` (:data:`OBS_MODE_DEFAULTS`, :func:`derive_from_obs_mode`)."""


def _schema(cls: type) -> Any:
    """``cls`` as a structured config whose :data:`DERIVED` fields are null, so that they are derived from
    the composed values (a dataclass default of ``PolicyConfig()`` has already derived them from its own
    defaults: ``policy.ddim_steps=4`` would then meet a K' computed for K = 10)."""
    from omegaconf import DictConfig, OmegaConf

    node = OmegaConf.structured(cls)

    def clear(cfg: DictConfig) -> None:
        for name in DERIVED.get(OmegaConf.get_type(cfg), ()):
            cfg[name] = None
        for key in cfg:
            child = cfg._get_node(key)
            if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
                clear(child)

    clear(node)
    return node


def register_configs() -> None:
    """Register every dataclass in Hydra's ConfigStore (schemas ``<name>_schema`` / ``<group>/<x>_schema``)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for name, cls in PRIMARY.items():
        cs.store(name=f"{name}_schema", node=_schema(cls))
    for group, cls in GROUPS.items():
        cs.store(group=group, name=f"{group}_schema", node=_schema(cls))
    for head, cls in LEARNERS.items():
        cs.store(group="algo", name=f"{head}_schema", node=_schema(cls))


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` that re-runs validation (a thin alias for readability at call sites)."""
    return dataclasses.replace(cfg, **changes)
