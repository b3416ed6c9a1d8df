"""Schedule, DDIM step Gaussian (against an independent formula and torch.distributions), fast sampler."""

import math

import pytest
import torch

from diffpolicy.diffusion.sampler import ddim_sample, ddim_sample_reference
from diffpolicy.diffusion.schedule import NoiseSchedule, cosine_betas, ddim_step_mean_std, ddpm_loss
from diffpolicy.models.unet1d import ConditionalUnet1D
from diffpolicy.policies import normal_log_prob

B, TA, DA, COND = 2, 16, 7, 16


def unet() -> ConditionalUnet1D:
    torch.manual_seed(0)
    return ConditionalUnet1D(DA, COND, [16, 32], n_groups=4, step_embed_dim=16).eval()


def test_cosine_schedule():
    betas = cosine_betas(100)
    assert betas.shape == (100,) and float(betas.max()) <= 0.999 and float(betas.min()) > 0
    ac = NoiseSchedule(100, 10, 5).alphas_cumprod
    assert (ac[1:] < ac[:-1]).all() and 0.99 < float(ac[0]) < 1 and float(ac[-1]) < 1e-3
    # squaredcos_cap_v2 closed form: alpha_bar(t) = cos^2(((t / T) + 0.008) / 1.008 * pi / 2), normalised.
    f = lambda t: math.cos((t / 100 + 0.008) / 1.008 * math.pi / 2) ** 2
    assert abs(float(ac[49]) - f(50) / f(0)) < 1e-5


def test_ddim_timesteps_and_std_floor():
    s = NoiseSchedule(100, 10, 4, eta=1.0, min_std=0.1)
    assert s.timesteps.tolist() == [90, 80, 70, 60, 50, 40, 30, 20, 10, 0]
    assert (s.std[s.first_ft_step :] >= 0.1).all()
    assert float(s.sigma[-1]) == 0.0 and float(s.std[-1]) == pytest.approx(0.1)  # last step: alpha_prev = 1
    s0 = NoiseSchedule(100, 10, 4, eta=0.0, min_std=0.05)
    assert (s0.std[: s0.first_ft_step] == 0).all() and (s0.std[s0.first_ft_step :] == 0.05).all()


