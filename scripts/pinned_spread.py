"""Measure what the pinned tiny runs (tests/test_pinned_runs.py) can be pinned to.

Two spreads decide each tolerance there:

- the *machine* spread: the same runs under every CPU instruction-set path that oneDNN, MKL and ATen can take
  (each child process caps them through ``ONEDNN_MAX_CPU_ISA``, ``MKL_ENABLE_INSTRUCTIONS`` and
  ``ATEN_CPU_CAPABILITY``, which are read at start-up), so float figures that differ only by summation order;
- the *behaviour* spread: small deliberate changes under the native path, each in fine-tuning only (the BC
  is read from a cache a clean run filled): one extra draw from each RNG (torch, numpy) the learner's first
  rollout seeds; one sample of its first update's first index draw moved (the first and last of a minibatch
  permutation swapped, so two minibatches differ by a sample; or a sampled batch's first index replaced by
  its last); the learning rate 1 % higher.

A pin's tolerance must lie above the first and below the second. Usage (about 3 minutes on one core):

    python scripts/pinned_spread.py > runs/pinned_spread.json

prints one JSON object: per run name, the figures of every ISA path and every change, per figure the
largest machine difference and each change's difference, and which rows the test's tolerances would fail
(``failed_by_machine`` must be empty; ``caught_changes`` names the changes the pin sees).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Each path as a newcomer's CPU might take it; "native" caps nothing.
ISA_PATHS = {
    "native": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx2_blas_only": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "sse41": {
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ATEN_CPU_CAPABILITY": "default",
    },
}
CHANGES = ("extra_draw", "moved_sample", "lr_plus_1pct")
FIGURES = ("bc_return", "ppo_return", "val_ppo_return", "env_steps", "sum_abs_w", "moved", "learner_w")


def _figures(name: str, cache: Path, run_dir: Path, extra: list[str]) -> dict[str, float]:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_pinned_runs import RUNS, TINY, figures

    from diffpolicy.cli import compose
    from diffpolicy.train import main

    cfg = compose("train", [*RUNS[name], *TINY, f"cache_dir={cache}", *extra])
    return dict(zip(FIGURES, figures(cfg, main(cfg, run_dir), run_dir)))


def _during_first_call(cls: type, method: str, patch) -> None:
    """Make ``cls.method``'s first call run inside the context manager ``patch()``."""
    real = getattr(cls, method)
    state = {"done": False}

    def wrapped(self, *args, **kwargs):
        if state["done"]:
            return real(self, *args, **kwargs)
        state["done"] = True
        with patch():
            return real(self, *args, **kwargs)

    setattr(cls, method, wrapped)


def _apply_change(change: str, cfg) -> list[str]:
    """Patch the run's learner for ``change``; return extra overrides."""
    import contextlib

    import numpy as np
    import torch

    from diffpolicy.rl.learner import learner_class

    cls = learner_class(cfg.algo.learner)
    if change == "extra_draw":  # each RNG the first rollout seeds (torch and numpy) draws one number more

        @contextlib.contextmanager
        def one_extra_draw():
            real_gen, real_rng = torch.Generator, np.random.default_rng
            fired = set()

            class OneExtraDraw(real_gen):
                def manual_seed(self, seed):  # type: ignore[override]
                    out = super().manual_seed(seed)
                    if "torch" not in fired:
                        fired.add("torch")
                        torch.rand(1, generator=self)
                    return out

            def default_rng(*args, **kwargs):
                rng = real_rng(*args, **kwargs)
                if "numpy" not in fired:
                    fired.add("numpy")
                    rng.random()
                return rng

            torch.Generator, np.random.default_rng = OneExtraDraw, default_rng
            try:
                yield
            finally:
                torch.Generator, np.random.default_rng = real_gen, real_rng

        _during_first_call(cls, "rollout", one_extra_draw)
        return []
    if change == "moved_sample":  # the first update's first index draw changes by one sample

        @contextlib.contextmanager
        def one_sample_moved():
            real = {name: getattr(torch, name) for name in ("randperm", "randint", "multinomial")}
            fired = {"done": False}

            def patched(name):
                def draw(*args, **kwargs):
                    idx = real[name](*args, **kwargs)
                    if not fired["done"] and idx.numel() > 2:
                        fired["done"] = True
                        flat = idx.view(-1)
                        if name == "randperm":  # first and last trade places: two minibatches change
                            flat[[0, -1]] = flat[[-1, 0]]
                        else:  # a drawn batch: its first sample replaced by its last one's
                            flat[0] = flat[-1]
                    return idx

                return draw

            for name in real:
                setattr(torch, name, patched(name))
            try:
                yield
            finally:
                for name, fn in real.items():
                    setattr(torch, name, fn)

        _during_first_call(cls, "update", one_sample_moved)
        return []
    if change == "lr_plus_1pct":
        return [f"algo.lr={cfg.algo.lr * 1.01!r}"]
    raise ValueError(f"unknown change {change!r}; expected one of {CHANGES}")


def child(isa: str, change: str | None, only: str | None) -> None:
    """One process: every pinned run under this ISA path, or one run with one change; a JSON line each."""
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from test_pinned_runs import RUNS, TINY

    from diffpolicy.cli import compose

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for name in [only] if only else RUNS:
            extra: list[str] = []
            if change is not None:
                _figures(name, cache, Path(tmp) / f"{name}_clean", [])  # fills the BC cache unchanged
                extra = _apply_change(change, compose("train", [*RUNS[name], *TINY]))
            got = _figures(name, cache, Path(tmp) / name, extra)
            print(json.dumps({"isa": isa, "change": change, "run": name, **got}), flush=True)


def _spawn(isa: str, change: str | None, run: str | None) -> list[dict]:
    env = {**os.environ, **ISA_PATHS[isa], "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    for key in {k for path in ISA_PATHS.values() for k in path} - set(ISA_PATHS[isa]):
        env.pop(key, None)
    args = [sys.executable, __file__, "--child", isa]
    args += ["--change", change, "--run", run] if change else []  # a fresh process per change: patches stay
    out = subprocess.run(args, env=env, check=True, capture_output=True, text=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _tuple(row: dict) -> tuple:
    return tuple(row[f] for f in FIGURES)


def parent() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from test_pinned_runs import RUNS, mismatches

    rows = [row for isa in ISA_PATHS for row in _spawn(isa, None, None)]
    rows += [row for change in CHANGES for run in RUNS for row in _spawn("native", change, run)]
    report: dict = {"runs": {}}
    for run in RUNS:
        mine = [r for r in rows if r["run"] == run]
        native = next(r for r in mine if r["isa"] == "native" and r["change"] is None)
        machine = {f: max(abs(r[f] - native[f]) for r in mine if r["change"] is None) for f in FIGURES}
        behaviour = {f: {r["change"]: abs(r[f] - native[f]) for r in mine if r["change"]} for f in FIGURES}
        pinned = tuple(native[f] for f in FIGURES)
        report["runs"][run] = {
            "rows": mine,
            "machine_spread": machine,
            "behaviour_change": behaviour,
            "failed_by_machine": [
                r["isa"] for r in mine if not r["change"] and mismatches(_tuple(r), pinned)
            ],
            "caught_changes": [r["change"] for r in mine if r["change"] and mismatches(_tuple(r), pinned)],
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=list(ISA_PATHS))
    parser.add_argument("--change", choices=CHANGES)
    parser.add_argument("--run")
    args = parser.parse_args()
    if args.child is None:
        parent()
    else:
        child(args.child, args.change, args.run)
