"""scripts/perception_probe.py's numerics: its ridge against least squares, its choice of penalty made on the
training scenes alone, and its errors in cm."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

SPEC = importlib.util.spec_from_file_location(
    "perception_probe", Path(__file__).resolve().parents[1] / "scripts" / "perception_probe.py"
)
probe = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(probe)


def test_ridge_without_penalty_is_least_squares_and_a_penalty_shrinks() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 8)) * rng.uniform(0.5, 3.0, 8) + 2.0
    y = x @ rng.normal(size=(8, 6)) + 0.3
    exact = probe.apply(probe.ridge(x, y, 0.0), x)
    np.testing.assert_allclose(exact, y, atol=1e-8)
    lstsq = np.linalg.lstsq(np.c_[x, np.ones(len(x))], y, rcond=None)[0]
    np.testing.assert_allclose(exact, np.c_[x, np.ones(len(x))] @ lstsq, atol=1e-8)
    shrunk = probe.ridge(x, y, 1e4)[2][:-1]
    assert np.abs(shrunk).sum() < 0.5 * np.abs(probe.ridge(x, y, 0.0)[2][:-1]).sum()


def test_penalty_is_chosen_on_held_out_training_scenes() -> None:
    """Noiseless linear data wants no shrinkage; pure noise wants the most."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(120, 30))
    episode_of = np.repeat(np.arange(10), 12)
    grid = (1e-3, 1.0, 1e4)
    assert probe.choose_penalty(x, x[:, :6] * 0.05, episode_of, grid) == 1e-3
    assert probe.choose_penalty(x, rng.normal(size=(120, 6)) * 0.05, episode_of, grid) == 1e4


def test_errors_are_the_mean_3d_distance_in_cm() -> None:
    y = np.zeros((2, 6))
    pred = np.array([[0.03, 0.04, 0.0, 0.0, 0.0, 0.01], [0.0, 0.0, 0.05, 0.0, 0.0, 0.03]])
    assert probe.errors_cm(pred, y) == {"object": 5.0, "goal": 2.0}
