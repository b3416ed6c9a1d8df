"""Success-filtered self-imitation (algo=filtered_bc): windows of kept episodes, a tiny run end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from diffpolicy.bc import ema_update
from diffpolicy.rl.imitation import WindowStore, concat_batches


def test_window_store_builds_demo_style_windows() -> None:
    """Decision d's window holds the Ta actions executed from its first step on, the last one repeated."""
    store = WindowStore(horizon=4)
    acts = [np.full((2, 1), v, np.float32) for v in (0.0, 1.0)] + [np.array([[2.0]], np.float32)]
    acts[0][1] = 0.5
    decisions = [({"state": np.array([float(d)], np.float32)}, a) for d, a in enumerate(acts)]
    assert store.add_episode(decisions) == 3
    obs, actions = store.batch(torch.arange(3), torch.device("cpu"))
    assert obs["state"].shape == (3, 1, 1) and obs["state"][:, 0, 0].tolist() == [0.0, 1.0, 2.0]
    assert actions[:, :, 0].tolist() == [[0.0, 0.5, 1.0, 1.0], [1.0, 1.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]]
    store.add_episode(decisions[:1])
    assert len(store) == 4
    state = store.state()
    again = WindowStore(horizon=4)
    again.load(state)
    assert torch.equal(
        again.batch(torch.arange(4), torch.device("cpu"))[1],
        store.batch(torch.arange(4), torch.device("cpu"))[1],
    )


def test_concat_batches_joins_text_and_tensors() -> None:
    a = ({"state": torch.zeros(2, 1, 3), "instruction": ["x", "y"]}, torch.zeros(2, 4, 2))
    b = ({"state": torch.ones(1, 1, 3), "instruction": ["z"]}, torch.ones(1, 4, 2))
    obs, actions = concat_batches(
        [a, b, ({"state": torch.zeros(0, 1, 3), "instruction": []}, torch.zeros(0, 4, 2))]
    )
    assert (
        obs["instruction"] == ["x", "y", "z"]
        and obs["state"].shape == (3, 1, 3)
        and actions.shape == (3, 4, 2)
    )


def test_keep_chooses_successes_or_top_returns() -> None:
    """algo.keep: the successes; the top keep_fraction by return (ties by order); auto picks by whether the
    env reports success; success on an env without one is a clear error."""
    from types import SimpleNamespace

    from diffpolicy.config import FilteredBCConfig
    from diffpolicy.rl.filtered_bc import FilteredBCLearner

    def head(**kw: object) -> FilteredBCLearner:
        fake = object.__new__(FilteredBCLearner)
        fake.cfg = SimpleNamespace(algo=FilteredBCConfig(**kw))
        return fake

    succ, rets = [False, True, False, True, False], [5.0, 1.0, 9.0, 2.0, 9.0]
    assert head(keep="success").choose(succ, rets, True) == [1, 3]
    assert head(keep="auto").choose(succ, rets, True) == [1, 3]
    assert head(keep="top", keep_fraction=0.4).choose(succ, rets, True) == [2, 4]
    assert head(keep="auto", keep_fraction=0.4).choose(succ, rets, False) == [2, 4]
    assert head(keep="top", keep_fraction=0.5).choose(succ, rets, False) == [0, 2, 4]  # ceil(2.5) = 3
    assert head(keep="top", keep_fraction=0.01).choose(succ, rets, False) == [2]  # at least one; tie -> first
    with pytest.raises(ValueError, match="reports no success"):
        head(keep="success").choose(succ, rets, False)
    with pytest.raises(ValueError, match="keep_fraction"):
        FilteredBCConfig(keep_fraction=0.0)
    with pytest.raises(ValueError, match="algo.keep"):
        FilteredBCConfig(keep="best")
    with pytest.raises(ValueError, match="algo.batch_size"):
        FilteredBCConfig(batch_size=0)


