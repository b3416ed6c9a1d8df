"""Held-out evaluation of a policy and videos of its episodes.

:func:`evaluate` runs seeded episodes through :func:`diffpolicy.policies.base.act`, the sampling path that
training rollouts use too (a mismatch between the two has cost peers a factor of two in success rate);
:func:`held_out` is the one protocol ``train`` and ``pretrain`` report. :func:`record_video` films episodes
and :func:`write_video` writes them as mp4 (or PNG frames).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpolicy.config import EnvConfig, PretrainConfig, TrainConfig
from diffpolicy.env_factory import make_envs, make_one_env, step_info
from diffpolicy.policies.base import act, to_policy_obs


@dataclass
class EvalResult:
    """Outcome of :func:`evaluate`."""

    success_rate: float
    mean_return: float
    episodes: int
    env_steps: int
    successes: list[bool] = field(default_factory=list)

    def wilson(self, z: float = 1.96) -> tuple[float, float]:
        """95 % Wilson score interval (z = 1.96) of the success rate, (low, high)."""
        return wilson_interval(sum(self.successes), self.episodes, z)


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion: ``successes`` of ``n`` -> (low, high)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (float(max(0.0, centre - half)), float(min(1.0, centre + half)))


def evaluate(
    policy: Any,
    cfg: EnvConfig,
    *,
    n_action_steps: int,
    n_episodes: int,
    seed: int,
    num_envs: int,
    device: torch.device,
    deterministic: bool = False,
    autocast: Callable[[], Any] | None = None,
) -> EvalResult:
    """Success rate over ``n_episodes`` held-out episodes; episode i uses seed ``seed + i``.

    Episodes run in waves of ``num_envs``; each wave resets its environments with the wave's seeds and runs
    until every one of them has finished once (what an environment does after that is ignored). The sampling
    noise comes from a generator seeded with ``seed``, so the result does not depend on the global RNG: one
    policy scores the same wherever it is evaluated. A policy
    that acts per control step (``acts_per_step``: base + residual) runs on control-step environments
    through :func:`diffpolicy.policies.residual.evaluate_steps` with its deterministic correction.
    """
    if getattr(policy, "acts_per_step", False):
        from diffpolicy.policies.residual import evaluate_steps

        venv = make_envs(cfg, n_action_steps, num_envs, seed, chunked=False)
        try:
            successes, returns, env_steps = evaluate_steps(
                policy, venv, n_episodes=n_episodes, seed=seed, num_envs=num_envs, device=device,
                autocast=autocast,
            )  # fmt: skip
        finally:
            venv.close()
        return EvalResult(
            success_rate=float(np.mean(successes)), mean_return=float(np.mean(returns)),
            episodes=len(successes), env_steps=env_steps, successes=successes,
        )  # fmt: skip
    venv = make_envs(cfg, n_action_steps, num_envs, seed)
    was_training = policy.training
    policy.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    successes: list[bool] = []
    returns: list[float] = []
    env_steps = 0
    try:
        for start in range(0, n_episodes, num_envs):
            obs, _ = venv.reset(seed=seed + start)
            live = np.arange(num_envs) < (n_episodes - start)
            done = ~live
            ret = np.zeros(num_envs)
            succ = np.zeros(num_envs, dtype=bool)
            while not done.all():
                actions, _ = act(
                    policy, to_policy_obs(obs, device), deterministic=deterministic, autocast=autocast,
                    generator=gen,
                )  # fmt: skip
                obs, reward, term, trunc, info = venv.step(actions)
                active = ~done
                executed = step_info(info, "executed", num_envs, n_action_steps)
                env_steps += int(executed[active].sum())
                ret[active] += reward[active]
                succ[active] |= step_info(info, "is_success", num_envs, False).astype(bool)[active]
                done |= term | trunc
            successes += succ[live].tolist()
            returns += ret[live].tolist()
    finally:
        venv.close()
        policy.train(was_training)
    return EvalResult(
        success_rate=float(np.mean(successes)),
        mean_return=float(np.mean(returns)),
        episodes=len(successes),
        env_steps=env_steps,
        successes=successes,
    )


def held_out(policy: Any, cfg: TrainConfig | PretrainConfig, runtime: Any) -> EvalResult:
    """The held-out evaluation that ``train`` (before and after PPO) and ``pretrain`` report, one protocol so
    that their success rates compare: ``cfg.eval_episodes`` episodes from seed ``cfg.eval_seed``, in waves of
    min(``env.num_envs``, episodes) environments, on ``runtime``'s device and autocast. A chain policy takes
    every DDIM step's mean when ``cfg.algo.head`` is residual (the residual's base samples that way: a BC
    policy is judged as the residual head starts from it) or ``cfg.eval_deterministic``, else samples the
    stochastic chain; a base + residual policy always runs its deterministic base and mean correction."""
    return evaluate(
        policy,
        cfg.env,
        n_action_steps=policy.n_action_steps,
        n_episodes=cfg.eval_episodes,
        seed=cfg.eval_seed,
        num_envs=min(cfg.env.num_envs, cfg.eval_episodes),
        device=runtime.device,
        deterministic=cfg.algo.head == "residual" or cfg.eval_deterministic,
        autocast=runtime.autocast,
    )


def record_video(
    policy: Any,
    cfg: EnvConfig,
    path: str,
    *,
    n_action_steps: int,
    n_episodes: int,
    seed: int,
    device: torch.device,
    fps: int = 10,
) -> int:
    """Write an mp4 of ``n_episodes`` episodes (seeds ``seed + i``) to ``path``; returns the frame count.

    A policy that acts per control step (base + residual) is driven by a one-environment
    :class:`diffpolicy.policies.residual.StepActor` with its deterministic correction.
    """
    per_step = getattr(policy, "acts_per_step", False)
    env = make_one_env(cfg, n_action_steps, render_mode="rgb_array", record=True)
    was_training = policy.training
    policy.eval()
    try:
        if per_step:
            from diffpolicy.policies.residual import StepActor

            actor, inner = StepActor(policy, 1, device), env.env  # step the env under the chunk wrapper
        for i in range(n_episodes):
            obs, _ = env.reset(seed=seed + i)
            done = False
            if per_step:
                actor.reset()
            while not done:
                batched = {k: (np.asarray(v)[None] if k != "instruction" else [v]) for k, v in obs.items()}
                if per_step:
                    action, _ = actor.act(batched, deterministic=True)
                    obs, _, term, trunc, _ = inner.step(action[0])
                    env.frames.append(inner.render())
                else:
                    actions, _ = act(policy, to_policy_obs(batched, device))
                    obs, _, term, trunc, _ = env.step(actions[0])
                done = term or trunc
        frames = [f for f in env.frames if f is not None]
        if frames:
            write_video(path, frames, fps)
        return len(frames)
    finally:
        env.close()
        policy.train(was_training)


def write_video(path: str, frames: list[np.ndarray], fps: int) -> str:
    """Write ``frames`` (H, W, 3) uint8 as an mp4 at ``path`` with imageio's ffmpeg plugin (the ``video``
    extra); without it, as numbered PNG frames in the directory ``path`` minus ``.mp4``, with a one-line
    notice. Returns what was written."""
    import imageio.v2 as imageio

    try:
        imageio.mimsave(path, frames, fps=fps, macro_block_size=1)
        return path
    except (ImportError, ValueError, RuntimeError) as exc:  # no ffmpeg backend
        folder = Path(path).with_suffix("")
        folder.mkdir(parents=True, exist_ok=True)
        for i, frame in enumerate(frames):
            imageio.imwrite(folder / f"{i:05d}.png", frame)
        print(
            f"no mp4 writer ({type(exc).__name__}); wrote {len(frames)} PNG frames to {folder} "
            '(pip install -e ".[video]" for mp4)',
            flush=True,
        )
        return str(folder)
