"""FastUnet1D and the sampler backends against the eager network and the plain eager DDIM loop (fp32)."""

import warnings

import pytest
import torch

import diffpolicy.diffusion.sampler as sampler_mod
from diffpolicy.diffusion.fast import FastUnet1D, fast_path_available, fast_unet
from diffpolicy.diffusion.sampler import ddim_sample, ddim_sample_reference, sampler_forward
from diffpolicy.diffusion.schedule import NoiseSchedule
from diffpolicy.models.unet1d import ConditionalUnet1D

B, TA, DA, COND = 2, 16, 7, 24
TOL = dict(atol=1e-4, rtol=1e-4)


def make(conditioning: str = "film", dims=(16, 32, 64)) -> ConditionalUnet1D:
    torch.manual_seed(0)
    net = ConditionalUnet1D(DA, COND, list(dims), n_groups=4, step_embed_dim=16,
                            conditioning=conditioning).eval()  # fmt: skip
    with torch.no_grad():  # as after training: the observation columns start at zero
        for b in net.res_blocks():
            b.cond_proj.weight[:, 16:].normal_(0.0, 0.2)
    return net


def sample(net, sched, cond, noise, *, deterministic, **kw):
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        return ddim_sample(net, sched, cond, TA, deterministic=deterministic, return_chain=True, noise=noise,
                           generator=gen, **kw)  # fmt: skip


def reference(net, sched, cond, noise, *, deterministic):
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        return ddim_sample_reference(net, sched, cond, TA, deterministic=deterministic, noise=noise,
                                     generator=gen)  # fmt: skip


