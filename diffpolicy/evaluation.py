"""Held-out evaluation of a policy and videos of its episodes.

:func:`evaluate` runs seeded episodes through :func:`diffpolicy.policies.base.act`, the sampling path that
training rollouts use too (a mismatch between the two has cost peers a factor of two in success rate);
:func:`held_out` is the one protocol ``train`` and ``pretrain`` report. :func:`record_video` films episodes
and :func:`write_video` writes them as mp4 (or PNG frames).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffpolicy.config import EnvConfig, PretrainConfig, TrainConfig
from diffpolicy.env_factory import make_envs, make_one_env, step_info
from diffpolicy.policies.base import act, to_policy_obs
from diffpolicy.policies.residual import ResidualPolicy, StepActor
from diffpolicy.policy_io import sampling_under

FAILED = "failed"
"""Outcome of an unsuccessful episode whose environment reports no ``info["outcome"]``."""


@dataclass
class EvalResult:
    """Outcome of :func:`evaluate`: one entry per episode in ``successes``, ``outcomes`` and ``grasp_miss``."""

    success_rate: float
    mean_return: float
    episodes: int
    env_steps: int
    successes: list[bool] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)
    """Why each episode ended as it did: the env's final ``info["outcome"]`` (MujocoPick: success,
    wrong_cube, never_grasped, dropped, missed_tray, timed_out), else success / failed."""
    grasp_miss: list[float] = field(default_factory=list)
    """The env's final ``info["grasp_miss"]`` (m; NaN when it reports none)."""
    lost_grip: list[str] = field(default_factory=list)
    """The env's final ``info["lost_grip"]``: how the grasp was lost (released | slipped; '' when it was
    not, or the env reports none)."""
    returns: list[float] = field(default_factory=list)
    """Each episode's undiscounted return (sum of its rewards)."""
    kinds: list[str] = field(default_factory=list)
    """The env's final ``info["dialogue_kind"]`` (MujocoDialogue: none, object, place: which slot a
    correction changed); '' where the env reports none."""
    holding: list[bool | None] = field(default_factory=list)
    """The env's final ``info["corrected_holding"]`` (MujocoDialogue: whether the gripper held a cube when the
    correction was spoken); None where the env reports none."""
    stages: list[int | None] = field(default_factory=list)
    """The env's final ``info["stage"]`` (a multi-stage task: the index of the sub-task current at the end);
    None where the env reports none."""
    reports_success: bool = True
    """Whether the env reports ``info["is_success"]`` at all; false (Hopper: returns, no goal) makes the
    success rate and the failure map meaningless, and the summaries give None for them."""

    def wilson(self, z: float = 1.96) -> tuple[float, float]:
        """95 % Wilson score interval (z = 1.96) of the success rate, (low, high)."""
        return wilson_interval(sum(self.successes), self.episodes, z)

    def return_ci(self) -> tuple[float, float]:
        """95 % Student-t interval of the mean episode return, (low, high) (:func:`mean_interval`)."""
        return mean_interval(self.returns)

    def success_fields(self) -> dict[str, Any]:
        """``success_rate``, ``success_ci`` (Wilson) and ``failures`` for a summary; all None when the env
        reports no success (Hopper), so that no 0.0 reads as "always fails"."""
        if not self.reports_success:
            return {"success_rate": None, "success_ci": None, "failures": None}
        ci = [round(v, 3) for v in self.wilson()]
        fields = {"success_rate": self.success_rate, "success_ci": ci, "failures": self.failures()}
        if any(self.kinds):
            fields["by_kind"] = self.by_kind()
        return fields

    def by_kind(self) -> dict[str, dict[str, Any]]:
        """Per episode kind (``info["dialogue_kind"]``): episodes, success rate, its Wilson interval and the
        failure map; {} where the env reports no kinds. A corrected kind also splits by whether the gripper
        held a cube when the correction came (``holding`` / ``not_holding``: episodes and success rate), two
        different skills (put the wrong cube back, or turn before grasping). A multi-stage kind counts its
        failed episodes by the sub-task they ended in (``failed_in``: 1-based sub-task -> episodes)."""
        holding = self.holding + [None] * (len(self.kinds) - len(self.holding))
        stages = self.stages + [None] * (len(self.kinds) - len(self.stages))
        out = {}
        for kind in sorted({k for k in self.kinds if k}):
            idx = [i for i, k in enumerate(self.kinds) if k == kind]
            ok = [self.successes[i] for i in idx]
            out[kind] = {
                "episodes": len(idx),
                "success_rate": round(float(np.mean(ok)), 4),
                "success_ci": [round(v, 3) for v in wilson_interval(sum(ok), len(ok))],
                "failures": failure_counts(ok, [self.outcomes[i] for i in idx]),
            }
            for name, held in (("holding", True), ("not_holding", False)):
                part = [self.successes[i] for i in idx if holding[i] is held]
                if part and kind not in ("none", "stages"):
                    out[kind][name] = {"episodes": len(part), "success_rate": round(float(np.mean(part)), 4)}
            ended = [stages[i] for i in idx if not self.successes[i] and stages[i] is not None]
            if ended:
                out[kind]["failed_in"] = {str(s + 1): ended.count(s) for s in sorted(set(ended))}
        return out

    def failures(self) -> dict[str, int]:
        """Failed episodes per reason, most frequent first (the failure map)."""
        return failure_counts(self.successes, self.outcomes)

    def drops(self) -> dict[str, int]:
        """The dropped and missed-tray episodes by how the grasp was lost: released (the policy opened the
        jaws) or slipped (the cube slid out of closed jaws); unknown where the env reports neither."""
        how = self.lost_grip + [""] * (len(self.outcomes) - len(self.lost_grip))
        return _ranked(
            f"{o}/{h or 'unknown'}" for o, h in zip(self.outcomes, how) if o in ("dropped", "missed_tray")
        )


