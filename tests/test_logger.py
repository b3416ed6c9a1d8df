"""The metrics logger writes namespaced scalars to metrics.jsonl and TensorBoard, only on rank 0."""

from __future__ import annotations

import math

import pytest

from diffpolicy.logger import Logger, read_metrics


def test_writes_jsonl_and_tensorboard(tmp_path) -> None:
    with Logger(tmp_path, tensorboard=True, progress=False) as log:
        for step in log.progress(range(3), total=3, desc="it"):
            log.log({"rollout/success_rate": 0.5 * step, "losses/policy": float("nan")}, step=step * 10)
        log.event("rollback", "success collapsed", step=30, to_step=20)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert rows[2]["rollout/success_rate"] == 1.0 and rows[0]["losses/policy"] is None
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert "rollback" in (tmp_path / "metrics.jsonl").read_text()


def test_tensorboard_scalars_are_readable(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with Logger(tmp_path, progress=False) as log:
        log.log({"time/sps": 12.5}, step=1)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert math.isclose(acc.Scalars("time/sps")[0].value, 12.5)


def test_non_zero_rank_writes_nothing(tmp_path) -> None:
    with Logger(tmp_path / "r1", rank=1) as log:
        log.log({"time/sps": 1.0}, step=0)
        assert list(log.progress([1, 2])) == [1, 2]
    assert not (tmp_path / "r1").exists()


def test_rejects_unnamespaced_metric(tmp_path) -> None:
    with (
        Logger(tmp_path, tensorboard=False, progress=False) as log,
        pytest.raises(ValueError, match="namespace"),
    ):
        log.log({"success": 1.0}, step=0)


def test_plot_runs_draws_every_run_and_the_reference(tmp_path) -> None:
    """Several runs' curves and a published reference on one axis; a run without the key is an error."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from diffpolicy.plots import plot_runs

    paths = {}
    for name, slope in (("a", 1.0), ("b", 2.0)):
        with Logger(tmp_path / name, tensorboard=False, progress=False) as log:
            for step in range(3):
                log.log({"rollout/mean_return": slope * step}, step=step * 100)
        paths[name] = tmp_path / name / "metrics.jsonl"
    drawn = {}
    real_savefig = plt.Figure.savefig

    def spy(fig, path, *a, **k):
        drawn["lines"] = {ln.get_label(): list(ln.get_ydata()) for ln in fig.axes[0].get_lines()}
        return real_savefig(fig, path, *a, **k)

    plt.Figure.savefig = spy
    try:
        out = plot_runs(
            paths, "rollout/mean_return", tmp_path / "c.png", reference={"paper": ([0, 200], [0, 5])}
        )
    finally:
        plt.Figure.savefig = real_savefig
    assert out.is_file() and out.stat().st_size > 0
    assert drawn["lines"] == {"a": [0.0, 1.0, 2.0], "b": [0.0, 2.0, 4.0], "paper": [0, 5]}
    with pytest.raises(ValueError, match="no values"):
        plot_runs({"a": paths["a"]}, "losses/bc", tmp_path / "d.png")
