"""The shared PPO epoch loop (``rl.epochs.KLEpochs``) in one process: it stops after the first pass whose mean
approximate KL passes ``target_kl`` and never otherwise (its two-rank agreement is in test_distributed)."""

from __future__ import annotations

import pytest
import torch

from diffpolicy.distributed import DistInfo
from diffpolicy.rl.epochs import KLEpochs


def _run(kls_per_epoch: list[list[float]], target: float) -> KLEpochs:
    loop = KLEpochs(len(kls_per_epoch), target, DistInfo(), torch.device("cpu"))
    for epoch in loop:
        for kl in kls_per_epoch[epoch]:
            loop.record(kl)
    return loop


@pytest.mark.parametrize(
    ("kls", "target", "run", "stopped"),
    [
        ([[0.01, 0.02], [0.03, 0.2], [0.0]], 0.1, 2, True),  # pass 2's mean 0.115 > 0.1: stop after it
        ([[0.01, 0.02], [0.03, 0.1], [0.5]], 0.1, 3, True),  # pass 2's mean 0.065 stays; pass 3 stops
        ([[0.01], [0.02], [0.03]], 0.1, 3, False),  # never over: every pass runs
        ([[5.0], [5.0]], 0.0, 2, False),  # target 0: no stop at all
        ([[], [], []], 0.1, 3, False),  # no minibatch (all skipped): no KL, no stop
    ],
)
def test_stops_after_the_first_pass_over_target(kls, target, run, stopped) -> None:
    loop = _run(kls, target)
    assert (loop.run, loop.stopped) == (run, stopped)


def test_a_pass_mean_weights_every_minibatch_not_every_pass() -> None:
    loop = KLEpochs(1, 0.1, DistInfo(), torch.device("cpu"))
    for _ in loop:
        for kl in (0.0, 0.0, 0.33):
            loop.record(kl)
    assert loop.epoch_kl() == pytest.approx(0.11)
    assert loop.stopped