def test_keep_advantage_keeps_the_successes_of_scenes_not_every_try_solved() -> None:
    """algo.keep=advantage with scene_tries=3: consecutive episodes share a scene; a scene every try solved
    gives nothing (advantage 0), a scene solved once in three gives its success advantage 2/3, a scene
    never solved gives nothing to keep; the config refuses one try or a round that splits a scene."""
    from types import SimpleNamespace

    from diffpolicy.config import FilteredBCConfig
    from diffpolicy.rl.filtered_bc import FilteredBCLearner

    fake = object.__new__(FilteredBCLearner)
    fake.cfg = SimpleNamespace(algo=FilteredBCConfig(keep="advantage", scene_tries=3, round_episodes=9))
    succ = [True, True, True, False, True, False, False, False, False]  # scenes: solved, once, never
    adv = fake.advantages(succ)
    assert np.allclose(adv, [0, 0, 0, 2 / 3, 2 / 3, 2 / 3, 1, 1, 1])
    assert fake.choose(succ, [0.0] * 9, True) == [4]
    with pytest.raises(ValueError, match="reports no success"):
        fake.choose(succ, [0.0] * 9, False)
    with pytest.raises(ValueError, match="scene_tries >= 2"):
        FilteredBCConfig(keep="advantage")
    with pytest.raises(ValueError, match="multiple of algo.scene_tries"):
        FilteredBCConfig(scene_tries=5)  # 192 episodes


def test_ema_update_moves_toward_source() -> None:
    t, s = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    before = t.weight.detach().clone()
    ema_update(t, s, 0.75)
    assert torch.allclose(t.weight, 0.75 * before + 0.25 * s.weight)


@pytest.mark.parametrize(
    "keep", [[], ["algo.keep=advantage", "algo.scene_tries=2"]], ids=["success", "advantage"]
)
def test_tiny_filtered_bc_run(tmp_path: Path, init_ckpt: Path, keep: list[str]) -> None:
    """Two rounds through the command line: kept windows grow, the summary carries the failure map."""
    from test_train import TINY_POLICY, TINY_RUN

    run = [a for a in TINY_RUN if not a.startswith("algo.")] + [
        "algo=filtered_bc", "algo.iterations=2", "algo.round_episodes=4", "algo.bc_steps=3", "bc.n_demos=2",
        "algo.batch_size=8", f"cache_dir={tmp_path / 'cache'}", *keep,
    ]  # fmt: skip
    run = [a for a in run if a != "algo=ppo"]
    cmd = [sys.executable, "-m", "diffpolicy.train", *run, *TINY_POLICY, f"policy.init={init_ckpt}",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["learner"] == "filtered_bc" and summary["env_steps"] > 0
    assert set(summary["failures"]) == {"bc", "ppo"}
    assert sum(summary["failures"]["ppo"].values()) == round(
        (1 - summary["ppo_success_rate"]) * summary["eval_episodes"]
    )
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["losses/bc"] for r in rows if "losses/bc" in r and "train/kept_windows" in r]
    assert len(losses) == 2 and all(np.isfinite(losses))
    assert {r["train/batch_windows"] for r in rows if "train/batch_windows" in r} == {
        8.0
    }  # not bc.batch_size


def test_fpo_ratio_is_one_on_the_rollout_weights_and_follows_the_loss() -> None:
    """exp(mean(old - new)): 1 when nothing moved; > 1 where the chunk's denoising loss fell."""
    from diffpolicy.rl.fpo import fpo_ratio_loss

    old = torch.tensor([[1.0, 2.0], [1.0, 1.0]])
    loss, stats = fpo_ratio_loss(old.clone(), old, torch.tensor([1.0, -1.0]), 0.2)
    assert float(stats["ratio_max"]) == 1.0 and float(loss) == 0.0
    new = old - torch.tensor([[0.1, 0.1], [0.0, 0.0]])  # the first chunk became likelier
    _, stats = fpo_ratio_loss(new, old, torch.tensor([1.0, -1.0]), 0.2)
    assert abs(float(stats["ratio_max"]) - float(np.exp(0.1))) < 1e-6


