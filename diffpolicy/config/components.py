"""The components' configs: environment, encoders, policy, behaviour cloning, device, processes, logging."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffpolicy.config.common import (
    MISSING_PATH,
    _choice,
    _derive_state_defaults,
    _positive,
    _unit,
)


@dataclass
class EnvConfig:
    """Which environment to train on and how to run it."""

    name: str = "mujoco_pick"
    """Config-group entry: mujoco_pick | mujoco_dialogue (the pick scene with two trays and an instruction
    corrected mid-episode) | mujoco_stages (its two-sub-task task) | obstacle_reach | hopper / walker2d (Gymnasium's Hopper-v5 /
    Walker2d-v5, demonstrated by a medium-quality PPO actor) | metaworld (any of Meta-World's 50 v3 tasks, ``env.task``) | gym."""
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
        _choice(
            "env.name",
            self.name,
            (
                "mujoco_pick",
                "mujoco_dialogue",
                "mujoco_stages",
                "obstacle_reach",
                "hopper",
                "walker2d",
                "metaworld",
                "gym",
            ),  # fmt: skip
        )
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
    text_memory: int = 0
    """The instruction as a dialogue (env=mujoco_dialogue: utterances separated by a newline): k > 0 pools its
    utterances, each embedded once with its recency, into k memory tokens
    (:class:`~diffpolicy.encoders.memory.InstructionMemory`) that take the one sentence's place in the FiLM and
    the fusion; 0 embeds the whole instruction as one sentence."""
    text_memory_turns: int = 8
    """Utterances the memory reads, the latest ones."""
    text_standardize: bool = False
    """Standardise the frozen sentence embedding per dimension before its projection, by statistics of the
    demonstrations' distinct instruction sentences (:class:`~diffpolicy.encoders.text.TextEncoder`): what
    tells one task's instructions apart is otherwise a few hundredths of a unit-norm vector."""
    predict_positions: int | None = None
    """Predict-then-act: with k > 0 the encoder predicts k xyz positions (the demonstrations' ``target_pos``
    label: Meta-World's ``env.kwargs.label=both`` gives the object's and the goal's, k = 2) from the fused
    perception, and the denoiser's condition is computed from the proprioception, those k positions and the
    instruction alone, so the denoiser cannot key its actions on a scene's look. BC trains the prediction
    on the label (weight ``bc.target_aux_weight``) and the condition on the label plus ``position_noise``;
    acting uses the prediction. 0: the fused perception is the condition. Null: derived from the environment
    (:data:`ENV_DEFAULTS`): 2 for Meta-World's multimodal policy, else 0."""
    position_head: str | None = None
    """Predict-then-act: where the positions are read. ``fused``: regressed by an MLP from the fused
    perception (every modality); ``points``: each a softmax-weighted mean of the point cloud's points plus a
    learned offset (:class:`diffpolicy.encoders.fusion.PointPositionHead`), so that it moves with the
    object's points on scenes the demonstrations never showed. Null: derived from the environment
    (:data:`OBS_MODE_DEFAULTS`, :data:`ENV_DEFAULTS`): ``points`` for Meta-World's multimodal policy, else
    ``fused``."""
    position_noise: float = 0.01
    """Predict-then-act: std (m, per axis) of the Gaussian error added to the labelled positions the
    condition is trained on, about what perception misses on new scenes (docs/experiments.md, 2026-12-02)."""

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
        _positive("policy.encoder.text_memory", self.text_memory, allow_zero=True)
        _positive("policy.encoder.text_memory_turns", self.text_memory_turns)
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
        _positive("policy.encoder.predict_positions", self.predict_positions, allow_zero=True)
        _positive("policy.encoder.position_noise", self.position_noise, allow_zero=True)
        _choice("policy.encoder.position_head", self.position_head, ("fused", "points"))


@dataclass
class PolicyConfig:
    """The diffusion policy: encoders, 1-D U-Net denoiser and DDPM/DDIM schedule."""

    name: str = "unet_small"
    """Config-group entry: unet_small64 (the default) | unet_small | unet_large | mlp | gaussian (the MLP baseline) |
    selector (a multi-stage task's high-level sub-task selector)."""
    kind: str = "diffusion"
    """diffusion | gaussian (a Gaussian MLP baseline with the same encoders) | selector (the encoders and a
    classifier over the demonstrations' sub-task instructions, ``cond_dim`` wide: ``pretrain`` trains it on the
    ``subtask`` labels, :mod:`diffpolicy.hierarchy`)."""
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    """Observation encoders."""
    plan_slots: int | None = 0
    """``kind=selector`` only: S > 0 reads the plan from the dialogue alone into S sub-task slots, and the
    observation only chooses the slot (:class:`~diffpolicy.policies.selector.SubtaskSelector`); S is at least
    the most sub-tasks a demonstrated episode has. Null: that count. 0: one classifier over the observation
    and the dialogue together."""
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
    fold: int | None = 1
    """Action steps folded into one position of the U-Net (``denoiser=unet``): the chunk enters its first level
    as Ta / fold positions of fold x Da channels and leaves the last 1x1 convolution the same way, so a
    64-step chunk at fold 4 runs the convolutions of a 16-step one. 1: one position per action step. Null
    (``policy=unet_small64``): derived from the horizon, Ta / 16 where 16 divides Ta, else 1, so every chunk
    length runs a 16-step chunk's convolutions (``policy.horizon=16`` on the default is an unfolded 16-step
    U-Net). Measured: a fold-4 U-Net that predicts the noise does not clone the pick task
    (docs/experiments.md, 2026-12-07); fold with ``prediction=sample``."""
    prediction: str = "epsilon"
    """What the U-Net's trunk predicts (``denoiser=unet``): epsilon (the noise, Chi et al.'s default) | sample
    (the clean chunk x0; the network still returns the noise it implies, so sampling, the DDPM loss and the
    chain log-probs are unchanged)."""
    train_kernels: bool = False
    """The training step's fast kernels: the U-Net's GroupNorm + Mish as one compiled CPU operator
    (:func:`diffpolicy.ops.group_norm_mish`; ATen's ops elsewhere) and torch's fused AdamW for BC and the
    learners' imitation steps. ~1.2x a BC step on the CPU (``bench bc_step train_kernels=true``), the same
    function to float32 rounding, but not the same bits: off by default because the one default run measured
    with them fine-tuned to 0.79 on validation where the same run without them reads 0.865
    (docs/experiments.md, 2026-12-07 fifth session); whether that is their effect or one run's luck is not
    measured yet. Part of the BC cache key when on."""
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
        _choice("policy.kind", self.kind, ("diffusion", "gaussian", "selector"))
        _choice("policy.conditioning", self.conditioning, ("film", "adanorm"))
        if self.plan_slots is not None:
            _positive("policy.plan_slots", self.plan_slots, allow_zero=True)
        if self.plan_slots != 0 and self.kind != "selector":
            raise ValueError(f"policy.plan_slots={self.plan_slots} is a selector's: add policy=selector")
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
        if self.fold is None:  # derived: a 16-step chunk's positions whatever the horizon
            unet16 = self.denoiser == "unet" and self.horizon % 16 == 0
            self.fold = self.horizon // 16 if unet16 and self.horizon >= 16 else 1
        _positive("policy.fold", self.fold)
        _choice("policy.prediction", self.prediction, ("epsilon", "sample"))
        if self.prediction != "epsilon" and self.denoiser != "unet":
            raise ValueError(
                f"policy.prediction={self.prediction} is the U-Net's; denoiser=mlp predicts epsilon"
            )
        if self.fold > 1 and self.denoiser != "unet":
            raise ValueError(
                f"policy.fold={self.fold} folds the U-Net's positions; denoiser=mlp takes fold=1"
            )
        if self.horizon % self.fold:
            raise ValueError(f"policy.horizon={self.horizon} must be divisible by policy.fold={self.fold}")
        levels = 2 ** (len(self.down_dims) - 1)
        if self.denoiser == "unet" and (self.horizon // self.fold) % levels:
            raise ValueError(
                f"policy.horizon / policy.fold = {self.horizon // self.fold} must be divisible by "
                f"2^(len(policy.down_dims)-1)={levels}"
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
        _positive("policy.clip_sample", self.clip_sample)


@dataclass
class BCConfig:
    """Behaviour cloning (``bc.*``), before any fine-tuning: from the scripted expert's demonstrations, or from
    a dataset on disk (``bc.demos``)."""

    __slots__ = ("__dict__", "__weakref__", "_derived")  # _derived: not a field, and not in vars() either

    instruction: str = "observed"
    """What BC reads as the instruction: ``observed`` (the demonstrations' own) or ``subtask`` (the sub-task
    label multi-stage demonstrations record, ``env.kwargs.task=stages``): the low-level policy of a hierarchy,
    which acts on the sub-task instruction a selector (``policy=selector``) names."""
    mask_unheard: bool = False
    """No BC loss on a window's chunk steps taken under an instruction its observation has not heard yet (a
    dialogue's correction said later; with ``instruction=subtask``, the next sub-task): those actions follow a
    meaning the window cannot know, and trained on they teach a mixture of the two. A no-op where the
    instruction never changes within an episode."""
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
    (``data/demo_N/{obs/<key>, actions, rewards, dones}``, images and depth included), a LeRobotDataset
    directory (``lerobot:DIR``, v2.1 or v3.0, never fetched), a local Minari dataset (``minari:ID``, or its
    directory) or a dataset in this project's format (:mod:`diffpolicy.demos`); '' collects from the expert.
    Checked against the environment's spaces and converted into the cache once; the policy reads the
    modalities the dataset holds."""
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
    concatenated in this order, form it (``+bc.obs_keys.state=[qpos,qvel]``,
    ``+bc.obs_keys.rgb=[observation.images.wrist]``); a key not named here is read from the dataset's default
    for it (:mod:`diffpolicy.demos`)."""

    def __post_init__(self) -> None:
        _derive_state_defaults(self, "bc")
        _choice("bc.instruction", self.instruction, ("observed", "subtask"))
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
