"""The PPO update's gradient-agreement diagnostic (cosine between consecutive minibatch gradients)."""

from __future__ import annotations

import torch
from torch import nn

from diffpolicy.rl.chain.update import GradAgreement


def _set_grads(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def test_grad_agreement_is_the_mean_cosine_of_consecutive_gradients() -> None:
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2, 2))]
    agreement = GradAgreement()
    g1 = [torch.tensor([1.0, 0.0, 0.0]), torch.zeros(2, 2)]
    g2 = [torch.tensor([2.0, 0.0, 0.0]), torch.zeros(2, 2)]  # same direction: +1
    g3 = [torch.zeros(3), torch.tensor([[0.0, 1.0], [0.0, 0.0]])]  # orthogonal to g2: 0
    g4 = [torch.zeros(3), torch.tensor([[0.0, -3.0], [0.0, 0.0]])]  # opposite of g3: -1
    for g in (g1, g2, g3, g4):
        _set_grads(params, g)
        agreement.update(params)
    assert agreement.n == 3
    assert abs(agreement.mean - (1.0 + 0.0 - 1.0) / 3) < 1e-6


def test_grad_agreement_of_noise_is_near_zero() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.zeros(10_000))]
    agreement = GradAgreement()
    for _ in range(20):
        _set_grads(params, [torch.randn(10_000)])
        agreement.update(params)
    assert abs(agreement.mean) < 0.02
    signal = torch.randn(10_000)
    shared = GradAgreement()
    for _ in range(20):
        _set_grads(params, [signal + 0.5 * torch.randn(10_000)])
        shared.update(params)
    assert shared.mean > 0.7
