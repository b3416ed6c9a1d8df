"""The MLP denoiser (policy=mlp): its split input layer against the plain forward, and a policy built on it."""

from __future__ import annotations

import torch

from diffpolicy.config import PolicyConfig
from diffpolicy.models.mlp_denoiser import MLPDenoiser


def test_film_tables_path_equals_plain_forward() -> None:
    """W [x; s; c] + b == W_x x + (obs part + step part): the sampler's path is the plain network."""
    torch.manual_seed(0)
    net = MLPDenoiser(action_dim=3, horizon=4, cond_dim=5, hidden=[16, 16, 8], step_embed_dim=8)
    torch.nn.init.normal_(net.inp.weight)  # the cond columns start at zero; give them weight
    x, cond, t = torch.randn(6, 4, 3), torch.randn(6, 5), torch.tensor([7, 3, 0])
    obs, step = net.film_tables(cond, t)  # (B, H0), (K, H0)
    assert obs.shape == (6, 16) and step.shape == (3, 16)
    for k in range(3):
        fast = net.forward_film(x, obs + step[k])
        plain = net(x, t[k], cond)
        assert fast.shape == (6, 4, 3)
        torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)


def test_observation_columns_start_at_zero() -> None:
    net = MLPDenoiser(action_dim=2, horizon=4, cond_dim=3, hidden=[8])
    x = torch.randn(2, 4, 2)
    torch.testing.assert_close(net(x, 5, torch.randn(2, 3)), net(x, 5, torch.randn(2, 3)))


def test_policy_samples_and_scores_chains_with_the_mlp() -> None:
    from diffpolicy.policies.diffusion import DiffusionPolicy

    cfg = PolicyConfig(name="mlp", denoiser="mlp", mlp_dims=[32, 32], horizon=4, n_action_steps=4,
                       train_timesteps=20, ddim_steps=20, cond_dim=16, step_embed_dim=8,
                       encoder={"state_hidden": 16, "token_dim": 16})  # fmt: skip
    policy = DiffusionPolicy(cfg, {"state": [11]}, 3, text_backend="hash")
    policy.set_sampling(ft_steps=10, eta=1.0, min_std=0.01, freeze=False)
    assert isinstance(policy.denoiser, MLPDenoiser)
    obs = {"state": torch.randn(5, 1, 11)}
    out = policy.sample(obs, return_chain=True, generator=torch.Generator().manual_seed(0))
    assert out.actions.shape == (5, 4, 3) and out.chain.shape == (5, 11, 4, 3)
    assert out.log_probs.shape == (5, 10) and torch.isfinite(out.log_probs).all()
    assert torch.isfinite(policy.bc_loss(obs, torch.rand(5, 4, 3) * 2 - 1)).all()
