"""Worker for tests/test_distributed.py, started by torchrun (not collected by pytest).

Usage: python -m torch.distributed.run --nproc_per_node=2 tests/dist_worker.py OUT_DIR MODE
MODE ``grad`` writes each rank's averaged gradient (:func:`diffpolicy.distributed.average_gradients`) and
post-step parameters; MODE ``fail`` makes rank 1 raise while rank 0 waits in a collective; MODE ``kl``
runs :class:`diffpolicy.rl.epochs.KLEpochs` with rank r's minibatches at KL r (rank 1 has two, rank 0 one)
and writes how many epochs each rank ran.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from diffpolicy.config import DistConfig
from diffpolicy.distributed import (
    average_gradients,
    broadcast_parameters,
    mean_metrics,
    process_group,
    seed_for_rank,
)
from diffpolicy.rl.epochs import KLEpochs


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
        if mode == "kl":  # rank 0 alone is under target_kl 0.6; the mean over minibatches (2/3) is above it
            epochs = KLEpochs(4, 0.6, info, torch.device("cpu"))
            for _ in epochs:
                for _ in range(info.rank + 1):
                    epochs.record(float(info.rank))
                torch.distributed.barrier()  # a collective inside the pass, as the gradient all-reduce is
            (out / f"epochs_rank{info.rank}.txt").write_text(f"{epochs.run} {epochs.stopped}")
            return
        model, x, y = model_and_batch()
        if info.rank == 1:  # rank 1 starts elsewhere: the broadcast gives every rank rank 0's parameters
            torch.nn.init.normal_(
                model[0].weight, generator=torch.Generator().manual_seed(seed_for_rank(123, 1))
            )
        broadcast_parameters([model], info)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        half = x.shape[0] // info.world_size
        sl = slice(info.rank * half, (info.rank + 1) * half)
        loss = torch.nn.functional.mse_loss(model(x[sl]), y[sl])
        loss.backward()
        average_gradients(list(model.parameters()), info)
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