@pytest.mark.parametrize("conditioning", ["film", "adanorm"])
@pytest.mark.parametrize("impl", ["gemm", "mkldnn", "auto"])
def test_fast_unet_matches_forward_film(conditioning, impl):
    if impl == "mkldnn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    net = make(conditioning)
    x, cond = torch.randn(B, TA, DA), torch.randn(B, COND)
    with torch.no_grad():
        obs, step = net.film_tables(cond, torch.tensor([90, 0]))
        fast = FastUnet1D(net, TA, impl)
        # 12 blocks x 2 convs, 5 residual 1x1 convs, 2 down- and 2 upsamplings, final conv and projection.
        assert set(fast.impls()) <= {"gemm", "mkldnn"} and len(fast.impls()) == 24 + 5 + 4 + 2
        for i in range(2):
            film = obs + step[i]
            torch.testing.assert_close(fast(x, film), net.forward_film(x, film), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("conditioning", ["film", "adanorm"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_fast_backend_matches_eager_loop(conditioning, deterministic):
    net, sched = make(conditioning), NoiseSchedule(100, 6, 3, eta=1.0, min_std=0.1)
    cond, noise = torch.randn(B, COND), torch.randn(B, TA, DA)
    ref = reference(net, sched, cond, noise, deterministic=deterministic)
    for backend in ("auto", "fast", "eager"):
        out = sample(net, sched, cond, noise, deterministic=deterministic, backend=backend)
        torch.testing.assert_close(out.x0, ref, **TOL)
    eager = sample(net, sched, cond, noise, deterministic=deterministic, backend="eager")
    fast = sample(net, sched, cond, noise, deterministic=deterministic, backend="fast")
    torch.testing.assert_close(fast.chain, eager.chain, **TOL)
    torch.testing.assert_close(fast.means, eager.means, **TOL)


def test_fast_path_follows_weight_updates():
    net, sched = make(), NoiseSchedule(100, 4, 2, eta=0.0)
    cond, noise = torch.randn(B, COND), torch.randn(B, TA, DA)
    before = sample(net, sched, cond, noise, deterministic=True).x0
    packed = fast_unet(net, TA)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    net.train()
    net(torch.randn(B, TA, DA), torch.tensor([3, 7]), cond).square().mean().backward()
    opt.step()
    net.eval()
    after = sample(net, sched, cond, noise, deterministic=True).x0
    assert fast_unet(net, TA) is packed  # repacked in place, not rebuilt
    assert not torch.allclose(before, after, atol=1e-4)
    torch.testing.assert_close(after, reference(net, sched, cond, noise, deterministic=True), **TOL)
    net.load_state_dict(make("film").state_dict())
    torch.testing.assert_close(sample(net, sched, cond, noise, deterministic=True).x0, before, **TOL)


def test_auto_backend_falls_back_to_eager_where_invalid():
    net, cond = make(), torch.randn(B, COND)
    with torch.no_grad():
        assert isinstance(sampler_forward(net, cond, TA), FastUnet1D)
        assert sampler_forward(net, cond, TA, "eager") == net.forward_film
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not fast_path_available(net, cond)
            assert sampler_forward(net, cond, TA) == net.forward_film
        assert sampler_forward(net, cond.double(), TA, "fast") == net.forward_film
    assert sampler_forward(net, cond, TA) == net.forward_film  # grad enabled
    with pytest.raises(ValueError, match="backend"):
        sampler_forward(net, cond, TA, "jit")


def test_compile_failure_warns_once_and_samples_uncompiled(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(sampler_mod, "_compile_failed", False)
    monkeypatch.setattr(FastUnet1D, "compiled", lambda self: broken)
    net, sched = make(), NoiseSchedule(100, 4, 2, eta=1.0)
    cond, noise = torch.randn(B, COND), torch.randn(B, TA, DA)
    with pytest.warns(UserWarning, match="no compiler"):
        out = sample(net, sched, cond, noise, deterministic=False, backend="compiled")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = sample(net, sched, cond, noise, deterministic=False, backend="compiled")
    ref = reference(net, sched, cond, noise, deterministic=False)
    torch.testing.assert_close(out.x0, ref, **TOL)
    torch.testing.assert_close(again.x0, ref, **TOL)


@pytest.mark.slow
@pytest.mark.parametrize("conditioning", ["film", "adanorm"])
def test_compiled_backend_matches_eager_loop(conditioning):
    """torch.compile (Inductor, needs a C++ compiler; ~30-60 s cold) of the fast network."""
    net, sched = make(conditioning, dims=(16, 32)), NoiseSchedule(100, 5, 3, eta=1.0)
    cond, noise = torch.randn(B, COND), torch.randn(B, TA, DA)
    out = sample(net, sched, cond, noise, deterministic=False, backend="compiled")
    torch.testing.assert_close(out.x0, reference(net, sched, cond, noise, deterministic=False), **TOL)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)  # new weights reach the compiled graph
    net(torch.randn(B, TA, DA), torch.tensor([3, 7]), cond).square().mean().backward()
    opt.step()
    out = sample(net, sched, cond, noise, deterministic=True, backend="compiled")
    torch.testing.assert_close(out.x0, reference(net, sched, cond, noise, deterministic=True), **TOL)


@pytest.mark.slow
def test_compiled_backend_keeps_networks_of_one_architecture_apart():
    """Guards are reduced on warmed calls: two same-shaped networks must still each get their own weights."""
    sched = NoiseSchedule(100, 4, 2, eta=1.0)
    cond, noise = torch.randn(B, COND), torch.randn(B, TA, DA)
    first = make(dims=(16, 32))
    torch.manual_seed(1)
    second = ConditionalUnet1D(DA, COND, [16, 32], n_groups=4, step_embed_dim=16).eval()
    want = [reference(n, sched, cond, noise, deterministic=True) for n in (first, second)]
    assert not torch.allclose(want[0], want[1])
    for net, expected in [(first, want[0]), (second, want[1]), (first, want[0]), (second, want[1])]:
        out = sample(net, sched, cond, noise, deterministic=True, backend="compiled")
        torch.testing.assert_close(out.x0, expected, **TOL)


@pytest.mark.parametrize("prediction", ["epsilon", "sample"])
def test_fast_unet_folds_as_the_network_does(prediction):
    """A 64-step chunk folded 4 steps to a position: the packed path equals the eager one, for a trunk that
    predicts the noise and for one that predicts the clean chunk."""
    torch.manual_seed(0)
    ac = NoiseSchedule(100, 10, 10).alphas_cumprod
    net = ConditionalUnet1D(DA, COND, [16, 32, 64], n_groups=4, step_embed_dim=16, fold=4,
                            prediction=prediction, alphas_cumprod=ac).eval()  # fmt: skip
    with torch.no_grad():
        for b in net.res_blocks():
            b.cond_proj.weight[:, 16:].normal_(0.0, 0.2)
        x, cond = torch.randn(B, 64, DA), torch.randn(B, COND)
        obs, step = net.film_tables(cond, torch.tensor([90, 0]))
        fast = FastUnet1D(net, 64)
        tol = 1e-5 if prediction == "epsilon" else 1e-4  # sample: the trunk's error x 1 / sqrt(1 - a_0) ~ 40
        for i in range(2):
            film = obs + step[i]
            torch.testing.assert_close(fast(x, film), net.forward_film(x, film), atol=tol, rtol=1e-5)