@pytest.mark.parametrize("eta", [0.0, 1.0])
def test_ddim_step_against_direct_formula(eta):
    s = NoiseSchedule(100, 10, 5, eta=eta, min_std=0.01, clip_sample=1.0)
    x, eps = torch.randn(3, TA, DA, dtype=torch.float64), torch.randn(3, TA, DA, dtype=torch.float64)
    ac = NoiseSchedule(100, 10, 5).alphas_cumprod.double()
    for i in range(10):
        a_t = ac[s.timesteps[i]]
        a_p = ac[s.timesteps[i + 1]] if i < 9 else torch.tensor(1.0, dtype=torch.float64)
        x0 = ((x - (1 - a_t).sqrt() * eps) / a_t.sqrt()).clamp(-1, 1)
        eps2 = (x - a_t.sqrt() * x0) / (1 - a_t).sqrt()
        sigma = eta * ((1 - a_p) / (1 - a_t) * (1 - a_t / a_p)).sqrt()
        want = a_p.sqrt() * x0 + (1 - a_p - sigma**2).sqrt() * eps2
        mean, std = ddim_step_mean_std(x.float(), eps.float(), s.step_coefs(i), 1.0)
        torch.testing.assert_close(mean.double(), want, atol=2e-5, rtol=1e-4)
        assert std == pytest.approx(max(float(sigma), 0.01) if i >= 5 else float(sigma), abs=1e-6)
        # The in-place variant and the tensor-coefficient variant give the same Gaussian.
        bufs = (torch.empty(3, TA, DA), torch.empty(3, TA, DA))
        m2, _ = ddim_step_mean_std(x.float(), eps.float(), s.step_coefs(i), 1.0, out=bufs)
        m3, s3 = ddim_step_mean_std(x.float(), eps.float(), s.step_coefs(torch.full((3,), i)), 1.0)
        torch.testing.assert_close(m2, mean, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(m3, mean, atol=1e-6, rtol=1e-6)
        assert s3.shape == (3, 1, 1)


def test_log_prob_matches_torch_distributions():
    mean, x = torch.randn(4, TA, DA), torch.randn(4, TA, DA)
    std = torch.tensor([0.1, 0.3, 1.0, 2.0]).view(4, 1, 1)
    want = torch.distributions.Normal(mean, std).log_prob(x)
    torch.testing.assert_close(normal_log_prob(x, mean, std), want)


@pytest.mark.parametrize("deterministic", [True, False])
def test_fast_sampler_matches_eager_loop(deterministic):
    net, s = unet(), NoiseSchedule(100, 6, 3, eta=1.0, min_std=0.1)
    cond, noise = torch.randn(B, COND), torch.randn(B, TA, DA)
    with torch.inference_mode():
        fast = ddim_sample(net, s, cond, TA, deterministic=deterministic, return_chain=True, noise=noise,
                           generator=torch.Generator().manual_seed(1))  # fmt: skip
        ref = ddim_sample_reference(net, s, cond, TA, deterministic=deterministic, noise=noise,
                                    generator=torch.Generator().manual_seed(1))  # fmt: skip
    torch.testing.assert_close(fast.x0, ref, atol=1e-5, rtol=1e-5)
    assert fast.chain.shape == (B, 4, TA, DA) and fast.means.shape == (B, 3, TA, DA)
    torch.testing.assert_close(fast.chain[:, -1], fast.x0)
    assert fast.stds.shape == (1, 3, 1, 1) and (fast.stds >= 0.1).all()
    if deterministic:
        torch.testing.assert_close(fast.chain[:, 1:], fast.means)


def test_sampler_is_reproducible_and_stochastic():
    net, s = unet(), NoiseSchedule(100, 5, 5)
    cond = torch.randn(B, COND)
    with torch.inference_mode():
        run = lambda seed: ddim_sample(net, s, cond, TA, generator=torch.Generator().manual_seed(seed)).x0
        a, b, c = run(0), run(0), run(1)
    assert torch.equal(a, b) and not torch.allclose(a, c)


def test_ddpm_loss_is_scalar_and_differentiable():
    net, s = unet().train(), NoiseSchedule(100, 10, 5)
    loss = ddpm_loss(net, torch.rand(B, TA, DA) * 2 - 1, torch.randn(B, COND), s)
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert net.final_proj.weight.grad is not None


def test_ddpm_loss_scores_a_sample_predictor_on_the_clean_chunk():
    """prediction=sample: the loss is the mean squared error of the trunk's x0_hat (read from its last
    convolution) against x0, at every t including t = T - 1 (a ~ 2e-7), not the eps error."""
    s = NoiseSchedule(100, 10, 10)
    torch.manual_seed(3)
    net = ConditionalUnet1D(DA, COND, [16, 32], n_groups=4, step_embed_dim=16, prediction="sample",
                            alphas_cumprod=s.alphas_cumprod).train()  # fmt: skip
    x0, cond = torch.rand(B, TA, DA) * 2 - 1, torch.randn(B, COND)
    t, noise = torch.tensor([0, 99]), torch.randn(B, TA, DA)  # B = 2: the ends of the schedule
    seen = []
    hook = net.final_proj.register_forward_hook(lambda m, i, o: seen.append(o))
    got = ddpm_loss(net, x0, cond, s, t=t, noise=noise, reduction="none")
    hook.remove()
    x0_hat = seen[0].transpose(1, 2).reshape(B, TA, DA)
    torch.testing.assert_close(got, (x0_hat - x0).square(), atol=2e-3, rtol=1e-3)
    eps_err = ddpm_loss(unet().train(), x0, cond, s, t=t, noise=noise, reduction="none")
    assert eps_err.shape == got.shape
    ddpm_loss(net, x0, cond, s).backward()
    assert net.final_proj.weight.grad.abs().sum() > 0


def test_dppo_protocol_draws_with_the_natural_stds() -> None:
    """``with_natural_std``: each step's own eta-scaled std floored at 1e-3, none at the last step, the min_std
    exploration floor gone; means and timesteps untouched; the sampler draws exactly those stds."""
    from diffpolicy.diffusion.schedule import NoiseSchedule

    s = NoiseSchedule(100, 10, 5, eta=1.0, min_std=0.1)
    n = s.with_natural_std()
    want = s.sigma.clamp_min(1e-3)
    want[-1] = 0.0
    torch.testing.assert_close(n.std, want)
    assert float(n.std[-1]) == 0.0 and float(s.std[-1]) >= 0.1 and (n.std[5:-1] < 0.1).any()
    for name in ("c_x", "c_x0", "inv_sqrt_a", "eps_to_x0", "timesteps"):
        assert torch.equal(getattr(n, name), getattr(s, name))
    assert [c.std for c in n._float_coefs] == [float(v) for v in want]