def test_denoising_losses_match_the_bc_loss_on_the_same_draws() -> None:
    """The per-draw loss over the whole chunk equals ddpm_loss (BC's loss) for the same t and noise."""
    from diffpolicy.diffusion.schedule import ddpm_loss
    from diffpolicy.rl.fpo import denoising_losses

    class Policy:
        def __init__(self) -> None:
            from diffpolicy.diffusion.schedule import NoiseSchedule

            self.schedule = NoiseSchedule(100)
            self.lin = torch.nn.Linear(2, 2)

        def denoiser(self, x, t, cond):
            return self.lin(x) + cond[:, None, :2] + t.float()[:, None, None] / 100

    p = Policy()
    x0, cond = torch.randn(3, 4, 2), torch.randn(3, 5)
    t, eps = torch.randint(0, 100, (3, 1)), torch.randn(3, 1, 4, 2)
    got = denoising_losses(p, x0, cond, t, eps, n_exec=4)  # (3, 1)
    want = torch.stack(
        [
            ddpm_loss(p.denoiser, x0[i : i + 1], cond[i : i + 1], p.schedule, t=t[i], noise=eps[i])
            for i in range(3)
        ]
    )
    assert torch.allclose(got[:, 0], want, atol=1e-6)


def test_tiny_fpo_run(tmp_path: Path, init_ckpt: Path) -> None:
    """Two FPO iterations through the command line: the denoiser moves, losses are finite."""
    from test_train import TINY_POLICY, TINY_RUN

    run = [a for a in TINY_RUN if not a.startswith("algo")] + [
        "algo=fpo", "algo.iterations=2", "algo.n_steps=3", "algo.minibatch_size=4", "algo.update_epochs=1",
        "algo.mc_draws=2", "algo.lr=1e-3",
    ]  # fmt: skip
    cmd = [sys.executable, "-m", "diffpolicy.train", *run, *TINY_POLICY, f"policy.init={init_ckpt}",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["learner"] == "fpo" and summary["env_steps"] > 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    kl = [r["losses/approx_kl"] for r in rows if "losses/approx_kl" in r]
    assert len(kl) == 2 and all(np.isfinite(kl))
    from diffpolicy import checkpoint

    moved = checkpoint.load(tmp_path / "run" / "checkpoints").state["policy"]
    start = checkpoint.load(init_ckpt).state["policy"]
    assert any(not torch.equal(moved[k], start[k]) for k in start if "denoiser" in k)


def test_chunk_exploration_keeps_the_executed_noisy_actions(init_ckpt: Path, monkeypatch) -> None:
    """explore=chunk: the deterministic chain's actions plus one noise draw held over each decision's steps,
    and a successful episode's windows hold exactly those executed actions."""
    from test_train import TINY_POLICY, TINY_RUN

    from diffpolicy.cli import compose
    from diffpolicy.device import Runtime
    from diffpolicy.distributed import DistInfo
    from diffpolicy.policy_io import load_policy
    from diffpolicy.rl import filtered_bc

    run = [a for a in TINY_RUN if not a.startswith("algo")] + [
        "algo=filtered_bc", "algo.explore=chunk", "algo.explore_std=0.3", "algo.round_episodes=2",
        "bc.n_demos=2",
    ]  # fmt: skip
    cfg = compose("train", [*run, *TINY_POLICY])
    rt = Runtime(device=torch.device("cpu"))
    policy = load_policy(init_ckpt, rt.device)[0]
    head = filtered_bc.FilteredBCLearner(cfg, rt, DistInfo(), policy, logger=None)
    planned: list[np.ndarray] = []
    real_act = filtered_bc.act

    def spy(*args, **kwargs):
        assert kwargs["deterministic"], "explore=chunk samples the deterministic chain"
        actions, out = real_act(*args, **kwargs)
        planned.append(actions.copy())
        return actions, out

    kept: list[np.ndarray] = []
    monkeypatch.setattr(filtered_bc, "act", spy)
    monkeypatch.setattr(
        head.kept,
        "add_episode",
        lambda d, weight=1.0: kept.append(np.concatenate([a for _, a in d])) or len(d),
    )

    class AllSucceed(filtered_bc.EpisodeRecord):  # every episode counts as a success, so every one is kept
        def step(self, *args, **kwargs):
            super().step(*args, **kwargs)
            self.succ[:] = True

    monkeypatch.setattr(filtered_bc, "EpisodeRecord", AllSucceed)
    try:
        head.rollout(seed=3)
    finally:
        head.close()
    first = planned[0][0]  # (Te, Da): env 0's first plan, before noise
    executed = kept[0][: len(first)]
    offset = executed - first
    inside = np.abs(executed) < 1.0  # the clip to [-1, 1] did not touch these entries
    assert np.abs(offset[inside]).max() > 0.01, "no noise was added"
    held = np.where(inside, offset, np.nan)
    assert np.allclose(np.nanmax(held, 0), np.nanmin(held, 0), atol=1e-6), "noise changes within a chunk"


def test_bc_step_benchmark_reports_each_batch_against_the_reference() -> None:
    """python -m diffpolicy.bench bc_step: every batch timed, the reference's ratio 1, bad options refused."""

    from diffpolicy.benchmarks.bc_step import run

    out = run(repeats=1, warmup=0, batches=[8], reference=16)
    assert set(out["batches"]) == {"8", "16"} and out["batches"]["16"]["ratio_to_reference"] == 1.0
    assert all(r["s_per_step"] > 0 and r["ms_per_window"] > 0 for r in out["batches"].values())
    with pytest.raises(ValueError, match="bc_step takes"):
        run(repeats=1, batch=8)
    with pytest.raises(ValueError, match="precision='fp16'"):
        run(repeats=1, precision="fp16")


def test_bc_step_benchmark_builds_the_unet_at_the_given_dims() -> None:
    """bench bc_step dims=[...] (unet_large's levels with its widths): the policy timed has those levels."""
    from diffpolicy.benchmarks import bc_step

    built = []
    real = bc_step._policy
    bc_step._policy = lambda cfg, floor=False: built.append(cfg) or real(cfg, floor)
    try:
        out = bc_step.run(repeats=1, warmup=0, batches=[2], reference=2, dims=[16, 32], cond_dim=24)
    finally:
        bc_step._policy = real
    assert out["down_dims"] == [16, 32] and built[0].down_dims == [16, 32] and built[0].cond_dim == 24


def test_bc_step_benchmark_times_other_chunk_shapes_in_the_same_rounds() -> None:
    """bench bc_step variants=[64/4]: a folded 64-step policy's step beside the main one, as a ratio to it;
    a malformed or invalid shape is refused before anything is timed."""
    from diffpolicy.benchmarks.bc_step import run

    out = run(repeats=1, warmup=0, batches=[8], reference=8, variants=["64/4", "64/4/sample"])
    assert out["fold"] == 1 and out["prediction"] == "epsilon"
    assert set(out["variants"]) == {"64/4", "64/4/sample"}
    row = out["variants"]["64/4"]
    assert row["s_per_step"] > 0 and row["ratio_to_main"] == pytest.approx(
        row["s_per_step"] / out["batches"]["8"]["s_per_step"], rel=0.02
    )
    with pytest.raises(ValueError, match="write <horizon>/<fold>"):
        run(repeats=1, variants=["64x4"])
    with pytest.raises(ValueError, match="policy.fold"):
        run(repeats=1, variants=["64/3"])
    with pytest.raises(ValueError, match="policy.prediction"):
        run(repeats=1, variants=["64/4/v"])


def test_bc_step_benchmark_floor_keeps_only_the_convolutions() -> None:
    """bench bc_step floor=true: the floor network is the real one with every convolution block reduced to its
    convolution (its GroupNorm and Mish no longer touch the output), timed beside the real step, under bf16
    autocast when asked."""
    from diffpolicy.benchmarks.bc_step import _policy, run
    from diffpolicy.config import PolicyConfig
    from diffpolicy.models.unet1d import Conv1dBlock

    cfg = PolicyConfig(horizon=8, down_dims=[16, 32], n_groups=4, step_embed_dim=16, cond_dim=16)
    real, bare = _policy(cfg), _policy(cfg, floor=True)
    blocks = [m for m in bare.modules() if isinstance(m, Conv1dBlock)]
    assert blocks and all(type(m) is not Conv1dBlock for m in blocks)
    x = torch.randn(3, blocks[0].conv.in_channels, 8)
    assert torch.equal(blocks[0](x), blocks[0].conv(x))
    twin = dict(real.named_modules())[next(n for n, m in bare.named_modules() if m is blocks[0])]
    assert type(twin) is Conv1dBlock and not torch.allclose(
        twin(x), twin.conv(x)
    )  # the real block normalises
    out = run(repeats=1, warmup=0, batches=[8], reference=8, floor=True, precision="bf16", horizon=8)
    row = out["batches"]["8"]
    assert out["precision"] == "bf16" and row["floor_s_per_step"] > 0 and row["s_per_step"] > 0


# ------------------------------------------------------------------------------- direction of each update
def _tiny_policy(ft_steps: int = 3, state_dim: int = 5):
    from diffpolicy.config import EncoderConfig, PolicyConfig
    from diffpolicy.policies import make_policy

    enc = EncoderConfig(state_hidden=16, token_dim=16, fusion_heads=2)
    cfg = PolicyConfig(encoder=enc, cond_dim=16, down_dims=[16, 32], n_groups=4, step_embed_dim=16, horizon=8,
                       n_action_steps=4, train_timesteps=50, ddim_steps=5)  # fmt: skip
    torch.manual_seed(0)
    policy = make_policy(cfg, {"state": (state_dim,)}, 2, text_backend="hash")
    policy.set_sampling(ft_steps=ft_steps, eta=1.0, min_std=0.05, freeze=False)
    policy.fit_normalizers(actions=torch.rand(64, 2) * 2 - 1, state=torch.rand(64, state_dim) * 2 - 1)
    return policy


def _runtime():
    from diffpolicy.config import DeviceConfig
    from diffpolicy.device import Runtime

    return Runtime.from_config(DeviceConfig(type="cpu"))


def test_a_filtered_round_moves_the_policy_toward_the_kept_episode_not_the_failed_one() -> None:
    """Direction of filtered_bc: one round in which, from the same observation, a successful episode executed
    +0.6 and a failed one -0.6. ``choose`` keeps the success, ``update`` continues BC, and the deployed
    (noise-free, EMA) action there moves to the success's side. A learner that imitated the failure, or
    every episode alike, would not."""
    import copy
    from types import SimpleNamespace

    from diffpolicy.config import FilteredBCConfig
    from diffpolicy.distributed import DistInfo
    from diffpolicy.rl.filtered_bc import FilteredBCLearner

    policy = _tiny_policy()
    s0 = np.full(5, 0.3, np.float32)
    learner = object.__new__(FilteredBCLearner)
    learner.cfg = SimpleNamespace(algo=FilteredBCConfig(bc_steps=150, lr=3e-3, batch_size=16, keep="success"),
                                  bc=SimpleNamespace(batch_size=16, ema_decay=0.9, translate=0.0))  # fmt: skip
    learner.rt, learner.info, learner.logger = _runtime(), DistInfo(), None
    learner.policy, learner.model = policy.eval(), copy.deepcopy(policy).train()
    learner.params = [p for p in learner.model.parameters() if p.requires_grad]
    learner.optim = torch.optim.AdamW(learner.params, lr=3e-3)
    learner.labelled = False  # a state policy: no predicted positions
    learner.demos = WindowStore(8)  # one demonstration elsewhere: the continuation mixes demos and kept
    learner.demos.add_episode([({"state": -s0}, np.zeros((4, 2), np.float32))] * 2)
    learner.kept = WindowStore(8)
    played = [[({"state": s0}, np.full((4, 2), sign * 0.6, np.float32))] * 2 for sign in (1.0, -1.0)]
    chosen = learner.choose([True, False], [1.0, 0.0], True)
    assert chosen == [0]
    learner._added = sum(learner.kept.add_episode(played[i]) for i in chosen)
    at_s0 = {"state": torch.from_numpy(s0)[None, None]}
    before = policy.sample(at_s0, deterministic=True).actions[0, :4]
    learner.update(seed=0, step=0, iteration=0)
    after = learner.policy.sample(at_s0, deterministic=True).actions[0, :4]
    assert float((after - 0.6).abs().mean()) < 0.5 * float((before - 0.6).abs().mean())
    assert float(after.mean()) > 0.3


def _fpo_fell(adv: torch.Tensor, norm_adv: str = "minibatch") -> torch.Tensor:
    """(T, N) fall of each stored chunk's denoising loss after one ``FPOLearner.update`` with advantages
    ``adv`` (standardised as ``norm_adv`` says) from the same start, on the update's own draws: FPO's
    log-ratio (> 0: likelier)."""
    from types import SimpleNamespace

    from test_chain_faithful import toy_rollout

    from diffpolicy.config import FPOConfig
    from diffpolicy.distributed import DistInfo
    from diffpolicy.models.critic import Critic
    from diffpolicy.rl.fpo import FPOLearner, denoising_losses

    policy = _tiny_policy()
    policy.set_freeze_encoders(True)
    T, N = adv.shape
    buffer = toy_rollout(policy, T, N)
    learner = object.__new__(FPOLearner)
    algo = FPOConfig(update_epochs=1, minibatch_size=T * N, mc_draws=8, lr=1e-4, clip_eps=0.2, target_kl=0.0,
                     norm_adv=norm_adv)  # fmt: skip
    learner.cfg, learner.rt, learner.info = SimpleNamespace(algo=algo), _runtime(), DistInfo()
    learner.policy, learner.buffer, learner._last = policy, buffer, (adv, torch.zeros(T, N))
    learner.critic = Critic(16, (8,))
    learner.actor_params = [p for p in policy.parameters() if p.requires_grad]
    # plain SGD: Adam's per-weight normalisation would let the part all chunks share (one denoiser learns
    # them all) move every chunk alike; SGD's step is the advantage-weighted sum of the chunks' gradients
    learner.actor_optim = torch.optim.SGD(learner.actor_params, lr=1e-3)
    learner.critic_optim = torch.optim.Adam(learner.critic.parameters(), lr=1e-3)
    data = buffer.get()
    x0, cond = data["chains"][:, :, -1].flatten(0, 1), data["cond"].flatten(0, 1)  # (T N, Ta, Da), (T N, C)
    g = torch.Generator().manual_seed(0)  # the draws the update takes with seed 0: FPO's own ratio
    t_draw = torch.randint(0, 50, (T, N, 8), generator=g).flatten(0, 1)
    eps = torch.randn(T, N, 8, 8, 2, generator=g).flatten(0, 1)
    with torch.no_grad():
        old = denoising_losses(policy, x0, cond, t_draw, eps, 4).mean(1)  # (T N,)
    learner.update(seed=0, step=0, iteration=0)
    with torch.no_grad():
        new = denoising_losses(policy, x0, cond, t_draw, eps, 4).mean(1)
    return (old - new).view(T, N)


@pytest.mark.parametrize("norm_adv", ["minibatch", "batch", "none"])
def test_the_fpo_update_makes_positive_advantage_chunks_likelier_than_negative_ones(norm_adv: str) -> None:
    """Direction of FPO (``FPOLearner.update`` itself on a filled buffer): the update under the advantages
    against the one under the flipped advantages, from one start, on FPO's own draws. Their difference in
    each chunk's log-ratio, less its mean over chunks (the part every chunk shares: one denoiser learns them
    all, so a step moves all their losses together), has the sign of the chunk's advantage. A learner with the
    ratio or the advantage's sign wrong, or that ignores the advantages, fails."""
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0], [1.0, -1.0, 1.0, -1.0]])  # (T, N)
    gap = _fpo_fell(adv, norm_adv) - _fpo_fell(-adv, norm_adv)  # (T, N)
    assert (torch.sign(gap - gap.mean()) == adv).all(), gap
    assert (gap * adv).sum() > 0


