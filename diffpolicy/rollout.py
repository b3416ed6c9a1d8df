"""Environments as the policy sees them, and the one code path that turns observations into executed actions.

A **decision** (DESIGN.md) is one policy call: observe, sample a Ta x Da chunk, execute its first Te actions.
:class:`ActionChunkWrapper` makes that one environment step: its action is the (Te, Da) executed part, it
steps the wrapped environment up to Te times (stopping early when the episode ends), and its reward is the
sum of those Te rewards. Vectorised with same-step autoreset, every ``step`` of the vector env is therefore
one decision for every environment, which is what PPO stores.

:func:`act` is the single sampling path shared by evaluation and training rollouts (a mismatch between the
two has cost peers a factor of two in success rate); :func:`evaluate` runs held-out seeded episodes with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch

from diffpolicy.config import EnvConfig, PretrainConfig, TrainConfig
from diffpolicy.modalities import KEYS, MODALITIES


class ActionChunkWrapper(gym.Wrapper):
    """One ``step`` executes a (Te, Da) action chunk; the reward is the sum of the executed steps' rewards.

    ``info`` carries the last inner step's info plus ``executed`` (inner steps run, <= Te) and
    ``is_success`` (true if any inner step succeeded). With ``record=True`` the wrapped env's ``render()``
    frame is appended to :attr:`frames` after every inner step (for videos).
    """

    def __init__(self, env: gym.Env, n_action_steps: int, record: bool = False) -> None:
        super().__init__(env)
        self.n_action_steps = n_action_steps
        inner = env.action_space
        self.action_space = gym.spaces.Box(
            low=np.repeat(inner.low[None], n_action_steps, 0),
            high=np.repeat(inner.high[None], n_action_steps, 0),
            dtype=np.float32,
        )
        self.record = record
        self.frames: list[np.ndarray] = []

    def reset(self, **kwargs: Any):
        obs, info = self.env.reset(**kwargs)
        if self.record:
            self.frames.append(self.env.render())
        return obs, info

    def step(self, chunk: np.ndarray):
        chunk = np.asarray(chunk, dtype=np.float32)
        if chunk.shape != self.action_space.shape:
            raise ValueError(
                f"action chunk must have shape {self.action_space.shape} (Te, Da), got {chunk.shape}"
            )
        total, success = 0.0, False
        terminated = truncated = False
        info: dict[str, Any] = {}
        executed = 0
        for action in chunk:
            obs, reward, terminated, truncated, info = self.env.step(action)
            executed += 1
            total += float(reward)
            success = success or bool(info.get("is_success", False))
            if self.record:
                self.frames.append(self.env.render())
            if terminated or truncated:
                break
        info = {**info, "executed": executed, "is_success": success}
        return obs, total, terminated, truncated, info


def env_kwargs(cfg: EnvConfig, n_action_steps: int) -> dict[str, Any]:
    """Constructor keyword arguments for ``cfg``'s environment (camera rendered once per decision)."""
    kwargs: dict[str, Any] = {"max_episode_steps": cfg.max_episode_steps}
    if cfg.name == "mujoco_pick":
        kwargs.update(
            obs_mode=cfg.obs_mode, image_size=cfg.image_size, n_points=cfg.n_points, obs_every=n_action_steps
        )
    kwargs.update(cfg.kwargs)
    return kwargs


def _make_one(
    cfg: EnvConfig,
    n_action_steps: int,
    render_mode: str | None = None,
    record: bool = False,
    chunked: bool = True,
) -> gym.Env:
    from diffpolicy_envs.adapters import make_env

    kwargs = env_kwargs(cfg, n_action_steps)
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    env = make_env(cfg.id, **kwargs)
    return ActionChunkWrapper(env, n_action_steps, record=record) if chunked else env


