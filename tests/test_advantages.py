"""Advantages: GAE through the op against a hand case and a looped reference; GRPO; discount; normalise
(per minibatch and over the rollout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from diffpolicy.rl.advantages import (
    denoise_discount,
    gae_advantages,
    gae_loop_reference,
    grpo_advantages,
    normalize,
    normalize_rollout,
)


def test_gae_hand_computed_case() -> None:
    # T=3, N=1, gamma=0.5, lam=0.5; the episode ends at t=1, so t=1 does not bootstrap from t=2.
    r = torch.tensor([[1.0], [2.0], [3.0]])
    v = torch.tensor([[0.5], [1.0], [2.0]])
    d = torch.tensor([[0.0], [1.0], [0.0]])
    last = torch.tensor([4.0])
    # delta_2 = 3 + 0.5*4 - 2 = 3;   A_2 = 3
    # delta_1 = 2 + 0     - 1 = 1;   A_1 = 1 (done: nothing from t=2)
    # delta_0 = 1 + 0.5*1 - 0.5 = 1; A_0 = 1 + 0.25 * 1 = 1.25
    expected = torch.tensor([[1.25], [1.0], [3.0]])
    for fn in (gae_advantages, gae_loop_reference):
        adv, ret = fn(r, v, d, last, 0.5, 0.5)
        torch.testing.assert_close(adv.float(), expected)
        torch.testing.assert_close(ret.float(), expected + v)


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_looped_reference(device, gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(1)
    T, N = 9, 5
    r, v = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g)
    d = (torch.rand(T, N, generator=g) < 0.25).float()
    last = torch.randn(N, generator=g)
    adv, ret = gae_advantages(*(x.to(device) for x in (r, v, d, last)), gamma, lam)
    ref_adv, ref_ret = gae_loop_reference(r, v, d, last, gamma, lam)
    assert adv.dtype == torch.float32 and adv.shape == (T, N) and adv.device.type == device.type
    torch.testing.assert_close(adv.cpu().double(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.cpu().double(), ref_ret, rtol=1e-5, atol=1e-5)


def test_gae_casts_inputs_to_float32() -> None:
    r = torch.ones(2, 2, dtype=torch.float64)
    adv, _ = gae_advantages(
        r,
        torch.zeros(2, 2, dtype=torch.float16),
        torch.zeros(2, 2, dtype=torch.bool),
        torch.zeros(2),
        1.0,
        1.0,
    )
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, torch.tensor([[2.0, 2.0], [1.0, 1.0]]))


def test_grpo_is_standardised_within_each_group() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 5.0, 5.0, 5.0], [0.0, 10.0, 0.0, 10.0]])
    adv = grpo_advantages(returns, eps=1e-6)
    assert adv.shape == (3, 4)
    for row, r in zip(adv, returns):
        expected = (r - r.mean()) / (r.std(correction=0) + 1e-6)
        torch.testing.assert_close(row, expected)
    torch.testing.assert_close(adv[1], torch.zeros(4))  # identical returns: no signal
    torch.testing.assert_close(adv.mean(dim=1), torch.zeros(3), atol=1e-6, rtol=0)
    torch.testing.assert_close(grpo_advantages(torch.tensor([[3.0]])), torch.zeros(1, 1))
    with pytest.raises(ValueError, match="num_groups"):
        grpo_advantages(torch.ones(4))


def test_grpo_unscaled_keeps_each_groups_spread() -> None:
    """Dr. GRPO: centre only. A group that differs by shaping noise weighs little; the std version inflates it."""
    returns = torch.tensor([[3.50, 3.52, 3.48, 3.50], [-3.5, 3.5, 3.5, -3.5]])
    adv = grpo_advantages(returns, scale=False)
    torch.testing.assert_close(adv, returns - returns.mean(dim=1, keepdim=True))
    assert adv[0].abs().max() < 0.05 < 3.0 < adv[1].abs().min()
    scaled = grpo_advantages(returns)
    assert (
        scaled[0].abs().max() > 1.0
    )  # the 2 cm-of-shaping group looks as decisive as a success/failure split


def test_normalize() -> None:
    x = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    y = normalize(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.mean(), torch.tensor(0.0), atol=1e-6, rtol=0)
    torch.testing.assert_close(y.std(), torch.tensor(1.0), atol=1e-5, rtol=0)


def test_normalize_rollout_matches_a_masked_numpy_reference() -> None:
    """algo.norm_adv=batch: one mean and std (Bessel-corrected) over the valid entries; invalid ones are 0."""
    g = torch.Generator().manual_seed(3)
    adv = torch.randn(6, 4, generator=g, dtype=torch.float64) * 3 + 1
    valid = (torch.rand(6, 4, generator=g) > 0.3).float()
    out = normalize_rollout(adv, valid)
    kept = adv.numpy()[valid.numpy() > 0]
    want = (adv.numpy() - kept.mean()) / (kept.std(ddof=1) + 1e-8) * valid.numpy()
    assert out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(normalize_rollout(adv), normalize(adv))  # no mask: the plain standardisation


def test_normalize_rollout_keeps_a_small_spread_small() -> None:
    """The point of batch standardisation: decisions whose advantages barely differ (a spread the critic has
    explained) stay small beside ones that differ a lot, where per-minibatch standardisation scales both to 1."""
    big = torch.tensor([2.0, -2.0, 1.5, -1.5])
    small = 1e-3 * torch.tensor([1.0, -1.0, 0.5, -0.5])
    out = normalize_rollout(torch.stack([big, small]))  # (2, 4): two "minibatches"
    assert out[1].abs().max() < 1e-2 * out[0].abs().min()
    assert normalize(small).std() == pytest.approx(1.0, rel=1e-4)  # per minibatch: the noise becomes unit


def test_denoise_discount_weights_final_step_one() -> None:
    adv = torch.tensor([2.0, -1.0])
    out = denoise_discount(adv, 3, 0.5)
    torch.testing.assert_close(out, torch.tensor([[0.5, 1.0, 2.0], [-0.25, -0.5, -1.0]]))
    torch.testing.assert_close(denoise_discount(adv, 4, 1.0), adv[:, None].expand(2, 4))
    torch.testing.assert_close(denoise_discount(adv, 2, 0.0), torch.tensor([[0.0, 2.0], [0.0, -1.0]]))


def _scaler_reference(reward_chunks, done_chunks, gamma=0.99, clip=10.0, eps=1e-8):
    """DPPO's running reward scaling as a plain float loop: returns each chunk's scaled rewards (T, N) lists."""
    n = len(reward_chunks[0][0])
    mean, var, count = 0.0, 1.0, 1e-4
    out = []
    for rewards, dones in zip(reward_chunks, done_chunks):
        rets, ret = [], [0.0] * n  # each rollout starts its episodes (its environments are reset)
        for t, row in enumerate(rewards):
            first = [1.0] * n if t == 0 else dones[t - 1]
            ret = [row[i] + gamma * (1.0 - first[i]) * ret[i] for i in range(n)]
            rets.extend(ret)
        b_mean = sum(rets) / len(rets)
        b_var = sum((x - b_mean) ** 2 for x in rets) / len(rets)
        total = count + len(rets)
        delta = b_mean - mean
        m2 = var * count + b_var * len(rets) + delta * delta * count * len(rets) / total
        mean, var, count = mean + delta * len(rets) / total, m2 / (total - 1), total
        s = (var + eps) ** 0.5
        out.append([[max(-clip, min(clip, x / s)) for x in row] for row in rewards])
    return out


def test_running_reward_scaler_against_a_looped_reference() -> None:
    """Three rollouts of (T=5, N=3) rewards with episode ends: the scaled rewards match the float loop (the
    discounted sums restart after an episode's end and at each rollout, the statistics carry over), and a
    scaler restored from its state continues identically."""
    from diffpolicy.rl.advantages import RunningRewardScaler

    g = torch.Generator().manual_seed(0)
    rewards = [torch.randn(5, 3, generator=g) * 20 + 3 for _ in range(3)]
    dones = [(torch.rand(5, 3, generator=g) < 0.3).float() for _ in range(3)]
    ref = _scaler_reference([r.tolist() for r in rewards], [d.tolist() for d in dones])
    scaler = RunningRewardScaler(3)
    got = [scaler(r, d) for r, d in zip(rewards[:2], dones[:2])]
    restored = RunningRewardScaler(3)
    restored.load_state_dict(scaler.state_dict())
    got.append(restored(rewards[2], dones[2]))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, torch.tensor(b, dtype=a.dtype), rtol=1e-6, atol=1e-6)
    assert 0.02 < float(got[2].abs().mean() / rewards[2].abs().mean()) < 0.5  # rewards ~20 come out ~O(1)
    assert torch.equal(torch.sign(got[0]), torch.sign(rewards[0]))  # scaled, not centred
