"""DiffusionPolicy: observation encoders + conditional 1-D U-Net denoiser + DDIM sampler (DPPO-style).

Sampling runs K DDIM steps. The first K - K' are the base part (std = eta-scaled DDIM sigma, no gradient),
run by a frozen copy of the pre-trained denoiser once :meth:`DiffusionPolicy.set_sampling` has asked for
K' < K (DPPO's ``actor`` beside ``actor_ft``); the last K' are Gaussian transitions
x_{k-1} ~ N(mu_theta(x_k, k, obs), sigma_k^2) with sigma_k >= min_std, and their chain x_{K'} .. x_0
(normalised units) is returned so that :meth:`DiffusionPolicy.log_prob` can evaluate each transition
exactly under the current parameters. Log-probabilities count only the executed part of the chunk, actions
[To - 1, To - 1 + Te) of Ta, averaged over its Te x Da elements.

:meth:`PolicyBase.plan` is the single acting path (training rollouts and evaluation): one chunk per
decision, the Te executed actions in env units plus the full :class:`SampleOutput`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffpolicy.config import PolicyConfig
from diffpolicy.diffusion.sampler import ddim_sample
from diffpolicy.diffusion.schedule import NoiseSchedule, ddim_step_mean_std, ddpm_loss
from diffpolicy.encoders.fusion import ObservationEncoder
from diffpolicy.models.unet1d import ConditionalUnet1D
from diffpolicy.normalizer import MinMaxNormalizer

Obs = Mapping[str, Any]
_HALF_LOG_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass
class SampleOutput:
    """One sampled chunk per observation (everything detached)."""

    actions: torch.Tensor
    """(B, Ta, Da) actions in env units (un-normalised)."""
    normalized: torch.Tensor
    """(B, Ta, Da) the same actions in normalised units (x_0)."""
    chain: torch.Tensor | None
    """(B, K'+1, Ta, Da) normalised latents x_{K'} .. x_0 of the fine-tuned steps (None unless asked)."""
    means: torch.Tensor | None
    """(B, K', Ta, Da) mean of each fine-tuned transition at sampling time (None unless asked)."""
    stds: torch.Tensor | None
    """Std of each fine-tuned transition, broadcastable to ``means``: (1, K', 1, 1) diffusion, (1, 1, Ta, Da)
    Gaussian (None unless asked)."""
    log_probs: torch.Tensor | None
    """(B, K') log-probability of each stored transition at sampling time (None unless asked)."""
    cond: torch.Tensor
    """(B, cond_dim) observation conditioning vector the chunk was sampled with."""


def normal_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor | float) -> torch.Tensor:
    """Elementwise log N(x; mean, std^2), the same formula as ``torch.distributions.Normal.log_prob``."""
    std = torch.as_tensor(std, dtype=mean.dtype, device=mean.device)
    return -((x - mean) ** 2) / (2 * std**2) - std.log() - _HALF_LOG_2PI