def make_envs(
    cfg: EnvConfig, n_action_steps: int, num_envs: int, seed: int, *, chunked: bool = True
) -> gym.vector.VectorEnv:
    """``num_envs`` environments (same-step autoreset), seeded ``seed + i``: decision-level (one step executes
    a (Te, Da) chunk; actions (B, Te, Da)) or, with ``chunked=False``, control-step environments (one step,
    one (Da,) action per env; actions (B, Da)).

    ``cfg.vectorization="sync"`` steps them all in this process; "async" shards them over ``cfg.workers``
    worker processes (0: one per CPU), each stepping its share in turn (:class:`ShardedVectorEnv`, the same
    results as sync), so B environments keep W cores busy without B processes contending for them. Workers
    start from a fork server (forking a process that holds an EGL context hangs the children) that has
    imported this module and the MuJoCo env once, so a later ``make_envs`` (each evaluation) starts its
    workers in milliseconds instead of seconds.
    """
    from diffpolicy_envs.vector import vectorize

    fns = [partial(_make_one, cfg, n_action_steps, chunked=chunked) for _ in range(num_envs)]
    return vectorize(
        fns,
        seed,
        "sync" if cfg.vectorization == "sync" else "sharded",
        workers=cfg.workers or None,  # None: one per CPU
        preload=("diffpolicy.rollout", "diffpolicy_envs.mujoco_pick"),  # torch, mujoco: imported once
    )


def obs_spec(space: gym.spaces.Dict) -> dict[str, list[int]]:
    """Modality -> per-step shape, from a single environment's Dict observation space (instruction -> [])."""
    spec: dict[str, list[int]] = {}
    for key in KEYS:
        if key in space.spaces:
            sub = space.spaces[key]
            spec[key] = [] if key == "instruction" else list(sub.shape)
    if "state" not in spec:
        raise ValueError(f"environment observations must contain 'state'; got keys {sorted(space.spaces)}")
    return spec


