"""PPO losses: hand-computed clipping for both advantage signs, the StableDRL gradient bound, references."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call, jacrev

from diffpolicy.rl.ppo import approx_kl, clip_schedule, grad_bound, policy_loss, regularizer, value_loss


def _loss_and_grad(log_ratio: float, adv: float, eps: float, mode: str, normalize: str = "mean"):
    new = torch.tensor([[log_ratio]], requires_grad=True)
    loss, _ = policy_loss(new, torch.zeros(1, 1), torch.tensor([adv]), eps, mode=mode, normalize=normalize)
    loss.backward()
    return loss.item(), new.grad.item()


def test_equal_logps_give_minus_mean_advantage() -> None:
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(6, 3, generator=g)
    adv = torch.randn(6, generator=g)
    for mode in ("ppo", "unconditional"):
        for norm in ("mean", "self"):
            loss, info = policy_loss(
                logp, logp.clone(), adv, clip_schedule(0.1, 0.3, 3), mode=mode, normalize=norm
            )
            torch.testing.assert_close(loss, -adv.mean())
            assert info["approx_kl"].item() == 0.0 and info["clipfrac"].item() == 0.0
            assert info["ratio_mean"].item() == 1.0 and info["ratio_max"].item() == 1.0


# (ratio r, advantage A) with eps = 0.2 -> (ppo loss, d loss / d logp), (unconditional loss, gradient).
# d(-r A)/d logp = -r A inside the range or where PPO keeps the unclipped term; 0 where the clip is active.
CASES = [
    (1.5, +1.0, (-1.2, 0.0), (-1.2, 0.0)),  # A > 0, r above the range: both clip
    (1.5, -1.0, (1.5, 1.5), (1.2, 0.0)),  # A < 0, r above: PPO keeps r A (the outlier passes), SDRL clips
    (0.5, +1.0, (-0.5, -0.5), (-0.8, 0.0)),  # A > 0, r below: PPO keeps r A, SDRL clips
    (0.5, -1.0, (0.8, 0.0), (0.8, 0.0)),  # A < 0, r below: both clip
    (1.1, +2.0, (-2.2, -2.2), (-2.2, -2.2)),  # inside the range: both are the plain surrogate
    (0.9, -2.0, (1.8, 1.8), (1.8, 1.8)),
]


@pytest.mark.parametrize("ratio,adv,ppo,uncond", CASES)
def test_clipping_by_hand(ratio: float, adv: float, ppo: tuple, uncond: tuple) -> None:
    for mode, (loss_exp, grad_exp) in (("ppo", ppo), ("unconditional", uncond)):
        loss, grad = _loss_and_grad(math.log(ratio), adv, 0.2, mode)
        assert loss == pytest.approx(loss_exp, rel=1e-6), mode
        assert grad == pytest.approx(grad_exp, rel=1e-6, abs=1e-7), mode


def test_self_normalisation_by_hand() -> None:
    # ratios 2 (clipped to 1.2) and 1.1 (inside); A = (1, 3); eps = 0.2.
    new = torch.log(torch.tensor([[2.0], [1.1]])).requires_grad_()
    loss, _ = policy_loss(
        new, torch.zeros(2, 1), torch.tensor([1.0, 3.0]), 0.2, mode="unconditional", normalize="self"
    )
    assert loss.item() == pytest.approx(-(1.2 * 1 + 1.1 * 3) / (1.2 + 1.1), rel=1e-6)
    loss.backward()
    assert new.grad[:, 0].tolist() == pytest.approx([0.0, -1.1 * 3 / 2.3], rel=1e-6)


def test_huge_ratios_stay_finite_when_unconditional() -> None:
    new = torch.tensor([[300.0, -300.0]], requires_grad=True)
    loss, info = policy_loss(
        new, torch.zeros(1, 2), torch.tensor([-1.0]), 0.2, mode="unconditional", normalize="self"
    )
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(new.grad).all()
    assert info["clipfrac"].item() == 1.0


def test_policy_loss_matches_looped_reference() -> None:
    g = torch.Generator().manual_seed(2)
    B, Kp = 7, 3
    new, old = torch.randn(B, Kp, generator=g) * 0.3, torch.randn(B, Kp, generator=g) * 0.3
    adv = torch.randn(B, Kp, generator=g)
    eps = clip_schedule(0.05, 0.25, Kp)
    for mode in ("ppo", "unconditional"):
        for norm in ("mean", "self"):
            total, weight = 0.0, 0.0
            for b in range(B):
                for k in range(Kp):
                    r = math.exp(float(new[b, k] - old[b, k]))
                    c = min(max(r, 1 - float(eps[k])), 1 + float(eps[k]))
                    a = float(adv[b, k])
                    total += min(r * a, c * a) if mode == "ppo" else c * a
                    weight += 1.0 if norm == "mean" else c
            loss, _ = policy_loss(new, old, adv, eps, mode=mode, normalize=norm)
            assert loss.item() == pytest.approx(-total / weight, rel=1e-5, abs=1e-6), (mode, norm)


def test_fp32_whatever_the_input_dtype() -> None:
    new = torch.zeros(2, 2, dtype=torch.bfloat16, requires_grad=True)
    loss, info = policy_loss(
        new, torch.zeros(2, 2, dtype=torch.float64), torch.ones(2, dtype=torch.float16), 0.1
    )
    assert loss.dtype == torch.float32 and info["approx_kl"].dtype == torch.float32
    loss.backward()
    assert new.grad.dtype == torch.bfloat16
    assert value_loss(torch.zeros(3, dtype=torch.bfloat16), torch.ones(3)).dtype == torch.float32


class _TinyLinear(torch.nn.Module):
    """log pi of K' Gaussian steps with means W_k x: (B, K') from inputs (B, D) and targets (B, K')."""

    def __init__(self, dim: int, ft_steps: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(ft_steps, dim) * 0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -0.5 * (y - x @ self.w.T).square()


@pytest.mark.parametrize("seed", range(5))
def test_unconditional_gradient_is_bounded_for_wild_ratios(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    B, D, Kp = 16, 4, 3
    model = _TinyLinear(D, Kp)
    x, y = torch.randn(B, D, generator=g), torch.randn(B, Kp, generator=g)
    adv = torch.randn(B, generator=g) * 3
    eps = clip_schedule(0.1, 0.3, Kp)
    with torch.no_grad():
        old = model(x, y) + 5.0 * torch.randn(B, Kp, generator=g)  # log-ratio noise of std 5
    params = {k: v.detach() for k, v in model.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (x, y)))(params)["w"]  # (B, K', K', D)
    g_norm = jac.flatten(2).norm(dim=-1)  # (B, K') per-element ||grad log pi||
    bound = grad_bound(adv, g_norm, eps).item()
    hull = (adv.abs().max() * g_norm.max()).item()  # tighter bound of the self-normalised loss
    assert bound == pytest.approx((1 + 0.3) * hull, rel=1e-6)
    norms = {}
    for mode, norm in (("unconditional", "self"), ("unconditional", "mean"), ("ppo", "mean")):
        model.zero_grad()
        loss, _ = policy_loss(model(x, y), old, adv, eps, mode=mode, normalize=norm)
        loss.backward()
        norms[mode, norm] = model.w.grad.norm().item()
    assert norms["unconditional", "self"] <= hull * (1 + 1e-5)
    assert norms["unconditional", "mean"] <= bound * (1 + 1e-5)


def test_standard_ppo_exceeds_the_bound_on_an_outlier() -> None:
    # One element with A < 0 and ratio e^6: PPO's gradient is ~e^6 |A| ||g|| / M, far past the bound.
    model = _TinyLinear(2, 1)
    x, y = torch.ones(2, 2), torch.zeros(2, 1)
    adv = torch.tensor([-1.0, 1.0])
    with torch.no_grad():
        old = model(x, y) - torch.tensor([[6.0], [0.0]])
    g_norm = torch.stack([torch.autograd.grad(model(x, y)[i, 0], model.w)[0].norm() for i in range(2)])
    bound = grad_bound(adv, g_norm, 0.2).item()
    for mode, norm, within in (("ppo", "mean", False), ("unconditional", "self", True)):
        model.zero_grad()
        policy_loss(model(x, y), old, adv, 0.2, mode=mode, normalize=norm)[0].backward()
        assert (model.w.grad.norm().item() <= bound) is within, mode


def test_clip_schedule_endpoints() -> None:
    s = clip_schedule(0.01, 0.05, 5)
    assert s.shape == (5,) and s.dtype == torch.float32
    assert s[0].item() == pytest.approx(0.01) and s[-1].item() == pytest.approx(0.05)
    assert torch.all(s[1:] >= s[:-1])
    assert clip_schedule(0.01, 0.05, 1).tolist() == pytest.approx([0.05])
    with pytest.raises(ValueError):
        clip_schedule(0.1, 0.1, 0)


def test_approx_kl_nonnegative_and_zero_at_equality() -> None:
    g = torch.Generator().manual_seed(4)
    a = torch.randn(50, 3, generator=g)
    assert approx_kl(a, a).item() == 0.0
    for _ in range(5):
        b = a + torch.randn(50, 3, generator=g)
        assert approx_kl(b, a).item() >= 0.0
    r = torch.exp(b - a)
    torch.testing.assert_close(approx_kl(b, a), ((r - 1) - (b - a)).mean())


def test_value_loss_plain_and_clipped() -> None:
    v, ret, old = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 2.5, 0.8])
    assert value_loss(v, ret).item() == pytest.approx(0.5 * (1 + 4 + 1) / 3)
    expected = 0.0
    for vi, ri, oi in zip(v.tolist(), ret.tolist(), old.tolist()):
        vc = oi + min(max(vi - oi, -0.2), 0.2)
        expected += max((vi - ri) ** 2, (vc - ri) ** 2)
    assert value_loss(v, ret, old, clip=0.2).item() == pytest.approx(0.5 * expected / 3)


