"""PPO update throughput: decisions per second through forward + backward + optimiser step.

Composes ``train`` with ``algo=ppo`` (the chain PPO learner), builds ``policy`` (default unet_small, fp32) for
the default env's observation (``modalities`` in the result) with the learner's K', fills a rollout buffer
with T x N decisions whose observations and chains come from the policy itself on real environment
observations, and times :func:`diffpolicy.rl.chain.update.ppo_update` with ``algo=ppo``'s settings (one epoch
per timed run, KL early stop disabled). ``decisions_per_s`` = decisions in the epoch / median seconds per
epoch. ``action_space`` times the same epoch with held action-space noise, whose ratio is differentiated
through the noise-free chain, whole and truncated (``algo.grad_steps``). ``residual`` times the residual
learner's update (:func:`residual_run`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

import torch

from diffpolicy.cli import compose
from diffpolicy.device import Runtime
from diffpolicy.distributed import DistInfo
from diffpolicy.env_factory import make_envs
from diffpolicy.models.critic import Critic
from diffpolicy.policy_io import build_policy, env_spec
from diffpolicy.rl.buffer import RolloutBuffer
from diffpolicy.rl.chain.learner import chain_specs, set_chain_options
from diffpolicy.rl.chain.rollout import collect_rollout
from diffpolicy.rl.chain.update import ChainModules, ppo_update
from diffpolicy.rl.ppo import clip_schedule
from diffpolicy.rl.stability import GradMonitor, StateSnapshot


def run(
    repeats: int = 5,
    threads: int = 2,
    num_envs: int = 8,
    n_steps: int = 8,
    minibatch_size: int = 32,
    policy: str = "unet_small",
    grad_steps: tuple[int, ...] = (0, 2, 1),
    **_: Any,
) -> dict[str, Any]:
    """Median decisions/s of one PPO epoch over T x N decisions (``num_envs`` x ``n_steps``), and under
    ``action_space`` the epoch's seconds with ``algo=ppo_anchor``'s held action-space noise, whose ratio
    differentiates the noise-free chain, for each ``algo.grad_steps`` in ``grad_steps`` (0: through all K
    steps), with each one's time as a share of the whole chain's (the same minibatch size for both)."""
    out = _time_epochs(["algo=ppo"], {}, repeats, num_envs, n_steps, minibatch_size, policy)
    seconds = {
        n: _time_epochs(
            ["algo=ppo_anchor"], {"grad_steps": n}, repeats, num_envs, n_steps, minibatch_size, policy
        )["seconds_per_epoch"]
        for n in grad_steps
    }
    whole = seconds.get(0)
    out["action_space"] = {
        "algo": "ppo_anchor",
        "seconds_per_epoch": {str(n): s for n, s in seconds.items()},
        **({"share_of_whole_chain": {str(n): s / whole for n, s in seconds.items()}} if whole else {}),
    }
    out["residual"] = residual_run(repeats=repeats)
    return out


def _time_epochs(
    overrides: list[str],
    algo_fields: dict[str, Any],
    repeats: int,
    num_envs: int,
    n_steps: int,
    minibatch_size: int,
    policy: str,
) -> dict[str, Any]:
    """Compose ``train`` with ``overrides``, set ``algo_fields`` on its algo, fill a real rollout and time
    ``repeats`` epochs of :func:`ppo_update` after one warm-up epoch."""
    cfg = compose(
        "train",
        [*overrides, f"policy={policy}", f"env.num_envs={num_envs}", f"algo.n_steps={n_steps}", "device=cpu"],
    )
    # one epoch of ``minibatch_size`` minibatches without the KL early stop
    algo = dataclasses.replace(
        cfg.algo, update_epochs=1, minibatch_size=minibatch_size, target_kl=0.0, iterations=1, **algo_fields
    )
    torch.manual_seed(0)
    rt = Runtime.from_config(cfg.device)
    spec, da = env_spec(cfg.env)
    pol = build_policy(cfg.policy, spec, da)
    pol.set_sampling(**algo.sampling())  # as train.py does
    set_chain_options(pol, algo)  # as the chain learner does
    critic = Critic(cfg.policy.cond_dim)
    learner = ChainModules(
        policy=pol,
        critic=critic,
        actor_optim=torch.optim.AdamW([p for p in pol.parameters() if p.requires_grad], lr=algo.lr),
        critic_optim=torch.optim.AdamW(critic.parameters(), lr=algo.critic_lr),
        scaler=rt.grad_scaler(),
    )
    buffer = RolloutBuffer(n_steps, num_envs, chain_specs(pol, cfg.policy.cond_dim), rt.device)
    venv = make_envs(cfg.env, pol.n_action_steps, num_envs, seed=0)
    try:
        pol.eval()
        collect_rollout(
            pol, critic, venv, buffer, n_steps=n_steps, seeds=list(range(num_envs)), gamma=algo.gamma,
            device=rt.device, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
    finally:
        venv.close()
    adv = torch.randn(n_steps, num_envs)
    ret = torch.randn(n_steps, num_envs)
    clip_eps = clip_schedule(algo.clip_eps, algo.clip_eps_final, pol.ft_steps)
    monitor, snapshot = GradMonitor(), StateSnapshot({"p": pol, "c": critic}, [learner.actor_optim])
    snapshot.capture()
    pol.train()
    times = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        ppo_update(
            learner, buffer, adv, ret, algo, clip_eps=clip_eps, runtime=rt, info=DistInfo(),
            generator=torch.Generator().manual_seed(r), monitor=monitor, snapshot=snapshot,
        )  # fmt: skip
        if r:  # the first epoch warms up allocators and caches
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    decisions = n_steps * num_envs
    return {
        "decisions_per_s": decisions / seconds,
        "seconds_per_epoch": seconds,
        "decisions_per_epoch": decisions,
        "algo": algo.name,
        "minibatch_size": minibatch_size,
        "policy": policy,
        "down_dims": list(cfg.policy.down_dims),
        "ft_steps": pol.ft_steps,
        "precision": "fp32",
        "modalities": sorted(spec),
    }


def residual_run(repeats: int = 5, num_envs: int = 16, n_steps: int = 120, **_: Any) -> dict[str, Any]:
    """Median seconds of one residual update (``algo=residual``: critic epochs, the evidence measurement
    with its shuffles, the signal-scaled actor epochs, the trust region) over T x N control steps of the
    default state observation, on synthetic inputs and advantages (the cost does not depend on them)."""
    from diffpolicy.models.residual import ResidualCritic, ResidualHead
    from diffpolicy.rl.residual.update import ResidualModules, residual_update

    cfg = compose("train", ["algo=residual", "device=cpu", "algo.signal_scaled_lr=false"])
    torch.manual_seed(0)
    head = ResidualHead(34, 7, 8, hidden=tuple(cfg.algo.residual_hidden))
    critic = ResidualCritic(head.input_dim, tuple(cfg.algo.residual_hidden))
    learner = ResidualModules(
        head,
        critic,
        torch.optim.Adam(head.parameters(), lr=cfg.algo.lr),
        torch.optim.Adam(critic.parameters()),
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n_steps, num_envs, head.input_dim, generator=g)
    with torch.no_grad():
        u, logp = head.sample(x.view(-1, head.input_dim), generator=g)
    data = {
        "x": x, "u": u.view(n_steps, num_envs, -1), "logprobs": logp.view(n_steps, num_envs),
        "elapsed": torch.rand(n_steps, num_envs, generator=g),
    }  # fmt: skip
    adv, ret = torch.randn(n_steps, num_envs, generator=g), torch.randn(n_steps, num_envs, generator=g)
    times = []
    for r in range(repeats + 1):
        start = time.perf_counter()
        residual_update(
            learner, data, adv, ret, cfg.algo, generator=torch.Generator().manual_seed(r), info=DistInfo()
        )
        if r:
            times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {
        "control_steps_per_update": n_steps * num_envs,
        "seconds_per_update": seconds,
        "control_steps_per_s": n_steps * num_envs / seconds,
        "update_epochs": cfg.algo.update_epochs,
        "signal_shuffles": cfg.algo.signal_shuffles,
    }
