"""Residual PPO: rollouts over control steps, GAE, and an update whose step follows its evidence.

Symbols: T control steps per environment per iteration, N environments, F the head's input width, Da.

**Rollout** (:func:`collect_steps`): every control step stores the head's input x (F), the pre-tanh action
u (Da), its log-prob, the critic's value, the environment reward, ``dones`` and the elapsed fraction of the
time limit. On a time-limit cut ``gamma * V(final obs)`` is added to the reward (the GAE op's contract), so
GAE (:func:`diffpolicy.ops.gae`) never bootstraps across episodes.

**Evidence** (:func:`signal_drift`): the first-order change of the executed correction ``alpha * tanh(mu)``
that a plain gradient step of the policy-gradient surrogate would cause (RMS over the batch, exactly, with a
Jacobian-vector product), divided by the same for reference advantages whose pairing with the sampled
actions is destroyed (RMS over several draws). The default reference flips each advantage's sign at random,
so every sample keeps its own |A| and the reference gradient has exactly the noise of the real one with none
of its signal; a permutation of the advantages (``signal_reference=shuffle``) also moves |A| between states
and is biased when |A| depends on the state. The ratio is about 1 when the advantages carry no signal (an
update would random-walk) and grows with the signal.

**Step** (:func:`residual_update`): the critic trains on every batch. The evidence earns the actor a step
scale ``w = clamp(1 - (margin / signal_drift)^2, 0, 1)`` (the positive-part James-Stein shrinkage of a noisy
estimate, the reference drift being its noise): pure noise gives w = 0 and the policy does not move.
``residual_update=trust_region`` (default) pools the evidence of every batch gathered since the policy last
moved (those batches come from the same policy, so the noise falls as 1/sqrt(batches)) and, once w > 0,
takes one step down the pooled gradient whose first-order drift of the executed correction is
``w * max_drift``, then starts a new pool. ``residual_update=ppo`` runs clipped PPO epochs on each batch at
Adam learning rate ``lr * w``. Either way a trust region then caps the update's actual drift (RMS over the
batch) at ``max_drift``, pulling the parameters back along the update when it went further. Consistent
evidence is not necessarily correct (a biased critic points the same way every batch): when the training
loop's rollback guard restores the last stable weights it also halves the trust region (``trust``).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.func import functional_call, jvp

from diffpolicy.config import ResidualConfig
from diffpolicy.distributed import DistInfo, average_gradients, rank_mean
from diffpolicy.env_factory import stack_final_obs, step_info
from diffpolicy.models.residual import ResidualCritic, ResidualHead
from diffpolicy.policies.residual import StepActor
from diffpolicy.rl.advantages import normalize, normalize_rollout
from diffpolicy.rl.buffer import RolloutBuffer
from diffpolicy.rl.epochs import KLEpochs
from diffpolicy.rl.learner import RolloutStats
from diffpolicy.rl.ppo import approx_kl, clipped_surrogate, value_loss


def residual_specs(input_dim: int, action_dim: int) -> dict[str, Any]:
    """Rollout fields of the residual head, per control step and environment."""
    f32 = torch.float32
    return {
        "x": ((input_dim,), f32),
        "u": ((action_dim,), f32),
        "logprobs": ((), f32),
        "values": ((), f32),
        "rewards": ((), f32),
        "dones": ((), f32),
        "elapsed": ((), f32),
    }


@torch.no_grad()
def collect_steps(
    actor: StepActor,
    critic: ResidualCritic,
    venv: Any,
    buffer: RolloutBuffer,
    *,
    n_steps: int,
    seeds: list[int],
    gamma: float,
    max_episode_steps: int,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, RolloutStats]:
    """Run T = ``n_steps`` control steps in every environment from a seeded reset, filling ``buffer``.

    Returns:
        ``(last_value, stats)``: last_value (N,) is V of the observation after the last step.
    """
    head = actor.policy.head
    obs, _ = venv.reset(seed=seeds)
    actor.reset()
    n = len(seeds)
    elapsed = np.zeros(n)
    ep_return = np.zeros(n)
    stats = RolloutStats()
    for _ in range(n_steps):
        t0 = time.perf_counter()
        x, base = actor.inputs(obs, generator)
        u, logp = head.sample(x, generator=generator)
        actions = head.correct(base, u)
        actor.pos += 1
        frac = torch.as_tensor(elapsed / max_episode_steps, dtype=torch.float32, device=x.device)
        values = critic(x, frac)
        actions = actions.cpu().numpy()
        t1 = time.perf_counter()
        obs_next, reward, term, trunc, info = venv.step(actions)
        stats.policy_s, stats.env_s = stats.policy_s + t1 - t0, stats.env_s + time.perf_counter() - t1
        reward = reward.astype(np.float64)
        cut = np.flatnonzero(trunc & ~term)
        if cut.size:  # bootstrap a time-limit cut into its reward (never across episodes)
            x_final = actor.peek(stack_final_obs(info["final_obs"], cut), cut, generator)
            t_final = torch.as_tensor((elapsed[cut] + 1) / max_episode_steps, dtype=torch.float32)
            reward[cut] += gamma * critic(x_final, t_final.to(x.device)).cpu().numpy()
        done = term | trunc
        buffer.add(
            x=x, u=u, logprobs=logp, values=values, elapsed=frac,
            rewards=torch.from_numpy(reward.astype(np.float32)),
            dones=torch.from_numpy(done.astype(np.float32)),
        )  # fmt: skip
        stats.env_steps += n
        ep_return += reward
        succ = step_info(info, "is_success", n, False).astype(bool)
        for i in np.flatnonzero(done):
            stats.end_episode(ep_return[i], succ[i])
        ep_return[done] = 0.0
        elapsed = np.where(done, 0.0, elapsed + 1)
        actor.reset(done)
        obs = obs_next
    x, _ = actor.inputs(obs, generator)
    frac = torch.as_tensor(elapsed / max_episode_steps, dtype=torch.float32, device=x.device)
    return critic(x, frac), stats


# ------------------------------------------------------------------------------------------ evidence
def surrogate_grad(head: ResidualHead, x: Tensor, u: Tensor, adv: Tensor, info: DistInfo) -> list[Tensor]:
    """Gradient of the policy-gradient surrogate -mean(A * log pi(u | x)) w.r.t. the mean network (ratio 1).

    x (B, F), u (B, Da), adv (B,) -> one tensor per mean-network parameter (averaged over ranks).
    """
    params = list(head.mean_net.parameters())
    loss = -(adv.detach() * head.log_prob(x.detach(), u.detach())).mean()
    grads = torch.autograd.grad(loss, params)
    for p, g in zip(params, grads):
        p.grad = g.clone()
    average_gradients(params, info)
    out = [p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return out


def correction_drift(head: ResidualHead, x: Tensor, direction: list[Tensor]) -> Tensor:
    """RMS over the batch of d/ds alpha*tanh(mu_{theta + s d}(x)) at s = 0: the executed correction's
    first-order change along the parameter direction d (one tensor per mean-network parameter). -> scalar."""
    names = [k for k, _ in head.mean_net.named_parameters()]
    params = {k: v.detach() for k, v in head.mean_net.named_parameters()}
    tangents = dict(zip(names, direction))

    def mean_fn(p: dict[str, Tensor]) -> Tensor:
        return functional_call(head.mean_net, p, (x.detach().float(),))

    mean, d_mean = jvp(mean_fn, (params,), (tangents,))  # (B, Da) each
    d_corr = head.alpha * (1 - torch.tanh(mean).square()) * d_mean
    return d_corr.detach().square().mean().sqrt()


def reference_advantages(adv: Tensor, kind: str, generator: torch.Generator) -> Tensor:
    """Advantages with the pairing to the sampled actions destroyed: ``signs`` flips each one's sign at
    random (every sample keeps its own |A|), ``shuffle`` permutes them over the batch. (B,) -> (B,)."""
    if kind == "signs":
        flips = torch.randint(0, 2, adv.shape, generator=generator).to(adv.device) * 2 - 1
        return adv * flips.to(adv.dtype)
    return adv[torch.randperm(adv.numel(), generator=generator).to(adv.device)]


class Evidence:
    """Policy-gradient evidence pooled over the batches gathered since the policy last moved.

    While the policy stands still every batch comes from the same policy, so their surrogate gradients (and
    the reference gradients of their sign-flipped or shuffled advantages, which are valid references for the
    pooled batch too) average into one estimate whose noise falls as 1/sqrt(batches). Sums are weighted by
    batch size. ``state()`` / ``load()`` carry it through checkpoints (a resumed run pools the same batches).
    """

    def __init__(self) -> None:
        self.grad: list[Tensor] | None = None
        self.refs: list[list[Tensor]] | None = None
        self.count = 0
        self.batches = 0

    def add(self, grad: list[Tensor], refs: list[list[Tensor]], n: int) -> None:
        if self.grad is None:
            self.grad = [g * n for g in grad]
            self.refs = [[g * n for g in r] for r in refs]
        else:
            self.grad = [a + g * n for a, g in zip(self.grad, grad)]
            self.refs = [[a + g * n for a, g in zip(ra, r)] for ra, r in zip(self.refs, refs)]
        self.count += n
        self.batches += 1

    def mean(self) -> tuple[list[Tensor], list[list[Tensor]]]:
        """(pooled gradient, pooled reference gradients), each one tensor per mean-network parameter."""
        return [g / self.count for g in self.grad], [[g / self.count for g in r] for r in self.refs]

    def reset(self) -> None:
        self.grad, self.refs, self.count, self.batches = None, None, 0, 0

    def state(self) -> dict[str, Any]:
        return {
            "grad": self.grad or [],
            "refs": self.refs or [],
            "count": self.count,
            "batches": self.batches,
        }

    def load(self, state: dict[str, Any]) -> None:
        self.grad = list(state["grad"]) or None
        self.refs = [list(r) for r in state["refs"]] or None
        self.count, self.batches = int(state["count"]), int(state["batches"])


def signal_drift(
    head: ResidualHead,
    x: Tensor,
    grad: list[Tensor],
    refs: list[list[Tensor]],
) -> tuple[float, float, float]:
    """(signal_drift, real drift, reference drift) of a surrogate gradient and its reference gradients.

    Drifts are :func:`correction_drift` on the batch ``x`` (B, F); the reference drift is their root mean
    square over the references. See the module docstring.
    """
    real = float(correction_drift(head, x, grad))
    ref = (sum(float(correction_drift(head, x, r)) ** 2 for r in refs) / len(refs)) ** 0.5
    tiny = 1e-12
    return (real + tiny) / (ref + tiny), real, ref


def batch_evidence(
    head: ResidualHead,
    x: Tensor,
    u: Tensor,
    adv: Tensor,
    *,
    references: int,
    kind: str,
    generator: torch.Generator,
    info: DistInfo,
) -> tuple[list[Tensor], list[list[Tensor]]]:
    """The batch's surrogate gradient and ``references`` gradients of reference advantages
    (:func:`reference_advantages`, drawn from ``generator``, the same on every rank)."""
    grad = surrogate_grad(head, x, u, adv, info)
    refs = [
        surrogate_grad(head, x, u, reference_advantages(adv, kind, generator), info)
        for _ in range(references)
    ]
    return grad, refs


def step_scale(signal: float, margin: float) -> float:
    """Positive-part shrinkage w = clamp(1 - (margin / signal)^2, 0, 1) of the learning rate."""
    if signal <= 0:
        return 0.0
    return float(min(max(1.0 - (margin / signal) ** 2, 0.0), 1.0))


# --------------------------------------------------------------------------------------------- update
@dataclass
class ResidualModules:
    """What the residual update changes: the head, its critic, their optimisers and the pooled evidence."""

    head: ResidualHead
    critic: ResidualCritic
    actor_optim: torch.optim.Optimizer
    critic_optim: torch.optim.Optimizer
    evidence: Evidence = field(default_factory=Evidence)
    trust: float = 1.0
    """Multiplier of ``max_drift`` (halved by each rollback of the training loop)."""


def residual_update(
    learner: ResidualModules,
    data: dict[str, Tensor],
    advantages: Tensor,
    returns: Tensor,
    cfg: ResidualConfig,
    *,
    generator: torch.Generator,
    info: DistInfo,
) -> dict[str, float]:
    """One update from a rollout: critic epochs, the evidence, then the actor step it earns.

    Args:
        data: the rollout buffer's fields, (T, N, ...) each.
        advantages: (T, N) GAE advantages.
        returns: (T, N) value targets.
        generator: CPU generator for minibatch orders and reference advantages (seeded per iteration).

    Returns:
        averaged ``losses/*`` and ``train/residual_*`` metrics, among them ``losses/signal_drift``,
        ``losses/step_scale`` (w) and ``losses/action_drift`` (RMS change of the executed correction).
    """
    head = learner.head
    max_drift = cfg.max_drift * learner.trust
    flat = {k: v.reshape(-1, *v.shape[2:]) for k, v in data.items()}  # (T*N, ...)
    x, u, elapsed = flat["x"], flat["u"], flat["elapsed"]
    adv_all, ret = advantages.reshape(-1), returns.reshape(-1)
    adv_n = adv_all if cfg.norm_adv == "none" else normalize(adv_all)  # (T*N,) the evidence's scale
    sums: dict[str, float] = defaultdict(float)
    out = {"losses/value": _critic_epochs(learner, x, elapsed, ret, cfg, generator, info)}

    # ---- evidence: this batch's, pooled with the batches since the policy last moved (trust_region)
    grad, refs = batch_evidence(
        head, x, u, adv_n, references=cfg.signal_shuffles, kind=cfg.signal_reference, generator=generator,
        info=info,
    )  # fmt: skip
    pool = learner.evidence
    if cfg.residual_update == "trust_region":
        pool.add(grad, refs, x.shape[0])
        grad, refs = pool.mean()
    _, real, ref = signal_drift(head, x, grad, refs)
    # ranks measure drift on their own batches: agree on one value, or their parameters would part
    real, ref = rank_mean(real, info, x.device), rank_mean(ref, info, x.device)
    signal = (real + 1e-12) / (ref + 1e-12)
    w = step_scale(signal, cfg.signal_margin) if cfg.signal_scaled_lr else 1.0
    out.update({
        "losses/signal_drift": signal, "losses/drift_real": real, "losses/drift_reference": ref,
        "losses/step_scale": w, "losses/evidence_batches": float(max(pool.batches, 1)),
    })  # fmt: skip
    with torch.no_grad():
        corr0 = head.alpha * torch.tanh(head(x))  # (T*N, Da) executed correction before the update
    before = [p.detach().clone() for p in head.parameters()]
    if w > 0 and cfg.residual_update == "trust_region":
        # one step down the pooled surrogate gradient, sized so that its first-order drift is w * max_drift
        per_unit = rank_mean(float(correction_drift(head, x, grad)), info, x.device)
        if per_unit > 0 and max_drift > 0:
            eta = w * max_drift / per_unit
            with torch.no_grad():
                for p, g in zip(head.mean_net.parameters(), grad):
                    p.sub_(eta * g)
        pool.reset()
    elif w > 0:
        _ppo_epochs(learner, x, u, flat["logprobs"], adv_all, cfg, w, generator, info, sums)

    # ---- trust region on the executed correction (also catches the first-order step's curvature)
    with torch.no_grad():
        drift = rank_mean(
            float((head.alpha * torch.tanh(head(x)) - corr0).square().mean().sqrt()), info, x.device
        )
        if max_drift > 0 and drift > max_drift:
            scale = max_drift / drift
            for p, p0 in zip(head.parameters(), before):
                p.copy_(p0 + scale * (p - p0))
            out["losses/trust_region_scale"] = scale
            drift = float((head.alpha * torch.tanh(head(x)) - corr0).square().mean().sqrt())
        out["losses/action_drift"] = drift
        out["losses/trust"] = learner.trust
        out["train/residual_mean_abs"] = float((head.alpha * torch.tanh(head(x))).abs().mean())
        out["train/residual_std"] = float(head.std.mean())
    out.update(sums)
    return out


def _critic_epochs(
    learner: ResidualModules,
    x: Tensor,
    elapsed: Tensor,
    ret: Tensor,
    cfg: ResidualConfig,
    generator: torch.Generator,
    info: DistInfo,
) -> float:
    """``cfg.update_epochs`` passes of value regression on the batch; every batch teaches the critic,
    whatever the actor does. Returns the mean value loss."""
    critic, total, n, loss_sum = learner.critic, x.shape[0], 0, 0.0
    mb = min(cfg.minibatch_size, total)
    params = list(critic.parameters())
    for _ in range(cfg.update_epochs):
        perm = torch.randperm(total, generator=generator).to(x.device)
        for start in range(0, total, mb):
            idx = perm[start : start + mb]
            v_loss = value_loss(critic(x[idx], elapsed[idx]), ret[idx])
            learner.critic_optim.zero_grad(set_to_none=True)
            v_loss.backward()
            average_gradients(params, info)
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))  # 0 disables
            learner.critic_optim.step()
            loss_sum, n = loss_sum + float(v_loss.detach()), n + 1
    return loss_sum / max(n, 1)


def _ppo_epochs(
    learner: ResidualModules,
    x: Tensor,
    u: Tensor,
    old_logp: Tensor,
    adv_all: Tensor,
    cfg: ResidualConfig,
    w: float,
    generator: torch.Generator,
    info: DistInfo,
    sums: dict[str, float],
) -> None:
    """Clipped-ratio PPO epochs on the batch at Adam learning rate ``cfg.lr * w`` (target-KL stop)."""
    head, total = learner.head, x.shape[0]
    mb = min(cfg.minibatch_size, total)
    for group in learner.actor_optim.param_groups:
        group["lr"] = cfg.lr * w
    n, params = 0, list(head.parameters())
    whole = normalize_rollout(adv_all, info=info) if cfg.norm_adv == "batch" else adv_all  # (T*N,)
    epochs = KLEpochs(cfg.update_epochs, cfg.target_kl, info, x.device)
    for epoch in epochs:
        perm = torch.randperm(total, generator=generator).to(x.device)
        for start in range(0, total, mb):
            idx = perm[start : start + mb]
            a = normalize(adv_all[idx]) if cfg.norm_adv == "minibatch" else whole[idx]
            new_logp = head.log_prob(x[idx], u[idx])
            log_ratio = new_logp - old_logp[idx]
            surrogate, _ = clipped_surrogate(log_ratio, a, cfg.clip_eps)
            loss = -surrogate.mean() - cfg.ent_coef * head.entropy()
            if cfg.residual_l2 > 0:  # pull the correction toward zero (the base policy)
                loss = loss + cfg.residual_l2 * torch.tanh(head(x[idx])).square().sum(-1).mean()
            learner.actor_optim.zero_grad(set_to_none=True)
            loss.backward()
            average_gradients(params, info)
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm or float("inf"))  # 0 disables
            learner.actor_optim.step()
            with torch.no_grad():
                kl = float(approx_kl(new_logp.detach(), old_logp[idx]))
                sums["losses/policy"] += float(-surrogate.mean().detach())
                sums["losses/approx_kl"] += kl
                sums["losses/clipfrac"] += float((log_ratio.exp() - 1).abs().gt(cfg.clip_eps).float().mean())
            epochs.record(kl)
            n += 1
        sums["losses/epochs"] = float(epoch + 1)
    for k in ("losses/policy", "losses/approx_kl", "losses/clipfrac"):
        sums[k] /= max(n, 1)
