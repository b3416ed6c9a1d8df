"""``python -m diffpolicy.pretrain env=mujoco_pick``: behaviour cloning of a policy from expert demonstrations.

Reads top to bottom: the demonstrations (``bc.demos=PATH`` imported into the cache once, or the scripted
expert's, collected into ``<cache_dir>/demos/<key>`` when missing: :func:`diffpolicy.demos.demonstrations`)
-> :func:`diffpolicy.bc.behaviour_cloning` -> the result published into the BC cache that
``diffpolicy.train`` reads (the same ``bc.demos`` there reuses it) -> the training curve ``bc_loss.png``
and, when ``eval_episodes > 0``, a held-out success rate measured as ``train`` measures its BC success
rate (:func:`diffpolicy.evaluation.held_out`).

``policy=selector`` trains a multi-stage task's sub-task selector instead (:func:`selector_main`): on the
demonstrations' ``subtask`` labels, judged by how often it names the expert's sub-task on the expert's
episodes from the validation seeds (``val_episodes``); its success comes from ``evaluate selector=PATH``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from diffpolicy import checkpoint
from diffpolicy.bc import bc_key, behaviour_cloning, publish
from diffpolicy.cli import launch
from diffpolicy.config import PretrainConfig, SamplingConfig
from diffpolicy.demos import demonstrations
from diffpolicy.device import Runtime
from diffpolicy.logger import Logger


# -------------------------------------------------------------------------------------------- entry point
def main(cfg: PretrainConfig, run_dir: Path) -> dict[str, Any]:
    """Behaviour cloning for ``cfg``; returns the summary printed as the last stdout line."""
    from diffpolicy.evaluation import held_out, protocol_of
    from diffpolicy.plots import plot_curve

    if cfg.policy.kind == "selector":
        return selector_main(cfg, run_dir)
    t0 = time.perf_counter()
    runtime = Runtime.from_config(cfg.device)
    summary: dict[str, Any] = {}
    with Logger(run_dir, tensorboard=cfg.log.tensorboard, progress=cfg.log.progress) as logger:
        # the settings `diffpolicy.train` would pre-train with: the result is shared through this cache entry
        cached = Path(cfg.cache_dir) / "bc" / bc_key(cfg.env, cfg.policy, cfg.bc, cfg.seed)
        if cfg.reuse_cache and checkpoint.exists(cached):
            policy, metrics, demos = reused(cached, runtime)
            summary["reused"] = str(checkpoint.resolve(cached))
        else:
            demos, made = demonstrations(cfg.env, cfg.bc, cfg.seed, cfg.cache_dir, logger.progress)
            summary["demos_imported" if cfg.bc.demos else "demos_collected"] = made
            # the run's checkpoints carry the protocol its figures are judged under, so evaluate says the same
            policy, metrics = behaviour_cloning(
                cfg.env, cfg.policy, cfg.bc, demos, runtime, logger, run_dir, cfg.seed,
                extra={"protocol": protocol_of(cfg)},
            )  # fmt: skip
            summary["cached"] = str(publish(policy, cfg.env, cfg.policy, cached, metrics, demos))
        summary["demos"] = str(demos)
        summary["protocol"] = protocol_of(cfg)
        if isinstance(cfg.algo, SamplingConfig):  # judged as train judges it: with the learner's sampling
            policy.set_sampling(**cfg.algo.sampling())
        if cfg.eval_episodes > 0:
            result = held_out(policy, cfg, runtime)
            scalars = {"eval/mean_return": result.mean_return}
            if result.reports_success:  # no 0.0 curve for an env without a success notion (Hopper)
                scalars["eval/success_rate"] = result.success_rate
            logger.log(scalars, metrics["steps"])
            summary.update(result.success_fields())  # None without a success notion (Hopper)
            summary["drops"] = result.drops()
            summary["mean_return"] = round(result.mean_return, 2)
            summary["return_ci"] = [round(v, 2) for v in result.return_ci()]  # 95 % Student-t interval
            summary["eval_episodes"] = result.episodes
            summary["split"] = {"test": {"first_seed": cfg.eval_seed, "episodes": result.episodes}}
            summary["protocols"] = {}  # report_protocols: the same test seeds under further protocols
            for name in cfg.report_protocols:
                res = held_out(policy, cfg, runtime, protocol=name)
                summary["protocols"][name] = {
                    "mean_return": round(res.mean_return, 2),
                    "return_ci": [round(v, 2) for v in res.return_ci()],
                    "success_rate": res.success_rate if res.reports_success else None,
                }
        if cfg.val_episodes > 0:  # the seeds BC settings are chosen on, reported apart from the test figure
            val = held_out(policy, cfg, runtime, "val")
            if val.reports_success:
                logger.log({"val/success_rate": val.success_rate}, metrics["steps"])
            summary["val"] = {
                "success_rate": val.success_rate if val.reports_success else None,
                "mean_return": round(val.mean_return, 2),
                "episodes": val.episodes,
                "first_seed": cfg.val_seed,
                "failures": val.failures() if val.reports_success else None,
                "by_kind": val.by_kind() or None,  # MujocoDialogue: per episode kind
            }
    curve = None
    if (run_dir / "metrics.jsonl").is_file() and "reused" not in summary:
        curve = plot_curve(
            run_dir / "metrics.jsonl", "losses/bc", run_dir / "bc_loss.png", title="behaviour cloning"
        )
    return {
        "final_loss": metrics["final_loss"],
        "checkpoint": metrics["checkpoint"],
        "epochs": metrics["epochs"],
        "condition_gap": metrics["condition_gap"],
        "steps": metrics["steps"],
        "s_per_step": metrics["s_per_step"],
        "curve": None if curve is None else str(curve),
        **summary,
        "wall_time_s": round(time.perf_counter() - t0, 2),
    }


def selector_main(cfg: PretrainConfig, run_dir: Path) -> dict[str, Any]:
    """Train a sub-task selector (``policy=selector``) and measure its label accuracy on validation episodes."""
    from diffpolicy.demos import collect_demos
    from diffpolicy.hierarchy import label_accuracy, train_selector

    t0 = time.perf_counter()
    runtime = Runtime.from_config(cfg.device)
    with Logger(run_dir, tensorboard=cfg.log.tensorboard, progress=cfg.log.progress) as logger:
        demos, made = demonstrations(cfg.env, cfg.bc, cfg.seed, cfg.cache_dir, logger.progress)
        selector, metrics = train_selector(
            cfg.env, cfg.policy, cfg.bc, demos, runtime, logger, run_dir, cfg.seed,
            corrections=cfg.selector_corrections,
        )  # fmt: skip
        summary: dict[str, Any] = {**metrics, "demos": str(demos), "demos_collected": made}
        if (
            cfg.val_episodes > 0
        ):  # the expert's own episodes on validation seeds: does it name their sub-task?
            val = collect_demos(cfg.env, cfg.val_episodes, cfg.val_seed, run_dir / "val_demos")["path"]
            summary["val"] = {"label_accuracy": label_accuracy(selector, val), "episodes": cfg.val_episodes,
                              "first_seed": cfg.val_seed}  # fmt: skip
    return {**summary, "wall_time_s": round(time.perf_counter() - t0, 2)}


def reused(root: Path, runtime: Runtime) -> tuple[Any, dict[str, Any], Path]:
    """The cached BC policy at ``root`` on ``runtime``'s device, the training figures of the run that wrote it
    (its ``summary.json``, beside the checkpoints it names as its source; None where that run is gone) and
    its demonstrations."""
    import json

    from diffpolicy.policy_io import load_policy

    policy, _, ckpt = load_policy(checkpoint.resolve(root), runtime.device)
    source = Path(ckpt.extra.get("source", ""))
    run = source.parent.parent if source.name else None
    found = json.loads((run / "summary.json").read_text()) if run and (run / "summary.json").is_file() else {}
    fields = ("final_loss", "epochs", "condition_gap", "steps", "s_per_step")
    metrics = {k: found.get(k) for k in fields}
    metrics["steps"] = metrics["steps"] if metrics["steps"] is not None else ckpt.step
    metrics["checkpoint"] = str(source) if source.name else str(checkpoint.resolve(root))
    return policy, metrics, Path(ckpt.extra.get("demos", ""))


if __name__ == "__main__":
    launch("pretrain", main)
