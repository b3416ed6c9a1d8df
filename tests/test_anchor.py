"""The chain learner's imitation anchor (``algo.anchor_steps``): the successful episodes it takes from a
rollout, the direction of its steps, and a tiny run that trains, checkpoints and resumes with it."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_filtered_bc import _runtime, _tiny_policy
from test_train import TINY_POLICY, TINY_RUN

from diffpolicy import checkpoint
from diffpolicy.config import ChainConfig
from diffpolicy.distributed import DistInfo
from diffpolicy.models.critic import make_critic
from diffpolicy.rl.buffer import RolloutBuffer, ppo_specs
from diffpolicy.rl.chain.learner import ChainLearner
from diffpolicy.rl.chain.update import ChainModules
from diffpolicy.rl.imitation import WindowStore, successful_episodes
from diffpolicy.rl.stability import GradMonitor, StateSnapshot


def _data(T: int, N: int) -> dict[str, torch.Tensor]:
    return {
        "state": torch.arange(T * N, dtype=torch.float32).view(T, N, 1),
        "dones": torch.zeros(T, N),
        "success": torch.zeros(T, N),
        "executed": torch.full((T, N), 4.0),
    }


def test_successful_episodes_are_the_ones_that_reached_success() -> None:
    """Env 0: an episode ending in success at t = 2 (kept whole), then one the rollout cut after a success at
    t = 4 (kept up to it); env 1: a failed episode and a cut one with no success (both dropped). The last
    decision keeps only the actions it executed."""
    T, N = 6, 2
    data = _data(T, N)
    data["dones"][2, 0] = data["success"][2, 0] = 1.0
    data["executed"][2, 0] = 3.0
    data["success"][4, 0] = 1.0
    data["dones"][1, 1] = 1.0
    actions = np.arange(T * N * 4 * 2, dtype=np.float32).reshape(T, N, 4, 2)
    episodes = successful_episodes(data, ["state"], actions, lambda ids: [])
    assert [[float(o["state"][0]) for o, _ in e] for e in episodes] == [[0.0, 2.0, 4.0], [6.0, 8.0]]
    assert [a.shape[0] for _, a in episodes[0]] == [4, 4, 3]
    np.testing.assert_array_equal(episodes[0][1][1], actions[1, 0])
    store = WindowStore(8)
    assert sum(store.add_episode(e) for e in episodes) == 5


def _anchored_learner(policy, kept_sign: float, ema: float, encoders: bool = False) -> ChainLearner:
    """A chain learner in its critic warm-up (PPO leaves the actor alone), whose last rollout holds, from one
    observation, a successful episode that executed ``kept_sign`` * 0.6 and a failed one that executed the
    opposite; the demonstrations are one window elsewhere. ``ema`` > 0: the anchor trains a copy the
    deployed weights follow as an EMA of that decay (``encoders``: encoders included)."""
    T, N = 2, 2
    s0 = np.full(5, 0.3, np.float32)
    specs = ppo_specs({"state": ((5,), torch.float32)}, ft_steps=1, horizon=8, action_dim=2)
    for name in ("valid", "success", "executed"):
        specs[name] = ((), torch.float32)
    specs["cond"] = ((16,), torch.float32)
    buffer = RolloutBuffer(T, N, specs)
    chunks = torch.stack([torch.full((8, 2), kept_sign * 0.6), torch.full((8, 2), -kept_sign * 0.6)])
    chain = torch.stack([torch.zeros(N, 8, 2), policy.action_normalizer.normalize(chunks)], dim=1)
    cond = policy.encode({"state": torch.from_numpy(s0)[None, None].expand(N, 1, 5)}, augment=False).detach()
    for t in range(T):
        last = float(t == T - 1)
        buffer.add(state=torch.from_numpy(s0), chains=chain, logprobs=0.0, values=0.0, rewards=0.0, bootstraps=0.0,
                   dones=last, valid=1.0, cond=cond, success=torch.tensor([last, 0.0]), executed=4.0)  # fmt: skip
    learner = object.__new__(ChainLearner)
    algo = ChainConfig(critic_warmup=1, anchor_steps=150, anchor_lr=3e-3, anchor_batch=16, action_std=0.05,
                       update_epochs=1, minibatch_size=4, target_kl=0.0)  # fmt: skip
    learner.cfg = SimpleNamespace(algo=algo, bc=SimpleNamespace(batch_size=16, translate=0.0))
    learner.rt, learner.info, learner.logger, learner.grpo = _runtime(), DistInfo(), None, False
    learner.policy, learner.buffer, learner._last = policy, buffer, (torch.zeros(T, N), torch.zeros(T, N))
    critic = make_critic(policy, 16, "cond", (8,))
    params = [p for p in policy.parameters() if p.requires_grad]
    learner.learner = ChainModules(
        policy, critic, torch.optim.Adam(params, lr=1e-3), torch.optim.Adam(critic.parameters()),
        torch.amp.GradScaler("cpu", enabled=False),
    )  # fmt: skip
    learner.critic, learner.clip_eps, learner.monitor = critic, torch.full((1,), 0.2), GradMonitor()
    learner.snapshot = StateSnapshot({"policy": policy, "critic": critic}, [learner.learner.actor_optim])
    learner.anchor_kept, learner._anchor_added = WindowStore(8), 0
    learner.anchor_demos = WindowStore(8)
    learner.anchor_demos.add_episode([({"state": -s0}, np.zeros((4, 2), np.float32))] * 2)
    learner.anchor_model, learner.anchor_decay = (copy.deepcopy(policy) if ema else None), ema
    if encoders:
        learner.anchor_model.set_freeze_encoders(False)
    trained = learner.anchor_model or policy
    learner.anchor_optim = torch.optim.AdamW(
        [p for p in trained.parameters() if p.requires_grad], lr=algo.anchor_lr
    )
    learner._keep_successes()
    return learner


@pytest.mark.parametrize(("sign", "ema"), [(1.0, 0.0), (-1.0, 0.0), (1.0, 0.9), (-1.0, 0.9)])
def test_the_anchor_moves_the_deployed_chunk_toward_the_successful_episode(sign: float, ema: float) -> None:
    """Direction of the anchor: after a rollout whose successful episode executed sign * 0.6 from s0 and whose
    failed one executed the opposite, the update's anchor steps pull the deployed noise-free action at s0 to
    the success's side (PPO is in its critic warm-up, so the anchor alone moves the actor), trained directly
    or followed as an EMA. An anchor that kept the failure, or both, would not."""
    policy = _tiny_policy()
    policy.obs_spec = {"state": [5]}  # what a built policy carries (diffpolicy.policy_io)
    policy.set_sampling(ft_steps=1, eta=1.0, min_std=0.05, action_std=0.05, freeze=False)
    policy.set_freeze_encoders(True)
    learner = _anchored_learner(policy, sign, ema)
    assert len(learner.anchor_kept) == 2  # the successful episode's two decisions, not the failed one's
    at_s0 = {"state": torch.full((1, 1, 5), 0.3)}
    x_k = torch.zeros(1, 8, 2)
    before = policy.sample(at_s0, deterministic=True, noise=x_k).actions[0, :4]
    losses = learner.update(seed=0, step=0, iteration=0)
    after = policy.sample(at_s0, deterministic=True, noise=x_k).actions[0, :4]
    target = sign * 0.6
    assert float((after - target).abs().mean()) < 0.5 * float((before - target).abs().mean())
    assert float(after.mean()) * sign > 0.15  # on the success's side, well away from 0
    assert losses["train/anchor_windows"] == 2 and losses["losses/anchor_last"] < losses["losses/anchor"]


def test_a_tiny_run_with_the_anchor_and_held_noise_trains_and_resumes(
    tmp_path: Path, init_ckpt: Path
) -> None:
    """``algo=ppo_anchor`` (held noise in env units, filtered_bc's exploration, with the anchor), scaled down,
    with the truncated gradient: trains, the checkpoint records how it sampled, and the run resumes."""
    from diffpolicy.cli import compose
    from diffpolicy.policy_io import sampling_of
    from diffpolicy.train import main

    run = [a if a != "algo=ppo" else "algo=ppo_anchor" for a in TINY_RUN]
    args = [*run, *TINY_POLICY, f"policy.init={init_ckpt}", "eval_episodes=2", "algo.anchor_steps=3",
            "algo.anchor_batch=8", "algo.critic_warmup=0", "algo.grad_steps=2"]  # fmt: skip
    cfg = compose("train", [*args, "algo.iterations=2"])
    assert (cfg.algo.action_std, cfg.algo.action_corr, cfg.algo.reward) == (0.05, 1.0, "success")
    summary = main(cfg, tmp_path)
    assert summary["env_steps"] > 0
    ckpt = checkpoint.load(tmp_path / "checkpoints")
    assert sampling_of(ckpt)["action_corr"] == 1.0 and sampling_of(ckpt)["action_std_env"] is True
    assert set(ckpt.state["anchor"]) == {"kept", "optim"}
    resumed = main(compose("train", [*args, "algo.iterations=3", "resume=true"]), tmp_path)
    assert resumed["iterations"] == 3
    with pytest.raises(ValueError, match="frozen base"):  # K' = 2 of K = 4 without action_std
        main(compose("train", [*TINY_RUN, *TINY_POLICY, f"policy.init={init_ckpt}", "algo.anchor_steps=3"]),
             tmp_path / "base")  # fmt: skip


@pytest.mark.parametrize("encoders", [False, True])
def test_the_anchor_trains_the_encoders_only_when_asked(encoders: bool) -> None:
    """``algo.anchor_encoders``: the deployed encoders follow the anchor's copy by the EMA (and stay frozen to
    PPO, which reuses the stored conditions); without it they do not move."""
    policy = _tiny_policy()
    policy.obs_spec = {"state": [5]}
    policy.set_sampling(ft_steps=1, eta=1.0, min_std=0.05, action_std=0.05, freeze=False)
    policy.set_freeze_encoders(True)
    before = [p.detach().clone() for p in policy.obs_encoder.parameters()]
    learner = _anchored_learner(policy, 1.0, 0.9, encoders=encoders)
    learner.update(seed=0, step=0, iteration=0)
    moved = any(not torch.equal(a, p) for a, p in zip(before, policy.obs_encoder.parameters()))
    assert moved == encoders and policy.encoders_frozen
    with pytest.raises(ValueError, match="anchor_ema"):
        ChainConfig(anchor_encoders=True, anchor_ema=0.0)
