"""DiffusionPolicy / GaussianPolicy: sampling, exact chain log-probs, acting, BC, save/load, critic."""

import io

import pytest
import torch

from diffpolicy.config import EncoderConfig, PolicyConfig
from diffpolicy.models.critic import Critic
from diffpolicy.policies import ActionQueue, DiffusionPolicy, GaussianPolicy, make_policy

B, TA, DA, TE = 3, 16, 4, 4
ENC = EncoderConfig(rgb_channels=[8], rgb_keypoints=4, point_channels=[8], point_keypoints=4, token_dim=16,
                    fusion_heads=2, state_hidden=16)  # fmt: skip
MULTI = {"rgb": (16, 16, 3), "points": (32, 3), "state": (5,), "instruction": None}


def cfg(**kw) -> PolicyConfig:
    base = dict(encoder=ENC, cond_dim=16, down_dims=[16, 32], n_groups=4, step_embed_dim=16, horizon=TA,
                n_action_steps=TE, train_timesteps=50, ddim_steps=5, gaussian_hidden=[32])  # fmt: skip
    return PolicyConfig(**{**base, **kw})


def make(
    spec=None, seed: int = 0, ft_steps: int = 3, eta: float = 1.0, min_std: float = 0.1, **kw
) -> DiffusionPolicy:
    torch.manual_seed(seed)
    policy = make_policy(cfg(**kw), spec or {"state": (5,)}, DA, text_backend="hash")
    policy.set_sampling(ft_steps=ft_steps, eta=eta, min_std=min_std, freeze=False)
    return policy


def obs(b: int = B, to: int = 1, multimodal: bool = False) -> dict:
    g = torch.Generator().manual_seed(0)
    o = {"state": torch.randn(b, to, 5, generator=g)}
    if multimodal:
        o["rgb"] = torch.randint(0, 256, (b, to, 16, 16, 3), dtype=torch.uint8, generator=g)
        o["points"] = torch.rand(b, to, 32, 3, generator=g) * 0.5
        o["instruction"] = [f"task {i % 2}" for i in range(b)]
    return o


def test_make_policy_kinds():
    assert isinstance(make(), DiffusionPolicy)
    assert isinstance(make(kind="gaussian"), GaussianPolicy)


def test_sample_shapes_and_chain():
    p = make(MULTI)
    p.fit_normalizers(actions=torch.rand(100, DA) * 4 - 2)
    out = p.sample(obs(multimodal=True), return_chain=True, generator=torch.Generator().manual_seed(0))
    assert out.actions.shape == (B, TA, DA) and out.chain.shape == (B, 4, TA, DA)
    assert out.means.shape == (B, 3, TA, DA) and out.log_probs.shape == (B, 3) and out.cond.shape == (B, 16)
    assert (out.stds >= 0.1).all()
    torch.testing.assert_close(out.chain[:, -1], out.normalized)
    torch.testing.assert_close(out.actions, p.action_normalizer.unnormalize(out.normalized))
    assert not out.actions.is_inference() and not out.chain.is_inference()


def test_deterministic_sampling_reproducible():
    p = make()
    noise = torch.randn(B, TA, DA)
    a = p.sample(obs(), deterministic=True, noise=noise).actions
    b = p.sample(obs(), deterministic=True, noise=noise).actions
    assert torch.equal(a, b)
    s1 = p.sample(obs(), generator=torch.Generator().manual_seed(5)).actions
    s2 = p.sample(obs(), generator=torch.Generator().manual_seed(5)).actions
    s3 = p.sample(obs(), generator=torch.Generator().manual_seed(6)).actions
    assert torch.equal(s1, s2) and not torch.allclose(s1, s3)


