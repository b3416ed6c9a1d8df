"""Self-imitation beside the chain's PPO loss (``algo.sil_coef``): what is kept, what is drawn, the direction
of its update, and a tiny run that keeps, imitates and checkpoints."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_chain_faithful import KP, make, toy_rollout
from test_train import TINY_POLICY, TINY_RUN

from diffpolicy import checkpoint
from diffpolicy.config import ChainConfig, DeviceConfig
from diffpolicy.device import Runtime
from diffpolicy.distributed import DistInfo
from diffpolicy.models.critic import make_critic
from diffpolicy.rl.chain.update import ChainModules, ppo_update
from diffpolicy.rl.self_imitation import SelfImitation
from diffpolicy.rl.stability import GradMonitor, StateSnapshot


class Constant(torch.nn.Module):
    """A critic valuing every decision at ``value``."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, cond: torch.Tensor, state: torch.Tensor | None = None) -> torch.Tensor:
        return torch.full((cond.shape[0],), self.value)


def obs_state(b: int) -> dict[str, torch.Tensor]:
    return {"state": torch.zeros(b, 1, 5)}


def _kept(capacity: int = 6) -> SelfImitation:
    return SelfImitation(capacity, cond_dim=2, chain_shape=(3,), state_dim=None)


def test_only_valid_decisions_that_beat_their_value_are_kept_newest_first() -> None:
    kept = _kept(capacity=3)
    returns = torch.tensor([[1.0, 0.0], [2.0, 5.0]])  # (T, N)
    values = torch.tensor([[0.5, 1.0], [1.0, 0.0]])
    valid = torch.tensor([[1.0, 1.0], [1.0, 0.0]])  # the last decision is past its env's first episode
    cond = torch.arange(8.0).view(2, 2, 2)
    assert kept.add(cond, torch.zeros(2, 2, 3), returns, values, valid) == 2  # (0, 0) and (1, 0)
    assert kept.returns[: kept.size].tolist() == [1.0, 2.0] and kept.cond[1].tolist() == [4.0, 5.0]
    assert (
        kept.add(torch.ones(4, 2), torch.ones(4, 3), torch.full((4,), 9.0), torch.zeros(4), torch.ones(4))
        == 3
    )
    assert kept.size == 3 and kept.kept == 5 and kept.returns.tolist() == [9.0, 9.0, 9.0]  # the ring: newest


def test_draws_follow_the_excess_and_skip_what_the_critic_caught_up_with() -> None:
    kept = _kept()
    kept.add(
        torch.zeros(3, 2), torch.zeros(3, 3), torch.tensor([1.0, 3.0, 11.0]), torch.zeros(3), torch.ones(3)
    )
    gen = torch.Generator().manual_seed(0)
    drawn = kept.draw(Constant(2.0), 4000, gen)  # excess: 0, 1, 9
    counts = torch.stack([(drawn["returns"] == r).sum() for r in (1.0, 3.0, 11.0)]).float()
    assert counts[0] == 0 and abs(counts[2] / counts[1] - 9.0) < 1.5
    assert kept.draw(Constant(20.0), 4, gen) is None  # every return reached: nothing to imitate
    assert _kept().draw(Constant(0.0), 4, gen) is None  # nothing kept


def test_the_ring_survives_a_checkpoint() -> None:
    kept = _kept()
    kept.add(torch.randn(4, 2), torch.randn(4, 3), torch.arange(1.0, 5.0), torch.zeros(4), torch.ones(4))
    again = _kept()
    again.load_state_dict(copy.deepcopy(kept.state_dict()))
    assert (again.size, again.next, again.kept) == (kept.size, kept.next, kept.kept)
    assert torch.equal(again.chains, kept.chains) and torch.equal(again.returns, kept.returns)
    with pytest.raises(ValueError, match="sil_capacity"):
        _kept(capacity=2).load_state_dict(kept.state_dict())