@pytest.mark.parametrize("translate", [0.0, 0.1])
def test_the_continuation_sees_the_scenes_shifted_as_bc_saw_them(translate: float) -> None:
    """bc.translate: every window the continuation trains on (demonstration and kept alike) is seen from a
    scene shifted in x and y by its own offset within +-translate, z unshifted, the actions unchanged, as BC
    trains (the continuation would otherwise fit the demonstrations' few placements again); with 0, as
    stored."""
    import copy
    from types import SimpleNamespace

    from diffpolicy.config import FilteredBCConfig
    from diffpolicy.distributed import DistInfo
    from diffpolicy.rl.filtered_bc import FilteredBCLearner

    policy = _tiny_policy(state_dim=6)  # two xyz triples, as a proprioception token the shift moves
    s0 = np.array([0.1, 0.2, 0.3, -0.1, -0.2, -0.3], np.float32)
    learner = object.__new__(FilteredBCLearner)
    learner.cfg = SimpleNamespace(algo=FilteredBCConfig(bc_steps=3, lr=1e-3, batch_size=32, keep="success"),
                                  bc=SimpleNamespace(batch_size=32, ema_decay=0.9, translate=translate,
                                                     translate_state=True))  # fmt: skip
    learner.rt, learner.info, learner.logger = _runtime(), DistInfo(), None
    learner.policy, learner.model = policy.eval(), copy.deepcopy(policy).train()
    learner.params = [p for p in learner.model.parameters() if p.requires_grad]
    learner.optim = torch.optim.AdamW(learner.params, lr=1e-3)
    learner.labelled = False
    learner.demos, learner.kept, learner._added = WindowStore(8), WindowStore(8), 0
    learner.demos.add_episode([({"state": s0}, np.zeros((4, 2), np.float32))] * 2)
    learner.kept.add_episode([({"state": s0}, np.ones((4, 2), np.float32))] * 2)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = learner.model.bc_loss

    def recording(obs, actions, **kwargs):
        seen.append((obs["state"].detach().clone(), actions.detach().clone()))
        return real(obs, actions, **kwargs)

    learner.model.bc_loss = recording
    learner.update(seed=0, step=0, iteration=0)
    assert len(seen) == 3
    for state, actions in seen:
        shift = (state[:, 0] - torch.from_numpy(s0)).unflatten(-1, (2, 3))  # (B, 2, 3)
        assert torch.allclose(shift[:, 0], shift[:, 1])  # one offset per window, on every triple
        assert torch.all(shift[..., 2] == 0) and float(shift[..., :2].abs().max()) <= translate + 1e-6
        assert set(actions[:, 0, 0].tolist()) <= {0.0, 1.0}  # the windows' own actions
        if translate:
            assert len({tuple(r) for r in shift[:, 0, :2].tolist()}) == len(
                shift
            )  # each window its own offset
            assert float(shift[..., :2].abs().max()) > 0.01
        else:
            assert torch.all(shift == 0)


