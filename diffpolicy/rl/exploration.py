"""How much exploration a policy tolerates: the largest noise level on a halving ladder under which its
validation figure stays within a tolerance of its noise-free figure.

Both learners that explore around a pre-trained policy size their noise this way before fine-tuning: the
residual head bounds its per-step action noise (``algo.noise_tolerance``), the chain learner scales the stds
of its K' sampled denoising steps (``algo.explore_tolerance``). A policy cloned from precise demonstrations
can lose most of its successes to noise it never saw; PPO then learns from rollouts of a policy that differs
from the deployed one and sees too few successes to follow (docs/experiments.md, 2026-12-03: on the pick task
the sampled chain succeeded 0.05 where the noise-free policy succeeded 0.29).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def tolerated(
    score: Callable[[float], Any],
    start: float,
    tolerance: float,
    *,
    levels: int = 6,
    share: bool = False,
) -> tuple[float, dict[float, float], int]:
    """The largest level of ``start`` * 2^-i (i < ``levels``) whose figure stays within ``tolerance`` of the
    noise-free figure (level 0); the smallest tried when none does.

    ``score(level)`` evaluates the policy at that noise level (0: none) and returns an
    :class:`~diffpolicy.evaluation.EvalResult`. The figure is its success rate or, for an environment without
    success, its mean return. The floor is ``figure(0) - tolerance`` on a success rate (absolute), or
    ``figure(0) - tolerance * |figure(0)|`` on a return, or on either with ``share`` (a share of the
    noise-free figure). Levels are tried from the largest down and the first that keeps the floor is taken.

    Returns (level, {level: figure} for every level tried (0 included), env steps spent).
    """
    if not 0 < tolerance <= 1:
        raise ValueError(f"tolerance={tolerance} must lie in (0, 1]")
    if start <= 0 or levels < 1:
        raise ValueError(f"start={start} must be > 0 and levels={levels} >= 1")
    ref = score(0.0)
    goal = ref.reports_success

    def figure(result: Any) -> float:
        return result.success_rate if goal else result.mean_return

    noise_free = figure(ref)
    floor = noise_free - (tolerance * abs(noise_free) if share or not goal else tolerance)
    seen, steps, level = {0.0: noise_free}, ref.env_steps, start
    for i in range(levels):
        level = start * 0.5**i
        result = score(level)
        seen[level], steps = figure(result), steps + result.env_steps
        if figure(result) >= floor:
            break
    return level, seen, steps
