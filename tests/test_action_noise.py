"""Action-space exploration of the chain learner (``algo.action_std``): the policy is N(chain(x_K), sigma^2)
around the noise-free chain, one stored transition (x_K, executed chunk), its log-probability taken through
all K denoising steps; checked against ``torch.distributions``, the sampler's own noise-free chunk, and the
direction of a PPO update."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_chain_faithful import KP, make, obs, toy_rollout
from test_train import TINY_POLICY, TINY_RUN

from diffpolicy import checkpoint
from diffpolicy.config import ChainConfig, DeviceConfig
from diffpolicy.device import Runtime
from diffpolicy.distributed import DistInfo
from diffpolicy.models.critic import make_critic
from diffpolicy.rl.chain.update import ChainModules, ppo_update
from diffpolicy.rl.stability import GradMonitor, StateSnapshot

SIGMA = 0.05


def noisy(seed: int = 0):
    policy = make(seed, ft_steps=KP)
    policy.set_sampling(ft_steps=KP, eta=1.0, min_std=0.05, action_std=SIGMA, freeze=True)
    return policy


def test_action_noise_is_one_transition_over_the_whole_chain() -> None:
    policy = noisy()
    assert policy.ft_steps == 1 and policy.base_denoiser is None  # every step fine-tuned, none frozen
    assert policy.sampling["ft_steps"] == policy.schedule.ddim_steps
    assert policy.sampling["action_std"] == SIGMA
    policy.set_sampling(**{**policy.sampling, "noise_scale": 0.5}, freeze=False)
    assert policy.action_sigma == pytest.approx(SIGMA / 2)
    policy.set_sampling(ft_steps=KP, eta=1.0, min_std=0.05, freeze=False)  # back to DPPO's steps
    assert policy.ft_steps == KP and "action_std" not in policy.sampling
    with pytest.raises(ValueError, match="action_std"):
        policy.set_sampling(ft_steps=KP, eta=1.0, min_std=0.05, action_std=-0.1)
    with pytest.raises(ValueError, match="action_std"):
        ChainConfig(action_std=-0.1)
    assert ChainConfig(action_std=0.05).sampling()["action_std"] == 0.05
    assert "action_std" not in ChainConfig().sampling()


def test_sampled_chunk_and_log_prob_match_references() -> None:
    """The mean is the sampler's noise-free chunk from the same x_K; the stored log-prob is
    ``torch.distributions.Normal``'s over the executed Te x Da elements; re-evaluated under unchanged weights
    it is the same (ratio 1)."""
    policy = noisy()
    o = obs()
    x_k = torch.randn(
        o["state"].shape[0], policy.horizon, policy.action_dim, generator=torch.Generator().manual_seed(3)
    )
    out = policy.sample(o, return_chain=True, noise=x_k, generator=torch.Generator().manual_seed(4))
    ref = policy.sample(o, deterministic=True, noise=x_k).normalized
    assert out.chain.shape == (x_k.shape[0], 2, policy.horizon, policy.action_dim)
    torch.testing.assert_close(out.chain[:, 0], x_k)
    torch.testing.assert_close(out.means[:, 0], ref, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(policy.noise_free_chunk(x_k, out.cond), ref, atol=1e-5, rtol=1e-5)
    executed = out.chain[:, 1, policy.exec_slice]
    lp = torch.distributions.Normal(ref[:, policy.exec_slice], SIGMA).log_prob(executed).mean(dim=(1, 2))
    torch.testing.assert_close(out.log_probs[:, 0], lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(policy.log_prob(out.chain, cond=out.cond), out.log_probs, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(out.actions, policy.action_normalizer.unnormalize(out.chain[:, 1]))
    noise = (out.chain[:, 1] - out.means[:, 0]) / SIGMA
    assert 0.7 < float(noise.std()) < 1.3  # the executed chunk strays by sigma


def _moved(
    sign: float,
    lr: float = 1e-5,
    epochs: int = 3,
    corr: float = 0.0,
    env_units: bool = False,
    grad_steps: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One PPO update of an action-noise toy rollout whose advantages are ``sign`` for every decision: the
    noise-free chunks' squared distance from the executed ones (before, after), per decision. ``corr``:
    the noise's correlation across the chunk; ``env_units``: its std in env units; ``grad_steps``: the
    gradient through the last this-many denoising steps only."""
    policy = noisy()
    policy.grad_steps = grad_steps
    if corr or env_units:
        policy.set_sampling(
            **{**policy.sampling, "action_corr": corr, "action_std_env": env_units}, freeze=False
        )
    T, N = 2, 4
    buffer = toy_rollout(policy, T, N)
    data = buffer.get()
    critic = make_critic(policy, 16, "cond", (8,))
    learner = ChainModules(
        policy, critic, torch.optim.Adam(policy.parameters(), lr=lr), torch.optim.Adam(critic.parameters()),
        torch.amp.GradScaler("cpu", enabled=False),
    )  # fmt: skip
    snapshot = StateSnapshot(
        {"policy": policy, "critic": critic}, [learner.actor_optim, learner.critic_optim]
    )
    snapshot.capture()
    chains, cond = data["chains"].flatten(0, 1), data["cond"].flatten(0, 1)

    def gap() -> torch.Tensor:  # -log pi(executed chunk); with independent noise the squared gap, scaled
        with torch.no_grad():
            return -policy.log_prob(chains, cond=cond)[:, 0]

    before = gap()
    cfg = ChainConfig(
        update_epochs=epochs, minibatch_size=8, target_kl=0.0, norm_adv="none", action_std=SIGMA,
        action_corr=corr, action_std_units="env" if env_units else "normalized", grad_steps=grad_steps,
    )  # fmt: skip
    ppo_update(
        learner, buffer, torch.full((T, N), sign), torch.zeros(T, N), cfg, clip_eps=torch.full((1,), 0.2),
        runtime=Runtime.from_config(DeviceConfig(type="cpu")), info=DistInfo(),
        generator=torch.Generator().manual_seed(0), monitor=GradMonitor(), snapshot=snapshot,
    )  # fmt: skip
    return before, gap()