def test_set_sampling_changes_the_chain_not_the_weights():
    p, ref = make(), make(ft_steps=2, eta=0.5, min_std=0.02)
    weights = {k: v.clone() for k, v in p.state_dict().items()}
    p.set_sampling(ft_steps=2, eta=0.5, min_std=0.02)
    assert p.ft_steps == 2 and p.sampling == {"ft_steps": 2, "eta": 0.5, "min_std": 0.02, "noise_scale": 1.0}
    for name in ("std", "timesteps", "alphas_cumprod"):
        torch.testing.assert_close(getattr(p.schedule, name), getattr(ref.schedule, name))
    assert all(torch.equal(v, p.state_dict()[k]) for k, v in weights.items())
    out = p.sample(obs(), return_chain=True, generator=torch.Generator().manual_seed(0))
    assert out.chain.shape == (B, 3, TA, DA) and (out.stds >= 0.02).all()
    torch.testing.assert_close(p.log_prob(out.chain, obs()), out.log_probs)


@pytest.mark.parametrize("to", [1, 2])
def test_log_prob_exact_and_ratio_one(to):
    p = make(n_obs_steps=to)
    o = obs(to=to)
    out = p.sample(o, return_chain=True, generator=torch.Generator().manual_seed(0))
    lp = p.log_prob(out.chain, o)
    assert lp.shape == (B, 3) and torch.isfinite(lp).all()
    torch.testing.assert_close(lp, out.log_probs, atol=1e-4, rtol=1e-4)  # ratio = 1 at the same params
    # Against torch.distributions over the executed part [To - 1, To - 1 + Te), averaged.
    ex = slice(to - 1, to - 1 + TE)
    want = torch.distributions.Normal(out.means, out.stds).log_prob(out.chain[:, 1:])[:, :, ex].mean((-2, -1))
    torch.testing.assert_close(lp, want, atol=1e-4, rtol=1e-4)
    # Only the executed actions count: changing x_0 outside them leaves the last transition unchanged.
    chain = out.chain.clone()
    chain[:, -1, to - 1 + TE :] += 5.0
    torch.testing.assert_close(p.log_prob(chain, o)[:, -1], lp[:, -1])
    # Differentiable with respect to the denoiser and the encoders.
    lp.mean().backward()
    assert p.denoiser.final_proj.weight.grad is not None
    assert p.obs_encoder.encoders["state"].net[0].weight.grad is not None


