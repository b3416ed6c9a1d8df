"""The chain path as DPPO runs it: critic-free GRPO returns, a frozen base for the first K - K' steps, the
log-prob std floor / clamp and noise clip, a KL bound on every single update step, and ``algo=dppo``."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

from diffpolicy.cli import compose
from diffpolicy.config import ChainConfig, DeviceConfig, EncoderConfig, PolicyConfig
from diffpolicy.device import Runtime
from diffpolicy.diffusion.sampler import ddim_sample, ddim_sample_reference
from diffpolicy.distributed import DistInfo
from diffpolicy.env_factory import ActionChunkWrapper
from diffpolicy.models.critic import make_critic
from diffpolicy.policies import DiffusionPolicy, make_policy
from diffpolicy.rl.buffer import RolloutBuffer, ppo_specs
from diffpolicy.rl.chain.rollout import collect_rollout
from diffpolicy.rl.chain.update import KL_STEP_FACTOR, ChainModules, ppo_update
from diffpolicy.rl.stability import GradMonitor, StateSnapshot

B, TA, DA, TE, K, KP = 4, 16, 3, 4, 5, 3
ENC = EncoderConfig(state_hidden=16, token_dim=16, fusion_heads=2)


def make(seed: int = 0, **kw) -> DiffusionPolicy:
    base = dict(encoder=ENC, cond_dim=16, down_dims=[16, 32], n_groups=4, step_embed_dim=16, horizon=TA,
                n_action_steps=TE, train_timesteps=50, ddim_steps=K)  # fmt: skip
    ft_steps = kw.pop("ft_steps", K)
    torch.manual_seed(seed)
    policy = make_policy(PolicyConfig(**{**base, **kw}), {"state": (5,)}, DA, text_backend="hash")
    policy.set_sampling(ft_steps=ft_steps, eta=1.0, min_std=0.05, freeze=False)
    return policy


def obs(b: int = B) -> dict:
    return {"state": torch.randn(b, 1, 5, generator=torch.Generator().manual_seed(1))}


def sample(p: DiffusionPolicy, noise: torch.Tensor, seed: int = 0):
    return p.sample(obs(), return_chain=True, noise=noise, generator=torch.Generator().manual_seed(seed))


def adam_step(p: DiffusionPolicy, lr: float = 1e-2) -> None:
    opt = torch.optim.Adam([q for q in p.parameters() if q.requires_grad], lr=lr)
    p.bc_loss(obs(), torch.randn(B, TA, DA, generator=torch.Generator().manual_seed(2))).backward()
    opt.step()


# ---------------------------------------------------------------------- (1) GRPO returns ignore the critic
class Endless(gym.Env):
    """Reward 1 per step, never terminates: every episode ends by the time limit (a truncation)."""

    observation_space = spaces.Dict({"state": spaces.Box(-np.inf, np.inf, (1,), np.float32)})
    action_space = spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return {"state": np.zeros(1, np.float32)}, {}

    def step(self, action):
        return {"state": np.zeros(1, np.float32)}, 1.0, False, False, {}


class ChainStub(torch.nn.Module):
    """Plans zeros with a one-step chain; the condition is the state."""

    n_action_steps = 2

    def plan(self, obs, *, deterministic=False, return_chain=False, generator=None):
        n = obs["state"].shape[0]
        out = SimpleNamespace(
            chain=torch.zeros(n, 2, 2, 2), log_probs=torch.zeros(n, 1), cond=obs["state"][:, 0]
        )
        return torch.zeros(n, 2, 2), out

    def encode(self, obs, augment=False):
        return obs["state"][:, 0]


@pytest.mark.parametrize("bootstrap", [True, False])
def test_grpo_returns_ignore_the_critic(bootstrap: bool) -> None:
    """A time-limit cut adds gamma * V(final obs) to the reward only with ``bootstrap`` (GAE): with a critic
    that answers 1e6, GRPO's rewards (bootstrap=False) stay the environment's own."""
    fns = [lambda: ActionChunkWrapper(gym.wrappers.TimeLimit(Endless(), 3), 2) for _ in range(2)]
    venv = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    specs = {"state": ((1,), torch.float32), **ppo_specs({}, ft_steps=1, horizon=2, action_dim=2)}
    buffer = RolloutBuffer(2, 2, {**specs, "valid": ((), torch.float32)})
    critic = lambda cond, state=None: torch.full((cond.shape[0],), 1e6)
    collect_rollout(ChainStub(), critic, venv, buffer, n_steps=2, seeds=[0, 0], gamma=0.5,
                    device=torch.device("cpu"), bootstrap=bootstrap)  # fmt: skip
    venv.close()
    rewards = buffer.get()["rewards"]  # (T, N): 2 steps, then the 3rd step and the cut
    cut = 1.0 + (0.5 * 1e6 if bootstrap else 0.0)
    torch.testing.assert_close(rewards, torch.tensor([[2.0, 2.0], [cut, cut]]))
    boot = 0.5 * 1e6 if bootstrap else 0.0  # the bootstrap part alone, so that a reward scaler can skip it
    torch.testing.assert_close(buffer.get()["bootstraps"], torch.tensor([[0.0, 0.0], [boot, boot]]))


class DenseThenSuccess(gym.Env):
    """Meta-World's shape: a dense reward of 5 every step, success (and the episode's end) at step 3."""

    observation_space = Endless.observation_space
    action_space = Endless.action_space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return {"state": np.zeros(1, np.float32)}, {"is_success": False}

    def step(self, action):
        self.t += 1
        return {"state": np.zeros(1, np.float32)}, 5.0, self.t == 3, False, {"is_success": self.t == 3}


@pytest.mark.parametrize("source", ["env", "success"])
def test_success_reward_pays_only_the_succeeding_decision(source: str) -> None:
    """``algo.reward=success`` stores 1 for the decision whose actions reach success and 0 for the others
    (the dense 5 per step is dropped); the episode returns the stats report stay the environment's."""
    fns = [lambda: ActionChunkWrapper(gym.wrappers.TimeLimit(DenseThenSuccess(), 10), 2) for _ in range(2)]
    venv = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    specs = {"state": ((1,), torch.float32), **ppo_specs({}, ft_steps=1, horizon=2, action_dim=2)}
    buffer = RolloutBuffer(2, 2, {**specs, "valid": ((), torch.float32)})
    critic = lambda cond, state=None: torch.zeros(cond.shape[0])
    _, stats = collect_rollout(ChainStub(), critic, venv, buffer, n_steps=2, seeds=[0, 1], gamma=0.9,
                               device=torch.device("cpu"), reward_source=source)  # fmt: skip
    venv.close()
    rewards = buffer.get()["rewards"]  # (T, N): steps 1-2, then step 3 (success, the chunk cut short)
    want = [[10.0, 10.0], [5.0, 5.0]] if source == "env" else [[0.0, 0.0], [1.0, 1.0]]
    torch.testing.assert_close(rewards, torch.tensor(want))
    torch.testing.assert_close(buffer.get()["dones"], torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    assert stats.returns == [15.0, 15.0] and stats.successes == 2


def test_success_reward_refuses_an_env_without_success() -> None:
    fns = [lambda: ActionChunkWrapper(gym.wrappers.TimeLimit(Endless(), 3), 2)]
    venv = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    specs = {"state": ((1,), torch.float32), **ppo_specs({}, ft_steps=1, horizon=2, action_dim=2)}
    buffer = RolloutBuffer(1, 1, {**specs, "valid": ((), torch.float32)})
    with pytest.raises(ValueError, match="algo.reward=success, but this env reports no success"):
        collect_rollout(ChainStub(), lambda c, s=None: torch.zeros(c.shape[0]), venv, buffer, n_steps=1,
                        seeds=[0], gamma=0.9, device=torch.device("cpu"), reward_source="success")  # fmt: skip
    venv.close()
    with pytest.raises(ValueError, match="algo.reward"):
        compose("train", ["algo=dppo", "algo.reward=sparse"])


class Stages(gym.Env):
    """Meta-World's outcome names over one episode: not reached (2 steps), reached, grasped, then a step that
    reports reached again (a stage once reached stays), success at step 6."""

    observation_space = Endless.observation_space
    action_space = Endless.action_space
    OUTCOMES = ("never_reached", "never_reached", "never_grasped", "timed_out", "never_grasped", "success")

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return {"state": np.zeros(1, np.float32)}, {"is_success": False, "outcome": "never_reached"}

    def step(self, action):
        outcome = self.OUTCOMES[self.t]
        self.t += 1
        done = outcome == "success"
        return {"state": np.zeros(1, np.float32)}, 5.0, done, False, {"is_success": done, "outcome": outcome}


def test_stage_reward_pays_each_stage_once_then_success() -> None:
    """``algo.reward=stages``: a decision (2 env steps) earns the rise of the potential of the outcome it ends
    in (reached 0.1, grasped 0.3), never a fall, plus success's 1; the next episode starts from 0 again."""
    fns = [lambda: ActionChunkWrapper(gym.wrappers.TimeLimit(Stages(), 10), 2)]
    venv = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    specs = {"state": ((1,), torch.float32), **ppo_specs({}, ft_steps=1, horizon=2, action_dim=2)}
    buffer = RolloutBuffer(5, 1, {**specs, "valid": ((), torch.float32)})
    potential = {"never_grasped": 0.1, "timed_out": 0.3}
    collect_rollout(ChainStub(), lambda c, s=None: torch.zeros(c.shape[0]), venv, buffer, n_steps=5, seeds=[0],
                    gamma=0.9, device=torch.device("cpu"), reward_source="stages",
                    stage_potential=potential)  # fmt: skip
    venv.close()
    rewards = buffer.get()["rewards"][:, 0]
    # steps 1-2 not reached; 3-4 reached and grasped; 5 "reached" again, 6 success; a new episode: 1-2, 3-4
    torch.testing.assert_close(rewards, torch.tensor([0.0, 0.3, 1.0, 0.0, 0.3]))
    assert rewards[:3].sum().item() == pytest.approx(1.3)  # success + the last stage's potential
    with pytest.raises(ValueError, match="must be in \\[0, 1\\)"):
        compose("train", ["algo=dppo", "algo.reward=stages", "algo.stage_potential.timed_out=1.5"])
    cfg = compose("train", ["algo=dppo", "algo.reward=stages", "algo.stage_potential.timed_out=0.5"])
    assert dict(cfg.algo.stage_potential) == {"never_grasped": 0.1, "timed_out": 0.5}


def test_stage_reward_refuses_an_env_without_outcomes() -> None:
    fns = [lambda: ActionChunkWrapper(gym.wrappers.TimeLimit(DenseThenSuccess(), 10), 2)]
    venv = SyncVectorEnv(fns, autoreset_mode=AutoresetMode.SAME_STEP)
    specs = {"state": ((1,), torch.float32), **ppo_specs({}, ft_steps=1, horizon=2, action_dim=2)}
    buffer = RolloutBuffer(1, 1, {**specs, "valid": ((), torch.float32)})
    with pytest.raises(ValueError, match="algo.reward=stages, but this env reports no stage"):
        collect_rollout(ChainStub(), lambda c, s=None: torch.zeros(c.shape[0]), venv, buffer, n_steps=1,
                        seeds=[0], gamma=0.9, device=torch.device("cpu"), reward_source="stages")  # fmt: skip
    venv.close()


# -------------------------------------------------------------- (2) frozen pre-trained denoiser, K' < K
def test_early_steps_use_a_frozen_copy_of_the_pretrained_denoiser() -> None:
    noise = torch.randn(B, TA, DA, generator=torch.Generator().manual_seed(3))
    p = make()
    keys = set(p.state_dict())
    n_params = len(list(p.parameters()))
    p.set_sampling(ft_steps=KP, eta=1.0, min_std=0.05)
    base = p.base_denoiser
    assert base is not None and all(not q.requires_grad for q in base.parameters())
    assert set(p.state_dict()) == keys and len(list(p.parameters())) == n_params  # not registered
    before = sample(p, noise)
    adam_step(p)
    after = sample(p, noise)
    torch.testing.assert_close(after.chain[:, 0], before.chain[:, 0], rtol=0, atol=0)  # x_{K'}: frozen base
    assert not torch.allclose(after.chain[:, -1], before.chain[:, -1])  # the fine-tuned steps moved

    # Without the frozen base, the same step moves x_{K'} too (what the base prevents).
    q = make()
    q.schedule = p.schedule  # K' < K, no base frozen
    assert q.base_denoiser is None
    x_kp = sample(q, noise).chain[:, 0]
    adam_step(q)
    assert not torch.allclose(sample(q, noise).chain[:, 0], x_kp)

    # A later set_sampling keeps the pre-trained base; K' = K drops it; copies and dtype moves carry it.
    p.set_sampling(ft_steps=KP, eta=1.0, min_std=0.05)
    assert p.base_denoiser is base
    assert copy.deepcopy(p).base_denoiser is not None
    assert next(p.double().base_denoiser.parameters()).dtype == torch.float64
    p.float().set_sampling(ft_steps=K, eta=1.0, min_std=0.05)
    assert p.base_denoiser is None


def test_sampler_backends_agree_with_a_base_and_a_noise_clip() -> None:
    p = make()
    p.set_sampling(ft_steps=KP, eta=1.0, min_std=0.05)
    adam_step(p)  # the base and the fine-tuned denoiser now differ
    cond = p.encode(obs())
    noise = torch.randn(B, TA, DA, generator=torch.Generator().manual_seed(4))
    kw = dict(noise=noise, base_denoiser=p.base_denoiser, noise_clip=0.5)
    with torch.no_grad():
        want = ddim_sample_reference(
            p.denoiser, p.schedule, cond, TA, generator=torch.Generator().manual_seed(5), **kw
        )
        for backend in ("eager", "fast"):
            got = ddim_sample(p.denoiser, p.schedule, cond, TA, generator=torch.Generator().manual_seed(5),
                              backend=backend, **kw).x0  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        plain = ddim_sample_reference(p.denoiser, p.schedule, cond, TA, noise=noise,
                                      generator=torch.Generator().manual_seed(5))  # fmt: skip
    assert not torch.allclose(plain, want)


# ------------------------------------------------------ (3) log-prob std floor and clamp, noise clip
def test_log_probs_floor_and_clamp_against_torch_distributions() -> None:
    p = make(ft_steps=KP)
    noise = torch.randn(B, TA, DA, generator=torch.Generator().manual_seed(6))
    p.logprob_min_std = 0.1
    out = sample(p, noise)

    def reference(low: float, high: float) -> torch.Tensor:
        std = out.stds.clamp_min(0.1).expand_as(out.means)
        lp = torch.distributions.Normal(out.means, std).log_prob(out.chain[:, 1:])  # (B, K', Ta, Da)
        return lp.clamp(low, high)[:, :, :TE].mean((-2, -1))

    torch.testing.assert_close(out.log_probs, reference(-1e9, 1e9), atol=1e-5, rtol=1e-5)  # unclamped
    p.logprob_clamp = [-5.0, 2.0]  # DPPO's bounds (at std >= 0.1 only draws beyond ~2.7 std reach -5)
    torch.testing.assert_close(sample(p, noise).log_probs, reference(-5.0, 2.0), atol=1e-5, rtol=1e-5)
    p.logprob_clamp = [-0.5, 0.8]  # inside the spread of the per-element log-probs
    clamped = sample(p, noise)
    torch.testing.assert_close(clamped.chain, out.chain)  # the clamp changes log-probs, not the samples
    torch.testing.assert_close(clamped.log_probs, reference(-0.5, 0.8), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(clamped.log_probs, out.log_probs)
    assert clamped.log_probs.min() >= -0.5 - 1e-6 and clamped.log_probs.max() <= 0.8 + 1e-6
    # the update's re-evaluation clamps alike: ratio 1 at the sampling parameters
    torch.testing.assert_close(p.log_prob(clamped.chain, obs()), clamped.log_probs, atol=1e-5, rtol=1e-5)


def test_noise_clip_bounds_every_draw() -> None:
    p = make(ft_steps=KP)
    noise = torch.randn(B, TA, DA, generator=torch.Generator().manual_seed(7))

    def draws(out) -> torch.Tensor:  # z = (x_{k-1} - mean) / std of every fine-tuned step
        return (out.chain[:, 1:] - out.means) / out.stds

    assert draws(sample(p, noise)).abs().max() > 1.0
    p.noise_clip = 1.0
    z = draws(sample(p, noise))
    assert z.abs().max() <= 1.0 + 1e-4 and (z.abs() > 1.0 - 1e-4).any()


def test_config_fields_are_validated() -> None:
    assert ChainConfig().logprob_clamp == [] and ChainConfig().noise_clip == 0.0  # off unless asked
    with pytest.raises(ValueError, match="logprob_clamp"):
        ChainConfig(logprob_clamp=[2.0, -5.0])
    with pytest.raises(ValueError, match="logprob_clamp"):
        ChainConfig(logprob_clamp=[1.0])
    with pytest.raises(ValueError, match="noise_clip"):
        ChainConfig(noise_clip=-1.0)
    with pytest.raises(ValueError, match="critic_input"):
        ChainConfig(critic_input="obs")
    with pytest.raises(ValueError, match="critic_hidden"):
        ChainConfig(critic_hidden=[])


# ------------------------------------------------------------------ (4) every step bounded by target_kl
def toy_rollout(policy: DiffusionPolicy, T: int, N: int, cond_dim: int = 16) -> RolloutBuffer:
    """A (T, N) chain rollout of ``policy`` (5-D states, fixed seeds; zero rewards and values) in a buffer with
    the fields the chain and FPO updates read."""
    specs = ppo_specs({}, ft_steps=policy.ft_steps, horizon=policy.horizon, action_dim=policy.action_dim)
    specs.update(state=((5,), torch.float32), valid=((), torch.float32), cond=((cond_dim,), torch.float32))
    buffer = RolloutBuffer(T, N, specs)
    for t in range(T):
        o = {"state": torch.randn(N, 1, 5, generator=torch.Generator().manual_seed(10 + t))}
        out = policy.sample(o, return_chain=True, generator=torch.Generator().manual_seed(t))
        buffer.add(state=o["state"][:, 0], chains=out.chain, logprobs=out.log_probs, values=0.0, rewards=0.0,
                   bootstraps=0.0, dones=0.0, valid=1.0, cond=out.cond)  # fmt: skip
    return buffer


def _update(
    lr: float,
    target_kl: float,
    adv: torch.Tensor | None = None,
    epochs: int = 3,
    buffer_out: list | None = None,
    critic_input: str = "cond",
    returns: torch.Tensor | None = None,
    critic_lr: float = 1e-3,
    norm_adv: str = "minibatch",
) -> tuple[dict, dict, dict, ChainModules]:
    """One ppo_update on a filled toy rollout: (metrics, weights before, weights after, learner); ``adv``
    (T, N) replaces the random advantages, ``buffer_out`` receives the buffer, ``critic_input`` and
    ``returns`` (T, N; default zeros) set the critic and its targets."""
    p = make(ft_steps=KP, freeze_encoders=True)
    T, N = 2, 4
    buffer = toy_rollout(p, T, N)
    critic = make_critic(p, 16, critic_input, (8,))
    learner = ChainModules(p, critic, torch.optim.Adam(p.parameters(), lr=lr), torch.optim.Adam(critic.parameters(), lr=critic_lr),
                      torch.amp.GradScaler("cpu", enabled=False))  # fmt: skip
    snapshot = StateSnapshot({"policy": p, "critic": critic}, [learner.actor_optim, learner.critic_optim])
    snapshot.capture()
    before = copy.deepcopy(p.state_dict())
    if adv is None:
        adv = torch.randn(T, N, generator=torch.Generator().manual_seed(9))
    if buffer_out is not None:
        buffer_out.append(buffer)
    cfg = ChainConfig(update_epochs=epochs, minibatch_size=8, target_kl=target_kl, lr=lr, norm_adv=norm_adv)
    metrics = ppo_update(
        learner, buffer, adv, torch.zeros(T, N) if returns is None else returns, cfg,
        clip_eps=torch.full((KP,), 0.01),
        runtime=Runtime.from_config(DeviceConfig(type="cpu")), info=DistInfo(),
        generator=torch.Generator().manual_seed(0), monitor=GradMonitor(), snapshot=snapshot,
    )  # fmt: skip
    return metrics, before, p.state_dict(), learner


def test_an_overshooting_first_step_is_undone() -> None:
    """At lr 1 Adam's first step moves every weight by ~1: far past target_kl, so it is rejected and the
    policy and the optimiser are left as they were; the epochs stop."""
    metrics, before, after, learner = _update(lr=1.0, target_kl=0.01)
    assert metrics["losses/kl_stops"] == 1.0 and metrics["losses/epochs"] == 1.0
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not learner.actor_optim.state  # Adam's moments and step count rolled back too
    # with target_kl off the same step is taken
    metrics, before, after, _ = _update(lr=1.0, target_kl=0.0)
    assert metrics["losses/kl_stops"] == 0.0 and any(not torch.equal(before[k], after[k]) for k in before)


def test_small_steps_pass_the_bound() -> None:
    metrics, before, after, _ = _update(lr=1e-6, target_kl=0.01)
    assert metrics["losses/kl_stops"] == 0.0 and metrics["losses/epochs"] == 3.0
    assert metrics["losses/approx_kl"] < KL_STEP_FACTOR * 0.01
    assert any(not torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("norm_adv", ["minibatch", "batch", "none"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_update_moves_the_chain_toward_positive_advantages(sign: float, norm_adv: str) -> None:
    """Direction: on a fixed batch, decisions with a positive advantage become likelier under the updated
    chain and those with a negative one less likely (summed over the K' stored transitions); flipping every
    advantage flips the movement, whichever way the advantages are standardised. A learner with the
    surrogate's sign wrong fails this."""
    adv = sign * torch.tensor([[1.0, 1.0, -1.0, -1.0], [1.0, 1.0, -1.0, -1.0]])  # (T, N)
    box: list = []
    _, before, after, learner = _update(lr=1e-5, target_kl=0.0, adv=adv, epochs=1, buffer_out=box,
                                        norm_adv=norm_adv)  # fmt: skip
    data = box[0].get()
    chains, cond = data["chains"].flatten(0, 1), data["cond"].flatten(0, 1)  # (T N, K'+1, Ta, Da), (T N, C)
    policy = learner.policy
    with torch.no_grad():
        new = policy.log_prob(chains, cond=cond).sum(-1)  # (T N,)
        policy.load_state_dict(before)
        old = policy.log_prob(chains, cond=cond).sum(-1)
    moved = (new - old).view_as(adv)
    assert (moved * adv).sum() > 0  # the surrogate the step ascends
    assert moved[adv > 0].mean() > 0 > moved[adv < 0].mean()


@pytest.mark.parametrize("critic_input", ["cond", "state"])
def test_the_update_moves_the_critic_toward_the_returns(critic_input: str) -> None:
    """Direction of the value step, for either critic input: after one update on a fixed batch the critic's
    squared error to the returns is lower than before (a critic fed the wrong input or target would not
    learn them)."""
    returns = torch.tensor([[3.0, 2.0, 4.0, 2.5], [3.5, 2.0, 3.0, 4.5]])  # (T, N)
    box: list = []
    _, _, _, learner = _update(lr=1e-6, target_kl=0.0, epochs=20, buffer_out=box, critic_input=critic_input,
                               returns=returns, critic_lr=0.03)  # fmt: skip
    data = box[0].get()
    cond, state = data["cond"].flatten(0, 1), data["state"].flatten(0, 1)
    with torch.no_grad():
        err = ((learner.critic(cond, state) - returns.flatten()) ** 2).mean()
    assert learner.critic.source == critic_input
    assert err < 0.1 * (returns**2).mean()  # V = 0 (about where it starts) is 10x further off


# -------------------------------------------------------------------------------- (5) algo=dppo
def test_dppo_entry_composes_with_its_policy_settings() -> None:
    cfg = compose("train", ["algo=dppo"])
    want = dict(name="dppo", advantage="gae", clip_eps=1e-3, clip_eps_final=1e-2, logprob_min_std=0.1,
                logprob_clamp=[-5.0, 2.0], noise_clip=3.0, update_epochs=10, lr=1e-4, critic_lr=1e-3,
                gamma=0.999, gae_lambda=0.95, denoise_gamma=0.99, target_kl=1.0, critic_warmup=2,
                reward_scale="running", max_grad_norm=0.0, iterations=151)  # fmt: skip
    assert {k: getattr(cfg.algo, k) for k in want} == want
    # DPPO HEAD's 20 minibatches per epoch (7500 of 150 000 pairs): 1/20 of the rollout's decisions
    assert cfg.algo.n_steps * cfg.env.num_envs == 20 * cfg.algo.minibatch_size
    pre = compose("pretrain", ["algo=dppo"]).algo  # pretrain judges BC with the learner's sampling too
    assert (pre.ft_steps, pre.min_std) == (cfg.algo.ft_steps, cfg.algo.min_std)
    gym = compose("train", ["env=hopper", "algo=dppo_gym"]).algo
    assert (gym.name, gym.reward_scale, gym.max_grad_norm) == ("dppo_gym", "running", 0.0)
    assert (cfg.algo.ft_steps, cfg.policy.ddim_steps, cfg.algo.min_std) == (5, 10, 0.1)
    # the policy group can still be swapped and the command line still wins
    assert compose("train", ["algo=dppo", "policy=unet_large"]).algo.ft_steps == 5
    assert compose("train", ["algo=dppo", "algo.ft_steps=2"]).algo.ft_steps == 2


def test_dppo_tiny_run(tmp_path: Path) -> None:
    from test_train import TINY_POLICY, TINY_RUN

    from diffpolicy.logger import read_metrics
    from diffpolicy.policy_io import build_policy, env_spec, save_policy
    from diffpolicy.train import main

    # the tiny end-to-end overrides of test_train (they set iterations 3, T 3, minibatches 4, 2 epochs)
    overrides = [*(o for o in TINY_RUN if not o.startswith("algo=")), "algo=dppo", *TINY_POLICY]
    cfg = compose("train", overrides)
    spec, da = env_spec(cfg.env)
    torch.manual_seed(0)
    init = tmp_path / "init"
    save_policy(init, 0, build_policy(cfg.policy, spec, da), env_cfg=cfg.env, policy_cfg=cfg.policy)
    cfg = compose("train", [*overrides, f"policy.init={init}"])
    summary = main(cfg, tmp_path / "run")
    assert summary is not None and summary["env_steps"] > 0
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    policy_rows = [r for r in rows if r.get("losses/policy") is not None]
    assert len(policy_rows) == 1  # 2 critic warm-up iterations, then 1 PPO iteration
    assert all(np.isfinite(r["losses/policy"]) and "losses/kl_stops" in r for r in policy_rows)
    # the one PPO iteration moved the fine-tuned denoiser and nothing else: the encoders stay frozen
    from diffpolicy import checkpoint

    start = checkpoint.load(init).state["policy"]
    end = checkpoint.load(tmp_path / "run" / "checkpoints").state["policy"]
    changed = {k for k in start if not torch.equal(start[k], end[k])}
    assert changed and all(k.startswith("denoiser.") for k in changed), sorted(changed)[:5]


def test_a_chain_checkpoint_keeps_its_frozen_base(tmp_path, init_ckpt) -> None:
    """algo=dppo (K' = 2 < K = 4 here): the saved policy samples its early steps with the pre-trained base."""
    from test_train import TINY_POLICY, TINY_RUN

    from diffpolicy import checkpoint
    from diffpolicy.policy_io import load_policy
    from diffpolicy.train import main as train_main

    args = [*TINY_RUN, *TINY_POLICY, f"policy.init={init_ckpt}", "algo.iterations=2", "algo.lr=1e-2"]
    summary = train_main(compose("train", [*args, "algo.target_kl=0"]), tmp_path)
    assert summary["env_steps"] > 0
    ckpt = checkpoint.load(tmp_path / "checkpoints")
    assert "base_denoiser" in ckpt.state
    policy, _, _ = load_policy(tmp_path / "checkpoints")
    init, _, _ = load_policy(init_ckpt)
    base = policy.base_denoiser.state_dict()
    assert all(torch.equal(base[k], v) for k, v in init.denoiser.state_dict().items())  # the BC weights
    assert any(not torch.equal(policy.denoiser.state_dict()[k], v) for k, v in base.items())  # fine-tuned
