"""The fine-tuning learners' configs (``algo.*``): what every learner reads (:class:`LearnerConfig`), the PPO
learners' shared fields (:class:`PPOConfig`) and one subclass per learner, with :data:`LEARNERS` mapping
each learner's name to its schema. The learners themselves live in ``diffpolicy/rl/`` and read these; the configs
stay below them so that every entry point can build and validate a config without importing a learner.

The one choice a user makes is ``algo=<entry>`` (a YAML under ``conf/algo/``, recorded as ``algo.name``); the
entry's schema says which learner runs (its class constant ``learner``), so no second field names it."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from diffpolicy.config.common import _choice, _positive, _unit


@dataclass
class LearnerConfig:
    """What every learner reads (``algo.*``): its name, how long it runs, its step size and the rollback guard.

    Each learner has its own subclass and YAML under ``conf/algo/`` (whose ``defaults`` name the schema), so
    ``algo=<learner> --cfg job`` shows only the fields that learner reads, and a field of another learner is
    an unknown key.
    """

    name: str = "learner"
    """The ``conf/algo/`` entry this config was composed from (``algo=<name>``): a record, not a switch."""
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
    keep_best: bool = False
    """Early stopping on validation: deploy the checkpoint the guard judged best on its validation episodes
    (the pre-trained policy included when ``val_episodes`` >= ``rollback_episodes``: BC's own figure on them is
    the first verdict), not the last one. Needs ``rollback_episodes`` > 0: a choice is made on validation seeds
    only, never on the training rollouts or the test split."""

    learner: ClassVar[str] = "chain"
    """Which learner of ``diffpolicy/rl/`` runs: chain (PPO on the last K' denoising steps, DPPO) | residual
    (the diffusion policy frozen, a Gaussian MLP correcting each control step's action) | filtered_bc (BC
    continued on the policy's own successful episodes) | fpo (PPO with the denoising-loss ratio). A class
    constant of each schema, its one declaration: the learner registers under it and the schema is stored as
    ``algo/<learner>_schema``."""
    judged_noise_free: ClassVar[bool] = False
    """The learner's policy acts with every DDIM step's mean, so BC and its result are judged that way
    (:func:`diffpolicy.evaluation.held_out`); a class constant of the learner, not a field."""

    def __post_init__(self) -> None:
        _positive("algo.rollback_episodes", self.rollback_episodes, allow_zero=True)
        _positive("algo.iterations", self.iterations)
        _positive("algo.lr", self.lr)
        _positive("algo.max_grad_norm", self.max_grad_norm, allow_zero=True)
        _unit("algo.rollback_drop", self.rollback_drop)
        if self.keep_best and not self.rollback_episodes:
            raise ValueError(
                "algo.keep_best=true selects on validation episodes: set algo.rollback_episodes > 0"
            )


@dataclass
class SamplingConfig:
    """How a learner that samples the stochastic DDIM chain draws its rollouts (chain, FPO, filtered_bc's
    ``explore=chain``). None of these enter the BC loss, so one cached BC checkpoint serves every setting;
    the learner applies them to the loaded policy (``DiffusionPolicy.set_sampling``) and its checkpoints
    record them (the ``exploration`` protocol of ``evaluate`` samples that way)."""

    ft_steps: int | None = None
    """K': last DDIM steps that are Gaussian transitions (and that the chain learner fine-tunes), K' <= K
    (null: ``ft_fraction`` of ``policy.ddim_steps``, else all K steps). A value given here wins over
    ``ft_fraction``; derived by :class:`~diffpolicy.config.TrainConfig`, which knows K."""
    ft_fraction: float | None = None
    """K' / K when ``ft_steps`` is null, in (0, 1]: K' = round(ft_fraction * K), at least 1 (DPPO's half
    chain: 0.5, so K' follows any ``policy.ddim_steps``); null: K' = K."""
    min_std: float = 0.01
    """Lower bound on the std of every stochastic DDIM step (exploration), normalised action units."""
    eta: float = 1.0
    """DDIM stochasticity of the K' sampled steps (0: their means)."""

    def __post_init__(self) -> None:
        if self.ft_fraction is not None:
            _unit("algo.ft_fraction", self.ft_fraction, open_low=True)
        if self.ft_steps is not None:
            _positive("algo.ft_steps", self.ft_steps)
        _positive("algo.min_std", self.min_std)
        _unit("algo.eta", self.eta)

    def sampling(self) -> dict[str, Any]:
        """The settings ``set_sampling`` takes: ``{"ft_steps": K', "eta": ..., "min_std": ...}`` (K' resolved)."""
        return {"ft_steps": self.ft_steps, "eta": self.eta, "min_std": self.min_std}

    def resolve_ft_steps(self, ddim_steps: int) -> None:
        """Derive a null ``ft_steps`` from ``ddim_steps`` (K) and check 0 < K' <= K."""
        if self.ft_steps is None:
            share = 1.0 if self.ft_fraction is None else self.ft_fraction
            self.ft_steps = min(ddim_steps, max(1, math.floor(share * ddim_steps + 0.5)))
        if not 0 < self.ft_steps <= ddim_steps:
            raise ValueError(f"algo.ft_steps={self.ft_steps} must lie in [1, policy.ddim_steps={ddim_steps}]")


NORM_ADV_ALIASES = {"true": "minibatch", "false": "none"}
"""Boolean spellings of ``algo.norm_adv`` (a YAML ``true`` arrives as the string ``"True"``)."""


@dataclass
class PPOConfig(LearnerConfig):
    """The fields of every PPO learner (chain, residual, FPO): rollout size, critic, GAE, clipping."""

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
    norm_adv: str = "minibatch"
    """How advantages are standardised before the policy loss: ``minibatch`` (each minibatch to zero mean and
    unit std, DPPO's), ``batch`` (once over the iteration's rollout, every rank's valid samples together, so
    a minibatch with little signal stays small beside one with much) or ``none`` (the critic's scale);
    ``true`` / ``false`` read as ``minibatch`` / ``none``."""
    vf_coef: float = 0.5
    """Weight of the value loss."""
    target_kl: float = 0.05
    """Stop the update epochs early when the approximate KL exceeds this (0 disables)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _choice("algo.advantage", self.advantage, ("gae", "grpo"))
        self.norm_adv = NORM_ADV_ALIASES.get(str(self.norm_adv).lower(), str(self.norm_adv))
        _choice("algo.norm_adv", self.norm_adv, ("minibatch", "batch", "none"))
        for name in ("n_steps", "update_epochs", "minibatch_size", "critic_lr", "clip_eps"):
            _positive(f"algo.{name}", getattr(self, name))
        for name in ("vf_coef", "target_kl"):
            _positive(f"algo.{name}", getattr(self, name), allow_zero=True)
        for name in ("gamma", "gae_lambda"):
            _unit(f"algo.{name}", getattr(self, name))


@dataclass
class ChainConfig(SamplingConfig, PPOConfig):
    """PPO on the last K' denoising steps of the diffusion policy (``algo=ppo | grpo | dppo | dppo_gym``)."""

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
    reward_scale: str = "none"
    """none (rewards enter GAE as the env gives them) | running (DPPO's ``reward_scale_running``: each reward
    divided by the running std of the rewards' backward-discounted sums, discount 0.99, clipped to +-10;
    :class:`~diffpolicy.rl.advantages.RunningRewardScaler`; a time-limit cut's bootstrap value is added after
    scaling, being in the critic's units already). GAE only (GRPO normalises its returns anyway)."""
    reward: str = "env"
    """What the chain learner maximises: env (the environment's reward) | success (1 on the decision whose
    executed actions reach ``info["is_success"]``, else 0: DPPO's sparse robomimic reward). An environment
    that ends episodes on success and pays a dense reward for every step near its goal (Meta-World) pays more
    for not finishing than for finishing; with ``success`` the discounted return is gamma^t of the decision
    that succeeds, so succeeding, and succeeding sooner, is all that earns. stages: success's reward plus, once
    per episode, the value :attr:`stage_potential` gives the furthest ``info["outcome"]`` reached so far
    (potential-based shaping), for tasks whose rollouts hold too few successes to learn from. Episode returns
    in the metrics stay the environment's."""
    stage_potential: dict[str, float] = field(
        default_factory=lambda: {"never_grasped": 0.1, "timed_out": 0.3}
    )
    """``algo.reward=stages``: outcome name (``info["outcome"]``) -> the potential of having reached it, in
    units of a success. The default names Meta-World's stages: ``never_grasped`` is reported once the hand has
    come near the object, ``timed_out`` once it has grasped it (``never_reached`` and names left out: 0)."""
    critic_input: str = "cond"
    """What the critic reads: cond (the policy's fused observation vector, frozen features trained for
    imitation) | state (the normalised state vector; DPPO's Gym critic, which reads the raw normalised
    observation). See :class:`~diffpolicy.models.critic.Critic`."""
    critic_hidden: list[int] = field(default_factory=lambda: [256, 256])
    """Hidden widths of the critic's MLP (DPPO's Gym critic: 256 x 3)."""
    finetune_encoders: bool = False
    """PPO also updates the observation encoders (re-encodes every minibatch: several times slower on a CPU);
    when False the encoders stay as pre-trained and the update reuses each decision's stored condition."""
    action_std: float = 0.0
    """> 0: explore in action space (NCDPO, Yang et al. 2025): each decision's chunk is the noise-free chain
    from a drawn x_K plus Gaussian noise of this std (normalised action units, times the measured noise scale
    with ``explore_tolerance``), and PPO's ratio is that Gaussian's, differentiated through all K denoising
    steps (``ft_steps`` / ``ft_fraction`` are then unused: every step is fine-tuned, none frozen). The policy
    that explores is the deployed noise-free one plus noise, where DPPO's stochastic steps (0, the default)
    explore with a chain that can succeed far less often than the deployed policy
    (:meth:`~diffpolicy.policies.diffusion.DiffusionPolicy.set_sampling`)."""
    explore_tolerance: float = 0.0
    """Explore with what the task tolerates: before the first rollout the sampled chain is judged on
    ``explore_episodes`` validation episodes with the stds of its K' sampled steps times 1, 1/2, 1/4, ...
    (``explore_levels``; the steps' means stay as they are), and the largest scale whose figure keeps
    (1 - this) of the noise-free figure on the same episodes (a share, of success rate or return) is
    explored with for the whole run (:func:`diffpolicy.rl.exploration.tolerated`); the summary and the
    checkpoints record the scale and the curve. 0: sample with ``eta`` and ``min_std`` as given (scale 1)."""
    explore_episodes: int = 50
    """Validation episodes per level of the ``explore_tolerance`` measurement."""
    explore_levels: int = 5
    """Scales tried by the ``explore_tolerance`` measurement: 1, 1/2, ..., 2^-(levels - 1)."""
    sil_coef: float = 0.0
    """Weight of self-imitation beside the PPO loss (Oh et al. 2018; :mod:`diffpolicy.rl.self_imitation`):
    decisions whose return beat the critic's value are kept, and every minibatch step also raises the
    log-probability of kept chains drawn in proportion to (R - V)+. 0: off."""
    sil_capacity: int = 8192
    """Kept decisions (a ring: the newest)."""
    sil_batch: int = 0
    """Kept decisions drawn per minibatch step (0: ``minibatch_size``)."""
    sil_loss: str = "chain"
    """How the kept decisions are imitated: chain (raise the exact log-probability of their K' stored
    transitions) | denoise (the diffusion policy's BC loss on their sampled chunks, at the timesteps of the
    K' fine-tuned steps: moves the steps' means, so the deployed noise-free policy, toward what succeeded)."""
    sil_value_coef: float = 0.01
    """Weight of the kept decisions' value loss 0.5 (R - V)+^2 inside the self-imitation term (the paper's
    beta)."""
    action_corr: float = 0.0
    """``action_std`` > 0: correlation in [0, 1] of the action noise across a chunk's steps (each entry is
    sqrt(corr) x one draw per decision and action dimension + sqrt(1 - corr) x a draw per step), so the noise
    moves where the chunk goes rather than jittering around it, as filtered_bc's held noise does; the ratio
    is that Gaussian's exact joint log-probability over the executed steps (per element), so it needs
    ``logprob_clamp: []``. 0: independent noise per entry. 1: one draw per decision and action dimension held
    over the chunk and nothing else (filtered_bc's exploration); the ratio is then the density of the
    executed steps' mean offset from the chain, so PPO's gradient moves the chunk's average over its
    executed steps and not its shape (:func:`~diffpolicy.policies.base.held_normal_log_prob`)."""
    action_std_units: str = "normalized"
    """Units of ``action_std``: normalized (one std on every dimension of the normalised action) | env (env
    units on every dimension, one std per normalised dimension through the action normaliser's scale, as
    ``algo=filtered_bc``'s ``explore_std`` is given)."""
    grad_steps: int = 0
    """``action_std`` > 0: the gradient of everything that differentiates the noise-free chunk (PPO's ratio,
    self-imitation's chain log-prob, the regulariser's mean) flows through the last this-many of the K
    denoising steps; the earlier ones run without gradient. The ratio, its clip and the KL stay exact (the
    chunk is the same); only the gradient's direction leaves out how the earlier steps would move it. An epoch
    then costs about (K + 2 n) / 3K of the whole chain's (measured 0.44x at n = 2, K = 10). 0: all K steps."""
    anchor_steps: int = 0
    """Imitation anchor (:mod:`diffpolicy.rl.imitation`): after each PPO update, this many BC steps on the
    demonstrations plus every window of the rollouts' successful episodes (drawn uniformly, as
    ``algo=filtered_bc`` draws them), so what the rollouts found is kept however noisy PPO's gradient is.
    The denoiser learns at every noise level, so the chain must have no frozen base (``action_std`` > 0 or
    ``ft_fraction: 1``). On an env that reports no success the anchor holds the demonstrations alone (a BC
    regulariser). 0: off."""
    anchor_lr: float = 3.0e-4
    """AdamW learning rate of the anchor's steps (its own optimiser; warmed up over a twentieth of them):
    ``algo=filtered_bc``'s ``lr``, chosen on the pick task's validation seeds (0.835 against 0.76 at 1e-4, 200
    episodes, docs/experiments.md 2026-12-07)."""
    anchor_batch: int | None = None
    """Windows per anchor step (null: ``bc.batch_size``)."""
    anchor_ema: float | None = None
    """The anchor's steps train a copy restarted from the deployed weights each iteration, and the deployed
    policy follows it as an exponential moving average of this decay, as BC and ``algo=filtered_bc`` deploy
    their EMA (null: ``bc.ema_decay``; 0: the steps train the deployed weights themselves)."""
    anchor_encoders: bool = False
    """The anchor's steps also train the observation encoders (as BC and ``algo=filtered_bc`` do), on its
    copy; the deployed encoders follow by the EMA between iterations, so PPO's update still reuses each
    decision's stored condition. Needs the EMA (``anchor_ema`` not 0)."""

    def __post_init__(self) -> None:
        PPOConfig.__post_init__(self)
        SamplingConfig.__post_init__(self)
        if self.clip_eps_final is None:
            self.clip_eps_final = self.clip_eps
        _positive("algo.clip_eps_final", self.clip_eps_final)
        _choice("algo.clip", self.clip, ("ppo", "unconditional"))
        _choice("algo.normalize", self.normalize, ("mean", "self"))
        _choice("algo.reg", self.reg, ("none", "kl", "bc"))
        _choice("algo.reward_scale", self.reward_scale, ("none", "running"))
        _choice("algo.critic_input", self.critic_input, ("cond", "state"))
        _choice("algo.reward", self.reward, ("env", "success", "stages"))
        for name, value in dict(self.stage_potential).items():
            if not 0.0 <= float(value) < 1.0:
                raise ValueError(
                    f"algo.stage_potential.{name}={value} must be in [0, 1): a stage is worth less than a success"
                )
        if not self.critic_hidden or any(int(h) <= 0 for h in self.critic_hidden):
            raise ValueError(
                f"algo.critic_hidden={list(self.critic_hidden)} needs one or more positive widths"
            )
        if self.reward_scale != "none" and self.advantage == "grpo":
            raise ValueError(
                "algo.reward_scale=running needs algo.advantage=gae (GRPO normalises its returns)"
            )
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
        _unit("algo.explore_tolerance", self.explore_tolerance)
        _positive("algo.action_std", self.action_std, allow_zero=True)
        _positive("algo.explore_episodes", self.explore_episodes)
        _positive("algo.explore_levels", self.explore_levels)
        for name in ("sil_coef", "sil_batch", "sil_value_coef"):
            _positive(f"algo.{name}", getattr(self, name), allow_zero=True)
        _positive("algo.sil_capacity", self.sil_capacity)
        _choice("algo.sil_loss", self.sil_loss, ("chain", "denoise"))
        if not 0.0 <= self.action_corr <= 1.0:
            raise ValueError(f"algo.action_corr={self.action_corr} must lie in [0, 1]")
        _choice("algo.action_std_units", self.action_std_units, ("normalized", "env"))
        if self.action_std_units == "env" and self.action_std <= 0:
            raise ValueError(
                "algo.action_std_units=env gives algo.action_std in env units: set algo.action_std > 0"
            )
        if self.grad_steps < 0:
            raise ValueError(f"algo.grad_steps={self.grad_steps} must be >= 0 (0: every denoising step)")
        if self.grad_steps > 0 and self.action_std <= 0:
            raise ValueError(
                "algo.grad_steps truncates the gradient through the noise-free chain of action-space "
                "exploration: set algo.action_std > 0"
            )
        if self.action_corr > 0 and self.action_std <= 0:
            raise ValueError("algo.action_corr correlates action-space noise: set algo.action_std > 0")
        if self.action_corr > 0 and list(self.logprob_clamp):
            raise ValueError(
                "algo.action_corr > 0 takes the joint log-probability of a chunk's noise, which has no "
                "per-element clamp: set algo.logprob_clamp=[]"
            )
        _positive("algo.anchor_steps", self.anchor_steps, allow_zero=True)
        _positive("algo.anchor_lr", self.anchor_lr)
        if self.anchor_batch is not None:
            _positive("algo.anchor_batch", self.anchor_batch)
        if self.anchor_ema is not None and not 0.0 <= self.anchor_ema < 1.0:
            raise ValueError(
                f"algo.anchor_ema={self.anchor_ema} must lie in [0, 1) (or be null: bc.ema_decay)"
            )
        if self.anchor_encoders and self.anchor_ema == 0:
            raise ValueError(
                "algo.anchor_encoders trains the encoders on the anchor's copy, which the deployed policy "
                "follows by its EMA: algo.anchor_ema must not be 0"
            )
        if self.sil_coef > 0 and (self.advantage != "gae" or self.finetune_encoders):
            raise ValueError(
                "algo.sil_coef > 0 keeps decisions as the frozen encoders' condition and weighs them by a "
                "critic: it needs algo.advantage=gae and algo.finetune_encoders=false"
            )

    def sampling(self) -> dict[str, Any]:
        """:meth:`SamplingConfig.sampling`, with ``action_std`` when it is > 0."""
        out = SamplingConfig.sampling(self)
        if self.action_std > 0:
            out["action_std"] = self.action_std
            if self.action_corr > 0:
                out["action_corr"] = self.action_corr
            if self.action_std_units == "env":
                out["action_std_env"] = True
        return out


@dataclass
class ResidualConfig(PPOConfig):
    """Residual PPO over control steps on the frozen BC policy (``algo=residual``)."""

    name: str = "residual"
    learner: ClassVar[str] = "residual"
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
    noise_tolerance: float = 0.1
    """Bound the head's exploration by what the base tolerates: before the first rollout, the base's
    noise-free figure on ``tolerance_episodes`` validation episodes is measured without and with per-step
    Gaussian action noise of std alpha * residual_init_std, halved until the figure stays within this much of
    the noise-free one (a fraction of the return, or of success rate); the head's sigma is capped at that std
    / alpha for the whole run (:func:`diffpolicy.rl.exploration.tolerated`). 0 disables."""
    tolerance_episodes: int = 10
    """Validation episodes per noise level of the ``noise_tolerance`` measurement."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.advantage != "gae":
            raise ValueError(f"algo=residual needs algo.advantage=gae (a critic), got {self.advantage!r}")
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
        _unit("algo.noise_tolerance", self.noise_tolerance)
        _positive("algo.tolerance_episodes", self.tolerance_episodes)


@dataclass
class FilteredBCConfig(SamplingConfig, LearnerConfig):
    """Success-filtered self-imitation (``algo=filtered_bc``): roll out, keep the successes, continue BC."""

    name: str = "filtered_bc"
    learner: ClassVar[str] = "filtered_bc"
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
    scene_tries: int = 1
    """Episodes per training scene: a round rolls out ``round_episodes / scene_tries`` scenes, each
    ``scene_tries`` times in a row (different exploration draws), so that ``keep=advantage`` can tell the
    scenes the policy already solves from those it solves only sometimes."""
    keep: str = "auto"
    """Which of a round's episodes are imitated: success (those that reached the goal) | advantage (the
    successes on scenes that not every one of their ``scene_tries`` solved, each window drawn in proportion to
    its scene's advantage 1 - success fraction, a demonstration's as 1: imitation spent where the policy
    fails, the successes it already owns left out; GRPO's group baseline on a 0/1 reward, positive part) |
    top (the ``keep_fraction`` of the round's episodes with the highest return: %BC, for envs without a
    success notion such as Hopper) | auto (success where the env reports it, else top)."""
    keep_fraction: float = 0.25
    """``keep=top``: the fraction of each round's episodes kept, by return (at least one)."""

    def __post_init__(self) -> None:
        LearnerConfig.__post_init__(self)
        SamplingConfig.__post_init__(self)
        _choice("algo.keep", self.keep, ("auto", "success", "advantage", "top"))
        _positive("algo.scene_tries", self.scene_tries)
        if self.keep == "advantage" and self.scene_tries < 2:
            raise ValueError("algo.keep=advantage compares the tries of a scene: set algo.scene_tries >= 2")
        if self.round_episodes % self.scene_tries:
            raise ValueError(
                f"algo.round_episodes={self.round_episodes} must be a multiple of algo.scene_tries={self.scene_tries}"
            )
        if not 0.0 < self.keep_fraction <= 1.0:
            raise ValueError(f"algo.keep_fraction={self.keep_fraction} must lie in (0, 1]")
        _choice("algo.explore", self.explore, ("deterministic", "chain", "chunk"))
        _positive("algo.explore_std", self.explore_std, allow_zero=True)
        _positive("algo.round_episodes", self.round_episodes)
        _positive("algo.bc_steps", self.bc_steps)
        if self.batch_size is not None:
            _positive("algo.batch_size", self.batch_size)


def as_learner(algo: Any) -> LearnerConfig:
    """``algo`` as a learner's config: a bare :class:`LearnerConfig` built in Python becomes the chain
    learner's :class:`ChainConfig` with its shared fields kept; a dict is read as that learner's fields, its
    optional ``learner`` key naming the learner (default chain); a learner config is returned as is."""
    if isinstance(algo, dict):
        values = dict(algo)
        name = values.pop("learner", "chain")
        _choice("algo.learner", name, tuple(LEARNERS))
        return LEARNERS[name](**values)
    if type(algo) is LearnerConfig:
        shared = {f.name: getattr(algo, f.name) for f in dataclasses.fields(LearnerConfig)}
        cls = LEARNERS[algo.learner]
        if shared["name"] == LearnerConfig.name:
            shared["name"] = cls.name
        return cls(**shared)
    return algo


@dataclass
class FPOConfig(SamplingConfig, PPOConfig):
    """PPO with the denoising-loss ratio (``algo=fpo``, FPO): the whole denoiser trained with BC's loss."""

    name: str = "fpo"
    learner: ClassVar[str] = "fpo"
    mc_draws: int = 8
    """M: (t, eps) draws per decision in the ratio exp(mean_i [l_old(i) - l_theta(i)])."""

    def __post_init__(self) -> None:
        PPOConfig.__post_init__(self)
        SamplingConfig.__post_init__(self)
        if self.advantage != "gae":
            raise ValueError(f"algo=fpo needs algo.advantage=gae (a critic), got {self.advantage!r}")
        _positive("algo.mc_draws", self.mc_draws)


LEARNERS: dict[str, type] = {
    cls.learner: cls for cls in (ChainConfig, FPOConfig, ResidualConfig, FilteredBCConfig)
}
"""Schema of each learner, keyed by its ``learner`` constant and registered as ``algo/<learner>_schema``
(``conf/algo/<entry>.yaml`` names it in its defaults)."""