def failure_counts(successes: list[bool], outcomes: list[str]) -> dict[str, int]:
    """Reason -> count over the failed episodes (reason ``failed`` where none was recorded)."""
    return _ranked(
        outcomes[i] if i < len(outcomes) and outcomes[i] != "success" else FAILED
        for i, ok in enumerate(successes)
        if not ok
    )


def _ranked(keys: Iterable[str]) -> dict[str, int]:
    """Key -> count, most frequent first (ties by name)."""
    return dict(sorted(Counter(keys).items(), key=lambda kv: (-kv[1], kv[0])))


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion: ``successes`` of ``n`` -> (low, high)."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (float(max(0.0, centre - half)), float(min(1.0, centre + half)))


def t_quantile(p: float, dof: int) -> float:
    """Quantile ``p`` of Student's t with ``dof`` degrees of freedom (Cornish-Fisher expansion about the
    normal quantile, Abramowitz & Stegun 26.7.5: within 1e-4 of the exact value for dof >= 5 at p = 0.975)."""
    from statistics import NormalDist

    if not 0.0 < p < 1.0 or dof < 1:
        raise ValueError(f"t_quantile needs 0 < p < 1 and dof >= 1, got p={p}, dof={dof}")
    z = NormalDist().inv_cdf(p)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / dof + g2 / dof**2 + g3 / dof**3 + g4 / dof**4


def mean_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """Two-sided Student-t interval of the mean of ``values`` (n >= 2): mean -+ t s / sqrt(n); (nan, nan)
    for fewer than two values."""
    n = len(values)
    if n < 2:
        return (float("nan"), float("nan"))
    x = np.asarray(values, dtype=np.float64)
    half = t_quantile(0.5 + level / 2, n - 1) * x.std(ddof=1) / np.sqrt(n)
    return (float(x.mean() - half), float(x.mean() + half))


