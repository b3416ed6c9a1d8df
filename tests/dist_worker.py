"""Worker for tests/test_distributed.py, started by torchrun (not collected by pytest).

Usage: python -m torch.distributed.run --nproc_per_node=2 tests/dist_worker.py OUT_DIR MODE
MODE ``grad`` writes each rank's DDP-averaged gradient and post-step parameters; MODE ``fail`` makes rank 1
raise while rank 0 waits in a collective.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffpolicy.config import DistConfig
from diffpolicy.distributed import mean_metrics, process_group, seed_for_rank, wrap


def model_and_batch() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    y = torch.randn(8, 3, generator=torch.Generator().manual_seed(2))
    return model, x, y


def main(out: Path, mode: str) -> None:
    cfg = DistConfig(name="ddp", mode="ddp", timeout_s=20)
    with process_group(cfg, "gloo") as info:
        if mode == "fail":
            if info.rank == 1:
                raise RuntimeError("rank 1 failed on purpose")
            torch.distributed.barrier()  # rank 0 blocks here until torchrun tears the job down
            return
        model, x, y = model_and_batch()
        torch.manual_seed(seed_for_rank(123, info.rank))  # different per rank; DDP syncs the initial params
        ddp = wrap(model, info, torch.device("cpu"))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        half = x.shape[0] // info.world_size
        sl = slice(info.rank * half, (info.rank + 1) * half)
        loss = torch.nn.functional.mse_loss(ddp(x[sl]), y[sl])
        loss.backward()
        grads = {f"grad.{n}": p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        params = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
        metrics = mean_metrics({"losses/mse": loss.item()}, info, torch.device("cpu"))
        save_file(
            {**grads, **params, "loss": torch.tensor(metrics["losses/mse"])},
            str(out / f"rank{info.rank}.safetensors"),
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