class PolicyBase(nn.Module):
    """What diffusion and Gaussian policies share: encoders, action normaliser, acting and reductions."""

    ft_steps: int
    """K': transitions per decision whose log-probabilities ``log_prob`` returns."""

    def __init__(self, cfg: PolicyConfig, obs_spec: Obs, action_dim: int, *, text_backend: str = "minilm"):
        super().__init__()
        self.cfg = cfg
        self.action_dim = action_dim
        self.horizon = cfg.horizon
        self.n_obs_steps = cfg.n_obs_steps
        self.n_action_steps = cfg.n_action_steps
        self.obs_encoder = ObservationEncoder(
            cfg.encoder, obs_spec, cfg.n_obs_steps, cfg.cond_dim, text_backend=text_backend
        )
        self.obs_encoder.grad_checkpointing = cfg.grad_checkpointing
        self.action_normalizer = MinMaxNormalizer(action_dim)
        self.set_freeze_encoders(cfg.freeze_encoders)

    # ------------------------------------------------------------------------------------------ setup
    def set_freeze_encoders(self, frozen: bool) -> None:
        """Switch requires_grad of all encoder weights (the MiniLM itself is always frozen)."""
        self.encoders_frozen = frozen
        self.obs_encoder.requires_grad_(not frozen)

    def fit_normalizers(self, actions: torch.Tensor | None = None, state: torch.Tensor | None = None) -> None:
        """Fit min/max of actions (..., Da) and proprioception (..., Ds) from demonstration data."""
        if actions is not None:
            self.action_normalizer.fit(actions)
        if state is not None and self.obs_encoder.state_dim:
            self.obs_encoder.state_normalizer.fit(state)

    @property
    def device(self) -> torch.device:
        return self.action_normalizer.low.device

    @property
    def exec_slice(self) -> slice:
        """Executed actions of a chunk: [To - 1, To - 1 + Te) along Ta."""
        start = self.n_obs_steps - 1
        return slice(start, start + self.n_action_steps)

    _FORWARD_METHODS = ("bc_loss", "log_prob", "encode", "sample", "plan")

    def forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call a public method by name, so DDP-wrapped policies go through ``forward``.

        ``ddp_policy("bc_loss", obs, actions)`` / ``ddp_policy("log_prob", chain, obs)``: DDP synchronises
        gradients only for computations started by a ``forward`` call of the wrapper.
        """
        if method not in self._FORWARD_METHODS:
            raise ValueError(
                f"policy forward method {method!r} is not allowed; choose one of {self._FORWARD_METHODS}"
            )
        return getattr(self, method)(*args, **kwargs)

    # --------------------------------------------------------------------------------------- encoding
    def encode(self, obs: Obs, *, augment: bool | None = None) -> torch.Tensor:
        """Observation dict -> cond (B, cond_dim); random-shift augmentation defaults to training mode."""
        augment = self.training if augment is None else augment
        if self.encoders_frozen:
            with torch.no_grad():
                return self.obs_encoder(obs, augment)
        return self.obs_encoder(obs, augment)

    def reduce_executed(self, log_prob: torch.Tensor) -> torch.Tensor:
        """(..., Ta, Da) elementwise log-probs -> (...) mean over the executed Te x Da part."""
        return log_prob[..., self.exec_slice, :].mean(dim=(-2, -1))

    # ----------------------------------------------------------------------------------------- acting
    def sample(
        self,
        obs: Obs | None = None,
        *,
        cond: torch.Tensor | None = None,
        deterministic: bool = False,
        return_chain: bool = False,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> SampleOutput:
        raise NotImplementedError  # pragma: no cover - implemented by subclasses

    def plan(
        self,
        obs: Obs,
        *,
        deterministic: bool = False,
        return_chain: bool = True,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, SampleOutput]:
        """One decision: sample a chunk and return its Te executed actions (B, Te, Da) (env units) + sample."""
        out = self.sample(
            obs, deterministic=deterministic, return_chain=return_chain, generator=generator, noise=noise
        )
        return out.actions[:, self.exec_slice], out


class DiffusionPolicy(PolicyBase):
    """Encoders + ConditionalUnet1D + DDIM; built from (PolicyConfig, obs_spec, Da).

    obs_spec maps observation keys to per-step shapes (``state`` needs its Ds; ``rgb``/``points`` any
    shape; ``instruction`` any value). ``text_backend`` selects the instruction embedder (``minilm`` or the
    weight-free ``hash`` for fast tests).
    """

    def __init__(self, cfg: PolicyConfig, obs_spec: Obs, action_dim: int, *, text_backend: str = "minilm"):
        super().__init__(cfg, obs_spec, action_dim, text_backend=text_backend)
        self.denoiser = ConditionalUnet1D(
            action_dim,
            cfg.cond_dim,
            cfg.down_dims,
            cfg.kernel_size,
            cfg.n_groups,
            cfg.step_embed_dim,
            cfg.conditioning,
        )
        self.denoiser.grad_checkpointing = cfg.grad_checkpointing
        self.schedule = NoiseSchedule(
            cfg.train_timesteps, cfg.ddim_steps, cfg.ft_steps, cfg.eta, cfg.min_std, cfg.clip_sample
        )
        self.ft_steps = cfg.ft_steps
        self.logprob_min_std = 0.0
        """Floor on the std of the chain log-probs (0: the exact sampling std); set by PPO, see log_prob."""
        self.logprob_clamp: list[float] | tuple[float, ...] = ()
        """[low, high] clamp of every per-element log-prob, in nats, before averaging (DPPO: [-5, 2]); empty
        disables. Set by PPO like ``logprob_min_std``; applies to sampled and re-evaluated log-probs alike."""
        self.noise_clip = 0.0
        """Clamp of every sampled standard-normal draw z to [-noise_clip, noise_clip] before
        x = mean + std z, in std units (DPPO's ``randn_clip_value``: 3); 0 disables."""
        self._base: list[ConditionalUnet1D] = []
        """The frozen pre-trained denoiser of the first K - K' steps (empty until K' < K is asked for). A
        plain list, so the module does not register it: it is in neither ``parameters()`` (the optimiser,
        DDP) nor ``state_dict()`` (checkpoints keep their format); :meth:`_apply` moves it with the policy."""
        self.sampler_backend = "compiled" if cfg.compile else "auto"
        """DDIM loop backend: auto (the prepacked fast path on the CPU in fp32 inference, else eager) or
        compiled (torch.compile; falls back with a one-time warning when no compiler works)."""

    def set_sampling(self, *, ft_steps: int, eta: float, min_std: float) -> None:
        """Change how chains are sampled (K' fine-tuned steps, eta, the std floor) without touching weights.

        These settings do not enter the DDPM training loss, so one BC checkpoint serves fine-tuning runs
        with any of them; ``cfg`` is updated so that a checkpoint saved afterwards records them. With
        K' < K the current denoiser is also frozen as the base of the first K - K' steps
        (:meth:`freeze_base`), unless a base is already held: call this on the pre-trained weights, before
        fine-tuning (a resumed run loads its fine-tuned weights afterwards and keeps the pre-trained base).
        With K' = K there are no base steps and any base is dropped.
        """
        s = self.schedule
        self.schedule = NoiseSchedule(
            s.train_timesteps, s.ddim_steps, ft_steps, eta, min_std, s.clip_sample
        ).to(s.alphas_cumprod.device)
        self.ft_steps = ft_steps
        self.cfg = dataclasses.replace(self.cfg, ft_steps=ft_steps, eta=eta, min_std=min_std)
        if ft_steps == s.ddim_steps:
            self._base = []
        elif not self._base:
            self.freeze_base()

    def freeze_base(self) -> None:
        """Keep a frozen deep copy of the current denoiser for the K - K' steps before the fine-tuned ones.

        DPPO samples those steps with the pre-trained network (``actor``) and fine-tunes a copy
        (``actor_ft``) for the last K' only. Without the copy, every optimiser step would also move the
        early steps, i.e. the distribution of x_{K'} that the stored chains start from, which no PPO ratio
        accounts for. The copy has requires_grad False, stays in eval mode and is not registered (see
        ``_base``); it is not saved in checkpoints, so a policy rebuilt from one has no base until this
        is called again.
        """
        base = copy.deepcopy(self.denoiser).eval().requires_grad_(False)
        for q in base.parameters():
            q.grad = None
        self._base = [base]

    @property
    def base_denoiser(self) -> ConditionalUnet1D | None:
        """The frozen denoiser of the first K - K' steps, or None (K' = K, or no base frozen yet)."""
        return self._base[0] if self._base and self.ft_steps < self.schedule.ddim_steps else None

    def _apply(self, fn: Any, recurse: bool = True) -> DiffusionPolicy:
        """``to`` / ``cuda`` / ``float`` / ... also convert the unregistered frozen base."""
        super()._apply(fn, recurse)
        for base in getattr(self, "_base", ()):
            base._apply(fn, recurse)
        return self

    @torch.no_grad()
    def _run_sampler(self, cond, deterministic, return_chain, generator, noise):
        return ddim_sample(
            self.denoiser,
            self.schedule,
            cond,
            self.horizon,
            deterministic=deterministic,
            return_chain=return_chain,
            generator=generator,
            noise=noise,
            backend=self.sampler_backend,
            base_denoiser=self.base_denoiser,
            noise_clip=self.noise_clip,
        )

    def sample(
        self,
        obs: Obs | None = None,
        *,
        cond: torch.Tensor | None = None,
        deterministic: bool = False,
        return_chain: bool = False,
        generator: torch.Generator | None = None,
        noise: torch.Tensor | None = None,
    ) -> SampleOutput:
        """Sample one chunk per observation.

        obs: observation dict (B, To, ...) or ``cond`` (B, cond_dim) precomputed; ``noise`` (B, Ta, Da) is
        x_K (default N(0, I) from ``generator``); later steps draw from ``generator`` (each draw clamped
        to +-``noise_clip`` when that is > 0). ``deterministic`` takes every step's mean (eta = 0
        behaviour). Returns actions (B, Ta, Da) in env units and, with ``return_chain``, the fine-tuned
        chain (B, K'+1, Ta, Da), its means / stds and log-probs (B, K') (see :meth:`log_prob`).
        """
        with torch.inference_mode():
            if cond is None:
                cond = self.encode(obs, augment=False)
            out = self._run_sampler(cond, deterministic, return_chain, generator, noise)
            actions = self.action_normalizer.unnormalize(out.x0)
            log_probs = None
            if return_chain:
                std = self._ratio_std(out.stds)
                lp = normal_log_prob(out.chain[:, 1:], out.means, std)  # (B, K', Ta, Da)
                log_probs = self.reduce_executed(self._clamp_log_prob(lp))
        # Leave inference mode: results may feed autograd later (PPO log-probs of the stored chain).
        clone = lambda t: None if t is None else t.clone()
        return SampleOutput(
            actions=actions.clone(),
            normalized=out.x0.clone(),
            chain=clone(out.chain),
            means=clone(out.means),
            stds=clone(out.stds) if return_chain else None,
            log_probs=clone(log_probs),
            cond=cond.clone(),
        )

    def transition_mean_std(
        self, chain: torch.Tensor, cond: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gaussians of the stored transitions under the current parameters (differentiable).

        chain (B, K'+1, Ta, Da), cond (B, cond_dim) -> mean (B, K', Ta, Da) fp32, std (1, K', 1, 1).
        All K' denoiser calls run as one batch of B K'.
        """
        B, Kp = chain.shape[0], chain.shape[1] - 1
        if Kp != self.ft_steps:
            raise ValueError(
                f"chain has K'={Kp} transitions but the policy fine-tunes ft_steps={self.ft_steps}"
            )
        x_k = chain[:, :-1].reshape(B * Kp, *chain.shape[2:]).float()  # (B K', Ta, Da)
        idx = torch.arange(self.schedule.first_ft_step, self.schedule.ddim_steps, device=chain.device).repeat(
            B
        )
        eps = self.denoiser(x_k, self.schedule.timesteps[idx], cond.repeat_interleave(Kp, dim=0))
        mean, std = ddim_step_mean_std(
            x_k, eps.float(), self.schedule.step_coefs(idx), self.schedule.clip_sample
        )
        return mean.view(B, Kp, *chain.shape[2:]), self.schedule.std[self.schedule.first_ft_step :].view(
            1, Kp, 1, 1
        )

    def log_prob(
        self, chain: torch.Tensor, obs: Obs | None = None, *, cond: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Exact log-probability of each stored transition x_k -> x_{k-1}: chain (B, K'+1, Ta, Da) -> (B, K').

        Evaluated under the current parameters from ``obs`` (encoded without augmentation, so encoder
        gradients flow) or a given ``cond`` (B, cond_dim); averaged over the executed Te x Da elements; fp32.
        With ``logprob_min_std`` > 0 (DPPO's ``min_logprob_denoising_std``) every Gaussian's std is floored
        there first, and with a ``logprob_clamp`` [low, high] every per-element log-prob is clamped to it
        before the average (DPPO clamps to [-5, 2]: a far-out element has no gradient and cannot dominate
        the ratio), for these log-probs and for the ones :meth:`sample` returns alike.
        """
        if cond is None:
            cond = self.encode(obs, augment=False)
        mean, std = self.transition_mean_std(chain, cond)
        lp = normal_log_prob(chain[:, 1:].float(), mean, self._ratio_std(std))  # (B, K', Ta, Da)
        return self.reduce_executed(self._clamp_log_prob(lp))

    def _ratio_std(self, std: torch.Tensor) -> torch.Tensor:
        """The std the log-probs use: the sampling std, floored at ``logprob_min_std`` when that is > 0."""
        return std.clamp_min(self.logprob_min_std) if self.logprob_min_std > 0 else std

    def _clamp_log_prob(self, log_prob: torch.Tensor) -> torch.Tensor:
        """Per-element log-probs (..., Ta, Da) clamped to ``logprob_clamp`` when one is set."""
        if not self.logprob_clamp:
            return log_prob
        low, high = self.logprob_clamp
        return log_prob.clamp(float(low), float(high))

    def bc_loss(
        self, obs: Obs, actions: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Behaviour-cloning DDPM loss: obs (B, To, ...), actions (B, Ta, Da) env units -> scalar (fp32)."""
        cond = self.encode(obs)
        x0 = self.action_normalizer.normalize(actions.to(self.device, torch.float32))
        return ddpm_loss(self.denoiser, x0, cond, self.schedule, generator=generator)


class ActionQueue:
    """Receding-horizon executor: replans with ``policy.plan`` every Te steps and hands out one action.

    ``act(obs) -> (B, Da)`` env-unit actions; ``last`` holds the latest :class:`SampleOutput`;
    ``reset()`` forces a replan at the next call (e.g. after environments reset).
    """

    def __init__(self, policy: PolicyBase, **plan_kwargs: Any) -> None:
        self.policy = policy
        self.plan_kwargs = plan_kwargs
        self.last: SampleOutput | None = None
        self._actions: torch.Tensor | None = None  # (B, Te, Da)
        self._next = 0

    def reset(self) -> None:
        self._actions, self._next = None, 0

    @property
    def needs_plan(self) -> bool:
        """True when the next ``act`` will sample a new chunk."""
        return self._actions is None or self._next >= self._actions.shape[1]

    def act(self, obs: Obs) -> torch.Tensor:
        if self.needs_plan:
            self._actions, self.last = self.policy.plan(obs, **self.plan_kwargs)
            self._next = 0
        action = self._actions[:, self._next]
        self._next += 1
        return action


def make_policy(
    cfg: PolicyConfig, obs_spec: Obs, action_dim: int, *, text_backend: str = "minilm"
) -> PolicyBase:
    """Build the policy named by ``cfg.kind``: ``diffusion`` -> DiffusionPolicy, ``gaussian`` -> GaussianPolicy."""
    if cfg.kind == "diffusion":
        return DiffusionPolicy(cfg, obs_spec, action_dim, text_backend=text_backend)
    if cfg.kind == "gaussian":
        from diffpolicy.models.gaussian import GaussianPolicy

        return GaussianPolicy(cfg, obs_spec, action_dim, text_backend=text_backend)
    raise ValueError(f"policy.kind={cfg.kind!r} is not allowed; choose one of diffusion, gaussian")
