"""ConditionalUnet1D: shapes, conditioning in every block (FiLM and AdaNorm), fast path, fp32 head."""

import pytest
import torch

from diffpolicy.models.unet1d import ConditionalUnet1D

B, TA, DA, COND = 3, 16, 7, 24


def make(conditioning: str = "film", seed: int = 0, trained: bool = True) -> ConditionalUnet1D:
    """A small U-Net; ``trained`` gives the (zero-initialised) observation columns random values, as after
    training, so that the tests below exercise the condition path."""
    torch.manual_seed(seed)
    net = ConditionalUnet1D(DA, COND, [16, 32, 32], kernel_size=5, n_groups=4, step_embed_dim=16,
                            conditioning=conditioning).eval()  # fmt: skip
    if trained:
        with torch.no_grad():
            for b in net.res_blocks():
                b.cond_proj.weight[:, 16:].normal_(0.0, 0.2)
    return net


@pytest.mark.parametrize("conditioning", ["film", "adanorm"])
def test_condition_starts_at_zero_and_learns(conditioning):
    """At initialisation the observation cannot change the output (no noise injected by the encoder), but
    the observation columns receive gradient, and one optimiser step makes the output depend on it."""
    net = make(conditioning, trained=False).train()
    x, cond, t = torch.randn(B, TA, DA), torch.randn(B, COND), torch.tensor([3, 50, 99])
    torch.testing.assert_close(net(x, t, cond), net(x, t, cond + 1.0))
    target = torch.randn(B, TA, DA)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    (net(x, t, cond) - target).square().mean().backward()
    assert all(b.cond_proj.weight.grad[:, 16:].abs().sum() > 0 for b in net.res_blocks())
    opt.step()
    assert not torch.allclose(net(x, t, cond), net(x, t, cond + 1.0), atol=1e-5)


@pytest.mark.parametrize("conditioning", ["film", "adanorm"])
def test_shape_and_conditioning(conditioning):
    net = make(conditioning)
    x, cond = torch.randn(B, TA, DA), torch.randn(B, COND)
    t = torch.tensor([3, 50, 99])
    out = net(x, t, cond)
    assert out.shape == (B, TA, DA) and out.dtype == torch.float32
    # Changing the observation condition or the step changes the output.
    assert not torch.allclose(out, net(x, t, cond + 1.0), atol=1e-4)
    assert not torch.allclose(out, net(x, t + 1, cond), atol=1e-6)
    # Every residual block is conditioned: its projection has a non-zero gradient.
    net.zero_grad()
    net(x, t, cond).square().mean().backward()
    blocks = net.res_blocks()
    assert len(blocks) == 2 * 3 + 2 + 2 * 2
    assert all(b.cond_proj.weight.grad.abs().sum() > 0 for b in blocks)


def test_adanorm_has_no_affine_before_condition():
    net = make("adanorm")
    for b in net.res_blocks():
        assert b.block0.norm.weight is None and b.block1.norm.weight is not None


@pytest.mark.parametrize("conditioning", ["film", "adanorm"])
def test_film_tables_match_plain_forward(conditioning):
    net = make(conditioning)
    x, cond = torch.randn(B, TA, DA), torch.randn(B, COND)
    ts = torch.tensor([90, 40, 0])
    with torch.no_grad():
        obs, step = net.film_tables(cond, ts)
        assert obs.shape == (B, sum(net.film_splits())) and step.shape == (3, obs.shape[1])
        for i, t in enumerate(ts):
            fast = net.forward_film(x, obs + step[i])
            torch.testing.assert_close(fast, net(x, t, cond), atol=1e-5, rtol=1e-5)


def test_final_layer_stays_fp32_under_autocast():
    net = make()
    x, cond = torch.randn(B, TA, DA), torch.randn(B, COND)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = net(x, torch.tensor(5), cond)
    assert net.fp32_head and out.dtype == torch.float32


def test_grad_checkpointing_same_gradients():
    x, cond, t = torch.randn(B, TA, DA), torch.randn(B, COND), torch.tensor([1, 2, 3])
    grads = []
    for ckpt in (False, True):
        net = make().train()
        net.grad_checkpointing = ckpt
        net(x, t, cond).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    torch.testing.assert_close(grads[0], grads[1])


