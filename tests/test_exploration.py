"""Exploration sized by what the task tolerates (``algo.explore_tolerance``): the measurement's direction, the
noise scale of the chain's fine-tuned steps, and a tiny run that records, explores with and resumes with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train import TINY_POLICY, TINY_RUN

from diffpolicy import checkpoint
from diffpolicy.diffusion.schedule import NoiseSchedule
from diffpolicy.evaluation import EvalResult
from diffpolicy.rl.exploration import tolerated


def _task(fragility: float, noise_free: float = 0.6):
    """A task whose success rate falls linearly with the exploration scale: noise_free * (1 - fragility * s)."""

    def score(scale: float) -> EvalResult:
        rate = max(0.0, noise_free * (1 - fragility * scale))
        return EvalResult(success_rate=rate, mean_return=rate, episodes=10, env_steps=50)

    return score


def test_a_task_that_tolerates_less_noise_gets_less() -> None:
    """The pick task's sampled chain kept a sixth of the noise-free figure (0.05 of 0.29): a fragile task gets a
    smaller scale than a robust one, and a tighter tolerance a smaller scale on the same task."""
    robust, _, _ = tolerated(_task(0.1), 1.0, 0.2, share=True)
    fragile, seen, steps = tolerated(_task(1.5), 1.0, 0.2, share=True)
    assert robust == 1.0 and fragile == 0.125  # 1.5 * 0.125 = 0.19 <= 0.2, while 1.5 * 0.25 = 0.375 > 0.2
    assert fragile < robust and list(seen) == [0.0, 1.0, 0.5, 0.25, 0.125] and steps == 5 * 50
    assert seen[fragile] >= 0.8 * seen[0.0] > seen[2 * fragile]
    strict, _, _ = tolerated(_task(0.5), 1.0, 0.05, share=True)
    loose, _, _ = tolerated(_task(0.5), 1.0, 0.5, share=True)
    assert strict < loose


def test_a_share_of_a_low_success_rate_is_not_an_absolute_tolerance() -> None:
    """At 0.29 noise-free, keeping 80 % means >= 0.232; an absolute 0.2 would accept 0.09 (a third of it)."""
    share, _, _ = tolerated(_task(0.6, noise_free=0.29), 1.0, 0.2, share=True)
    absolute, _, _ = tolerated(_task(0.6, noise_free=0.29), 1.0, 0.2)
    assert share == 0.25 and absolute == 1.0


def test_noise_scale_scales_the_fine_tuned_stds_and_leaves_the_means() -> None:
    ref, scaled = NoiseSchedule(100, 10, 5, 1.0, 0.1), NoiseSchedule(100, 10, 5, 1.0, 0.1, noise_scale=0.25)
    torch.testing.assert_close(scaled.std[:5], ref.std[:5])  # the K - K' base steps keep their own stds
    torch.testing.assert_close(scaled.std[5:], 0.25 * ref.std[5:])
    for name in ("c_x", "c_x0", "inv_sqrt_a", "eps_to_x0", "sigma"):
        torch.testing.assert_close(getattr(scaled, name), getattr(ref, name))
    assert scaled.step_coefs(7).std == pytest.approx(0.25 * ref.step_coefs(7).std)
    assert scaled.with_eta(0.5).noise_scale == 0.25  # another eta keeps the scale
    natural = scaled.with_natural_std()  # DPPO's protocol: the natural stds, no floor and no scale
    torch.testing.assert_close(natural.std[:-1], ref.with_natural_std().std[:-1])
    with pytest.raises(ValueError, match="noise_scale"):
        NoiseSchedule(100, 10, 5, noise_scale=0.0)


def test_explore_tolerance_is_validated(compose) -> None:
    with pytest.raises(ValueError, match="explore_tolerance"):
        compose("train", ["algo=ppo", "algo.explore_tolerance=1.5"])
    with pytest.raises(ValueError, match="explore_levels"):
        compose("train", ["algo=ppo", "algo.explore_tolerance=0.2", "algo.explore_levels=0"])


def test_a_tiny_run_explores_with_the_measured_scale_and_resumes_with_it(
    tmp_path: Path, init_ckpt: Path
) -> None:
    from diffpolicy.cli import compose
    from diffpolicy.train import main

    explore = ["algo.explore_tolerance=0.5", "algo.explore_episodes=2", "algo.explore_levels=3"]
    args = [
        *TINY_RUN,
        *TINY_POLICY,
        f"policy.init={init_ckpt}",
        "eval_episodes=2",
        "val_episodes=2",
        *explore,
    ]
    summary = main(compose("train", [*args, "algo.iterations=2"]), tmp_path)
    found = summary["exploration"]
    assert found["noise_scale"] in (1.0, 0.5, 0.25) and found["tolerance"] == 0.5
    scales = [s for s, _ in found["curve"]]
    assert scales[0] == 0.0 and found["noise_scale"] in scales and len(scales) <= 4
    assert found["env_steps"] > 0 and summary["env_steps"] > found["env_steps"]  # counted once, in the run
    ckpt = checkpoint.load(tmp_path / "checkpoints")
    assert ckpt.config["sampling"]["noise_scale"] == found["noise_scale"]
    assert ckpt.state["exploration"]["curve"] == found["curve"]
    # resumed: the scale comes back with the learner's state and is not measured again
    resumed = main(compose("train", [*args, "algo.iterations=3", "resume=true"]), tmp_path)
    assert resumed["exploration"] == found
    assert checkpoint.load(tmp_path / "checkpoints").config["sampling"]["noise_scale"] == found["noise_scale"]
    assert (tmp_path / "metrics.jsonl").read_text().count('"event": "explore_scale"') == 1  # measured once
