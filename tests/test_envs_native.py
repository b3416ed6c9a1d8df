"""The environments' C loops (diffpolicy_envs.native) against their NumPy references, and their fallback."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from diffpolicy_envs import native
from diffpolicy_envs.meta_world import farthest_points


def _built() -> None:
    """Skip only where no C compiler exists; with one, the C loop must build."""
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler on this machine: the NumPy loop runs")
    assert native.library("fps") is not None, native.why("fps")


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """No library loaded yet in this process (so the environment variables below take effect)."""
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.setattr(native, "_why", {})
    return native


@pytest.mark.parametrize("m, n", [(300, 40), (1400, 512), (1401, 512), (513, 513), (1, 1)])
def test_c_farthest_points_gives_the_numpy_indices(m: int, n: int) -> None:
    _built()
    rng = np.random.default_rng(m)
    xyz = rng.normal(size=(m, 3))
    for start in (0, m // 3, m - 1):
        np.testing.assert_array_equal(native.farthest_points(xyz, n, start), farthest_points(xyz, n, start))


def test_c_farthest_points_breaks_ties_as_numpy() -> None:
    """A voxel grid is full of equal distances: the first of the farthest points wins in both."""
    _built()
    grid = np.stack(np.meshgrid(*[np.arange(6.0) * 0.01] * 3, indexing="ij"), -1).reshape(-1, 3)
    got = native.farthest_points(grid, 100, 0)
    np.testing.assert_array_equal(got, farthest_points(grid, 100, 0))
    assert len(set(got.tolist())) == 100
    with pytest.raises(ValueError, match="0 < n <= M"):
        native.farthest_points(grid, len(grid) + 1, 0)
    grid[7, 1] = np.nan
    with pytest.raises(ValueError, match="finite"):
        native.farthest_points(grid, 10, 0)


def test_without_a_compiler_or_when_switched_off_numpy_runs(fresh, monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.setenv(native.ENV_VAR, "0")
    assert fresh.farthest_points(np.zeros((4, 3)), 2, 0) is None and fresh.why("fps") == f"{native.ENV_VAR}=0"
    monkeypatch.setattr(native, "_libs", {})
    monkeypatch.delenv(native.ENV_VAR)
    monkeypatch.setenv("DIFFPOLICY_CACHE", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "no-such-compiler")
    assert fresh.library("fps") is None and "no C compiler" in fresh.why("fps")
