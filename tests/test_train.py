"""Tiny end-to-end PPO runs: losses finite, checkpoints written, metrics logged, resume is exact."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffpolicy import checkpoint
from diffpolicy.cli import compose
from diffpolicy.config import PolicyConfig
from diffpolicy.logger import read_metrics

TINY_POLICY = [
    # the 16-step noise-predicting U-Net these mechanics tests were written on (the default, unet_small64,
    # runs end to end in the quick preset's test; under algo=ppo an untrained x0-predicting net's first step
    # exceeds the KL bound and is undone)
    "policy=unet_small",
    "policy.down_dims=[16,32]",
    "policy.cond_dim=32",
    "policy.step_embed_dim=16",
    "policy.horizon=16",
    "policy.n_action_steps=8",
    "policy.ddim_steps=4",
    "policy.encoder.state_hidden=32",
    "policy.encoder.token_dim=32",
]
TINY_RUN = [
    "env=obstacle_reach",
    "algo=ppo",  # GAE with a critic (the train default is grpo, covered below)
    "algo.ft_steps=2",  # K' = 2 of the tiny policy's K = 4
    "env.num_envs=2",
    "algo.iterations=3",
    "algo.n_steps=3",
    "algo.minibatch_size=4",
    "algo.update_epochs=2",
    "eval_episodes=4",
    "checkpoint_every=1",
    "video_episodes=0",
    "log.progress=false",
    "device=cpu",
]


def _train(
    run_dir: Path, init: Path, *extra: str, wait: bool = True
) -> subprocess.CompletedProcess | subprocess.Popen:
    args = [*TINY_RUN, *TINY_POLICY, f"policy.init={init}", f"hydra.run.dir={run_dir}", *extra]
    cmd = [sys.executable, "-m", "diffpolicy.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def _summary(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory: pytest.TempPathFactory, init_ckpt: Path) -> tuple[Path, dict]:
    """One uninterrupted tiny run through the command line: (run directory, summary)."""
    run_dir = tmp_path_factory.mktemp("reference")
    out = _train(run_dir, init_ckpt)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, _summary(out.stdout)


def test_tiny_run_end_to_end(reference_run: tuple[Path, dict]) -> None:
    run_dir, summary = reference_run
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps", "wall_time_s"):
        assert key in summary
    assert summary["env_steps"] > 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["losses/policy"] for r in rows if "losses/policy" in r]
    assert len(losses) == 3 and all(v is not None for v in losses)
    agreement = [r["losses/grad_agreement"] for r in rows if "losses/grad_agreement" in r]
    assert agreement and all(-1.0 <= a <= 1.0 for a in agreement)  # two minibatches per rollout
    assert (run_dir / "summary.json").is_file()
    assert list((run_dir / "tb").glob("events.*"))
    assert checkpoint.load(run_dir / "checkpoints").step == 3
    # algo=ppo judges the stochastic chain; the checkpoints carry that protocol for evaluate, export, serve
    assert summary["protocol"] == "exploration"
    assert checkpoint.load(run_dir / "checkpoints").extra["protocol"] == "exploration"
    assert checkpoint.load(run_dir / "checkpoints" / "stable").extra["protocol"] == "exploration"


def test_resume_after_a_stop_is_exact(
    tmp_path: Path, init_ckpt: Path, reference_run: tuple[Path, dict]
) -> None:
    ref_dir, summary = reference_run
    first = _train(tmp_path, init_ckpt, "algo.iterations=2")  # stops after 2 of the 3 iterations
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _train(tmp_path, init_ckpt, "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = _summary(resumed.stdout)
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps"):
        assert again[key] == summary[key], key
    a = checkpoint.load(ref_dir / "checkpoints").state["policy"]
    b = checkpoint.load(tmp_path / "checkpoints").state["policy"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "losses/policy" in r]
    assert steps == sorted(set(steps)) and len(steps) == 3  # no duplicated iterations after the resume
    bc_rows = [
        r for r in read_metrics(tmp_path / "metrics.jsonl") if r["step"] == 0 and "eval/mean_return" in r
    ]
    assert len(bc_rows) == 1  # the BC evaluation is carried in the checkpoint, not logged again
    # resuming with other chain sampling than the run's would change its chains mid-run: one clear line
    other = _train(tmp_path, init_ckpt, "resume=true", "algo.iterations=4", "algo.ft_steps=1")
    assert other.returncode == 2 and "resume:" in other.stderr.strip().splitlines()[-1], other.stderr[-2000:]


def test_sigkill_mid_run_then_resume_matches(
    tmp_path: Path, init_ckpt: Path, reference_run: tuple[Path, dict]
) -> None:
    proc = _train(tmp_path, init_ckpt, wait=False)
    deadline = time.monotonic() + 240
    while (
        not checkpoint.exists(tmp_path / "checkpoints")
        and time.monotonic() < deadline
        and proc.poll() is None
    ):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    resumed = _train(tmp_path, init_ckpt, "resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = _summary(resumed.stdout), reference_run[1]
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps"):
        assert got[key] == want[key], key


def _chain_head(tmp_path: Path, init: Path, *options: str, shift: bool = True, perturb: bool = False):
    """A chain learner on the tiny run, its policy loaded as ``train`` loads it, after one seeded rollout.

    One update epoch over one minibatch (all T x N = 6 decisions), so the update's reported losses are those
    of the stored batch under the loaded weights, before the step. With ``shift`` the stored log-probs move
    by fixed noise, so the ratios differ from 1 as they do after a first step (most of them then past the
    clip range, where PPO's gradient vanishes); with ``perturb`` the denoiser's
    weights move by fixed noise away from the frozen reference copy the regulariser pulls toward.
    """
    from diffpolicy.device import Runtime
    from diffpolicy.distributed import DistInfo
    from diffpolicy.rl.learner import make_learner
    from diffpolicy.train import initial_policy

    cfg = compose(
        "train",
        [*TINY_RUN, *TINY_POLICY, f"policy.init={init}", "algo.update_epochs=1", "algo.minibatch_size=6",
         *options],
    )  # fmt: skip
    rt, info = Runtime.from_config(cfg.device), DistInfo()
    policy, _ = initial_policy(cfg, rt, info, tmp_path)
    head = make_learner(cfg, rt, info, policy, logger=None)
    head.begin()
    head.rollout(seed=1)
    gen = torch.Generator().manual_seed(0)
    if shift:
        logprobs = head.buffer.storage["logprobs"]  # (T, N, K')
        logprobs.add_(0.1 * torch.randn(logprobs.shape, generator=gen))
    if perturb:
        with torch.no_grad():
            for p in head.policy.denoiser.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
    return head


def _update(head) -> dict[str, float]:
    return head.update(seed=2, step=0, iteration=0)


def test_running_reward_scale_reaches_gae_and_survives_a_checkpoint(
    tmp_path: Path, init_ckpt: Path, monkeypatch
) -> None:
    """algo.reward_scale=running: GAE receives the rollout's rewards divided by the scaler's running std
    (which holds this rollout's discounted sums), and the learner's state carries the scaler."""
    import diffpolicy.rl.chain.learner as chain

    seen = []
    real = chain.gae_advantages

    def recording(rewards, *args):
        seen.append(rewards.clone())
        return real(rewards, *args)

    monkeypatch.setattr(chain, "gae_advantages", recording)
    plain = _chain_head(tmp_path, init_ckpt, shift=False)
    scaled = _chain_head(tmp_path, init_ckpt, "algo.reward_scale=running", shift=False)
    assert plain.reward_scaler is None and scaled.reward_scaler.count > 1.0
    raw = scaled.buffer.get()["rewards"]
    torch.testing.assert_close(seen[0], plain.buffer.get()["rewards"])  # without the option: as the env gave
    std = (scaled.reward_scaler.var + scaled.reward_scaler.eps) ** 0.5
    torch.testing.assert_close(seen[1], (raw / std).clamp(-10, 10))
    assert abs(std - 1.0) > 1e-3  # the scale moved off its prior
    assert scaled.state()["reward_scaler"]["count"] == scaled.reward_scaler.count


def test_grpo_advantages_are_group_normalised(tmp_path: Path, init_ckpt: Path) -> None:
    """algo.advantage=grpo: G = 2 environments share each reset seed, every decision of an environment's
    first episode carries (R - mean_group R) / std_group R of that episode's return, and no critic learns."""
    from diffpolicy.rl.learner import env_seeds

    head = _chain_head(tmp_path, init_ckpt, "algo.advantage=grpo", "algo.group_size=2", "algo.n_steps=6")
    assert env_seeds(head.cfg, 10) == [10, 10]
    data = head.buffer.get()
    valid = data["valid"] > 0.5  # (T, N) decisions of each env's first episode
    ret = (data["rewards"] * data["valid"]).sum(0)  # (N,) first-episode returns, one group of G = 2
    assert ret[0] != ret[1]
    want = (ret - ret.mean()) / ret.std(correction=0)  # (N,): +-1 for a group of two
    adv, _ = head._last  # (T, N)
    for n in range(2):
        assert torch.allclose(adv[valid[:, n], n], want[n].expand(int(valid[:, n].sum())), atol=1e-4)
    assert torch.all(adv[~valid] == 0)
    assert _update(head)["losses/value"] == 0.0


def test_stabledrl_options_change_the_loss(tmp_path: Path, init_ckpt: Path) -> None:
    """algo.clip=unconditional, algo.normalize=self and algo.logprob_min_std each change the policy loss of
    the same stored batch (ratios away from 1); all three together give a finite loss."""
    base = _update(_chain_head(tmp_path, init_ckpt))["losses/policy"]
    for option in ("algo.clip=unconditional", "algo.normalize=self", "algo.logprob_min_std=0.1"):
        loss = _update(_chain_head(tmp_path, init_ckpt, option))["losses/policy"]
        assert abs(loss - base) > 1e-6, option
    head = _chain_head(
        tmp_path, init_ckpt, "algo.clip=unconditional", "algo.normalize=self", "algo.logprob_min_std=0.1"
    )
    assert head.policy.logprob_min_std == 0.1
    assert math.isfinite(_update(head)["losses/policy"])


@pytest.mark.parametrize("reg", ["kl", "bc"])
def test_regulariser_pulls_a_moved_policy(tmp_path: Path, init_ckpt: Path, reg: str) -> None:
    """algo.reg=kl|bc with reg_coef > 0: a frozen reference copy is built, and once the denoiser has moved
    away from it the regulariser is positive and enters the loss; without algo.reg there is neither."""
    plain = _chain_head(tmp_path, init_ckpt, perturb=True)
    assert plain.learner.reference is None and _update(plain)["losses/regularizer"] == 0.0
    head = _chain_head(tmp_path, init_ckpt, f"algo.reg={reg}", "algo.reg_coef=0.1", perturb=True)
    assert head.learner.reference is not None
    assert _update(head)["losses/regularizer"] > 0
    unmoved = _chain_head(tmp_path, init_ckpt, f"algo.reg={reg}", "algo.reg_coef=0.1")
    assert _update(unmoved)["losses/regularizer"] == 0.0  # the same weights as the reference: no pull


def test_sampling_and_clip_options_reach_the_policy(tmp_path: Path, init_ckpt: Path) -> None:
    """algo.min_std applies to the loaded policy whatever its checkpoint recorded (and so to the saved
    checkpoints' sampling), algo.clip_eps_final sets the last step's clip range, algo.denoise_gamma changes the loss."""
    head = _chain_head(tmp_path, init_ckpt, "algo.min_std=0.05", "algo.clip_eps_final=0.05")
    assert checkpoint.load(init_ckpt).config["sampling"]["min_std"] != 0.05
    assert head.policy.sampling["min_std"] == 0.05 and head.policy.schedule.min_std == 0.05
    assert head.clip_eps[0].item() == pytest.approx(0.01) and head.clip_eps[-1].item() == pytest.approx(0.05)
    base = _update(_chain_head(tmp_path, init_ckpt))["losses/policy"]
    discounted = _update(_chain_head(tmp_path, init_ckpt, "algo.denoise_gamma=0.5"))["losses/policy"]
    assert abs(discounted - base) > 1e-6


def test_bf16_runs_the_denoiser_in_bf16_and_trains_the_encoders(tmp_path: Path, init_ckpt: Path) -> None:
    """device.precision=bf16: the update's denoiser body runs under bf16 autocast (fp32 by default; its last
    layer stays fp32 either way);
    algo.finetune_encoders=true: the encoders' weights change in the update (frozen by default)."""
    seen: list[torch.dtype] = []  # output dtypes of the denoiser's first convolution in one update
    for options, dtype, moved in (
        ((), torch.float32, False),
        (("device.precision=bf16", "algo.finetune_encoders=true"), torch.bfloat16, True),
    ):
        # a full step (ratios 1, no KL undo); perturbed, since the untrained U-Net's FiLM layers start at
        # zero, so that the condition (and through it the encoders) gets a gradient
        head = _chain_head(tmp_path, init_ckpt, "algo.target_kl=0", *options, shift=False, perturb=True)
        seen.clear()
        conv = next(m for m in head.policy.denoiser.modules() if isinstance(m, torch.nn.Conv1d))
        hook = conv.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        before = [p.detach().clone() for p in head.policy.obs_encoder.parameters()]
        losses = _update(head)
        hook.remove()
        assert seen and set(seen) == {dtype} and math.isfinite(losses["losses/policy"])
        after = list(head.policy.obs_encoder.parameters())
        assert any(not torch.equal(a, b) for a, b in zip(after, before)) == moved, options


def test_critic_warmup_trains_only_the_critic(tmp_path: Path, init_ckpt: Path) -> None:
    from diffpolicy.train import main

    cfg = compose(
        "train",
        [*TINY_RUN, *TINY_POLICY, f"policy.init={init_ckpt}", "algo.iterations=2", "algo.critic_warmup=2"],
    )
    main(cfg, tmp_path)
    before = checkpoint.load(init_ckpt).state["policy"]
    after = checkpoint.load(tmp_path / "checkpoints").state["policy"]
    assert all(torch.equal(before[k], after[k]) for k in before)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "losses/value" in r]
    assert rows and all(r["losses/value"] > 0 for r in rows)
    with pytest.raises(ValueError, match="critic_warmup"):
        compose("train", ["algo=ppo", "algo.critic_warmup=-1"])


def test_grpo_needs_whole_groups(init_ckpt: Path) -> None:
    with pytest.raises(ValueError, match="group_size"):  # rejected when the config is built, before any work
        compose("train", [*TINY_RUN, "algo.advantage=grpo", "algo.group_size=3", f"policy.init={init_ckpt}"])


def test_tiny_policy_config_is_valid() -> None:
    cfg = compose("train", [*TINY_RUN, *TINY_POLICY])
    assert isinstance(cfg.policy, PolicyConfig) and cfg.algo.ft_steps == 2


def test_default_run_is_the_cpu_mission() -> None:
    """What ``python -m diffpolicy.train env=mujoco_pick`` composes to (the README's mission settings)."""
    cfg = compose("train", ["env=mujoco_pick"])
    assert cfg.env.obs_mode == "state" and cfg.env.expert == {"max_speed": None} and cfg.bc.n_demos == 40
    assert cfg.algo.name == "ppo_anchor" and cfg.algo.learner == "chain" and cfg.eval_protocol == "noise_free"
    steps = cfg.algo.iterations * cfg.algo.n_steps * cfg.env.num_envs * cfg.policy.n_action_steps
    assert steps <= 200_000  # env steps: filtered_bc's budget (~182 k), at most
    # the card's 64 x 7 chunks, 4 steps to a U-Net position, the trunk predicting the clean chunk
    assert (cfg.policy.name, cfg.policy.horizon, cfg.policy.fold, cfg.policy.prediction) == (
        "unet_small64",
        64,
        4,
        "sample",
    )
    assert cfg.eval_episodes >= 200
    pre = compose("pretrain", ["env=mujoco_pick"])  # pretrain clones, and judges, the same BC
    assert pre.bc == cfg.bc and pre.env == cfg.env and pre.algo.learner == cfg.algo.learner


MULTIMODAL_LEARNER = {
    "residual": ["algo.n_steps=8", "algo.minibatch_size=8", "algo.update_epochs=1"],
    "ppo": ["algo.n_steps=8", "algo.minibatch_size=8", "algo.update_epochs=1"],
    "filtered_bc": [
        "algo.round_episodes=4",
        "algo.bc_steps=2",
    ],  # the baseline (train.yaml's where no env names one)
}


@pytest.mark.parametrize("algo", sorted(MULTIMODAL_LEARNER))
def test_multimodal_fine_tuning_runs_from_an_empty_cache(tmp_path: Path, algo: str) -> None:
    """The whole train pipeline on pixels, points, text and proprioception: collect two demonstrations,
    clone them, fine-tune (the default filtered_bc, the residual head or the chain) for two iterations and
    evaluate, in process."""
    from diffpolicy.train import main

    cfg = compose(
        "train",
        [
            "env=mujoco_pick",
            "env.obs_mode=multimodal",
            "env.image_size=32",
            "env.n_points=64",
            "env.num_envs=2",
            "env.vectorization=sync",
            f"algo={algo}",
            "bc.n_demos=2",
            "bc.epochs=1",
            "bc.batch_size=16",
            "algo.iterations=2",
            *MULTIMODAL_LEARNER[algo],
            *TINY_POLICY,
            "policy.encoder.rgb_channels=[8]",
            "policy.encoder.rgb_keypoints=4",
            "policy.encoder.point_channels=[16]",
            "policy.encoder.point_keypoints=4",
            "eval_episodes=2",
            "video_episodes=0",
            "log.progress=false",
            "device=cpu",
            f"cache_dir={tmp_path / 'cache'}",
        ],
    )
    summary = main(cfg, tmp_path / "run")
    assert summary["env_steps"] > 0 and summary["eval_episodes"] == 2
    assert 0.0 <= summary["bc_success_rate"] <= 1.0 and 0.0 <= summary["ppo_success_rate"] <= 1.0
    ckpt = checkpoint.load(tmp_path / "run" / "checkpoints")
    assert ckpt.extra["obs_spec"]["points"] == [64, 6] and ckpt.extra["obs_spec"]["state"] == [10]
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    if algo == "filtered_bc":  # every round continues BC on the demonstrations (+ its kept episodes)
        losses = [r["losses/bc"] for r in rows if "train/kept_windows" in r]
        assert len(losses) == 2 and all(v == v for v in losses)
        return
    values = [r["losses/value"] for r in rows if r.get("losses/value") is not None]
    assert len(values) == 2 and all(v == v for v in values), "every iteration updates (its critic at least)"


def test_rollback_guard_can_judge_validation_episodes(tmp_path: Path, init_ckpt: Path) -> None:
    """algo.rollback_episodes=n: at every checkpoint the guard evaluates the first n validation seeds (logged
    as val/guard_success_rate), and their env steps are counted apart from the training rollouts'."""
    out = _train(tmp_path, init_ckpt, "algo.rollback_episodes=2", "val_episodes=2")
    assert out.returncode == 0, out.stderr[-3000:]
    summary = _summary(out.stdout)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "val/guard_success_rate" in r]
    assert len(rows) == 3 and all(0.0 <= r["val/guard_success_rate"] <= 1.0 for r in rows)
    assert summary["guard_env_steps"] >= 3 * 2  # three checks of two episodes, at least a step each
    assert summary["time_split_s"]["guard"] > 0  # their seconds, apart from the iterations'
    with pytest.raises(ValueError, match="overlap the test seeds"):
        compose("train", [*TINY_RUN, "algo.rollback_episodes=2000000", "val_episodes=2"])