def test_regularizers() -> None:
    g = torch.Generator().manual_seed(5)
    mu, mu_ref = torch.randn(4, 2, 8, 7, generator=g), torch.randn(4, 2, 8, 7, generator=g)
    std = torch.tensor([0.3, 0.1]).view(1, 2, 1, 1)
    kl = torch.distributions.kl_divergence(
        torch.distributions.Normal(mu, std.expand_as(mu)),
        torch.distributions.Normal(mu_ref, std.expand_as(mu)),
    ).mean()
    torch.testing.assert_close(regularizer("kl", means=mu, ref_means=mu_ref, stds=std), kl)
    torch.testing.assert_close(regularizer("bc", means=mu, ref_means=mu_ref), (mu - mu_ref).square().mean())
    assert regularizer("bc", bc_loss=lambda: torch.tensor(2.5, dtype=torch.float64)).item() == 2.5
    assert regularizer("none").item() == 0.0
    with pytest.raises(ValueError, match="stds"):
        regularizer("kl", means=mu, ref_means=mu_ref)


def test_stabledrl_beats_ppo_under_100x_ratio_noise() -> None:
    from diffpolicy.benchmarks.stabledrl import train_variant

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kw = dict(seed=0, iterations=8, batch=128, minibatch=64, epochs=3, eval_size=256)
        ppo = train_variant("ppo", **kw)
        stable = train_variant("stable", **kw)
    finally:
        torch.set_num_threads(threads)
    assert stable["grad_bound_ok_frac"] == 1.0
    assert stable["curve"][-1] > stable["curve"][0] + 1.0  # keeps improving
    assert ppo["curve"][-1] < ppo["curve"][0]  # degrades
    assert stable["curve"][-1] > ppo["curve"][-1]
    assert ppo["max_grad_norm"] > 10 * stable["max_grad_norm"]
