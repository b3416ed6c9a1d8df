"""PPO update throughput: decisions per second through forward + backward + optimiser step.

Builds the default multimodal policy (unet_small, fp32) for MujocoPick-v0's observation spec, fills a
rollout buffer with T x N decisions whose observations and chains come from the policy itself on real
environment observations, and times :func:`diffpolicy.rl.update.ppo_update` (one epoch per timed run, KL
early stop disabled). ``decisions_per_s`` = decisions in the epoch / median seconds per epoch.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from diffpolicy.cli import compose
from diffpolicy.config import AlgoConfig
from diffpolicy.device import Runtime
from diffpolicy.distributed import DistInfo
from diffpolicy.models.critic import Critic
from diffpolicy.policy_io import build_policy, env_spec
from diffpolicy.rl.buffer import RolloutBuffer
from diffpolicy.rl.ppo import clip_schedule
from diffpolicy.rl.stability import GradMonitor, StateSnapshot
from diffpolicy.rl.update import Learner, ppo_update
from diffpolicy.rollout import collect_rollout, make_envs


def run(
    repeats: int = 5,
    threads: int = 2,
    num_envs: int = 8,
    n_steps: int = 8,
    minibatch_size: int = 32,
    policy: str = "unet_small",
    **_: Any,
) -> dict[str, Any]:
    """Median decisions/s of one PPO epoch over T x N decisions (``num_envs`` x ``n_steps``)."""
    from diffpolicy.train import buffer_specs

    cfg = compose(
        "train",
        [f"policy={policy}", f"env.num_envs={num_envs}", f"algo.n_steps={n_steps}", "device=cpu"],
    )
    torch.manual_seed(0)
    rt = Runtime.from_config(cfg.device)
    spec, da = env_spec(cfg.env)
    pol = build_policy(cfg.policy, spec, da)
    critic = Critic(cfg.policy.cond_dim)
    algo = AlgoConfig(
        update_epochs=1, minibatch_size=minibatch_size, target_kl=0.0, n_steps=n_steps, iterations=1
    )
    learner = Learner(
        policy=pol,
        critic=critic,
        actor_optim=torch.optim.AdamW([p for p in pol.parameters() if p.requires_grad], lr=algo.lr),
        critic_optim=torch.optim.AdamW(critic.parameters(), lr=algo.critic_lr),
        scaler=rt.grad_scaler(),
    )
    buffer = RolloutBuffer(n_steps, num_envs, buffer_specs(pol, cfg), rt.device)
    venv = make_envs(cfg.env, pol.n_action_steps, num_envs, seed=0)
    try:
        pol.eval()
        last_value, _ = collect_rollout(
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
        "minibatch_size": minibatch_size,
        "policy": policy,
        "down_dims": list(cfg.policy.down_dims),
        "ft_steps": pol.ft_steps,
        "precision": "fp32",
        "modalities": sorted(spec),
    }
