"""The PPO update's outer loop, written once: epochs over minibatches that stop on the KL every rank agrees on.

Every learner with a clipped surrogate (chain, residual, FPO) runs ``algo.update_epochs`` passes and stops
after a pass whose mean approximate KL passes ``algo.target_kl``. Under torchrun that decision must be the
same on every rank: a rank that stopped alone would leave the others waiting in their next gradient
all-reduce until the collective timeout. So the KL is summed and counted over ranks before it is compared,
and every rank takes part in that sum even when it had no minibatch in the pass.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from diffpolicy.distributed import DistInfo, sum_metrics


class KLEpochs:
    """``for epoch in KLEpochs(...)``: up to ``epochs`` passes; call :meth:`record` with each minibatch's
    approximate KL; after a pass whose KL, averaged over every rank's minibatches, exceeds ``target_kl``
    (> 0), the loop ends on every rank alike. ``run`` counts the passes done, ``stopped`` says whether the
    KL ended them."""

    def __init__(self, epochs: int, target_kl: float, info: DistInfo, device: torch.device) -> None:
        self.epochs, self.target_kl, self.info, self.device = int(epochs), float(target_kl), info, device
        self.run, self.stopped = 0, False
        self._sum, self._n = 0.0, 0

    def record(self, kl: float) -> None:
        """One minibatch's approximate KL (this rank's)."""
        self._sum, self._n = self._sum + float(kl), self._n + 1

    def epoch_kl(self) -> float:
        """The pass's mean KL over every rank's minibatches (nan when none ran anywhere)."""
        total = sum_metrics({"kl": self._sum, "n": float(self._n)}, self.info, self.device)
        return total["kl"] / total["n"] if total["n"] else float("nan")

    def __iter__(self) -> Iterator[int]:
        for epoch in range(self.epochs):
            self._sum, self._n = 0.0, 0
            yield epoch
            self.run = epoch + 1
            if self.target_kl > 0 and self.epoch_kl() > self.target_kl:
                self.stopped = True
                return
