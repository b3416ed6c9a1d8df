"""DiffusionPolicy: observation encoders + denoiser (conditional 1-D U-Net, or an MLP) + DDIM sampler (DPPO-style).

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
import math
from typing import Any

import torch

from diffpolicy.config import PolicyConfig, SamplingConfig
from diffpolicy.diffusion.sampler import ddim_sample
from diffpolicy.diffusion.schedule import NoiseSchedule, ddim_step_mean_std, ddpm_loss
from diffpolicy.models.mlp_denoiser import MLPDenoiser
from diffpolicy.models.unet1d import ConditionalUnet1D
from diffpolicy.policies.base import (
    Obs,
    PolicyBase,
    SampleOutput,
    correlated_normal_log_prob,
    held_normal_log_prob,
    normal_log_prob,
)


class DiffusionPolicy(PolicyBase):
    """Encoders + ConditionalUnet1D + DDIM; built from (PolicyConfig, obs_spec, Da).

    obs_spec maps observation keys to per-step shapes (``state`` needs its Ds; ``rgb``/``points`` any
    shape; ``instruction`` any value). ``text_backend`` selects the instruction embedder (``minilm`` or the
    weight-free ``hash`` for fast tests).
    """

    def __init__(self, cfg: PolicyConfig, obs_spec: Obs, action_dim: int, *, text_backend: str = "minilm"):
        super().__init__(cfg, obs_spec, action_dim, text_backend=text_backend)
        fresh = SamplingConfig()  # every step stochastic until a learner or checkpoint says otherwise
        self.schedule = NoiseSchedule(
            cfg.train_timesteps, cfg.ddim_steps, cfg.ddim_steps, fresh.eta, fresh.min_std, cfg.clip_sample
        )
        if cfg.denoiser == "mlp":
            self.denoiser = MLPDenoiser(
                action_dim, cfg.horizon, cfg.cond_dim, cfg.mlp_dims, cfg.step_embed_dim
            )
        else:
            self.denoiser = ConditionalUnet1D(
                action_dim,
                cfg.cond_dim,
                cfg.down_dims,
                cfg.kernel_size,
                cfg.n_groups,
                cfg.step_embed_dim,
                cfg.conditioning,
                cfg.fold,
                cfg.prediction,
                self.schedule.alphas_cumprod,
                norm_kernel=cfg.train_kernels,
            )
        self.denoiser.grad_checkpointing = cfg.grad_checkpointing
        self.ft_steps = cfg.ddim_steps
        self.logprob_min_std = 0.0
        """Floor on the std of the chain log-probs (0: the exact sampling std); set by PPO, see log_prob."""
        self.logprob_clamp: list[float] | tuple[float, ...] = ()
        """[low, high] clamp of every per-element log-prob, in nats, before averaging (DPPO: [-5, 2]); empty
        disables. Set by PPO like ``logprob_min_std``; applies to sampled and re-evaluated log-probs alike."""
        self.noise_clip = 0.0
        """Clamp of every sampled standard-normal draw z to [-noise_clip, noise_clip] before
        x = mean + std z, in std units (DPPO's ``randn_clip_value``: 3); 0 disables."""
        self.action_std = 0.0
        """> 0: the chain learner's policy is Gaussian around the noise-free chain, N(chain(x_K), sigma^2) over
        the chunk (normalised units, sigma = this x the schedule's ``noise_scale``): one "transition" from x_K
        to the executed chunk, whose log-probability is differentiated back through all K steps, or the last
        :attr:`grad_steps` (see :meth:`set_sampling`). 0: the K' stochastic DDIM steps are the policy (DPPO)."""
        self.action_corr = 0.0
        """Correlation of that noise across the chunk's steps, in [0, 1] (see :meth:`set_sampling`)."""
        self.action_std_env = False
        """``action_std`` is in env units, one std per normalised dimension (see :meth:`set_sampling`)."""
        self.grad_steps = 0
        """Gradient of the action-space log-prob through the last this-many denoising steps only (0: all K);
        set by the chain learner (``algo.grad_steps``), see :meth:`noise_free_chunk`."""
        self._base: list[ConditionalUnet1D] = []
        """The frozen pre-trained denoiser of the first K - K' steps (empty until K' < K is asked for). A
        plain list, so the module does not register it: it is in neither ``parameters()`` (the optimiser,
        DDP) nor ``state_dict()`` (checkpoints keep their format); :meth:`_apply` moves it with the policy."""
        self.sampler_backend = "compiled" if cfg.compile else "auto"
        """DDIM loop backend: auto (the prepacked fast path on the CPU in fp32 inference, else eager) or
        compiled (torch.compile; falls back with a one-time warning when no compiler works)."""

    def set_sampling(
        self,
        *,
        ft_steps: int,
        eta: float,
        min_std: float,
        noise_scale: float = 1.0,
        action_std: float = 0.0,
        action_corr: float = 0.0,
        action_std_env: bool = False,
        freeze: bool = True,
    ) -> None:
        """Change how chains are sampled (K' stochastic steps, eta, the std floor, the scale of the K' steps'
        stds, which the chain learner measures: ``algo.explore_tolerance``) without touching weights.

        The learner that samples the chain owns these settings (``algo.ft_steps``, ``algo.eta``,
        ``algo.min_std``: :class:`~diffpolicy.config.SamplingConfig`); they do not enter the DDPM training
        loss, so one BC checkpoint serves fine-tuning runs with any of them. :attr:`sampling` records them,
        and a checkpoint saved afterwards carries them (``config["sampling"]``). With K' < K and ``freeze``
        the current denoiser is also frozen as the base of the first K - K' steps (:meth:`freeze_base`),
        unless a base is already held: call this on the pre-trained weights, before fine-tuning (a resumed
        run loads its fine-tuned weights afterwards and keeps the pre-trained base); a checkpoint being
        rebuilt passes ``freeze=False`` and loads its stored base. With K' = K any base is dropped.

        ``action_std`` > 0 explores in action space instead (the chain learner's ``algo.action_std``): a
        rollout takes the noise-free chain from a drawn x_K and adds Gaussian noise of std ``action_std`` x
        ``noise_scale`` to its chunk; the stored "chain" is (x_K, executed chunk), one transition (``ft_steps``
        becomes 1 for the learner), and its log-probability is taken under the noise-free chain recomputed from
        x_K with gradients through every one of the K steps (all fine-tuned: no frozen base). The policy that
        is deployed (every step's mean) is then the mean of the policy that explores, as in NCDPO (Yang et
        al. 2025), where DPPO's stochastic steps explore with a policy the deployed one only approximates.
        ``action_corr`` in [0, 1] correlates that noise across the chunk's steps (one draw per action
        dimension held over the chunk, weight sqrt(corr), plus one per step, sqrt(1 - corr)), and its
        log-probability is the joint one over the executed steps (:func:`correlated_normal_log_prob`); 1 holds
        one draw over the chunk and nothing else, and the log-probability is that of the executed steps' mean
        offset from the chain (:func:`held_normal_log_prob`). ``action_std_env`` reads ``action_std`` in env
        units, one std per action dimension through the action normaliser's scale (as ``algo=filtered_bc``'s
        exploration is given), instead of normalised units.
        """
        if not action_std >= 0:
            raise ValueError(f"action_std={action_std} must be >= 0")
        if not 0.0 <= action_corr <= 1.0 or (action_corr > 0 and action_std == 0):
            raise ValueError(f"action_corr={action_corr} must lie in [0, 1], and be 0 without action_std")
        if action_std_env and action_std == 0:
            raise ValueError("action_std_env reads action_std in env units: it needs action_std > 0")
        s = self.schedule
        if action_std > 0:
            ft_steps = s.ddim_steps
        self.schedule = NoiseSchedule(
            s.train_timesteps, s.ddim_steps, ft_steps, eta, min_std, s.clip_sample, noise_scale
        ).to(s.alphas_cumprod.device)
        self.ft_steps = 1 if action_std > 0 else ft_steps
        self.action_std = float(action_std)
        self.action_corr = float(action_corr)
        self.action_std_env = bool(action_std_env)
        if ft_steps == s.ddim_steps:
            self._base = []
        elif freeze and not self._base:
            self.freeze_base()

    @property
    def sampling(self) -> dict[str, float | int]:
        """How chains are sampled now: ``{"ft_steps": K', "eta": ..., "min_std": ..., "noise_scale": ...}``, and
        ``action_std`` when it is > 0 (:meth:`set_sampling`)."""
        s = self.schedule
        out: dict[str, float | int] = {
            "ft_steps": int(s.ft_steps),
            "eta": float(s.eta),
            "min_std": float(s.min_std),
            "noise_scale": float(s.noise_scale),
        }
        if self.action_std > 0:
            out["action_std"] = self.action_std
        if self.action_corr > 0:
            out["action_corr"] = self.action_corr
        if self.action_std_env:
            out["action_std_env"] = True
        return out

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
        to +-``noise_clip`` when that is > 0). ``deterministic`` takes every step's mean with no noise: the
        means of the chain's own Gaussians under its ``eta`` (the noise-free protocol), which is DDIM eta 0
        only for a policy sampled with eta 0 (with eta 1 the means weight x_k differently). Returns actions (B, Ta, Da) in env units and, with ``return_chain``, the fine-tuned
        chain (B, K'+1, Ta, Da), its means / stds and log-probs (B, K') (see :meth:`log_prob`).
        """
        if self.action_std > 0 and not deterministic:
            return self._sample_action_noise(obs, cond, return_chain, generator, noise)
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

    @property
    def action_sigma(self) -> float:
        """The std of the action-space exploration: ``action_std`` x the noise scale (normalised units, or env
        units with ``action_std_env``; :meth:`_action_std_tensor` gives it per normalised dimension)."""
        return self.action_std * float(self.schedule.noise_scale)

    def _sample_action_noise(self, obs, cond, return_chain, generator, noise) -> SampleOutput:
        """:meth:`sample` with ``action_std`` > 0: the noise-free chain from x_K (``noise``, else drawn), plus
        Gaussian noise of std :attr:`action_sigma` on its chunk (each draw clamped to +-``noise_clip``)."""
        with torch.inference_mode():
            if cond is None:
                cond = self.encode(obs, augment=False)
            shape = (cond.shape[0], self.horizon, self.action_dim)
            x_k = noise if noise is not None else torch.randn(shape, generator=generator, device=cond.device)
            x_k = x_k.to(cond.device, torch.float32)
            mean = self._run_sampler(cond, True, False, generator, x_k).x0  # (B, Ta, Da)
            z = torch.randn(shape, generator=generator, device=cond.device)
            if self.noise_clip > 0:
                z = z.clamp(-self.noise_clip, self.noise_clip)
            if self.action_corr > 0:  # one draw per action dimension held over the chunk, plus z per step
                held = torch.randn((shape[0], 1, shape[2]), generator=generator, device=cond.device)
                if self.noise_clip > 0:
                    held = held.clamp(-self.noise_clip, self.noise_clip)
                z = math.sqrt(self.action_corr) * held + math.sqrt(1.0 - self.action_corr) * z
            std = self._action_std_tensor(cond.device)  # (1, 1, 1, 1 or Da)
            x = mean + std[0] * z
            log_probs = None
            if return_chain:
                log_probs = self._action_log_prob(x, mean, std[0]).unsqueeze(1)  # (B, 1)
        return SampleOutput(
            actions=self.action_normalizer.unnormalize(x).clone(),
            normalized=x.clone(),
            chain=torch.stack([x_k, x], dim=1).clone() if return_chain else None,  # (B, 2, Ta, Da)
            means=mean.unsqueeze(1).clone() if return_chain else None,
            stds=std.clone() if return_chain else None,
            log_probs=None if log_probs is None else log_probs.clone(),
            cond=cond.clone(),
        )

    def _action_log_prob(self, x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
        """Log-probability of executed chunks x (..., Ta, Da) under the action-space Gaussian around ``mean``,
        per executed element (the joint log-probability over the Te executed steps divided by Te Da when the
        noise is correlated, the mean of the clamped element log-probs when it is not): (...) fp32."""
        std = self._ratio_std(std)
        if self.action_corr > 0:
            executed, centre = x[..., self.exec_slice, :], mean[..., self.exec_slice, :]
            if self.action_corr == 1.0:
                lp = held_normal_log_prob(executed, centre, std)  # (..., Da)
            else:
                lp = correlated_normal_log_prob(executed, centre, std, self.action_corr)  # (..., Da)
            return lp.mean(-1) / executed.shape[-2]
        return self.reduce_executed(self._clamp_log_prob(normal_log_prob(x, mean, std)))

    def _action_std_tensor(self, device: torch.device) -> torch.Tensor:
        """:attr:`action_sigma` as the one transition's std in normalised units, shaped like
        :meth:`transition_mean_std`'s: (1, 1, 1, 1), or (1, 1, 1, Da) with ``action_std_env`` (env-unit std
        times the normaliser's per-dimension scale, 2 / range, 1 on a constant dimension)."""
        if not self.action_std_env:
            return torch.full((1, 1, 1, 1), self.action_sigma, device=device)
        scale = self.action_normalizer.scale.float().to(device)
        return (self.action_sigma * scale).view(1, 1, 1, -1)

    def noise_free_chunk(self, x_k: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Every DDIM step's mean from x_K (B, Ta, Da) under cond (B, cond_dim) -> x_0 (B, Ta, Da) (the
        noise-free protocol's chunk, as :meth:`sample` with ``deterministic``), differentiable through all K
        steps, or through the last :attr:`grad_steps` only when that is in (0, K): the steps before them run
        without gradient, so the chunk is the same and only its gradient is truncated."""
        s, x = self.schedule, x_k.float()
        first_grad = s.ddim_steps - self.grad_steps if 0 < self.grad_steps < s.ddim_steps else 0
        for i in range(s.ddim_steps):
            with torch.set_grad_enabled(torch.is_grad_enabled() and i >= first_grad):
                idx = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
                eps = self.denoiser(x, s.timesteps[idx], cond)
                x, _ = ddim_step_mean_std(x, eps.float(), s.step_coefs(idx), s.clip_sample)
        return x

    def transition_mean_std(
        self, chain: torch.Tensor, cond: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gaussians of the stored transitions under the current parameters (differentiable).

        chain (B, K'+1, Ta, Da), cond (B, cond_dim) -> mean (B, K', Ta, Da) fp32, std (1, K', 1, 1).
        All K' denoiser calls run as one batch of B K'. With ``action_std`` > 0 the one transition x_K -> chunk:
        mean (B, 1, Ta, Da) the noise-free chain from ``chain[:, 0]`` (K sequential calls), std
        :attr:`action_sigma`.
        """
        B, Kp = chain.shape[0], chain.shape[1] - 1
        if self.action_std > 0:
            if Kp != 1:
                raise ValueError(f"chain has K'={Kp} transitions; action-space exploration stores one")
            mean = self.noise_free_chunk(chain[:, 0], cond)
            return mean.unsqueeze(1), self._action_std_tensor(chain.device)
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
        if self.action_std > 0:
            return self._action_log_prob(chain[:, 1:].float(), mean, std)  # (B, 1)
        lp = normal_log_prob(chain[:, 1:].float(), mean, self._ratio_std(std))  # (B, K', Ta, Da)
        return self.reduce_executed(self._clamp_log_prob(lp))

    def chain_bc_loss(
        self, x0: torch.Tensor, cond: torch.Tensor, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """The BC (DDPM) loss of the denoiser at the timesteps the K' fine-tuned steps query: x0 (B, Ta, Da)
        normalised chunks (a stored chain's last state), cond (B, cond_dim) -> scalar fp32.

        t is drawn uniformly below K' T / K (the DDIM timesteps of the fine-tuned steps are 0, T/K, ...,
        (K'-1) T/K); the first K - K' steps run the frozen base, which no gradient reaches. The chunk's steps
        are weighted as in :meth:`bc_loss`. Minimising it moves every fine-tuned step's mean toward x0, so
        the noise-free chain (the deployed policy) follows, where raising the chain's exact log-probability
        pulls each step toward one noisy draw of its successor. Draws come from ``generator`` (CPU) and are
        moved to x0's device."""
        s = self.schedule
        high = s.ft_steps * (s.train_timesteps // s.ddim_steps)
        B = x0.shape[0]
        t = torch.randint(0, high, (B,), generator=generator).to(x0.device)
        noise = torch.randn(x0.shape, generator=generator).to(x0.device)
        elements = ddpm_loss(self.denoiser, x0.float(), cond, s, t=t, noise=noise, reduction="none")
        return self.chunk_loss(elements)

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
        self,
        obs: Obs,
        actions: torch.Tensor,
        *,
        generator: torch.Generator | None = None,
        draws: int = 1,
        return_cond: bool = False,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Behaviour-cloning DDPM loss: obs (B, To, ...), actions (B, Ta, Da) env units -> scalar (fp32).

        ``draws`` > 1 encodes each observation once and averages the loss over that many (step, noise)
        draws of its chunk (the denoiser sees B * draws samples): lower-variance gradients for the encoders
        at the denoiser's cost only. The chunk's steps are weighted by :meth:`chunk_loss`. ``return_cond``
        also returns the condition (B, cond_dim), for an auxiliary loss on it. ``positions`` (B, 3 k) m:
        predict-then-act's condition is computed from these (BC's noised labels), not from perception.
        ``mask`` (B, Ta) bool: the chunk steps the loss is taken on (:meth:`chunk_loss`)."""
        if draws < 1:
            raise ValueError(f"draws={draws} must be >= 1")
        cond = self.encode(obs, positions=positions)
        x0 = self.action_normalizer.normalize(actions.to(self.device, torch.float32))
        c, x = (
            (cond, x0) if draws == 1 else (cond.repeat_interleave(draws, 0), x0.repeat_interleave(draws, 0))
        )
        if mask is not None and draws > 1:
            mask = mask.repeat_interleave(draws, 0)
        loss = self.chunk_loss(
            ddpm_loss(self.denoiser, x, c, self.schedule, generator=generator, reduction="none"), mask
        )
        return (loss, cond) if return_cond else loss
