"""Multimodal BC on Meta-World tasks beside DP3's published table (Ze et al. 2024, RSS, Table XVIII).

For each task, one ``python -m diffpolicy.pretrain env=metaworld env.task=<task>`` with the default
configuration (the same for every task: 10 demonstrations of Meta-World's scripted policy, multimodal BC),
evaluated once on ``--test`` test episodes (seeds 1 000 000 + i, noise-free: every DDIM step's mean) and on
``--val`` validation episodes (100 000 + i). Each task's summary is appended to ``--out`` (JSON lines), so an
interrupted table resumes where it stopped; the Markdown table (success with its Wilson interval, DP3's
published figure, BC wall time) is printed last:

    python scripts/metaworld_bc_table.py --tasks assembly box-close --out runs/metaworld_bc.jsonl
    python scripts/metaworld_bc_table.py device.threads=1 --test 0 --tasks push  # overrides before --tasks

With the override ``reuse_cache=true`` a task whose BC the cache already holds (an earlier ``pretrain`` or
``train`` with the same settings) is evaluated without training again; its row reports that run's training
figures.

DP3 reports the mean of the 5 best of 20 evaluations (20 episodes each) over 3 seeds: optimistic; a row here
is one final evaluation of one seed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PUBLISHED = {
    "assembly": 99,
    "box-close": 42,
    "coffee-push": 94,
    "stick-pull": 27,
    "pick-place": 12,
    "peg-insert-side": 69,
    "hand-insert": 14,
    "push": 51,
    "shelf-place": 17,
    "bin-picking": 34,
}
"""DP3's published success (%, 10 demonstrations, DP3 Table XVIII) on the ten tasks the table compares."""


def run_task(task: str, mode: str, test: int, val: int, cache: str, runs: str, extra: list[str]) -> dict:
    """One pretrain run of ``task`` in observation mode ``mode`` under ``runs``; its summary plus the task's name."""
    cmd = [sys.executable, "-m", "diffpolicy.pretrain", "env=metaworld", f"env.task={task}",
           f"env.obs_mode={mode}", f"eval_episodes={test}", f"val_episodes={val}", "log.progress=false",
           f"cache_dir={cache}", f"hydra.run.dir={runs}/{task}-{mode}", *extra]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"error: {task}: {out.stderr.strip().splitlines()[-1]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    return {"task": task, "obs_mode": mode, "total_s": round(time.perf_counter() - t0, 1), **summary}


def table(rows: list[dict]) -> str:
    lines = ["| task | obs | ours (test) | 95 % CI | val | DP3 | failures (test) | BC steps | BC min | total min |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        dp3 = PUBLISHED.get(r["task"])
        test = r.get("success_rate")
        ci = r.get("success_ci") or [None, None]
        val = (r.get("val") or {}).get("success_rate")
        failures = ", ".join(f"{n} {k}" for k, n in (r.get("failures") or {}).items())
        lines.append(
            f"| {r['task']} | {r.get('obs_mode', 'multimodal')} | {'' if test is None else f'{test:.2f}'} | "
            f"{'' if ci[0] is None else f'[{ci[0]:.2f}, {ci[1]:.2f}]'} | {'' if val is None else f'{val:.2f}'} | {dp3} | {failures} | "
            f"{r['steps']} | {r['steps'] * r['s_per_step'] / 60:.1f} | {r['total_s'] / 60:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", nargs="+", default=list(PUBLISHED))
    p.add_argument(
        "--test", type=int, default=100, help="test episodes per task (0: validation only, for a choice)"
    )
    p.add_argument("--val", type=int, default=50, help="validation episodes per task")
    p.add_argument(
        "--obs-mode",
        default="multimodal",
        choices=["multimodal", "state"],
        help="multimodal (the table) or state (the 39-D state-only rows)",
    )
    p.add_argument("--out", default="runs/metaworld_bc.jsonl")
    p.add_argument("--cache", default=os.environ.get("DIFFPOLICY_CACHE", "runs/cache"))
    p.add_argument("--runs", default="runs/metaworld_bc", help="folder of the tasks' run directories")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every task (the same for all)")
    args = p.parse_args()
    if stray := [t for t in args.tasks if "=" in t]:
        raise SystemExit(f"error: {' '.join(stray)} read as task names: put Hydra overrides before --tasks")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows_read = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    done = {(r["task"], r.get("obs_mode", "multimodal")): r for r in rows_read}
    for task in args.tasks:
        if (task, args.obs_mode) not in done:
            row = run_task(task, args.obs_mode, args.test, args.val, args.cache, args.runs, args.overrides)
            done[task, args.obs_mode] = row
            with out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{task} ({args.obs_mode}): test {row.get('success_rate')}, "
                  f"val {(row.get('val') or {}).get('success_rate')}", flush=True)  # fmt: skip
    rows = [done[t, args.obs_mode] for t in args.tasks]
    print(table(rows))
    theirs = [PUBLISHED[t] for t in args.tasks if t in PUBLISHED]
    means = {"tasks": args.tasks, "mean_dp3": round(sum(theirs) / max(len(theirs), 1), 1)}
    val = [(r.get("val") or {}).get("success_rate") for r in rows]
    if None not in val:
        means["mean_val"] = round(100 * sum(val) / len(val), 1)
    if all("success_rate" in r for r in rows):
        means["mean_ours"] = round(sum(r["success_rate"] * 100 for r in rows) / len(rows), 1)
        means["at_or_above_dp3"] = sum(r["success_rate"] * 100 >= PUBLISHED.get(r["task"], 101) for r in rows)
    print(json.dumps(means))


if __name__ == "__main__":
    main()
