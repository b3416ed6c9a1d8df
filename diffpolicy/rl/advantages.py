"""Advantage estimators: GAE over decisions, group-relative (GRPO), normalisation, denoising discount.

Symbols (DESIGN.md): T decisions per environment, N environments, B decisions in a batch, K' fine-tuned
denoising steps, G environments per group.

GAE runs the ``diffpolicy::gae`` operator (:func:`diffpolicy.ops.gae`, imported lazily so this module imports
even where the op is not built); :func:`gae_loop_reference` is an independent scalar loop the op is tested
against here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from diffpolicy.distributed import DistInfo, sum_metrics


@torch.no_grad()
def gae_advantages(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimates over decisions with :func:`diffpolicy.ops.gae`.

    Args:
        rewards: (T, N) reward of each decision (the sum of its Te environment rewards).
        values: (T, N) critic value of the observation each decision was taken from.
        dones: (T, N) 1 where the episode ended at that decision (nothing after it is bootstrapped).
        last_value: (N,) critic value of the observation after the last decision.
        gamma: discount between decisions.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both (T, N) float32, with ``returns = advantages + values``.
    """
    from diffpolicy.ops import gae

    f32 = torch.float32
    return gae(
        rewards.to(f32).contiguous(),
        values.to(f32).contiguous(),
        dones.to(f32).contiguous(),
        last_value.to(f32).contiguous(),
        float(gamma),
        float(lam),
    )


