"""PPO whose likelihood ratio comes from the denoising loss (``algo=fpo``; FPO, McAllister et al. 2025).

The diffusion policy's likelihood is never computed. For a stored decision (observation o, sampled chunk
x0 in normalised units) and M fixed draws (t_i, eps_i), the per-draw denoising loss

    l_theta(i) = mean over the executed Te x Da entries of (eps_theta(sqrt(a_t) x0 + sqrt(1 - a_t) eps_i, t_i, o) - eps_i)^2

is BC's own loss on that chunk; a lower loss means the chunk became likelier (it bounds -log pi up to a
constant, the ELBO). FPO's ratio is r = exp(mean_i [l_old(i) - l_theta(i)]), with l_old taken under the
rollout's weights on the same draws, and enters PPO's clipped surrogate with GAE advantages from a critic on
the observation. So it trains the whole denoiser (every noise level, not the last K' DDIM steps) with the loss
BC uses, the PPO form of "imitate what worked, more where the advantage is larger".

Rollouts are the chain learner's (:func:`diffpolicy.rl.chain.rollout.collect_rollout`: the stochastic DDIM chain,
``algo.eta`` and ``algo.min_std``), so exploration is the same as DPPO's; only the update differs.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import Tensor

from diffpolicy import checkpoint
from diffpolicy.config import FPOConfig, TrainConfig
from diffpolicy.device import Runtime
from diffpolicy.distributed import DistInfo, average_gradients, seed_for_rank
from diffpolicy.env_factory import make_envs
from diffpolicy.models.critic import Critic
from diffpolicy.rl.advantages import gae_advantages, normalize, normalize_rollout
from diffpolicy.rl.buffer import RolloutBuffer
from diffpolicy.rl.chain.learner import chain_specs
from diffpolicy.rl.chain.rollout import collect_rollout
from diffpolicy.rl.chain.update import batch_obs
from diffpolicy.rl.epochs import KLEpochs
from diffpolicy.rl.learner import PolicyLearner, RolloutStats, register
from diffpolicy.rl.ppo import clipped_surrogate, value_loss


def denoising_losses(policy: Any, x0: Tensor, cond: Tensor, t: Tensor, eps: Tensor, n_exec: int) -> Tensor:
    """Per-draw denoising loss over the executed part of each chunk.

    Args:
        x0: (B, Ta, Da) normalised chunks; cond: (B, cond_dim); t: (B, M) diffusion steps; eps: (B, M, Ta, Da).
        n_exec: Te, the leading chunk steps that were executed (the loss averages over them only).

    Returns:
        (B, M) float32 losses.
    """
    B, M = t.shape
    a = policy.schedule.alphas_cumprod[t].view(B, M, 1, 1)
    x_t = a.sqrt() * x0.unsqueeze(1) + (1 - a).sqrt() * eps  # (B, M, Ta, Da)
    flat_cond = cond.unsqueeze(1).expand(B, M, cond.shape[-1]).reshape(B * M, -1)
    pred = policy.denoiser(x_t.reshape(B * M, *x0.shape[1:]), t.reshape(-1), flat_cond)  # (B M, Ta, Da)
    err = (pred.float() - eps.reshape(B * M, *x0.shape[1:]).float())[:, :n_exec] ** 2
    return err.mean(dim=(1, 2)).view(B, M)


def fpo_ratio_loss(
    new_loss: Tensor, old_loss: Tensor, adv: Tensor, clip_eps: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate with FPO's ratio exp(mean_i (old - new)); new/old (B, M), adv (B,) -> scalar."""
    log_ratio = (old_loss - new_loss).mean(dim=1).clamp(-20.0, 20.0)  # (B,)
    surrogate, _ = clipped_surrogate(log_ratio, adv, clip_eps)
    with torch.no_grad():
        ratio = log_ratio.exp()
        stats = {
            "clipfrac": ((ratio - 1).abs() > clip_eps).float().mean(),
            "approx_kl": ((ratio - 1) - log_ratio).mean(),
            "ratio_max": ratio.max(),
        }
    return -surrogate.mean(), stats