@dataclass
class Exploration:
    """Noise added to a policy's executed actions (env units, clipped to [-1, 1] after adding), to measure what
    an exploring learner can reach: ``std`` per action entry, drawn afresh every control step (``hold="step"``,
    like a per-step Gaussian residual) or once per decision and held over its Te steps (``hold="chunk"``,
    temporally correlated)."""

    std: float = 0.0
    hold: str = "step"

    def __post_init__(self) -> None:
        if self.hold not in ("step", "chunk"):
            raise ValueError(f"exploration hold={self.hold!r} is not allowed; choose step or chunk")
        if self.std < 0:
            raise ValueError(f"exploration std={self.std} must be >= 0")

    def apply(self, actions: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """actions (B, Te, Da) -> the same with noise added, clipped to [-1, 1]."""
        if self.std == 0:
            return actions
        B, Te, Da = actions.shape
        shape = (B, Te, Da) if self.hold == "step" else (B, 1, Da)
        noise = rng.normal(0.0, self.std, shape).astype(np.float32)
        return np.clip(actions + noise, -1.0, 1.0)


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
    seeds: list[int] | None = None,
    exploration: Exploration | None = None,
) -> EvalResult:
    """Success rate over ``n_episodes`` held-out episodes; episode i uses seed ``seed + i`` (or ``seeds[i]``).

    Episodes run in waves of ``num_envs``; each wave resets its environments with the wave's seeds and runs
    until every one of them has finished once (what an environment does after that is ignored). The sampling
    noise (and ``exploration``'s action noise) comes from generators seeded with ``seed``, so the result does
    not depend on the global RNG: one policy scores the same wherever it is evaluated. A policy that acts per
    control step (``acts_per_step``: base + residual) runs on control-step environments through
    :func:`evaluate_steps` with its deterministic correction (no exploration).
    Each episode's final ``info["outcome"]`` and ``info["grasp_miss"]`` are kept (the failure map). A policy
    with a ``listen(info, active)`` method (a hierarchy's simulated person) is handed the vector env's info
    after every reset and step, with which environments are still in the episode being judged.
    """
    if seeds is not None:
        n_episodes = len(seeds)
    all_seeds = list(seeds) if seeds is not None else [seed + i for i in range(n_episodes)]
    if getattr(policy, "acts_per_step", False):
        venv = make_envs(cfg, n_action_steps, num_envs, seed, chunked=False)
        try:
            record = evaluate_steps(
                policy, venv, seeds=all_seeds, seed=seed, num_envs=num_envs, device=device, autocast=autocast
            )
        finally:
            venv.close()
        return _result(record)
    venv = make_envs(cfg, n_action_steps, num_envs, seed)
    was_training = policy.training
    policy.eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    rng = np.random.default_rng(seed)
    record = EpisodeRecord(num_envs)
    listen = getattr(policy, "listen", None)  # a hierarchy's simulated person watches the env's info
    try:
        for start in range(0, n_episodes, num_envs):
            wave = all_seeds[start : start + num_envs]
            live = np.arange(num_envs) < len(wave)
            obs, info = venv.reset(seed=wave + [wave[-1]] * (num_envs - len(wave)))
            record.begin(live)
            if listen is not None:
                listen(info, ~record.done)
            while not record.wave_done:
                actions, _ = act(
                    policy, to_policy_obs(obs, device), deterministic=deterministic, autocast=autocast,
                    generator=gen,
                )  # fmt: skip
                if exploration is not None:
                    actions = exploration.apply(actions, rng)
                obs, reward, term, trunc, info = venv.step(actions)
                record.step(reward, term, trunc, info, step_info(info, "executed", num_envs, n_action_steps))
                if listen is not None:
                    listen(info, ~record.done)
            record.end()
    finally:
        venv.close()
        policy.train(was_training)
    return _result(record)


class EpisodeRecord:
    """Per-episode bookkeeping of evaluation waves: returns, success, the final outcome and grasp miss."""

    def __init__(self, num_envs: int) -> None:
        self.n = num_envs
        self.successes: list[bool] = []
        self.returns: list[float] = []
        self.outcomes: list[str] = []
        self.grasp_miss: list[float] = []
        self.lost_grip: list[str] = []
        self.kinds: list[str] = []
        self.holding: list[bool | None] = []
        self.stages: list[int | None] = []
        self.env_steps = 0
        self.reports_success = False

    def begin(self, live: np.ndarray) -> None:
        n = self.n
        self.live, self.done = live, ~live
        self.ret, self.succ = np.zeros(n), np.zeros(n, dtype=bool)
        self.outcome, self.miss = np.full(n, FAILED, dtype=object), np.full(n, np.nan)
        self.lost = np.full(n, "", dtype=object)
        self.kind = np.full(n, "", dtype=object)
        self.hold = np.full(n, None, dtype=object)
        self.stage = np.full(n, None, dtype=object)

    @property
    def wave_done(self) -> bool:
        return bool(self.done.all())

    def step(self, reward: Any, term: Any, trunc: Any, info: dict[str, Any], executed: Any) -> None:
        """Account one vector step; ``executed`` (B,) control steps each env ran (1 per step for step envs)."""
        active = ~self.done
        n = self.n
        self.env_steps += int(np.asarray(executed)[active].sum())
        self.ret[active] += np.asarray(reward)[active]
        self.succ[active] |= step_info(info, "is_success", n, False).astype(bool)[active]
        self.reports_success = (
            self.reports_success or "is_success" in info or "is_success" in info.get("final_info", {})
        )
        ended = active & (np.asarray(term) | np.asarray(trunc))
        if ended.any():
            self.outcome[ended] = step_info(info, "outcome", n, FAILED).astype(object)[ended]
            self.miss[ended] = step_info(info, "grasp_miss", n, np.nan).astype(float)[ended]
            self.lost[ended] = step_info(info, "lost_grip", n, "").astype(object)[ended]
            self.kind[ended] = step_info(info, "dialogue_kind", n, "").astype(object)[ended]
            self.hold[ended] = step_info(info, "corrected_holding", n, None).astype(object)[ended]
            self.stage[ended] = step_info(info, "stage", n, None).astype(object)[ended]
        self.done |= ended

    def end(self) -> None:
        live = self.live
        succ = self.succ[live]
        outcome = np.where(succ, "success", self.outcome[live])
        self.successes += succ.tolist()
        self.returns += self.ret[live].tolist()
        self.outcomes += [str(o) for o in outcome]
        self.grasp_miss += self.miss[live].tolist()
        self.lost_grip += [str(v) for v in self.lost[live]]
        self.kinds += [str(v) for v in self.kind[live]]
        self.holding += [None if v is None else bool(v) for v in self.hold[live]]
        self.stages += [None if v is None else int(v) for v in self.stage[live]]