def test_fold_is_the_unfolded_net_on_grouped_steps():
    """fold=4 on a 64-step chunk is, weight for weight, a fold-1 U-Net over 16 positions of 4 x Da channels:
    the chunk's steps 4i..4i+3 enter and leave position i, in step order (an independent reference for the
    reshape on both ends)."""
    torch.manual_seed(1)
    ta, fold = 64, 4
    folded = ConditionalUnet1D(DA, COND, [16, 32, 32], n_groups=4, step_embed_dim=16, fold=fold).eval()
    inner = ConditionalUnet1D(fold * DA, COND, [16, 32, 32], n_groups=4, step_embed_dim=16).eval()
    with torch.no_grad():
        for b in folded.res_blocks():
            b.cond_proj.weight[:, 16:].normal_(0.0, 0.2)
    inner.load_state_dict(folded.state_dict())
    x, cond, t = torch.randn(B, ta, DA), torch.randn(B, COND), torch.tensor([3, 50, 99])
    with torch.no_grad():
        out = folded(x, t, cond)
        ref = inner(x.reshape(B, ta // fold, fold * DA), t, cond).reshape(B, ta, DA)
    assert out.shape == (B, ta, DA)
    torch.testing.assert_close(out, ref)
    # The first level runs at a quarter of the chunk's resolution: 16 positions, not 64.
    seen = []
    hook = folded.down[0][0].register_forward_hook(lambda m, i, o: seen.append(o.shape[-1]))
    with torch.no_grad():
        folded(x, t, cond)
    hook.remove()
    assert seen == [ta // fold]
    with pytest.raises(ValueError, match="cannot be folded"):
        folded(torch.randn(B, 62, DA), t, cond)
    with pytest.raises(ValueError, match="fold=0"):
        ConditionalUnet1D(DA, COND, [16, 32], fold=0)


def test_sample_prediction_returns_the_noise_its_clean_chunk_implies():
    """prediction=sample: the trunk's output is x0_hat, and the network returns the eps that makes the DDIM
    x0 estimate (x_t - sqrt(1 - a_t) eps) / sqrt(a_t) equal it (the schedule's alphas, float64 reference);
    forward and the film-table path agree, a missing schedule or unknown mode is refused."""
    from diffpolicy.diffusion.schedule import NoiseSchedule

    torch.manual_seed(2)
    ac = NoiseSchedule(100, 10, 10).alphas_cumprod
    net = ConditionalUnet1D(DA, COND, [16, 32], n_groups=4, step_embed_dim=16, fold=4, prediction="sample",
                            alphas_cumprod=ac).eval()  # fmt: skip
    for b in net.res_blocks():
        b.cond_proj.weight.data[:, 16:].normal_(0.0, 0.2)
    trunk_out = []
    hook = net.final_proj.register_forward_hook(lambda m, i, o: trunk_out.append(o))
    x, cond, t = torch.randn(B, 64, DA), torch.randn(B, COND), torch.tensor([0, 50, 99])
    with torch.no_grad():
        eps = net(x, t, cond)
        obs, step = net.film_tables(cond, t)
        via_film = torch.stack([net.forward_film(x[i : i + 1], obs[i : i + 1] + step[i]) for i in range(B)])
    hook.remove()
    x0_hat = trunk_out[0].transpose(1, 2).reshape(B, 64, DA).double()
    a = ac.double()[t].view(B, 1, 1)
    # fp32 eps divided by sqrt(a_t) (~3e-3 at t = 99): 1e-3 absolute is fp32's error there
    torch.testing.assert_close(
        ((x.double() - (1 - a).sqrt() * eps.double()) / a.sqrt()), x0_hat, atol=1e-3, rtol=0
    )
    torch.testing.assert_close(via_film.squeeze(1), eps, atol=1e-4, rtol=1e-5)
    assert net.film_splits()[-1] == 2 and sum(net.film_splits()) == obs.shape[1]
    with pytest.raises(ValueError, match="alphas_cumprod"):
        ConditionalUnet1D(DA, COND, [16, 32], prediction="sample")
    with pytest.raises(ValueError, match="prediction='v'"):
        ConditionalUnet1D(DA, COND, [16, 32], prediction="v")
