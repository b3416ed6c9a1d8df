"""What fine-tuning is worth in demonstrations: held-out BC success against the number of demonstrations.

For each count in ``n_demos`` the BC policy of ``train``'s defaults for that count (``bc.n_demos=n``, the
precise expert unless ``expert`` says otherwise) is taken from the cache or trained into it
(:func:`diffpolicy.bc.pretrained_checkpoint`), then evaluated on the same ``eval_episodes`` held-out seeds with
every DDIM step's mean (the protocol ``train`` uses for the residual and filtered_bc heads). Checkpoints given
in ``finetuned`` (``{"label": path}``) are evaluated on the same seeds and drawn as horizontal lines, so one
reads off how many demonstrations BC would need to match them. Writes ``out`` (PNG) and returns the rows with
Wilson intervals and failure maps.

``python -m diffpolicy.bench demos_curve +options.finetuned='{fbc: runs/x/checkpoints}' +options.out=docs/demos_curve.png``
(BC at 100 precise demonstrations is about 12 min on 2 cores; the whole curve about 20 min from an empty cache).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from diffpolicy.cli import compose
from diffpolicy.device import Runtime


def run(
    repeats: int = 1,
    threads: int = 2,
    n_demos: tuple[int, ...] = (10, 20, 40, 100),
    eval_episodes: int = 200,
    finetuned: dict[str, str] | None = None,
    out: str = "docs/demos_curve.png",
    overrides: tuple[str, ...] = ("env.expert.max_speed=null",),
) -> dict[str, Any]:
    """BC success per demonstration count (and the ``finetuned`` checkpoints) on the same held-out seeds."""
    from diffpolicy.bc import pretrained_checkpoint
    from diffpolicy.evaluation import evaluate
    from diffpolicy.policy_io import load_policy

    t0 = time.perf_counter()
    base = compose("train", ["env=mujoco_pick", *overrides])
    runtime = Runtime.from_config(base.device)

    def score(path: Path, env_cfg: Any) -> dict[str, Any]:
        policy, _, _ = load_policy(path, runtime.device)
        res = evaluate(
            policy, env_cfg, n_action_steps=policy.n_action_steps, n_episodes=eval_episodes, seed=base.eval_seed,
            num_envs=min(env_cfg.num_envs, eval_episodes), device=runtime.device, deterministic=True,
            autocast=runtime.autocast,
        )  # fmt: skip
        return {
            "success": res.success_rate,
            "ci": [round(v, 3) for v in res.wilson()],
            "failures": res.failures(),
        }

    rows = []
    for n in n_demos:
        bc = dataclasses.replace(base.bc, n_demos=int(n))
        path = pretrained_checkpoint(base.env, base.policy, bc, runtime, base.cache_dir, seed=base.seed)
        rows.append({"n_demos": int(n), "checkpoint": str(path), **score(path, base.env)})
    lines = {label: score(Path(p), base.env) for label, p in (finetuned or {}).items()}
    plot(rows, lines, Path(out))
    return {"rows": rows, "finetuned": lines, "eval_episodes": eval_episodes, "png": out,
            "overrides": list(overrides), "wall_time_s": round(time.perf_counter() - t0, 1)}  # fmt: skip


def plot(rows: list[dict[str, Any]], lines: dict[str, dict[str, Any]], path: Path) -> None:
    """BC success (with 95 % Wilson bars) against demonstrations, log x; fine-tuned policies as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    x = [r["n_demos"] for r in rows]
    y = [r["success"] for r in rows]
    err = [[r["success"] - r["ci"][0] for r in rows], [r["ci"][1] - r["success"] for r in rows]]
    ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label="BC")
    for i, (label, res) in enumerate(lines.items()):
        ax.axhline(res["success"], color=f"C{i + 1}", linestyle="--", label=f"{label} ({res['success']:.2f})")
        ax.axhspan(res["ci"][0], res["ci"][1], color=f"C{i + 1}", alpha=0.12)
    ax.set_xscale("log")
    ax.set_xticks(x, [str(v) for v in x])
    ax.set_xlabel("demonstrations")
    ax.set_ylabel("held-out success")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