def to_policy_obs(obs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Batched env observation -> policy observation with a To = 1 history axis.

    ``rgb`` (B, H, W, 3) uint8 -> (B, 1, H, W, 3); ``points`` (B, N, 3) and ``state`` (B, Ds) likewise gain
    the To axis as float32; ``instruction`` becomes a list of B strings.
    """
    out: dict[str, Any] = {}
    for key, value in obs.items():
        if key == "instruction":
            out[key] = [str(s) for s in value]
        elif key in MODALITIES:
            t = torch.as_tensor(np.asarray(value), device=device)
            out[key] = (t if key == "rgb" else t.float()).unsqueeze(1)
    return out


@torch.no_grad()
def act(
    policy: Any,
    obs: dict[str, Any],
    *,
    deterministic: bool = False,
    return_chain: bool = False,
    autocast: Callable[[], Any] | None = None,
    generator: torch.Generator | None = None,
) -> tuple[np.ndarray, Any]:
    """The one sampling path of evaluation and training: observation -> the Te executed actions.

    Args:
        policy: a policy with ``plan(obs, deterministic=, return_chain=) -> (actions (B, Te, Da), out)``.
        obs: policy observation from :func:`to_policy_obs`.
        deterministic: DDIM with eta = 0 instead of the stochastic fine-tuned steps.
        return_chain: keep the chain (B, K'+1, Ta, Da) and its log-probabilities for PPO.
        autocast: a context factory (the device runtime's ``autocast``) for mixed precision.
        generator: source of the sampling noise (seeded per iteration for reproducible runs).

    Returns:
        ``(actions, out)``: actions (B, Te, Da) float32 numpy in env units, and the policy's sample output.
    """
    ctx = autocast() if autocast is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        actions, out = policy.plan(
            obs, deterministic=deterministic, return_chain=return_chain, generator=generator
        )
    return actions.float().cpu().numpy().astype(np.float32), out


def step_info(info: dict[str, Any], key: str, num_envs: int, default: Any) -> np.ndarray:
    """Per-environment ``info[key]`` of the step just taken, (B,).

    With same-step autoreset an environment whose episode ended is already reset, and the top-level info
    holds its reset info; the last step's info is in ``info["final_info"]`` where ``info["_final_info"]``.
    """
    out = np.asarray(info.get(key, np.full(num_envs, default))).copy()
    done = np.asarray(info.get("_final_info", np.zeros(num_envs, dtype=bool)), dtype=bool)
    if done.any():
        final = info["final_info"]
        if key in final:
            out[done] = np.asarray(final[key])[done]
    return out


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
    env = _make_one(cfg, n_action_steps, render_mode="rgb_array", record=True)
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


# ------------------------------------------------------------------------------------------- PPO rollouts
@dataclass
class RolloutStats:
    """What one PPO rollout saw."""

    env_steps: int = 0
    """Environment (control) steps executed, summed over environments."""
    episodes: int = 0
    """Episodes that ended during the rollout."""
    successes: int = 0
    """Of those, successful ones."""
    returns: list[float] = field(default_factory=list)
    """Return of every ended episode."""

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else float("nan")


def _stack_final_obs(final_obs: Any, index: np.ndarray) -> dict[str, Any]:
    """Batch the autoreset ``info['final_obs']`` entries of environments ``index`` into one obs dict."""
    items = [final_obs[i] for i in index]
    out: dict[str, Any] = {}
    for key in items[0]:
        vals = [it[key] for it in items]
        out[key] = vals if key == "instruction" else np.stack([np.asarray(v) for v in vals])
    return out


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
) -> tuple[torch.Tensor, RolloutStats]:
    """Run T = ``n_steps`` decisions in every environment from a seeded reset, filling ``buffer``.

    Each decision stores the observation, the fine-tuned chain (K'+1, Ta, Da) and its log-probs (K',), the
    critic's value, the reward (the sum of the executed Te rewards; on a time-limit truncation with
    ``bootstrap``, ``gamma * V(final obs)`` is added, so GAE never bootstraps across episodes), ``dones``
    and ``valid`` (0 for decisions after an environment's first episode when ``first_episode_only``, used by
    GRPO).

    Args:
        seeds: one reset seed per environment (equal seeds make a GRPO group).
        bootstrap: fold the critic's value of a time-limit cut into the reward. False for returns that must
            not depend on a critic (GRPO: its critic is never trained, so V would be noise in the returns).

    Returns:
        ``(last_value, stats)``: last_value (N,) is V of the observation after the last decision.
    """
    obs, _ = venv.reset(seed=seeds)
    num_envs = len(seeds)
    stats = RolloutStats()
    ep_return = np.zeros(num_envs)
    finished = np.zeros(num_envs, dtype=bool)
    for _ in range(n_steps):
        pobs = to_policy_obs(obs, device)
        actions, out = act(policy, pobs, return_chain=True, autocast=autocast, generator=generator)
        values = critic(out.cond)  # (N,) fp32
        next_obs, reward, term, trunc, info = venv.step(actions)
        reward = reward.astype(np.float64)
        executed = step_info(info, "executed", num_envs, actions.shape[1])
        stats.env_steps += int(executed.sum())
        cut = np.flatnonzero(trunc & ~term)
        if bootstrap and cut.size:  # fold a cut's bootstrap into the reward (the GAE op's contract)
            final = to_policy_obs(_stack_final_obs(info["final_obs"], cut), device)
            with autocast() if autocast is not None else torch.autocast("cpu", enabled=False):
                v_final = critic(policy.encode(final, augment=False))
            reward[cut] += gamma * v_final.float().cpu().numpy()
        done = term | trunc
        valid = ~finished if first_episode_only else np.ones(num_envs, dtype=bool)
        buffer.add(
            **{k: v for k, v in obs.items() if k in buffer.fields},
            chains=out.chain,
            logprobs=out.log_probs,
            values=values,
            rewards=torch.from_numpy(reward.astype(np.float32)),
            dones=torch.from_numpy(done.astype(np.float32)),
            valid=torch.from_numpy(valid.astype(np.float32)),
            **({"cond": out.cond} if "cond" in buffer.fields else {}),
        )
        ep_return += reward
        succ = step_info(info, "is_success", num_envs, False).astype(bool)
        for i in np.flatnonzero(done & valid):
            stats.episodes += 1
            stats.successes += int(succ[i])
            stats.returns.append(float(ep_return[i]))
        ep_return[done] = 0.0
        finished |= done
        obs = next_obs
    with autocast() if autocast is not None else torch.autocast("cpu", enabled=False):
        last_value = critic(policy.encode(to_policy_obs(obs, device), augment=False))
    return last_value.float(), stats