@register(FPOConfig)
class FPOLearner(PolicyLearner):
    """FPO on the whole denoiser of ``policy``: the chain learner's rollout, the denoising-loss ratio's update."""

    def __init__(self, cfg: TrainConfig, rt: Runtime, info: DistInfo, policy: Any, logger: Any) -> None:
        if not hasattr(policy, "denoiser"):
            raise ValueError("algo=fpo needs a diffusion policy (policy.kind=diffusion)")
        algo = cfg.algo
        self.cfg, self.rt, self.info, self.policy, self.logger = cfg, rt, info, policy, logger
        self.critic = Critic(cfg.policy.cond_dim).to(rt.device)
        self.actor_params = [p for p in policy.parameters() if p.requires_grad]
        self.actor_optim = torch.optim.Adam(self.actor_params, lr=algo.lr)
        self.critic_optim = torch.optim.Adam(self.critic.parameters(), lr=algo.critic_lr)
        self.venv = make_envs(
            cfg.env, policy.n_action_steps, cfg.env.num_envs, seed_for_rank(cfg.seed, info.rank)
        )
        self.buffer = RolloutBuffer(
            algo.n_steps, cfg.env.num_envs, chain_specs(policy, cfg.policy.cond_dim), rt.device
        )
        self._last: tuple[Tensor, Tensor] | None = None

    def rollout(self, seed: int) -> RolloutStats:
        algo, n = self.cfg.algo, self.cfg.env.num_envs
        self.policy.eval()
        last_value, stats = collect_rollout(
            self.policy, self.critic, self.venv, self.buffer, n_steps=algo.n_steps,
            seeds=[seed + i for i in range(n)], gamma=algo.gamma, device=self.rt.device,
            generator=torch.Generator(device=self.rt.device).manual_seed(seed), autocast=self.rt.autocast,
        )  # fmt: skip
        data = self.buffer.get()
        self._last = gae_advantages(
            data["rewards"], data["values"], data["dones"], last_value, algo.gamma, algo.gae_lambda
        )
        return stats

    def _cond(self, mb: dict[str, Tensor]) -> Tensor:
        if getattr(self.policy, "encoders_frozen", False):
            return mb["cond"]
        return self.policy.encode(batch_obs(mb, self.buffer), augment=False)

    def update(self, seed: int, step: int, iteration: int) -> dict[str, float]:
        """``algo.update_epochs`` epochs of clipped FPO steps over the rollout; ``losses/*`` averaged."""
        algo, policy, device = self.cfg.algo, self.policy, self.rt.device
        adv, ret = self._last
        data = self.buffer.get()
        if algo.norm_adv == "batch":
            adv = normalize_rollout(adv, data.get("valid"), self.info)
        T, N = adv.shape
        gen = torch.Generator().manual_seed(seed)
        x0 = data["chains"][:, :, -1]  # (T, N, Ta, Da): the executed chunks, normalised
        M, Te = algo.mc_draws, policy.n_action_steps
        t = torch.randint(0, policy.schedule.train_timesteps, (T, N, M), generator=gen).to(device)
        eps = torch.randn((T, N, M, *x0.shape[2:]), generator=gen).to(device)
        old = torch.empty(T, N, M, device=device)
        with torch.no_grad(), self.rt.autocast():
            policy.eval()
            for i in range(T):  # l_old under the rollout's weights, on the draws the update will use
                mb = {k: v[i] for k, v in data.items()}
                old[i] = denoising_losses(policy, x0[i], self._cond(mb), t[i], eps[i], Te)
        policy.train()
        sums: dict[str, float] = defaultdict(float)
        count = 0
        params = self.actor_params + list(self.critic.parameters())
        extra = {"advantages": adv, "returns": ret, "t": t, "eps": eps, "old": old}
        epochs = KLEpochs(algo.update_epochs, algo.target_kl, self.info, device)
        for _ in epochs:
            for mb in self.buffer.minibatches(algo.minibatch_size, gen, extra=extra):
                with self.rt.autocast():
                    cond = self._cond(mb)
                    new = denoising_losses(policy, mb["chains"][:, -1], cond, mb["t"], mb["eps"], Te)
                a = normalize(mb["advantages"]) if algo.norm_adv == "minibatch" else mb["advantages"].float()
                pg, stats = fpo_ratio_loss(new, mb["old"], a, algo.clip_eps)
                v_loss = value_loss(self.critic(cond.detach().float()), mb["returns"])
                loss = pg + algo.vf_coef * v_loss
                self.actor_optim.zero_grad(set_to_none=True)
                self.critic_optim.zero_grad(set_to_none=True)
                loss.backward()
                average_gradients(params, self.info)
                norm = torch.nn.utils.clip_grad_norm_(params, algo.max_grad_norm or float("inf"))
                self.actor_optim.step()
                self.critic_optim.step()
                for name, value in (("losses/policy", pg), ("losses/value", v_loss), ("losses/grad_norm", norm),
                                    *((f"losses/{k}", v) for k, v in stats.items())):  # fmt: skip
                    sums[name] += float(value.detach())
                count += 1
                epochs.record(float(stats["approx_kl"]))  # the stop compares the KL averaged over ranks
        policy.eval()
        out = {k: v / max(1, count) for k, v in sums.items()}
        out["losses/epochs"] = float(epochs.run)
        out["rollout/advantage_std"] = float(adv.std())
        return out

    # ------------------------------------------------------------------------------------- checkpoints
    def state(self) -> dict[str, Any]:
        return {
            "critic": self.critic.state_dict(),
            "actor_optim": self.actor_optim.state_dict(),
            "critic_optim": self.critic_optim.state_dict(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.load_weights(state)
        checkpoint.load_state(self.critic, state["critic"], name="critic")
        self.actor_optim.load_state_dict(state["actor_optim"])
        self.critic_optim.load_state_dict(state["critic_optim"])

    def modules(self) -> list[torch.nn.Module]:
        return [self.policy, self.critic]