@pytest.mark.parametrize(
    ("corr", "env_units", "lr", "grad_steps"),
    [(0.0, False, 1e-5, 0), (0.8, False, 1e-5, 0), (1.0, True, 1e-4, 0), (1.0, True, 1e-4, 2)],
)
def test_ppo_moves_the_noise_free_chain_toward_chunks_with_positive_advantage(
    corr: float, env_units: bool, lr: float, grad_steps: int
) -> None:
    """Direction: a positive advantage pulls the deployed noise-free chunk toward what was executed (its
    log-probability rises), a negative one pushes it away; with independent, correlated and held noise (whose
    per-element log-prob holds Da numbers per decision, not Te Da, so it moves less per step), and with the
    gradient through the last two denoising steps only."""
    before, after = _moved(+1.0, lr=lr, corr=corr, env_units=env_units, grad_steps=grad_steps)
    assert after.mean() < before.mean() and (after < before).float().mean() >= 0.75
    before, after = _moved(-1.0, lr=lr, corr=corr, env_units=env_units, grad_steps=grad_steps)
    assert after.mean() > before.mean() and (after > before).float().mean() >= 0.75


def _chunk_grads(policy, x_k: torch.Tensor, cond: torch.Tensor, weights: torch.Tensor) -> list[torch.Tensor]:
    """Gradients of sum(weights * noise_free_chunk) w.r.t. the denoiser's parameters."""
    policy.zero_grad(set_to_none=True)
    (policy.noise_free_chunk(x_k, cond) * weights).sum().backward()
    return [p.grad.clone() for p in policy.denoiser.parameters()]


@pytest.mark.parametrize("n", [1, 2])
def test_truncated_gradient_keeps_the_chunk_and_matches_a_detached_reference(n: int) -> None:
    """``grad_steps`` = n: the chunk (and so every log-prob and ratio) is unchanged; its gradient equals
    autograd's through a hand-written chain whose state is detached before the last n steps; n = K (or 0) is
    the whole chain's gradient, and a truncated gradient differs from it."""
    from diffpolicy.diffusion.schedule import ddim_step_mean_std

    policy = noisy()
    K, o = policy.schedule.ddim_steps, obs()
    assert n < K
    g = torch.Generator().manual_seed(5)
    x_k = torch.randn(o["state"].shape[0], policy.horizon, policy.action_dim, generator=g)
    weights = torch.randn(x_k.shape, generator=g)
    with torch.no_grad():
        cond = policy.encode(o, augment=False)
        full_chunk = policy.noise_free_chunk(x_k, cond)
    full = _chunk_grads(policy, x_k, cond, weights)
    policy.grad_steps = K
    torch.testing.assert_close(_chunk_grads(policy, x_k, cond, weights), full)
    policy.grad_steps = n
    with torch.no_grad():
        torch.testing.assert_close(policy.noise_free_chunk(x_k, cond), full_chunk)
    truncated = _chunk_grads(policy, x_k, cond, weights)

    s, x = policy.schedule, x_k.float()  # the reference: the whole chain, the state detached at K - n
    for i in range(K):
        if i == K - n:
            x = x.detach()
        idx = torch.full((x.shape[0],), i, dtype=torch.long)
        x, _ = ddim_step_mean_std(x, policy.denoiser(x, s.timesteps[idx], cond).float(), s.step_coefs(idx),
                                  s.clip_sample)  # fmt: skip
    policy.zero_grad(set_to_none=True)
    (x * weights).sum().backward()
    for got, ref in zip(truncated, [p.grad for p in policy.denoiser.parameters()], strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)
    assert max(float((a - b).abs().max()) for a, b in zip(truncated, full, strict=True)) > 1e-4


