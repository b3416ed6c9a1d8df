"""``python -m diffpolicy.sweep DIR``: the summaries of a Hydra multirun, as one table.

``python -m diffpolicy.train -m algo.lr=1e-5,3e-5 seed=0,1`` runs every combination in its own directory
under ``runs/multirun/<date>/<job>/``, each with its ``summary.json`` and Hydra's ``.hydra/overrides.yaml``.
This command finds them under DIR (default: the newest sweep in ``runs/multirun``), prints a Markdown
table (one row per job: its overrides, then the summary's numbers, the validation split's as ``val_*``
columns: choose on those, the top-level figures are the test split's) and, last, the rows as one JSON line.
Jobs that did not finish are listed with ``status: missing``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from diffpolicy.cli import fail, summary_line


def _overrides(job: Path) -> dict[str, str]:
    path = job / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        item = line.strip().removeprefix("- ").strip().strip("'\"")
        if "=" in item:
            key, value = item.split("=", 1)
            out[key] = value
    return out


def collect(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory of a sweep: its overrides and its summary (or ``status: missing``)."""
    rows = []
    jobs = sorted({p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")})
    for job in jobs:
        row: dict[str, Any] = {"job": job.name, **_overrides(job)}
        summary = job / "summary.json"
        if summary.is_file():
            data = json.loads(summary.read_text())
            row.update(data)
            # the validation figures as columns of their own: a sweep's choice reads these, not the test ones
            for key, value in (data.get("val") or {}).items():
                row[f"val_{key}"] = value
            row["status"] = "done"
        else:
            row["status"] = "missing"
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], overrides: set[str] | None = None) -> str:
    """Markdown table of ``rows`` (columns in first-seen order; floats with 4 significant digits).

    Override columns (``overrides``) whose value is the same in every row are left out: the table shows
    what the sweep varied, then the results.
    """
    cols: list[str] = []
    for row in rows:
        cols += [k for k in row if k not in cols and not isinstance(row[k], dict | list)]
    if overrides and len(rows) > 1:
        cols = [c for c in cols if c not in overrides or len({str(r.get(c)) for r in rows}) > 1]
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def newest_sweep(root: Path = Path("runs/multirun")) -> Path:
    """The most recent sweep directory under ``root``."""
    sweeps = sorted(p for p in root.glob("*") if p.is_dir()) if root.is_dir() else []
    if not sweeps:
        raise FileNotFoundError(f"no sweep under {root}; run python -m diffpolicy.train -m ... first")
    return sweeps[-1]


def cli(argv: list[str]) -> None:
    """``[DIR]`` -> table on stdout, then the rows as one JSON line."""
    try:
        sweep_dir = Path(argv[0]) if argv else newest_sweep()
        if not sweep_dir.is_dir():
            raise FileNotFoundError(f"{sweep_dir} is not a directory")
        rows = collect(sweep_dir)
        if not rows:
            raise FileNotFoundError(f"no Hydra job directories under {sweep_dir}")
    except FileNotFoundError as exc:
        fail(str(exc))
    varied = {
        k
        for job in sorted({p.parent.parent for p in sweep_dir.rglob(".hydra/overrides.yaml")})
        for k in _overrides(job)
    }
    print(table(rows, varied))
    print(summary_line({"sweep": str(sweep_dir), "jobs": rows}))


if __name__ == "__main__":
    cli(sys.argv[1:])