def _sil_update(
    sil_coef: float, kept_returns: float, *, form: str = "chain", target: float | None = None,
    epochs: int = 2, lr: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One update whose PPO advantages are all zero and whose kept decisions are a toy rollout's chains with
    return ``kept_returns`` (the critic starts near 0), imitated by ``form``. Returns (before, after): the
    log-probs of those chains or, with ``target``, the chains' last states set to that constant chunk and
    the noise-free policy's squared distance from it, per decision."""
    policy = make(ft_steps=KP, freeze_encoders=True)
    T, N = 2, 4
    buffer = toy_rollout(policy, T, N)
    data = buffer.get()
    critic = make_critic(policy, 16, "cond", (8,))
    kept = SelfImitation(64, 16, tuple(data["chains"].shape[2:]), None)
    returns = torch.full((T, N), kept_returns)
    chains = data["chains"].clone()
    if target is not None:
        chains[:, :, -1] = target
    kept.add(data["cond"], chains, returns, torch.full((T, N), -100.0), data["valid"])
    learner = ChainModules(
        policy, critic, torch.optim.Adam(policy.parameters(), lr=lr), torch.optim.Adam(critic.parameters()),
        torch.amp.GradScaler("cpu", enabled=False), kept=kept,
    )  # fmt: skip
    snapshot = StateSnapshot(
        {"policy": policy, "critic": critic}, [learner.actor_optim, learner.critic_optim]
    )
    snapshot.capture()
    chains, cond = chains.flatten(0, 1), data["cond"].flatten(0, 1)

    def measure() -> torch.Tensor:
        with torch.no_grad():
            if target is None:
                return policy.log_prob(chains, cond=cond).sum(-1)
            noise = torch.randn(chains[:, -1].shape, generator=torch.Generator().manual_seed(5))  # x_K
            x0 = policy.sample(cond=cond, deterministic=True, noise=noise).normalized  # (T N, Ta, Da)
            return ((x0 - target) ** 2).mean(dim=(1, 2))

    before = measure()
    cfg = ChainConfig(
        update_epochs=epochs, minibatch_size=8, target_kl=0.0, sil_coef=sil_coef, sil_batch=256,
        norm_adv="none", sil_loss=form,
    )  # fmt: skip
    ppo_update(
        learner, buffer, torch.zeros(T, N), torch.zeros(T, N), cfg, clip_eps=torch.full((KP,), 0.01),
        runtime=Runtime.from_config(DeviceConfig(type="cpu")), info=DistInfo(),
        generator=torch.Generator().manual_seed(0), monitor=GradMonitor(), snapshot=snapshot,
    )  # fmt: skip
    return before, measure()


def test_self_imitation_raises_the_log_probability_of_a_kept_success() -> None:
    """Direction: with every PPO advantage zero, the update moves the policy only through self-imitation, and
    the kept chains become likelier; without the term (or when the critic already values the kept decisions
    at their return) the policy moves only by the surrogate's zero gradient: not at all. (Adam's steps are
    not the gradient's, so one chain of eight may lose a little while their mean rises.)"""
    before, after = _sil_update(sil_coef=1.0, kept_returns=5.0)
    assert (after - before).mean() > 0.02 and (after > before).float().mean() >= 0.75
    before, after = _sil_update(sil_coef=0.0, kept_returns=5.0)
    torch.testing.assert_close(after, before)
    before, after = _sil_update(sil_coef=1.0, kept_returns=-50.0)  # below the critic's ~0: never drawn
    torch.testing.assert_close(after, before)


def test_denoising_self_imitation_moves_the_noise_free_policy_to_the_kept_chunks() -> None:
    """Direction of ``algo.sil_loss=denoise``: the kept decisions' chunks are one constant chunk, and the
    update (PPO advantages all zero) brings the deployed noise-free policy's chunks closer to it for every
    decision; no term or nothing drawn, no move."""
    kw = dict(form="denoise", target=0.3, epochs=20, lr=1e-3)
    before, after = _sil_update(sil_coef=1.0, kept_returns=5.0, **kw)
    assert bool((after < before).all()) and after.mean() < 0.8 * before.mean()
    before, after = _sil_update(sil_coef=0.0, kept_returns=5.0, **kw)
    torch.testing.assert_close(after, before)
    before, after = _sil_update(sil_coef=1.0, kept_returns=-50.0, **kw)
    torch.testing.assert_close(after, before)


def test_denoising_self_imitation_reaches_only_the_fine_tuned_timesteps() -> None:
    """``chain_bc_loss`` draws t below K' T / K: the timesteps the K' fine-tuned steps query, none of the
    base's."""
    policy = make(ft_steps=KP)
    seen: list[torch.Tensor] = []
    forward = policy.denoiser.forward
    policy.denoiser.forward = lambda x, t, c: (seen.append(t), forward(x, t, c))[1]
    x0 = torch.zeros(512, *policy.sample(obs_state(512)).normalized.shape[1:])
    policy.chain_bc_loss(x0, torch.zeros(512, 16), generator=torch.Generator().manual_seed(0))
    s = policy.schedule
    ft_t = s.timesteps[s.first_ft_step :]
    assert int(seen[-1].max()) < int(ft_t.max()) + s.train_timesteps // s.ddim_steps
    assert int(seen[-1].max()) >= int(ft_t.max()) and int(seen[-1].min()) == 0


def test_sil_needs_a_critic_and_frozen_encoders() -> None:
    with pytest.raises(ValueError, match="sil_coef"):
        ChainConfig(sil_coef=0.1, advantage="grpo")
    with pytest.raises(ValueError, match="sil_coef"):
        ChainConfig(sil_coef=0.1, finetune_encoders=True)
    with pytest.raises(ValueError, match="sil_capacity"):
        ChainConfig(sil_coef=0.1, sil_capacity=0)
    with pytest.raises(ValueError, match="sil_loss"):
        ChainConfig(sil_coef=0.1, sil_loss="bc")


@pytest.mark.parametrize("form", ["chain", "denoise"])
def test_a_tiny_run_keeps_imitates_and_checkpoints(tmp_path: Path, init_ckpt: Path, form: str) -> None:
    from diffpolicy.cli import compose
    from diffpolicy.logger import read_metrics
    from diffpolicy.train import main

    args = [*TINY_RUN, *TINY_POLICY, f"policy.init={init_ckpt}", "eval_episodes=2", "algo.sil_coef=0.5",
            f"algo.sil_loss={form}"]  # fmt: skip
    main(compose("train", args), tmp_path)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    kept = [r["rollout/sil_kept"] for r in rows if "rollout/sil_kept" in r]
    assert len(kept) == 3 and kept == sorted(kept) and kept[-1] > 0
    assert any("losses/sil_policy" in r for r in rows)
    state = checkpoint.load(tmp_path / "checkpoints").state["kept"]
    assert state["returns"].shape[0] == kept[-1] and state["chains"].shape[0] == kept[-1]