def test_log_prob_std_floor_for_the_ratio():
    """logprob_min_std floors the std of both the stored and the re-evaluated log-probs (ratio 1 at the same
    parameters), against torch.distributions; the sampled chain itself is unchanged."""
    p = make()
    exact = p.sample(obs(), return_chain=True, generator=torch.Generator().manual_seed(0))
    p.logprob_min_std = 0.5
    out = p.sample(obs(), return_chain=True, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(out.chain, exact.chain)
    floored = out.stds.clamp_min(0.5)
    assert (out.stds < 0.5).any() and not torch.equal(out.log_probs, exact.log_probs)
    want = torch.distributions.Normal(out.means, floored).log_prob(out.chain[:, 1:])[:, :, :TE].mean((-2, -1))
    torch.testing.assert_close(out.log_probs, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(p.log_prob(out.chain, obs()), out.log_probs, atol=1e-4, rtol=1e-4)


def test_log_prob_from_cond_and_under_autocast():
    p = make()
    out = p.sample(obs(), return_chain=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = p.log_prob(out.chain, cond=out.cond)
    assert lp.dtype == torch.float32 and torch.isfinite(lp).all()
    torch.testing.assert_close(lp, out.log_probs, atol=0.1, rtol=0.1)


def test_sample_and_bc_loss_under_bf16_autocast():
    p = make()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = p.sample(obs(), return_chain=True)
        loss = p.bc_loss(obs(), torch.randn(B, TA, DA))
    assert out.actions.dtype == torch.float32 and torch.isfinite(out.log_probs).all()
    assert loss.dim() == 0 and loss.dtype == torch.float32 and torch.isfinite(loss)


def test_plan_and_action_queue():
    p = make()
    noise = torch.randn(B, TA, DA)
    acts, out = p.plan(obs(), deterministic=True, noise=noise)
    assert acts.shape == (B, TE, DA)
    torch.testing.assert_close(acts, out.actions[:, :TE])
    q = ActionQueue(p, deterministic=True, noise=noise)
    got = [q.act(obs()) for _ in range(TE + 1)]
    torch.testing.assert_close(torch.stack(got[:TE], 1), acts)
    assert q.last is not None and not q.needs_plan


def test_chunk_loss_mask_against_a_loop():
    """bc.mask_unheard's per-window mask: each kept step weighted as the chunk's weights say, the masked ones
    left out, divided by the kept weight; an all-true mask is the plain chunk loss."""
    p = make()
    w = p.chunk_loss_weights()
    assert w is not None and w[0] == 1.0 and w[-1] < 1.0  # 16-step chunks, 4 executed: the rest weigh less
    g = torch.Generator().manual_seed(0)
    elements = torch.rand(B, TA, DA, generator=g)
    mask = torch.rand(B, TA, generator=g) > 0.4
    num = den = 0.0
    for b in range(B):
        for t in range(TA):
            if mask[b, t]:
                num += float(w[t]) * float(elements[b, t].mean())
                den += float(w[t])
    torch.testing.assert_close(p.chunk_loss(elements, mask), torch.tensor(num / den))
    torch.testing.assert_close(
        p.chunk_loss(elements, torch.ones(B, TA, dtype=torch.bool)), p.chunk_loss(elements)
    )


def test_bc_lowers_loss():
    p = make(seed=1)
    g = torch.Generator().manual_seed(0)
    state = torch.randn(32, 1, 5, generator=g)
    actions = torch.tanh(state[:, :, :DA]).expand(32, TA, DA) * torch.linspace(0.5, 1.0, TA)[:, None]
    p.fit_normalizers(actions=actions, state=state)
    opt = torch.optim.AdamW(p.parameters(), lr=3e-3)
    losses = []
    for step in range(40):
        loss = p.bc_loss({"state": state}, actions, generator=torch.Generator().manual_seed(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5


def test_state_dict_roundtrip_reproduces_actions():
    p = make(MULTI)
    p.fit_normalizers(actions=torch.rand(50, DA), state=torch.randn(50, 5))
    keys = set(p.state_dict())
    assert {"action_normalizer.low", "obs_encoder.state_normalizer.high"} <= keys
    assert not any("bert" in k or "backend" in k or "schedule" in k for k in keys)
    buf = io.BytesIO()
    torch.save(p.state_dict(), buf)
    q = make(MULTI, seed=123)
    q.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    o = obs(multimodal=True)
    a = p.sample(o, generator=torch.Generator().manual_seed(0)).actions
    b = q.sample(o, generator=torch.Generator().manual_seed(0)).actions
    assert torch.equal(a, b)


def test_freeze_encoders():
    p = make(freeze_encoders=True)
    assert all(not q.requires_grad for q in p.obs_encoder.parameters())
    assert all(q.requires_grad for q in p.denoiser.parameters())
    p.bc_loss(obs(), torch.randn(B, TA, DA)).backward()


def test_gaussian_policy_same_api():
    p = make(kind="gaussian")
    o = obs()
    out = p.sample(o, return_chain=True, generator=torch.Generator().manual_seed(0))
    assert (
        out.actions.shape == (B, TA, DA)
        and out.chain.shape == (B, 2, TA, DA)
        and out.log_probs.shape == (B, 1)
    )
    torch.testing.assert_close(p.log_prob(out.chain, o), out.log_probs)
    want = (
        torch.distributions.Normal(out.means, out.stds).log_prob(out.chain[:, 1:])[:, :, :TE].mean((-2, -1))
    )
    torch.testing.assert_close(out.log_probs, want)
    acts, _ = p.plan(o)
    assert acts.shape == (B, TE, DA)
    loss = p.bc_loss(o, torch.randn(B, TA, DA))
    loss.backward()
    assert p.log_std.grad is not None


def test_critic():
    c = Critic(16, (32,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        v = c(torch.randn(B, 16))
    assert v.shape == (B,) and v.dtype == torch.float32


def test_state_critic_reads_the_latest_normalised_state_not_the_condition():
    """``algo.critic_input=state`` (DPPO's Gym critic): V of the policy-normalised latest state step; the
    condition is ignored, and a policy without a state observation is one clear error."""
    from diffpolicy.models.critic import make_critic

    p = make()
    p.fit_normalizers(actions=torch.rand(100, DA), state=torch.rand(50, 5) * 10 - 3)
    c = make_critic(p, 16, "state", (32,))
    state = torch.randn(B, 2, 5) * 4
    v = c(torch.randn(B, 16), state)
    want = c.net(p.obs_encoder.state_normalizer.normalize(state[:, -1])).squeeze(-1)
    torch.testing.assert_close(v, want)
    torch.testing.assert_close(c(torch.zeros(B, 16), state[:, -1]), v)  # cond unused; (B, Ds) alike
    p.obs_encoder.state_normalizer.low.fill_(0.0)  # a copy: the policy's later changes do not leak in
    torch.testing.assert_close(c(torch.zeros(B, 16), state), v)
    with pytest.raises(ValueError, match="pass it"):
        c(torch.zeros(B, 16))
    no_state = make({"points": (32, 3)})
    with pytest.raises(ValueError, match="needs a policy with a state"):
        make_critic(no_state, 16, "state", (32,))
    assert make_critic(p, 16, "cond", (32,)).net[0].in_features == 16


def test_ddim_protocol_is_deterministic_ddim_against_a_looped_reference():
    """``protocol=ddim`` on an eta-1 policy: DDIM eta 0 (x_{k-1} = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps),
    written out here from alphas_cumprod; the eta-1 posterior means (``noise_free``) are another policy."""
    from diffpolicy.policy_io import apply_protocol

    p = make(eta=1.0).eval()
    p.fit_normalizers(actions=torch.rand(100, DA) * 4 - 2)
    x_k = torch.randn(B, TA, DA, generator=torch.Generator().manual_seed(1))
    cond = p.encode(obs(), augment=False)
    noise_free = p.sample(cond=cond, deterministic=True, noise=x_k.clone()).normalized
    apply_protocol(p, "ddim")
    got = p.sample(cond=cond, deterministic=True, noise=x_k.clone()).normalized
    s = p.schedule
    assert s.eta == 0.0 and float(s.sigma.abs().max()) == 0.0
    ac, x = s.alphas_cumprod.double(), x_k.double()
    ts = s.timesteps.tolist()
    with torch.no_grad():
        for i, t in enumerate(ts):
            a_t = ac[t]
            a_prev = ac[ts[i + 1]] if i + 1 < len(ts) else torch.tensor(1.0, dtype=torch.float64)
            eps = p.denoiser(x.float(), torch.full((B,), t), cond).double()
            x0 = ((x - (1 - a_t).sqrt() * eps) / a_t.sqrt()).clamp(-s.clip_sample, s.clip_sample)
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * ((x - a_t.sqrt() * x0) / (1 - a_t).sqrt())
    torch.testing.assert_close(got, x.float(), atol=1e-4, rtol=1e-4)
    assert (got - noise_free).abs().max() > 1e-3  # eta 1's means are not DDIM eta 0


@pytest.mark.parametrize("prediction", ["epsilon", "sample"])
def test_folded_denoiser_samples_and_scores_the_whole_chunk(prediction):
    """policy.fold=4: the chunk keeps its Ta steps, the chain log-probs stay exact (torch.distributions),
    whether the trunk predicts the noise or the clean chunk."""
    p = make(fold=4, prediction=prediction)
    assert p.denoiser.fold == 4 and p.denoiser.prediction == prediction
    o = obs()
    out = p.sample(o, return_chain=True, generator=torch.Generator().manual_seed(0))
    assert out.actions.shape == (B, TA, DA) and out.chain.shape == (B, 4, TA, DA)
    want = (
        torch.distributions.Normal(out.means, out.stds).log_prob(out.chain[:, 1:])[:, :, :TE].mean((-2, -1))
    )
    torch.testing.assert_close(p.log_prob(out.chain, o), want, atol=1e-4, rtol=1e-4)