def evaluate_steps(
    policy: ResidualPolicy,
    venv: Any,
    *,
    seeds: list[int],
    seed: int,
    num_envs: int,
    device: torch.device,
    autocast: Callable[[], Any] | None = None,
) -> Any:
    """Held-out episodes of a base + residual policy with the head's mean correction (deterministic).

    Episode i uses seed ``seeds[i]``; episodes run in waves of ``num_envs`` control-step environments, each
    wave until all its live environments finished once; the base's starting noise comes from a generator
    seeded with ``seed``, so the result does not depend on the global RNG. Returns the filled
    :class:`EpisodeRecord`.
    """
    was_training = policy.training
    policy.eval()
    actor = StepActor(policy, num_envs, device, autocast)
    gen = torch.Generator(device=device).manual_seed(seed)
    record = EpisodeRecord(num_envs)
    try:
        for start in range(0, len(seeds), num_envs):
            wave = seeds[start : start + num_envs]
            obs, _ = venv.reset(seed=wave + [wave[-1]] * (num_envs - len(wave)))
            actor.reset()
            record.begin(np.arange(num_envs) < len(wave))
            while not record.wave_done:
                actions, _ = actor.act(obs, deterministic=True, generator=gen)
                obs, reward, term, trunc, info = venv.step(actions)
                record.step(reward, term, trunc, info, np.ones(num_envs, dtype=int))
                actor.reset(term | trunc)
            record.end()
    finally:
        policy.train(was_training)
    return record


def _result(record: EpisodeRecord) -> EvalResult:
    return EvalResult(
        success_rate=float(np.mean(record.successes)),
        mean_return=float(np.mean(record.returns)),
        episodes=len(record.successes),
        env_steps=record.env_steps,
        successes=record.successes,
        outcomes=record.outcomes,
        grasp_miss=record.grasp_miss,
        lost_grip=record.lost_grip,
        returns=record.returns,
        kinds=record.kinds,
        holding=record.holding,
        stages=record.stages,
        reports_success=record.reports_success,
    )