def test_advantage_weights_draw_the_rare_success_more_often_and_survive_a_checkpoint() -> None:
    """keep=advantage: the continuation draws a kept window in proportion to its weight (a demonstration's
    as 1), so on a fixed batch the update moves the deployed action at the heavily weighted scene's
    observation further than at the lightly weighted one's; the weights are saved and restored, and a store
    saved without them loads as uniform."""
    import copy
    from types import SimpleNamespace

    from diffpolicy.config import FilteredBCConfig
    from diffpolicy.distributed import DistInfo
    from diffpolicy.rl.filtered_bc import FilteredBCLearner

    policy = _tiny_policy()
    s_heavy, s_light = np.full(5, 0.3, np.float32), np.full(5, -0.3, np.float32)
    learner = object.__new__(FilteredBCLearner)
    learner.cfg = SimpleNamespace(
        algo=FilteredBCConfig(bc_steps=150, lr=3e-3, batch_size=16, keep="advantage", scene_tries=2,
                              round_episodes=4),
        bc=SimpleNamespace(batch_size=16, ema_decay=0.9, translate=0.0),
    )  # fmt: skip
    learner.rt, learner.info, learner.logger = _runtime(), DistInfo(), None
    learner.policy, learner.model = policy.eval(), copy.deepcopy(policy).train()
    learner.params = [p for p in learner.model.parameters() if p.requires_grad]
    learner.optim = torch.optim.AdamW(learner.params, lr=3e-3)
    learner.labelled = False
    learner.demos = WindowStore(8)
    learner.demos.add_episode([({"state": np.zeros(5, np.float32)}, np.zeros((4, 2), np.float32))] * 2)
    learner.kept, learner._added = WindowStore(8), 0
    learner.kept.add_episode([({"state": s_heavy}, np.full((4, 2), 0.6, np.float32))] * 2, weight=1.0)
    learner.kept.add_episode([({"state": s_light}, np.full((4, 2), 0.6, np.float32))] * 2, weight=0.02)
    assert not learner.kept.uniform

    def gap(s: np.ndarray) -> float:
        out = learner.policy.sample({"state": torch.from_numpy(s)[None, None]}, deterministic=True)
        return float((out.actions[0, :4] - 0.6).abs().mean())

    before = gap(s_heavy), gap(s_light)
    learner.update(seed=0, step=0, iteration=0)
    after = gap(s_heavy), gap(s_light)
    assert after[0] < 0.6 * before[0]  # the heavy scene's success was imitated
    assert after[0] / before[0] < after[1] / before[1] - 0.1  # ... more than the rarely drawn one

    restored = WindowStore(8)
    restored.load(learner.kept.state())
    assert torch.equal(restored.weights, learner.kept.weights)
    state = learner.kept.state()
    old = WindowStore(8)
    old.load({"obs": state["obs"], "actions": state["actions"]})
    assert old.uniform and len(old.weights) == len(old)


