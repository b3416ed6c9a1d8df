"""Worker for tests/test_distributed.py: one PPO iteration under torchrun (not collected by pytest).

Usage: python -m torch.distributed.run --nproc_per_node=2 tests/dist_train_worker.py OUT_DIR INIT_CKPT
Each rank writes its policy and critic parameters after the iteration to OUT_DIR/params_rank{r}.safetensors.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from safetensors.torch import save_file

from diffpolicy.cli import compose
from diffpolicy.device import Runtime
from diffpolicy.distributed import apply_visible_devices, process_group
from diffpolicy.logger import Logger
from diffpolicy.train import fine_tune

sys.path.insert(0, str(Path(__file__).parent))
from test_train import TINY_POLICY, TINY_RUN


def main(out: Path, init: str, *extra: str) -> None:
    run = [a for a in TINY_RUN if not ("algo=residual" in extra and a.startswith("algo.ft_steps"))]
    overrides = [*run, *TINY_POLICY, f"policy.init={init}", "algo.iterations=1", "dist=ddp"]
    overrides += ["eval_episodes=2", "dist.timeout_s=120", *extra]
    cfg = compose("train", overrides)
    apply_visible_devices(cfg.dist, cfg.device.type)
    rt = Runtime.from_config(cfg.device)
    with process_group(cfg.dist, rt.dist_backend, rt.device) as info:
        logger = Logger(out / "run", rank=info.rank, progress=False)
        try:
            summary, learner = fine_tune(cfg, out / "run", rt, info, logger, time.perf_counter())
        finally:
            logger.close()
        tensors = {f"policy.{k}": v.detach().clone() for k, v in learner.policy.named_parameters()}
        tensors.update({f"critic.{k}": v.detach().clone() for k, v in learner.critic.named_parameters()})
        save_file(tensors, str(out / f"params_rank{info.rank}.safetensors"))
        if info.is_main:
            (out / "summary.txt").write_text(repr(summary))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], *sys.argv[3:])
