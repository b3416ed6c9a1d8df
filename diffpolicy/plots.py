"""Training-curve figures from a run's ``metrics.jsonl`` (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

from diffpolicy.logger import read_metrics


def plot_curve(
    metrics_jsonl: str | Path,
    key: str,
    out_png: str | Path,
    *,
    title: str | None = None,
    smooth: int = 0,
    logy: bool | None = None,
) -> Path:
    """Plot metric ``key`` against ``step`` from ``metrics_jsonl`` into ``out_png``; returns the PNG path.

    Args:
        metrics_jsonl: a :class:`~diffpolicy.logger.Logger` metrics file.
        key: namespaced metric name (``losses/bc``).
        out_png: where to write the figure.
        title: figure title (default: the key).
        smooth: also draw a moving average over this many points (0 = auto: ~1/20 of the points).
        logy: log-scale y axis (default: when the values are all positive and span > 2 decades).

    Raises:
        ValueError: if the file holds no finite value of ``key``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    records = [r for r in read_metrics(metrics_jsonl) if r.get(key) is not None]
    if not records:
        raise ValueError(f"{metrics_jsonl} has no values of {key!r}")
    steps = np.array([r["step"] for r in records], dtype=np.float64)
    values = np.array([r[key] for r in records], dtype=np.float64)
    window = smooth or max(1, len(values) // 20)
    if logy is None:
        logy = bool((values > 0).all() and values.max() / max(values.min(), 1e-300) > 100)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(steps, values, lw=0.8, alpha=0.4 if window > 1 else 1.0, label=key)
    if window > 1 and len(values) >= window:
        kernel = np.ones(window) / window
        ax.plot(
            steps[window - 1 :], np.convolve(values, kernel, mode="valid"), lw=1.6, label=f"mean of {window}"
        )
        ax.legend(loc="best", fontsize=8)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title or key)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)
    return out_png


def plot_runs(
    runs: dict[str, str | Path],
    key: str,
    out_png: str | Path,
    *,
    reference: dict[str, tuple[list[float], list[float]]] | None = None,
    title: str | None = None,
) -> Path:
    """Metric ``key`` against ``step`` for several runs on one axis (one line each), for comparing learners.

    Args:
        runs: label -> a run's ``metrics.jsonl``.
        key: namespaced metric name (``rollout/mean_return``).
        out_png: where to write the figure.
        reference: label -> (steps, values) drawn as dashed lines with markers (a published curve).
        title: figure title (default: the key).

    Raises:
        ValueError: if a run holds no value of ``key``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.6), dpi=100)
    for label, path in runs.items():
        records = [r for r in read_metrics(path) if r.get(key) is not None]
        if not records:
            raise ValueError(f"{path} has no values of {key!r}")
        ax.plot([r["step"] for r in records], [r[key] for r in records], lw=1.6, marker=".", label=label)
    for label, (steps, values) in (reference or {}).items():
        ax.plot(steps, values, ls="--", lw=1.2, marker="o", ms=3, color="grey", label=label)
    ax.set_xlabel("env steps")
    ax.set_ylabel(key)
    ax.set_title(title or key)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8, ncol=1, frameon=False)
    fig.tight_layout()
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, bbox_inches="tight")
    plt.close(fig)
    return out_png