def test_a_run_is_the_same_from_an_empty_and_from_a_warm_cache(tmp_path: Path) -> None:
    """A run is a function of its config and seed: whatever state BC leaves in this process (RNG streams)
    must not reach fine-tuning, so the same command gives the same summary whether it trained BC first or
    read it from the cache."""
    from diffpolicy.train import main

    overrides = [
        "env=mujoco_pick", "env.num_envs=2", "env.vectorization=sync", "algo=filtered_bc",
        "algo.iterations=2", "algo.round_episodes=2", "algo.bc_steps=3", "seed=7", "bc.epochs=2",
        "bc.n_demos=3", *TINY_POLICY, "eval_episodes=2", "video_episodes=0", "log.progress=false",
        "device=cpu", "device.threads=1", f"cache_dir={tmp_path / 'cache'}",
    ]  # fmt: skip
    cold = main(compose("train", overrides), tmp_path / "cold")
    warm = main(compose("train", overrides), tmp_path / "warm")
    volatile = {"wall_time_s", "checkpoint", "env_sps", "time_split_s"}
    assert {k: v for k, v in cold.items() if k not in volatile} == {
        k: v for k, v in warm.items() if k not in volatile
    }
    # the time split names every stage; collection and BC ran in the cold run only
    stages = ("collect", "bc", "bc_eval", "env", "policy", "update", "guard", "eval")
    cold_s, warm_s = cold["time_split_s"], warm["time_split_s"]
    assert tuple(cold_s) == stages and tuple(warm_s) == stages
    assert cold_s["collect"] > 0 and cold_s["bc"] > 0 and warm_s["collect"] == warm_s["bc"] == 0.0
    assert all(warm_s[k] > 0 for k in ("bc_eval", "env", "policy", "update", "eval"))
    assert sum(cold_s.values()) <= cold["wall_time_s"] + 0.5
    a = checkpoint.load(tmp_path / "cold" / "checkpoints").state["policy"]
    b = checkpoint.load(tmp_path / "warm" / "checkpoints").state["policy"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_harm_to_the_deployed_policy_rolls_back_to_bc(tmp_path: Path, init_ckpt: Path, monkeypatch) -> None:
    """The guard judging validation episodes sees the pre-trained policy first: BC's own validation figure is
    its best and BC is the stable checkpoint of step 0, so an update whose deployed policy scores far worse is
    rolled back to BC itself. Here the environment reports no success (returns are judged, relative to the
    best) and the update is made harmful: the validation return falls from 100 to 10."""
    from diffpolicy import train
    from diffpolicy.evaluation import EvalResult

    calls = {"n": 0}

    def fake_held_out(policy, cfg, runtime, split="test", episodes=0):
        calls["n"] += 1
        n = episodes or (cfg.val_episodes if split == "val" else cfg.eval_episodes)
        ret = 100.0 if calls["n"] <= 2 else 10.0  # BC's test and validation evaluations, then harm
        return EvalResult(
            0.0, ret, n, n, [False] * n, ["failed"] * n, returns=[ret] * n, reports_success=False
        )

    monkeypatch.setattr(train, "held_out", fake_held_out)
    cfg = compose("train", [*TINY_RUN, *TINY_POLICY, f"policy.init={init_ckpt}", "algo.iterations=1",
                            "algo.rollback_episodes=2", "val_episodes=2", "algo.lr=1e-2", "algo.target_kl=0",
                            "video_episodes=0",
                            "log.progress=false"])  # fmt: skip
    summary = train.main(cfg, tmp_path)
    assert summary["bc_return"] == 100.0 and summary["ppo_return"] == 10.0
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    events = [e for e in map(json.loads, lines) if e.get("event") == "rollback"]
    assert len(events) == 2  # the guard's verdict, then the restore from the stable checkpoint of step 0
    assert events[0]["best"] == 100.0 and events[0]["success"] == 10.0 and events[0]["to_step"] == 0
    start = checkpoint.load(init_ckpt).state["policy"]
    end = checkpoint.load(tmp_path / "checkpoints").state["policy"]
    assert all(torch.equal(start[k], end[k]) for k in start), "the harmful update was not undone"
    assert not any(e.get("event") == "kl_stop" for e in map(json.loads, lines))  # the update was applied


@pytest.mark.parametrize(("guard_returns", "deployed"), [((150.0, 120.0), 1), ((90.0, 95.0), 0)])
def test_keep_best_deploys_the_best_checkpoint_on_validation(
    tmp_path: Path, init_ckpt: Path, monkeypatch, guard_returns: tuple[float, float], deployed: int
) -> None:
    """algo.keep_best=true: after the last iteration the policy is the one the guard judged best on its
    validation episodes (BC's own figure, 100, included), not the last one; the summary, the final checkpoint
    and the evaluated weights agree. No verdict here rolls back (every value stays within 30 % of the best),
    so only keep_best can move the weights: to iteration 1's, or back to BC when no update beat it."""
    from diffpolicy import train
    from diffpolicy.evaluation import EvalResult

    verdicts = iter(guard_returns)

    def fake_held_out(policy, cfg, runtime, split="test", episodes=0, **_):
        n = episodes or (cfg.val_episodes if split == "val" else cfg.eval_episodes)
        ret = next(verdicts) if episodes else 100.0  # the guard asks for its n; BC and the end ask for all
        return EvalResult(
            0.0, ret, n, n, [False] * n, ["failed"] * n, returns=[ret] * n, reports_success=False
        )

    monkeypatch.setattr(train, "held_out", fake_held_out)
    cfg = compose("train", [*TINY_RUN, *TINY_POLICY, f"policy.init={init_ckpt}", "algo.iterations=2",
                            "algo.rollback_episodes=2", "algo.keep_best=true", "val_episodes=2",
                            "algo.lr=1e-2", "algo.target_kl=0", "video_episodes=0"])  # fmt: skip
    summary = train.main(cfg, tmp_path)
    assert summary["deployed_iteration"] == deployed
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    events = [e for e in map(json.loads, lines) if e.get("event") in ("rollback", "keep_best")]
    assert [(e["event"], e["to_step"]) for e in events] == [("keep_best", deployed)]
    root = tmp_path / "checkpoints"
    weights = {
        0: checkpoint.load(init_ckpt).state["policy"],
        1: checkpoint.load(root / "step_00000001").state["policy"],
    }
    final = checkpoint.load(root)
    assert final.step == 2 and final.extra["deployed"] == deployed
    assert all(torch.equal(final.state["policy"][k], weights[deployed][k]) for k in weights[deployed])
    other = weights[1 - deployed]
    assert not all(torch.equal(final.state["policy"][k], other[k]) for k in other), "the update moved nothing"


def test_keep_best_needs_validation_episodes() -> None:
    """Early stopping chooses on validation episodes only: without them the config is refused, in one line."""
    with pytest.raises(ValueError, match="set algo.rollback_episodes > 0"):
        compose("train", [*TINY_RUN, "algo.keep_best=true"])