@pytest.mark.parametrize("finetune", [False, True])
def test_the_continuation_trains_the_encoders_unless_frozen(
    tmp_path: Path, init_ckpt: Path, finetune: bool
) -> None:
    """One round of train's own loop moves the observation encoders' weights as BC would (the default), or
    leaves them as they were with policy.freeze_encoders=true, and moves the denoiser either way."""
    from test_train import TINY_POLICY, TINY_RUN

    from diffpolicy import checkpoint
    from diffpolicy.cli import compose
    from diffpolicy.train import main

    run = [a for a in TINY_RUN if not a.startswith("algo")] + [
        "algo=filtered_bc", "algo.iterations=1", "algo.round_episodes=4", "algo.bc_steps=3", "bc.n_demos=2",
        "algo.batch_size=8", "algo.keep=top", f"policy.freeze_encoders={str(not finetune).lower()}",
        f"cache_dir={tmp_path / 'cache'}", *TINY_POLICY, f"policy.init={init_ckpt}",
    ]  # fmt: skip
    main(compose("train", run), tmp_path / "run")
    before = checkpoint.load(init_ckpt).state["policy"]
    after = checkpoint.load(tmp_path / "run" / "checkpoints").state["policy"]
    moved = {
        k.split(".")[0]
        for k in before
        if before[k].is_floating_point() and not torch.equal(before[k], after[k])
    }
    assert "denoiser" in moved
    changed = [k for k in before if k.startswith("obs_encoder") and not torch.equal(before[k], after[k])]
    assert ("obs_encoder" in moved) == finetune, changed
