"""Controlled StableDRL experiment: standard PPO clipping vs unconditional clipping + self-normalisation.

The problem is a contextual bandit solved by a tiny linear-Gaussian "denoising chain", so the optimum and
every per-sample gradient are known exactly:

- context s ~ N(0, I_Ds); the best action is a* = M s + c; reward = -||a - a*||^2;
- the policy draws the action through K' Gaussian steps from x_{K'} = 0:
  x_{k-1} = x_k + W_k s + b_k + sigma z (z ~ N(0, I_Da), sigma fixed), a = x_0; the log-probability of each
  step is averaged over Da (as the diffusion policy's are), giving log-probs (B, K');
- the optimum is sum_k W_k = M, sum_k b_k = c, with reward -K' Da sigma^2 (the irreducible noise).

Each iteration samples a batch, takes advantages as the batch-normalised rewards, and makes several PPO
epochs of minibatch updates on those now-stale samples. The rollout-time log-probabilities are corrupted
as ``old_logp + 100 * noise_scale * N(0, 1)``: 100x inflated noise in the importance-ratio estimate (the
situation of diffusion likelihood proxies). Two losses, same data and seeds:

(i)  ``clip="ppo", normalize="mean"``: standard PPO;
(ii) ``clip="unconditional", normalize="self"``: StableDRL.

At every update the gradient norm is compared with the bound (1+eps) max|A| max||grad log pi|| computed
from exact per-element gradients (``torch.func``), which (ii) must always satisfy. ``run`` reports reward
curves on a fixed evaluation set (common random numbers), the fraction of updates within the bound and
the largest gradient-to-bound ratio, as medians over ``repeats`` seeds.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

import torch
from torch.func import functional_call, jacrev

from diffpolicy.rl.advantages import normalize
from diffpolicy.rl.ppo import grad_bound, policy_loss

VARIANTS = {"ppo": ("ppo", "mean"), "stable": ("unconditional", "self")}
"""Variant name -> (policy_loss mode, normalize)."""


class ChainPolicy(torch.nn.Module):
    """K' linear-Gaussian steps x_{k-1} = x_k + W_k s + b_k + sigma z, from x_{K'} = 0.

    Parameters: ``weight`` (K', Da, Ds) and ``bias`` (K', Da), both zero at start.
    """

    def __init__(self, ft_steps: int, obs_dim: int, action_dim: int, sigma: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(ft_steps, action_dim, obs_dim))
        self.bias = torch.nn.Parameter(torch.zeros(ft_steps, action_dim))
        self.sigma = sigma

    def step_means(self, s: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
        """(B, K', Da) mean of each step given the stored chain (B, K'+1, Da) x_{K'} .. x_0."""
        drift = torch.einsum("kad,bd->bka", self.weight, s) + self.bias  # (B, K', Da)
        return chain[:, :-1] + drift

    def forward(self, s: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
        """(B, K') log-probability of each step of the stored chain, averaged over Da."""
        mu = self.step_means(s, chain)
        z = (chain[:, 1:] - mu) / self.sigma  # (B, K', Da)
        return (-0.5 * z.square() - math.log(self.sigma) - 0.5 * math.log(2 * math.pi)).mean(-1)

    @torch.no_grad()
    def sample(self, s: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """(B, K'+1, Da) chain x_{K'} = 0, ..., x_0 (the action)."""
        B, (Kp, Da, _) = s.shape[0], self.weight.shape
        noise = torch.randn(B, Kp, Da, generator=generator) * self.sigma
        drift = torch.einsum("kad,bd->bka", self.weight, s) + self.bias  # (B, K', Da)
        steps = torch.cumsum(drift + noise, dim=1)  # (B, K', Da)
        return torch.cat([torch.zeros(B, 1, Da), steps], dim=1)


def _reward(action: torch.Tensor, s: torch.Tensor, M: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return -(action - (s @ M.T + c)).square().sum(-1)  # (B,)


def train_variant(
    variant: str,
    *,
    seed: int = 0,
    iterations: int = 30,
    batch: int = 256,
    minibatch: int = 64,
    epochs: int = 4,
    ft_steps: int = 2,
    obs_dim: int = 3,
    action_dim: int = 2,
    sigma: float = 0.5,
    lr: float = 1.0,
    clip_eps: float = 0.2,
    noise_scale: float = 0.03,
    noise_mult: float = 100.0,
    eval_size: int = 1024,
) -> dict[str, Any]:
    """Train one variant from the same seeded start; returns its reward curve and gradient-bound checks."""
    mode, norm = VARIANTS[variant]
    gen = torch.Generator().manual_seed(seed)
    M = torch.randn(action_dim, obs_dim, generator=gen)
    c = torch.randn(action_dim, generator=gen)
    eval_s = torch.randn(eval_size, obs_dim, generator=gen)
    eval_seed = seed + 10_000
    policy = ChainPolicy(ft_steps, obs_dim, action_dim, sigma)
    opt = torch.optim.SGD(policy.parameters(), lr=lr)
    params = dict(policy.named_parameters())

    def evaluate() -> float:
        chain = policy.sample(eval_s, torch.Generator().manual_seed(eval_seed))
        value = _reward(chain[:, -1], eval_s, M, c).mean().item()
        return value if math.isfinite(value) else -math.inf

    def logp_of(p: dict[str, torch.Tensor], s: torch.Tensor, chain: torch.Tensor) -> torch.Tensor:
        return functional_call(policy, p, (s, chain), strict=True)

    curve = [evaluate()]
    within, ratios, max_norm = [], [], 0.0
    for _ in range(iterations):
        s = torch.randn(batch, obs_dim, generator=gen)
        chain = policy.sample(s, gen)
        with torch.no_grad():
            old_logp = policy(s, chain)  # (B, K')
            old_logp = old_logp + noise_mult * noise_scale * torch.randn(old_logp.shape, generator=gen)
        adv = normalize(_reward(chain[:, -1], s, M, c))  # (B,)
        for _ in range(epochs):
            for idx in torch.randperm(batch, generator=gen).split(minibatch):
                mb_s, mb_chain = s[idx], chain[idx]
                new_logp = policy(mb_s, mb_chain)
                loss, _ = policy_loss(new_logp, old_logp[idx], adv[idx], clip_eps, mode=mode, normalize=norm)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                grads = [p.grad for p in policy.parameters()]
                gnorm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])).item()
                detached = {k: v.detach() for k, v in params.items()}
                jac = jacrev(logp_of)(detached, mb_s, mb_chain)  # name -> (B, K', *param shape)
                per_elem = sum(j.flatten(2).square().sum(-1) for j in jac.values()).sqrt()  # (B, K')
                bound = grad_bound(adv[idx], per_elem, clip_eps).item()
                ok = math.isfinite(gnorm) and gnorm <= bound * (1 + 1e-4) + 1e-7
                within.append(ok)
                ratios.append(gnorm / bound if math.isfinite(gnorm) and bound > 0 else math.inf)
                max_norm = max(max_norm, gnorm) if math.isfinite(gnorm) else math.inf
                if math.isfinite(gnorm):
                    opt.step()
        curve.append(evaluate())
    return {
        "curve": curve,
        "grad_bound_ok_frac": sum(within) / len(within),
        "max_grad_over_bound": max(ratios),
        "max_grad_norm": max_norm,
        "optimum_reward": -ft_steps * action_dim * sigma**2,
    }


def _points(curve: list[float]) -> list[float]:
    """Start, quarter, middle, three quarters and end of a curve."""
    n = len(curve) - 1
    return [curve[round(f * n)] for f in (0.0, 0.25, 0.5, 0.75, 1.0)]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def run(repeats: int = 3, threads: int = 2, **kw: Any) -> dict:
    """Run both variants on ``repeats`` seeds; medians over seeds of every reported number.

    Keyword options are passed to :func:`train_variant` (``iterations``, ``noise_scale``, ``noise_mult``,
    ``lr``, ...). A control run (seed 0, ``noise_mult=1``: no inflation) shows both losses solve the task
    when the ratios are sane.

    Returns:
        ``ppo_reward_curve`` / ``stable_reward_curve`` (evaluation reward at 0, 25, 50, 75, 100 % of
        training), ``*_final_reward``, ``*_best_reward``, ``*_grad_bound_ok_frac`` (fraction of updates whose
        gradient norm is within (1+eps) max|A| max||g||; worst seed), ``*_max_grad_over_bound``,
        ``*_max_grad_norm``, ``*_control_final_reward``, ``optimum_reward``, ``logratio_noise_std`` and
        ``seconds``. Non-finite numbers are reported as null.
    """
    # The tensors are tiny (a few hundred elements): extra intra-op threads only add synchronisation,
    # which on a shared 2-core machine made a run ~7x slower, so one thread is used whatever ``threads``.
    previous = torch.get_num_threads()
    torch.set_num_threads(min(threads, 1))
    try:
        return _run(repeats, kw)
    finally:
        torch.set_num_threads(previous)


def _run(repeats: int, kw: dict[str, Any]) -> dict:
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    for name in VARIANTS:
        runs = [train_variant(name, seed=seed, **kw) for seed in range(repeats)]
        curves = [_points(r["curve"]) for r in runs]
        out[f"{name}_reward_curve"] = [_finite(statistics.median(col)) for col in zip(*curves)]
        out[f"{name}_final_reward"] = _finite(statistics.median(r["curve"][-1] for r in runs))
        out[f"{name}_best_reward"] = _finite(statistics.median(max(r["curve"]) for r in runs))
        out[f"{name}_grad_bound_ok_frac"] = min(r["grad_bound_ok_frac"] for r in runs)
        out[f"{name}_max_grad_over_bound"] = _finite(max(r["max_grad_over_bound"] for r in runs))
        out[f"{name}_max_grad_norm"] = _finite(max(r["max_grad_norm"] for r in runs))
        out["optimum_reward"] = runs[0]["optimum_reward"]
    for name in VARIANTS:
        control = train_variant(name, seed=0, **{**kw, "noise_mult": 1.0})
        out[f"{name}_control_final_reward"] = _finite(control["curve"][-1])
    out["logratio_noise_std"] = kw.get("noise_mult", 100.0) * kw.get("noise_scale", 0.03)
    out["repeats"] = repeats
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run()))
