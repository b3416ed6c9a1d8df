"""The deployed Hopper policy's validation curve of fine-tuning runs beside DPPO's logged runs, at equal env steps.

    python scripts/hopper_vs_dppo.py runs/hopper_a runs/hopper_b --out docs/hopper_vs_dppo.png

Each run is a ``python -m diffpolicy.train env=hopper`` directory. Its curve is ``val/guard_return`` (the rollback
guard's validation episodes, under the run's ``eval_protocol``: noise-free for env=hopper) divided by BC's
validation return (``val/mean_return`` at step 0), against env steps. DPPO's points are the
``eval/avg episode reward`` (DPPO's deterministic protocol) of its three hopper-medium-v2 runs
(``ppo_diffusion_mlp_ta4_td20_tdf10``, seeds 0, 42, 3407), logged every 10 iterations of 80 000 env steps, as
exported from wandb into ReinFlow's ``Final_experiments/data/finetune/gym-state/hopper/hopper_reward.csv``;
each run divided by its own iteration-0 value. The figure says which protocol each line is under.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

# DPPO's logged eval/avg episode reward, seeds (0, 3407, 42), at iterations 0, 10, 20 (x 80 000 env steps).
DPPO_STEPS = [0, 800_000, 1_600_000]
DPPO_RETURNS = {
    0: [1457.27, 1606.24, 2200.69],
    3407: [1453.94, 1588.22, 2297.32],
    42: [1405.75, 1607.40, 2262.48],
}


def run_curve(run: Path) -> tuple[np.ndarray, np.ndarray]:
    """(env steps, val/guard_return / BC's val/mean_return) of one run, BC's point (0, 1) first."""
    from diffpolicy.logger import read_metrics

    rows = read_metrics(run / "metrics.jsonl")
    bc = next((r["val/mean_return"] for r in rows if r.get("step") == 0 and "val/mean_return" in r), None)
    if bc is None:
        raise SystemExit(f"{run}: no BC validation return (val/mean_return at step 0)")
    pts = [(r["step"], r["val/guard_return"]) for r in rows if "val/guard_return" in r]
    if not pts:
        raise SystemExit(f"{run}: no val/guard_return (run with algo.rollback_episodes > 0)")
    steps = np.array([0] + [s for s, _ in pts], dtype=float)
    return steps, np.array([1.0] + [v / bc for _, v in pts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="train run directories (env=hopper)")
    parser.add_argument("--label", action="append", default=[], help="one per run (default: its name)")
    parser.add_argument("--out", type=Path, default=Path("hopper_vs_dppo.png"))
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2), dpi=100)
    labels = args.label + [r.name for r in args.runs[len(args.label) :]]
    for run, label in zip(args.runs, labels):
        steps, ratio = run_curve(run)
        ax.plot(steps / 1e6, ratio, marker=".", lw=1.6, label=f"{label} (noise-free, 10 validation episodes)")
    dppo = np.array([np.array(v) / v[0] for v in DPPO_RETURNS.values()])  # (3 seeds, 3 points)
    x = np.array(DPPO_STEPS) / 1e6
    ax.plot(
        x,
        dppo.mean(0),
        ls="--",
        marker="o",
        color="grey",
        label="DPPO's logged runs (deterministic, 3 seeds)",
    )
    ax.fill_between(x, dppo.min(0), dppo.max(0), color="grey", alpha=0.15)
    ax.axhline(1.3, color="k", lw=0.8, ls=":", label="1.3x BC")
    ax.set_xlim(0, 1.05)
    ax.set_xlabel("env steps (millions)")
    ax.set_ylabel("return / BC's return")
    ax.set_title("Hopper-v5 from a medium BC: fine-tuned / BC")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize=8, frameon=False)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, bbox_inches="tight")
    print(args.out)


if __name__ == "__main__":
    main()