def test_grad_steps_is_validated() -> None:
    with pytest.raises(ValueError, match="grad_steps"):
        ChainConfig(grad_steps=-1)
    with pytest.raises(ValueError, match="action_std"):
        ChainConfig(grad_steps=2)
    assert ChainConfig(action_std=0.05, grad_steps=2).grad_steps == 2


def test_a_tiny_run_explores_in_action_space_and_resumes(tmp_path: Path, init_ckpt: Path) -> None:
    from diffpolicy.cli import compose
    from diffpolicy.train import main

    args = [*TINY_RUN, *TINY_POLICY, f"policy.init={init_ckpt}", "eval_episodes=2", "algo.action_std=0.05",
            "algo.logprob_clamp=[]", "algo.sil_coef=0.5", "algo.sil_loss=denoise"]  # fmt: skip
    summary = main(compose("train", [*args, "algo.iterations=2"]), tmp_path)
    assert summary["env_steps"] > 0
    ckpt = checkpoint.load(tmp_path / "checkpoints")
    assert ckpt.config["sampling"]["action_std"] == 0.05
    assert ckpt.state["kept"]["chains"].shape[1] == 2  # (x_K, executed chunk)
    resumed = main(compose("train", [*args, "algo.iterations=3", "resume=true"]), tmp_path)
    assert resumed["iterations"] == 3


@pytest.mark.parametrize("corr", [0.0, 0.6, 0.95])
def test_correlated_log_prob_matches_multivariate_normal(corr: float) -> None:
    """The closed form equals ``torch.distributions.MultivariateNormal`` with covariance
    std^2 ((1 - corr) I + corr 1 1^T) along the steps, one per action dimension."""
    from diffpolicy.policies.base import correlated_normal_log_prob

    g = torch.Generator().manual_seed(0)
    te, da, std = 5, 3, 0.3
    x, mean = (
        torch.randn(4, te, da, generator=g, dtype=torch.float64),
        torch.randn(4, te, da, generator=g, dtype=torch.float64),
    )
    cov = std**2 * (
        (1 - corr) * torch.eye(te, dtype=torch.float64) + corr * torch.ones(te, te, dtype=torch.float64)
    )
    ref = torch.distributions.MultivariateNormal(mean.transpose(1, 2), cov).log_prob(
        x.transpose(1, 2)
    )  # (4, Da)
    got = correlated_normal_log_prob(x, mean, torch.tensor([[std]], dtype=torch.float64), corr)
    torch.testing.assert_close(got, ref)
    with pytest.raises(ValueError, match="corr"):
        correlated_normal_log_prob(x, mean, std, 1.0)