def reachability(
    policy: Any,
    cfg: EnvConfig,
    failed_seeds: list[int],
    *,
    tries: int,
    n_action_steps: int,
    num_envs: int,
    device: torch.device,
    deterministic: bool,
    exploration: Exploration | None = None,
    seed: int = 0,
    autocast: Callable[[], Any] | None = None,
    reasons: list[str] | None = None,
) -> dict[str, Any]:
    """Of the scenes ``failed_seeds`` (ones a base policy fails), the fraction in which at least one of
    ``tries`` exploratory episodes succeeds: what a learner exploring that way can ever find to reinforce.

    Exploration is the stochastic chain (``deterministic=False``), action noise on the deterministic chain
    (``exploration``), or both. Returns ``{"scenes", "tries", "reachable", "reachable_seeds",
    "success_rate"}`` (success_rate: over all scenes x tries; ``reachable``: the fraction of scenes), and with
    ``reasons`` (the base's failure reason per failed seed, same order) ``by_reason``: reason ->
    ``[scenes reached, scenes]``, most frequent reason first — which failures this exploration reaches.
    """
    if reasons is not None and len(reasons) != len(failed_seeds):
        raise ValueError(f"reachability: {len(reasons)} reasons for {len(failed_seeds)} failed seeds")
    if not failed_seeds:
        return {
            "scenes": 0,
            "tries": tries,
            "reachable": float("nan"),
            "reachable_seeds": [],
            "success_rate": float("nan"),
        }
    seeds = [s for s in failed_seeds for _ in range(tries)]
    res = evaluate(
        policy, cfg, n_action_steps=n_action_steps, n_episodes=len(seeds), seed=seed, num_envs=num_envs,
        device=device, deterministic=deterministic, autocast=autocast, seeds=seeds, exploration=exploration,
    )  # fmt: skip
    hits = np.asarray(res.successes, dtype=bool).reshape(len(failed_seeds), tries)
    hit_scene = hits.any(1)  # (scenes,) at least one try succeeded
    reached = [s for s, h in zip(failed_seeds, hit_scene) if h]
    out: dict[str, Any] = {
        "scenes": len(failed_seeds),
        "tries": tries,
        "reachable": round(len(reached) / len(failed_seeds), 4),
        "reachable_seeds": reached,
        "success_rate": round(float(hits.mean()), 4),
    }
    if reasons is not None:
        out["by_reason"] = {
            r: [int(sum(h for h, q in zip(hit_scene, reasons) if q == r)), n]
            for r, n in _ranked(reasons).items()
        }
    return out


SPLITS = ("val", "test")
"""The held-out seed ranges: ``val`` (every choice reads it), ``test`` (the reported figure)."""


def split_seeds(cfg: TrainConfig | PretrainConfig, split: str) -> tuple[int, int]:
    """``(first seed, episodes)`` of ``split``: ``val`` -> (``val_seed``, ``val_episodes``), ``test`` ->
    (``eval_seed``, ``eval_episodes``)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not allowed; choose val or test")
    return (cfg.val_seed, cfg.val_episodes) if split == "val" else (cfg.eval_seed, cfg.eval_episodes)


def protocol_of(cfg: TrainConfig | PretrainConfig) -> str:
    """The protocol :func:`held_out` judges under: ``cfg.eval_protocol`` when named; else ``noise_free``
    (every DDIM step's mean) when the learner's policy acts that way (``cfg.algo.judged_noise_free``) or
    ``cfg.eval_deterministic``, else ``exploration`` (the stochastic chain the rollouts sample). ``train``
    writes it into every checkpoint."""
    if cfg.eval_protocol:
        return cfg.eval_protocol
    return "noise_free" if cfg.algo.judged_noise_free or cfg.eval_deterministic else "exploration"


def held_out(
    policy: Any,
    cfg: TrainConfig | PretrainConfig,
    runtime: Any,
    split: str = "test",
    episodes: int = 0,
    protocol: str = "",
) -> EvalResult:
    """The held-out evaluation that ``train`` (before and after PPO) and ``pretrain`` report, one protocol so
    that their figures compare: the ``split``'s episodes (:func:`split_seeds`: validation, or the test
    seeds of the reported figure), in waves of min(``env.num_envs``, episodes) environments, on ``runtime``'s
    device and autocast, under ``protocol`` ('' = :func:`protocol_of`; the policy's own schedule is back
    afterwards). A base + residual policy always runs its deterministic base and mean correction.
    ``episodes`` > 0 takes the split's first that many instead (the rollback guard's validation check)."""
    seed, n = split_seeds(cfg, split)
    episodes = episodes or n
    with sampling_under(policy, protocol or protocol_of(cfg)) as deterministic:
        return evaluate(
            policy,
            cfg.env,
            n_action_steps=policy.n_action_steps,
            n_episodes=episodes,
            seed=seed,
            num_envs=min(cfg.env.num_envs, episodes),
            device=runtime.device,
            deterministic=deterministic,
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
    extra), or as a looping GIF when ``path`` ends in ``.gif``; an mp4 without ffmpeg is written as numbered
    PNG frames in the directory ``path`` minus ``.mp4``, with a one-line notice. Returns what was written."""
    import imageio.v2 as imageio

    if str(path).endswith(".gif"):  # Pillow's writer, a core dependency through imageio
        imageio.mimsave(path, frames, duration=1000.0 / fps, loop=0)
        return path
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
