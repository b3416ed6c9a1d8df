"""``python -m diffpolicy.bench NAME [overrides]``: one benchmark, printed as one JSON line.

Each benchmark lives in ``diffpolicy/benchmarks/<name>.py`` and exposes ``run(**options) -> dict``.
Timings are medians of repeated runs, with references measured in the same run; ``threads`` sets torch's
intra-op threads (2 by default, this project's CI machine). Options: ``repeats=5 threads=2
+options.key=value``. ``make bench`` runs every one but the long studies (:data:`STUDIES`).
"""

from __future__ import annotations

import importlib
import inspect
import platform
import sys
from pathlib import Path

import torch

from diffpolicy.cli import fail, launch
from diffpolicy.config import BenchConfig

BENCHMARKS = {
    "env": "environment steps per second with full and replan-only observations",
    "gae": "the GAE op against reference loops and a memory-copy bound",
    "sampler": "batch-1 latency of one DDIM chunk for both U-Net sizes",
    "bimodal": "diffusion vs Gaussian BC on the bimodal ObstacleReach task",
    "ppo_update": "PPO update throughput (decisions per second)",
    "stabledrl": "standard PPO vs StableDRL clipping under 100x importance-ratio noise",
    "scaling": "training environment steps per second with 1 and 2 processes (algo=filtered_bc by default)",
    "serve": "gRPC action server latency and throughput",
    "encoders": "encoder forward+backward samples/s per modality at the BC batch size",
    "bc_step": "one BC optimiser step of the state task's policy at several batch sizes",
    "group_norm_mish": "the U-Net block's GroupNorm + Mish operator against ATen's ops, forward + backward",
    "demos_curve": "held-out BC success against the number of demonstrations (and fine-tuned policies on it)",
    "demos_import": "LeRobotDataset import (video decode + cache) in frames/s, H.264 and AV1, against the native format",
}
"""Benchmark names and what each measures."""

STUDIES = ("demos_curve",)
"""Benchmarks that are long multi-run studies, left out of ``make bench`` (the Makefile's ``BENCH``)."""


def _job(name: str):
    def main(cfg: BenchConfig, run_dir: Path) -> dict:
        try:
            module = importlib.import_module(f"diffpolicy.benchmarks.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"diffpolicy.benchmarks.{name}":
                fail(f"benchmark '{name}' is not built yet")
            raise
        torch.set_num_threads(cfg.threads)
        accepted = inspect.signature(module.run).parameters
        given = {"repeats": cfg.repeats, "threads": cfg.threads, **dict(cfg.options)}
        unknown = sorted(k for k in given if k not in accepted and k not in ("repeats", "threads"))
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
            fail(f"benchmark '{name}' has no option(s) {unknown}; it takes {sorted(accepted)}")
        result = module.run(
            **{k: v for k, v in given.items() if k in accepted or k not in ("repeats", "threads")}
        )
        return {
            "benchmark": name,
            **result,
            "threads": cfg.threads,
            "torch": torch.__version__,
            "machine": platform.machine(),
        }

    return main


def cli(argv: list[str]) -> None:
    """Parse ``NAME [overrides]`` and run the benchmark."""
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        names = ", ".join(BENCHMARKS)
        fail(f"usage: python -m diffpolicy.bench NAME [overrides]; NAME is one of {names}")
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        fail(f"unknown benchmark '{name}'; choose one of {', '.join(BENCHMARKS)}")
    launch("bench", _job(name), rest)


if __name__ == "__main__":
    cli(sys.argv[1:])