def test_correlated_action_noise_is_held_over_the_chunk_and_its_log_prob_is_exact() -> None:
    """With ``action_corr`` the noise of a chunk's steps is correlated as asked (one draw held over the chunk
    plus one per step), the stored log-prob is the joint Gaussian's over the executed steps per element, and
    it is re-evaluated unchanged (ratio 1)."""
    corr = 0.8
    policy = noisy()
    policy.set_sampling(ft_steps=KP, eta=1.0, min_std=0.05, action_std=SIGMA, action_corr=corr, freeze=False)
    assert policy.sampling["action_corr"] == corr
    o = obs(256)
    out = policy.sample(o, return_chain=True, generator=torch.Generator().manual_seed(5))
    z = (
        ((out.chain[:, 1] - out.means[:, 0]) / SIGMA).transpose(1, 2).reshape(-1, policy.horizon)
    )  # (B Da, Ta)
    c = torch.corrcoef(z.T)
    off = c[~torch.eye(policy.horizon, dtype=torch.bool)]
    assert abs(float(off.mean()) - corr) < 0.05 and 0.8 < float(z.std()) < 1.2
    ex = policy.exec_slice
    te = out.chain[:, 1, ex].shape[1]
    cov = SIGMA**2 * ((1 - corr) * torch.eye(te) + corr * torch.ones(te, te))
    ref = torch.distributions.MultivariateNormal(out.means[:, 0, ex].transpose(1, 2).double(), cov.double())
    lp = ref.log_prob(out.chain[:, 1, ex].transpose(1, 2).double()).mean(-1) / te  # per element
    torch.testing.assert_close(out.log_probs[:, 0].double(), lp, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(policy.log_prob(out.chain, cond=out.cond), out.log_probs, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="action_corr"):
        ChainConfig(action_corr=0.5)  # no action_std
    with pytest.raises(ValueError, match="logprob_clamp"):
        ChainConfig(action_std=0.05, action_corr=0.5, logprob_clamp=[-5.0, 2.0])
    assert ChainConfig(action_std=0.05, action_corr=0.5).sampling()["action_corr"] == 0.5


def test_held_log_prob_is_the_offsets_normal_density_and_blind_to_the_chunks_shape() -> None:
    """For x = mean + std z 1 (one draw per dimension held over the steps) the held log-probability is
    ``torch.distributions.Normal(0, std).log_prob`` of the offset std z; a change of the mean that keeps its
    average over the steps leaves it unchanged, a shift of the average moves it as the Normal says."""
    from diffpolicy.policies.base import held_normal_log_prob

    g = torch.Generator().manual_seed(0)
    te, da = 6, 3
    std = torch.tensor([0.2, 0.05, 1.0], dtype=torch.float64)  # one per dimension
    mean = torch.randn(4, te, da, generator=g, dtype=torch.float64)
    z = torch.randn(4, 1, da, generator=g, dtype=torch.float64)
    x = mean + std * z
    ref = torch.distributions.Normal(torch.zeros(da, dtype=torch.float64), std).log_prob(std * z[:, 0])
    torch.testing.assert_close(held_normal_log_prob(x, mean, std), ref)
    shape = torch.randn(4, te, da, generator=g, dtype=torch.float64)
    shape = shape - shape.mean(1, keepdim=True)  # zero average over the steps
    torch.testing.assert_close(held_normal_log_prob(x, mean + shape, std), ref)
    shifted = torch.distributions.Normal(torch.zeros(da, dtype=torch.float64), std).log_prob(
        std * z[:, 0] - 0.1
    )
    torch.testing.assert_close(held_normal_log_prob(x, mean + 0.1, std), shifted)


def test_held_noise_in_env_units_is_filtered_bcs_exploration() -> None:
    """``action_corr=1`` with ``action_std_env``: every executed step of a chunk carries the same noise, whose
    std in env units is ``action_std`` on every dimension (normalised: times the normaliser's scale, so the
    dimensions differ); the stored log-prob is the offset's Normal density per element and is re-evaluated
    unchanged (ratio 1)."""
    policy = noisy()
    policy.action_normalizer.low.copy_(torch.linspace(-0.2, -1.0, policy.action_dim))
    policy.action_normalizer.high.copy_(torch.linspace(0.2, 1.0, policy.action_dim))
    policy.set_sampling(**{**policy.sampling, "action_corr": 1.0, "action_std_env": True}, freeze=False)
    assert policy.sampling["action_corr"] == 1.0 and policy.sampling["action_std_env"]
    out = policy.sample(obs(512), return_chain=True, generator=torch.Generator().manual_seed(5))
    mean_env = policy.action_normalizer.unnormalize(out.means[:, 0])
    noise = out.actions - mean_env  # (B, Ta, Da) env units
    torch.testing.assert_close(noise, noise[:, :1].expand_as(noise), atol=1e-5, rtol=0)  # held
    per_dim = noise[:, 0].std(0)
    assert torch.all((per_dim - SIGMA).abs() < 0.15 * SIGMA), per_dim
    scale = policy.action_normalizer.scale
    ex = policy.exec_slice
    offset = (out.chain[:, 1, ex] - out.means[:, 0, ex]).mean(1)  # (B, Da) normalised
    lp = torch.distributions.Normal(torch.zeros_like(scale), SIGMA * scale).log_prob(offset)
    te = out.chain[:, 1, ex].shape[1]
    torch.testing.assert_close(out.log_probs[:, 0], lp.mean(-1) / te, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(policy.log_prob(out.chain, cond=out.cond), out.log_probs, atol=1e-4, rtol=1e-5)
    assert ChainConfig(action_std=0.05, action_corr=1.0, action_std_units="env").sampling()["action_std_env"]
    with pytest.raises(ValueError, match="action_std_units"):
        ChainConfig(action_std=0.05, action_std_units="metres")
    with pytest.raises(ValueError, match="action_std_units=env"):
        ChainConfig(action_std_units="env")
    with pytest.raises(ValueError, match="action_corr"):
        ChainConfig(action_std=0.05, action_corr=1.5)