def gae_loop_reference(
    rewards: Tensor, values: Tensor, dones: Tensor, last_value: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Scalar double loop over envs and reversed time, in float64: the independent answer for tests.

    Same arguments and returns as :func:`gae_advantages` (float64, on the CPU).
    """
    r, v, d = (x.detach().double().cpu() for x in (rewards, values, dones))
    lv = last_value.detach().double().cpu()
    T, N = r.shape
    adv = torch.zeros(T, N, dtype=torch.float64)
    for n in range(N):
        running = 0.0
        for t in reversed(range(T)):
            next_v = float(lv[n]) if t == T - 1 else float(v[t + 1, n])
            keep = 1.0 - float(d[t, n])
            delta = float(r[t, n]) + gamma * next_v * keep - float(v[t, n])
            running = delta + gamma * lam * keep * running
            adv[t, n] = running
    return adv, adv + v


def grpo_advantages(returns: Tensor, eps: float = 1e-6, scale: bool = True) -> Tensor:
    """Group-relative advantages: (R - mean) / (std + eps) within each group, or R - mean unscaled.

    A group is the G environments reset to the same seed; their episode returns are compared with each
    other, so no critic is needed. The std is the population std (``correction=0``), so a group of one
    gives advantage 0 rather than NaN.

    Dividing by the group's std gives every group the same weight, however little its returns differ: a
    group whose members all succeeded, and differ only in shaping terms, gets advantages of +-1 from those
    small differences. ``scale=False`` (Dr. GRPO, Liu et al. 2025) keeps the returns' own scale, so such a
    group weighs little next to one that split into successes and failures; a batch-wide normalisation
    (``algo.norm_adv``) then sets the overall scale.

    Args:
        returns: (num_groups, G) episode return of each member.
        eps: added to the std (groups whose members all scored the same get advantage 0).
        scale: divide by the group's std (False: only subtract the group mean).

    Returns:
        (num_groups, G) float32 advantages.
    """
    if returns.dim() != 2:
        raise ValueError(f"returns must be (num_groups, G); got shape {tuple(returns.shape)}")
    r = returns.float()
    mean = r.mean(dim=1, keepdim=True)  # (num_groups, 1)
    if not scale:
        return r - mean
    std = r.std(dim=1, correction=0, keepdim=True)  # (num_groups, 1)
    return (r - mean) / (std + eps)


def normalize(adv: Tensor, eps: float = 1e-8) -> Tensor:
    """(adv - mean) / (std + eps) over all elements (e.g. per minibatch), in float32."""
    a = adv.float()
    if a.numel() < 2:
        return a - a.mean()
    return (a - a.mean()) / (a.std() + eps)


def normalize_rollout(
    adv: Tensor, valid: Tensor | None = None, info: DistInfo | None = None, eps: float = 1e-8
) -> Tensor:
    """``algo.norm_adv=batch``: the whole rollout's advantages standardised with one mean and std.

    The statistics are over the ``valid`` entries of every rank's rollout (sums all-reduced, so every rank
    applies the same shift and scale); invalid entries come back 0. Unlike per-minibatch standardisation a
    minibatch whose advantages are all small (little signal, or a spread the critic already explains) stays
    small beside one with a large spread, instead of being scaled up to unit std.

    Args:
        adv: (T, N) or (B,) advantages.
        valid: the same shape, 1 for samples the update uses (None: all).
        info: the process group (None: this process alone).

    Returns:
        float32 advantages of ``adv``'s shape: (adv - mean) / (std + eps) on valid entries, 0 elsewhere.
    """
    a = adv.float()
    w = torch.ones_like(a) if valid is None else valid.float().to(a.device)
    a64, w64 = a.double(), w.double()  # one all-reduce of the three sums, in float64
    local = {"n": float(w64.sum()), "s": float((a64 * w64).sum()), "ss": float((a64 * a64 * w64).sum())}
    sums = sum_metrics(local, info or DistInfo(), a.device)
    n = sums["n"]
    mean = sums["s"] / max(n, 1.0)
    std = max(sums["ss"] - n * mean * mean, 0.0) / max(n - 1.0, 1.0)
    return (a - mean) / (std**0.5 + eps) * w


def denoise_discount(adv: Tensor, ft_steps: int, gamma_denoise: float) -> Tensor:
    """Spread decision advantages over the K' fine-tuned denoising steps with a discount.

    Column k (0 = first fine-tuned step, K'-1 = the final step producing x_0) is weighted
    ``gamma_denoise ** (K' - 1 - k)``: the final step keeps the full advantage, earlier steps less.

    Args:
        adv: (B,) advantage per decision.
        ft_steps: K'.
        gamma_denoise: discount along the denoising steps in [0, 1] (1 = none).

    Returns:
        (B, K') float32.
    """
    if adv.dim() != 1:
        raise ValueError(f"adv must be (B,); got shape {tuple(adv.shape)}")
    k = torch.arange(ft_steps, device=adv.device, dtype=torch.float32)  # (K',)
    weights = torch.pow(torch.tensor(float(gamma_denoise), device=adv.device), ft_steps - 1 - k)  # (K',)
    return adv.float()[:, None] * weights[None, :]  # (B, K')


class RunningRewardScaler:
    """Rewards divided by the running std of their backward-discounted sums (DPPO's ``reward_scale_running``,
    after OpenAI Baselines' reward normaliser): the scale of the returns without the future, so that actor
    and critic losses keep their balance whatever the environment's reward units.

    Per environment, ret_t = r_t + gamma (1 - first_t) ret_{t-1} (first_t: decision t starts an episode,
    i.e. the decision before it ended one). Every rollout here starts by resetting its environments
    (``collect_rollout``), so its first decisions start episodes and no sum carries over (DPPO's
    ``firsts_trajs[0] = 1`` when it resets at an iteration). The moments of every ret
    seen so far are merged batch by batch (pairwise update, starting from count 1e-4 at mean 0 and variance 1,
    the variance divided by count - 1 as DPPO's ``RunningMeanStd`` does); each reward is divided by
    sqrt(var + eps) and clipped to [-clip, clip]. The mean is not subtracted, so signs are kept. The
    statistics are this process's (each rank scales its own rollouts).
    """

    def __init__(self, num_envs: int, gamma: float = 0.99, clip: float = 10.0, eps: float = 1e-8) -> None:
        self.num_envs, self.gamma, self.clip, self.eps = num_envs, gamma, clip, eps
        self.mean, self.var, self.count = 0.0, 1.0, 1e-4

    @torch.no_grad()
    def __call__(self, rewards: Tensor, dones: Tensor) -> Tensor:
        """rewards, dones (T, N) of one rollout (dones: the episode ended at that decision) -> scaled (T, N),
        after merging this rollout's discounted sums into the statistics."""
        r, d = rewards.double().cpu(), dones.double().cpu()
        if r.shape[1] != self.num_envs:
            raise ValueError(f"rewards have {r.shape[1]} environments, the scaler {self.num_envs}")
        first = torch.cat([torch.ones_like(d[:1]), d[:-1]])  # (T, N): the rollout starts its episodes
        rets = torch.empty_like(r)
        prev = torch.zeros_like(r[0])
        for t in range(r.shape[0]):
            prev = rets[t] = r[t] + self.gamma * (1.0 - first[t]) * prev
        batch = rets.flatten()
        b_mean, b_var, b_count = float(batch.mean()), float(batch.var(unbiased=False)), batch.numel()
        delta, total = b_mean - self.mean, self.count + b_count
        m2 = self.var * self.count + b_var * b_count + delta**2 * self.count * b_count / total
        self.mean, self.var, self.count = self.mean + delta * b_count / total, m2 / (total - 1), total
        scale = (self.var + self.eps) ** 0.5
        return (rewards / scale).clamp(-self.clip, self.clip)

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])
