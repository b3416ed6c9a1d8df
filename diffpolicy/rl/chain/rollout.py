"""The chain learner's rollout: seeded decisions from vector environments into a rollout buffer.

Every decision acts through :func:`diffpolicy.policies.base.act` (the sampling path of evaluation too) and
stores the fine-tuned chain and its log-probabilities; :class:`~diffpolicy.rl.learner.RolloutStats` sums up
the episodes it saw. FPO and filtered_bc's chain exploration roll out through it too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from diffpolicy.env_factory import stack_final_obs, step_info
from diffpolicy.policies.base import act, to_policy_obs
from diffpolicy.rl.learner import RolloutStats


@torch.no_grad()
def collect_rollout(
    policy: Any,
    critic: Any,
    venv: gym.vector.VectorEnv,
    buffer: Any,
    *,
    n_steps: int,
    seeds: list[int],
    gamma: float,
    device: torch.device,
    generator: torch.Generator | None = None,
    autocast: Callable[[], Any] | None = None,
    first_episode_only: bool = False,
    bootstrap: bool = True,
    reward_source: str = "env",
    stage_potential: dict[str, float] | None = None,
) -> tuple[torch.Tensor, RolloutStats]:
    """Run T = ``n_steps`` decisions in every environment from a seeded reset, filling ``buffer``.

    Each decision stores the observation, the fine-tuned chain (K'+1, Ta, Da) and its log-probs (K',), the
    critic's value, the reward (the sum of the executed Te rewards; on a time-limit truncation with
    ``bootstrap``, ``gamma * V(final obs)`` is added, so GAE never bootstraps across episodes; that part is
    also stored alone as ``bootstraps``, so a reward scaler can leave it out), ``dones``
    and ``valid`` (0 for decisions after an environment's first episode when ``first_episode_only``, used by
    GRPO); where the buffer has the fields, also ``success`` (1 where the decision's executed actions reached
    ``info["is_success"]``) and ``executed`` (how many of its Te actions ran before the episode ended).

    Args:
        seeds: one reset seed per environment (equal seeds make a GRPO group).
        bootstrap: fold the critic's value of a time-limit cut into the reward. False for returns that must
            not depend on a critic (GRPO: its critic is never trained, so V would be noise in the returns).
        reward_source: ``env`` stores the environment's rewards; ``success`` stores 1.0 for a decision whose
            executed actions reached ``info["is_success"]`` and 0.0 otherwise (``algo.reward``); ``stages``
            adds to that success reward the rise of a potential over the episode's ``info["outcome"]``
            (``stage_potential``: outcome name -> value, 0 for names it leaves out; reset to 0 at every new
            episode), so a decision that first reaches a stage earns its value once (shaping in the sense of
            Ng et al. 1999: the return of a whole episode is success + the potential of the last stage
            reached). The episode returns in ``stats`` are the environment's either way.

    Returns:
        ``(last_value, stats)``: last_value (N,) is V of the observation after the last decision.
    """
    obs, _ = venv.reset(seed=seeds)
    num_envs = len(seeds)
    stats = RolloutStats()
    ep_return = np.zeros(num_envs)
    finished = np.zeros(num_envs, dtype=bool)
    potential = np.zeros(num_envs)  # the stage potential each env's episode has reached (algo.reward=stages)
    for _ in range(n_steps):
        t0 = time.perf_counter()
        pobs = to_policy_obs(obs, device)
        actions, out = act(policy, pobs, return_chain=True, autocast=autocast, generator=generator)
        values = critic(out.cond, pobs.get("state"))  # (N,) fp32
        t1 = time.perf_counter()
        next_obs, reward, term, trunc, info = venv.step(actions)
        stats.policy_s, stats.env_s = stats.policy_s + t1 - t0, stats.env_s + time.perf_counter() - t1
        reward = reward.astype(np.float64)
        ep_return += reward  # the env's rewards only
        succ = step_info(info, "is_success", num_envs, False).astype(bool)
        if reward_source in ("success", "stages"):
            if "is_success" not in info and "is_success" not in info.get("final_info", {}):
                raise ValueError(
                    f"algo.reward={reward_source}, but this env reports no success (no info['is_success']); "
                    "use algo.reward=env"
                )
            reward = succ.astype(np.float64)
        if reward_source == "stages":
            if "outcome" not in info and "outcome" not in info.get("final_info", {}):
                raise ValueError(
                    "algo.reward=stages, but this env reports no stage (no info['outcome']); use algo.reward=success"
                )
            outcome = step_info(info, "outcome", num_envs, "")
            reached = np.array([(stage_potential or {}).get(str(o), 0.0) for o in outcome])
            reached = np.maximum(reached, potential)  # a stage once reached stays (success ends the episode)
            reward += reached - potential
            potential = reached
        executed = step_info(info, "executed", num_envs, actions.shape[1])
        stats.env_steps += int(executed.sum())
        cut = np.flatnonzero(trunc & ~term)
        boot = np.zeros(num_envs)
        if bootstrap and cut.size:  # fold a cut's bootstrap into the reward (the GAE op's contract)
            final = to_policy_obs(stack_final_obs(info["final_obs"], cut), device)
            with autocast() if autocast is not None else torch.autocast("cpu", enabled=False):
                v_final = critic(policy.encode(final, augment=False), final.get("state"))
            boot[cut] = gamma * v_final.float().cpu().numpy()
            reward[cut] += boot[cut]
        done = term | trunc
        valid = ~finished if first_episode_only else np.ones(num_envs, dtype=bool)
        buffer.add(
            **{k: v for k, v in obs.items() if k in buffer.fields},
            chains=out.chain,
            logprobs=out.log_probs,
            values=values,
            rewards=torch.from_numpy(reward.astype(np.float32)),
            bootstraps=torch.from_numpy(boot.astype(np.float32)),
            dones=torch.from_numpy(done.astype(np.float32)),
            valid=torch.from_numpy(valid.astype(np.float32)),
            **({"cond": out.cond} if "cond" in buffer.fields else {}),
            **({"success": torch.from_numpy(succ.astype(np.float32))} if "success" in buffer.fields else {}),
            **(
                {"executed": torch.from_numpy(executed.astype(np.float32))}
                if "executed" in buffer.fields
                else {}
            ),
        )
        for i in np.flatnonzero(done & valid):
            stats.end_episode(ep_return[i], succ[i])
        ep_return[done] = 0.0
        potential[done] = 0.0
        finished |= done
        obs = next_obs
    with autocast() if autocast is not None else torch.autocast("cpu", enabled=False):
        pobs = to_policy_obs(obs, device)
        last_value = critic(policy.encode(pobs, augment=False), pobs.get("state"))
    return last_value.float(), stats
