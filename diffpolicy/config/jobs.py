"""The entry points' configs (train, collect, pretrain, evaluate, bench, export, serve) and their Hydra
registration (:func:`register_configs`, :func:`replace`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from diffpolicy.config.common import (
    ENV_DEFAULTS,
    OBS_MODE_DEFAULTS,
    PROTOCOLS,
    TEST_SEED,
    VAL_SEED,
    _choice,
    _positive,
    check_splits,
    default_cache_dir,
)
from diffpolicy.config.components import (
    BCConfig,
    DeviceConfig,
    DistConfig,
    EncoderConfig,
    EnvConfig,
    LogConfig,
    PolicyConfig,
)
from diffpolicy.config.learners import LEARNERS, LearnerConfig, PPOConfig, SamplingConfig, as_learner


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


def check_protocols(eval_protocol: str, report: list[str], eval_deterministic: bool) -> None:
    """ValueError for a protocol name that is not in :data:`PROTOCOLS`, or one that contradicts
    ``eval_deterministic``."""
    _choice("eval_protocol", eval_protocol, ("", *PROTOCOLS))
    for name in report:
        _choice("report_protocols", name, tuple(PROTOCOLS))
    if eval_protocol and eval_deterministic and not PROTOCOLS[eval_protocol]:
        raise ValueError(f"eval_protocol={eval_protocol} samples noise but eval_deterministic=true; give one")


@dataclass
class TrainConfig:
    """``python -m diffpolicy.train``: collect, pre-train, fine-tune with PPO, evaluate."""

    env: EnvConfig = field(default_factory=EnvConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    algo: LearnerConfig = field(default_factory=LearnerConfig)
    """The learner: a :data:`LEARNERS` schema chosen by ``algo=<entry>`` (a bare LearnerConfig built in
    Python becomes the chain learner's config with defaults)."""
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
    eval_protocol: str = ""
    """The named protocol (:data:`PROTOCOLS`) BC, the guard and the fine-tuned policy are judged under and the
    checkpoints record (what ``evaluate``, ``export`` and ``serve`` then use); '' = the learner's own
    (``noise_free`` for residual and filtered_bc or with ``eval_deterministic``, else ``exploration``)."""
    report_protocols: list[str] = field(default_factory=list)
    """More protocols under which BC and the fine-tuned policy are also evaluated once on the test split,
    reported under ``protocols`` in the summary (e.g. ``[dppo]``: DPPO's deterministic beside the mean)."""
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
        if isinstance(self.algo, SamplingConfig) and isinstance(self.policy, PolicyConfig):
            self.algo.resolve_ft_steps(self.policy.ddim_steps)
        val_used = max(self.val_episodes, self.algo.rollback_episodes)  # the guard reads the first n of them
        check_splits(self.val_seed, val_used, self.eval_seed, self.eval_episodes)
        check_protocols(self.eval_protocol, self.report_protocols, self.eval_deterministic)
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
    policy: Any = None
    """Unused: the policy an env entry chooses for train and pretrain (env=hopper: mlp), kept so that every env
    entry composes here too."""
    algo: Any = None
    """Unused: the learner an env entry chooses (env=hopper, env=metaworld)."""
    n_episodes: int = 100
    """Demonstration episodes to record."""
    seed: int = 0
    """First episode seed (episode i uses seed + i)."""
    out: str = ""
    """Output: the dataset directory (format=native; '' writes ``demos`` in the run directory), the HDF5 file
    (format=robomimic; '' writes ``demos.hdf5``) or the LeRobotDataset directory (format=lerobot; ''
    writes ``lerobot``)."""
    format: str = "native"
    """native (this project's chunked store) | robomimic (robomimic-style HDF5 for other tools) | lerobot (a
    LeRobotDataset v3.0 directory, videos included); with either of the last two the native store is kept
    beside it in the run directory."""
    fps: float | None = None
    """format=lerobot: frames per second recorded in the dataset (null: the environment's control rate,
    ``metadata["render_fps"]``: MujocoPick 10, Meta-World 80)."""
    video_codec: str = "av1"
    """format=lerobot: av1 (SVT-AV1, LeRobot's default) | h264."""
    keep_failures: bool | None = None
    """Also store episodes where the expert failed (null: the environment's ``env.demo_failures``; true or
    false overrides it)."""

    def __post_init__(self) -> None:
        _positive("n_episodes", self.n_episodes)
        _positive("seed", self.seed, allow_zero=True)
        _choice("format", self.format, ("native", "robomimic", "lerobot"))
        _choice("video_codec", self.video_codec, ("av1", "h264"))
        if self.fps is not None:
            _positive("fps", self.fps)


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
    reuse_cache: bool = False
    """Where the BC cache already holds a policy cloned with these settings (an earlier ``pretrain`` or
    ``train``), evaluate that one instead of training again (as ``train`` does); the summary then names it
    (``reused``) and reports its run's training figures."""
    eval_episodes: int = 0
    """Test episodes evaluated after training (0 skips them): the reported figure."""
    eval_seed: int = TEST_SEED
    """First test seed (:data:`TEST_SEED`), as ``train``'s."""
    val_episodes: int = 0
    """Validation episodes evaluated after training (0 skips them): what BC settings are chosen on."""
    val_seed: int = VAL_SEED
    """First validation seed (:data:`VAL_SEED`), as ``train``'s."""
    eval_deterministic: bool = False
    """As ``train``'s: every DDIM step's mean (always so with ``algo=residual``, whose base samples that
    way), else the stochastic chain the chain learner fine-tunes."""
    eval_protocol: str = ""
    """As ``train``'s: the named protocol BC is judged under ('' = the learner's own)."""
    report_protocols: list[str] = field(default_factory=list)
    """As ``train``'s: more protocols BC is also evaluated under on the test split (summary ``protocols``)."""
    selector_corrections: list[str] = field(default_factory=list)
    """``policy=selector`` only: datasets of a person's corrections of a selector (``evaluate selector=...
    correct=true`` writes one) that join the demonstrations' sub-task labels in training."""

    def __post_init__(self) -> None:
        if isinstance(self.env, EnvConfig):  # first: the replace below would make the derived values set ones
            self.policy, self.bc = derive_from_obs_mode(self.env, self.policy, self.bc, self.demos)
        self.cache_dir = self.cache_dir or default_cache_dir()
        self.algo = as_learner(self.algo)  # its class says how BC is judged (judged_noise_free)
        if isinstance(self.algo, SamplingConfig) and isinstance(self.policy, PolicyConfig):
            self.algo.resolve_ft_steps(self.policy.ddim_steps)  # BC is judged as train's learner samples
        _positive("seed", self.seed, allow_zero=True)
        _positive("eval_episodes", self.eval_episodes, allow_zero=True)
        check_splits(self.val_seed, self.val_episodes, self.eval_seed, self.eval_episodes)
        check_protocols(self.eval_protocol, self.report_protocols, self.eval_deterministic)
        if self.selector_corrections and getattr(self.policy, "kind", "") != "selector":
            raise ValueError("selector_corrections train a sub-task selector: add policy=selector")
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
    num_envs: int | None = None
    """Parallel environments; null: the checkpoint's ``env.num_envs``, the waves ``train`` evaluated in, so that
    a sampled (and the noise-free chain's x_K) draw the same noise in the same order and the figure is train's
    to the digit."""
    split: str = "test"
    """Which seeds: test (:data:`TEST_SEED` + i, the reported figure, as ``train``'s test evaluation) | val
    (:data:`VAL_SEED` + i, the seeds choices are made on: the reachability measurement needs them)."""
    eval_seed: int | None = None
    """First seed; null: the split's (a number overrides it, and the summary says so)."""
    video_episodes: int = 2
    """Episodes recorded to mp4."""
    video_format: str = "mp4"
    """mp4 (``eval.mp4``, the ``video`` extra's ffmpeg) | gif (``eval.gif``, Pillow: shows inline in a README)."""
    deterministic: bool | None = None
    """true: every DDIM step's mean (``noise_free``); false: the stochastic chain the rollouts sample
    (``exploration``); null: the protocol the checkpoint's figure was reported under (``extra["protocol"]``,
    written by ``train``; exploration for a checkpoint that records none). The summary names it."""
    protocol: str = ""
    """A named evaluation protocol, ``noise_free`` | ``ddim`` (eta 0) | ``exploration`` | ``dppo`` (DPPO's
    deterministic: each step's own std floored at 1e-3, none at the last; :data:`PROTOCOLS`); '' defers to
    ``deterministic``, then to the checkpoint."""
    reachability_tries: int = 0
    """Exploratory episodes per failed held-out scene for the reachability measurement (0 skips it)."""
    explore_std: float = 0.0
    """Reachability: std of Gaussian action noise (env units) on the deterministic chain; 0 explores with the
    stochastic chain instead."""
    explore_hold: str = "step"
    """Reachability: step (fresh noise every control step, as a per-step residual explores) | chunk (one
    draw per decision, held over its Te steps: temporally correlated)."""
    selector: str = ""
    """A sub-task selector's checkpoint (``pretrain policy=selector``): evaluate the hierarchy of it above
    ``checkpoint`` (the low-level policy, cloned with ``bc.instruction=subtask``) on a multi-stage task."""
    correct: bool = False
    """With ``selector``: a simulated person corrects the selector wherever it names another sub-task than the
    one the task is at (the environment's ``info["subtask"]``), as in Yell At Your Robot; the success is then
    the hierarchy's with that person in the loop (summary ``person``: decisions watched, corrections), and
    the corrected decisions are written to ``<run dir>/corrections`` for ``pretrain policy=selector
    selector_corrections=[...]``. Run it on seeds nothing is judged on (``eval_seed``)."""
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    """Environment keyword arguments changed for this evaluation only, over the checkpoint's ``env.kwargs``
    (``+env_kwargs.state_noise=0.015`` evaluates a Meta-World state policy with its positions off by that
    much); the summary records them. An argument the environment does not take fails in one line."""
    n_action_steps: int | None = None
    """Actions executed from each sampled chunk before the policy decides again (1 .. its horizon); null: the
    checkpoint's ``policy.n_action_steps``. Fewer replans more often (closed-loop, at more sampling and, for a
    camera, rendering per episode); the summary records a changed value."""
    device: DeviceConfig = field(default_factory=DeviceConfig)

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("checkpoint is required: pass checkpoint=PATH to a checkpoint directory")
        if self.n_action_steps is not None:
            _positive("n_action_steps", self.n_action_steps)
        _choice("split", self.split, ("test", "val"))
        _choice("protocol", self.protocol, ("", *PROTOCOLS))
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
        if self.correct and not self.selector:
            raise ValueError("correct=true corrects a selector's choices: give selector=PATH")
        _positive("n_episodes", self.n_episodes)
        if self.num_envs is not None:
            _positive("num_envs", self.num_envs)
        _choice("video_format", self.video_format, ("mp4", "gif"))
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


POLICY_DERIVED = ("n_groups", "n_action_steps", "ddim_steps", "unexecuted_weight")
"""PolicyConfig fields whose null default :meth:`PolicyConfig.__post_init__` derives from other fields."""


def _obs_mode_derived(prefix: str) -> tuple[str, ...]:
    """The field names under ``prefix`` that :data:`OBS_MODE_DEFAULTS` derives."""
    return tuple(p.rpartition(".")[2] for p in OBS_MODE_DEFAULTS["state"] if p.rpartition(".")[0] == prefix)


DERIVED: dict[type, tuple[str, ...]] = {
    PolicyConfig: POLICY_DERIVED,
    EncoderConfig: _obs_mode_derived("policy.encoder"),
    BCConfig: _obs_mode_derived("bc"),
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
    for learner, cls in LEARNERS.items():
        cs.store(group="algo", name=f"{learner}_schema", node=_schema(cls))


def replace(cfg: Any, **changes: Any) -> Any:
    """``dataclasses.replace`` that re-runs validation (a thin alias for readability at call sites)."""
    return dataclasses.replace(cfg, **changes)
