"""pretrain: a tiny BC run end to end (function and CLI), EMA, schedule, cache."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from diffpolicy import checkpoint
from diffpolicy.bc import (
    EMA,
    TargetHead,
    behaviour_cloning,
    cosine_with_warmup,
    pretrained_checkpoint,
    translate_scene,
)
from diffpolicy.config import BCConfig, DeviceConfig, EncoderConfig, EnvConfig, PolicyConfig
from diffpolicy.data.windows import DemoWindows
from diffpolicy.demos import collect_demos
from diffpolicy.device import Runtime
from diffpolicy.logger import Logger, read_metrics
from diffpolicy.policies import normal_log_prob
from diffpolicy.policy_io import build_policy, load_policy

ROOT = Path(__file__).resolve().parents[1]
REACH = EnvConfig(name="obstacle_reach", id="diffpolicy_envs:ObstacleReach-v0", obs_mode="state", num_envs=2)
PICK = EnvConfig(image_size=32, n_points=64, num_envs=2)
ENC = EncoderConfig(rgb_channels=[8], rgb_keypoints=4, point_channels=[8], point_keypoints=4, token_dim=16,
                    fusion_heads=2, state_hidden=16)  # fmt: skip
SMALL = PolicyConfig(encoder=ENC, cond_dim=16, down_dims=[16, 32], n_groups=4, step_embed_dim=16, horizon=16,
                     n_action_steps=8, train_timesteps=20, ddim_steps=4)  # fmt: skip
CPU = Runtime.from_config(DeviceConfig(type="cpu"))


@pytest.fixture(scope="module")
def reach_demos(tmp_path_factory):
    return Path(collect_demos(REACH, 4, 0, tmp_path_factory.mktemp("d") / "reach")["path"])


def test_condition_gap_tells_a_conditional_denoiser_from_one_that_ignores_the_observation(reach_demos):
    from diffpolicy.bc import condition_gap

    data = DemoWindows(reach_demos, 1, SMALL.horizon)
    policy = build_policy(SMALL, data.obs_spec, data.action_dim).eval()
    policy.fit_normalizers(actions=data.data["action"], state=data.data["state"])
    obs, actions = data.batch(torch.arange(16))
    # Freshly built, the observation columns of the FiLM projections are zero: the observation is ignored.
    assert condition_gap(policy, obs, actions) == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():  # random observation columns: the output now depends on the condition
        for b in policy.denoiser.res_blocks():
            b.cond_proj.weight.normal_(0.0, 0.5)
    assert condition_gap(policy, obs, actions) != pytest.approx(1.0, abs=1e-3)


def test_schedule_and_ema():
    lrs = [cosine_with_warmup(s, 100, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0) and lrs[-1] < 0.01
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))
    net = torch.nn.Linear(2, 2)
    ema = EMA(net, max_decay=0.5)
    with torch.no_grad():
        net.weight.add_(1.0)
    before = ema.module.weight.clone()
    ema.update(net)  # decay 1/10 at the first update
    torch.testing.assert_close(ema.module.weight, 0.1 * before + 0.9 * net.weight)
    assert not ema.module.weight.requires_grad


def test_behaviour_cloning_reach(tmp_path, reach_demos):
    algo = BCConfig(epochs=3, batch_size=32, lr=1e-3)
    with Logger(tmp_path, tensorboard=False, progress=False) as log:
        policy, metrics = behaviour_cloning(REACH, SMALL, algo, reach_demos, CPU, log, tmp_path, seed=0)
    assert metrics["epochs"] == 3 and metrics["steps"] == 3 * (metrics["n_windows"] // 32)
    assert metrics["n_episodes"] == 4 and torch.isfinite(torch.tensor(metrics["final_loss"]))
    records = read_metrics(tmp_path / "metrics.jsonl")
    losses = [r["losses/bc"] for r in records if "losses/bc" in r]
    gaps = [r["train/condition_gap"] for r in records if "train/condition_gap" in r]
    assert len(gaps) == 3 and all(g > 0 for g in gaps) and metrics["condition_gap"] == round(gaps[-1], 3)
    assert losses and all("train/lr" in r for r in records if "losses/bc" in r)
    assert not policy.training and policy.action_normalizer.high.max() <= 1.0
    # The final checkpoint holds the EMA weights as the policy and reloads to the same actions.
    loaded, env_cfg, ckpt = load_policy(tmp_path / "checkpoints")
    assert str(ckpt.path) == metrics["checkpoint"] and env_cfg == REACH and ckpt.extra["stage"] == "bc"
    assert {"model", "optim", "rng"} <= set(ckpt.state)
    obs = {"state": torch.randn(3, 1, 6)}
    noise = torch.randn(3, 16, 2)
    torch.testing.assert_close(
        policy.sample(obs, noise=noise, deterministic=True).actions,
        loaded.sample(obs, noise=noise, deterministic=True).actions,
    )
    raw = ckpt.state["model"]
    assert any(not torch.equal(raw[k], v) for k, v in ckpt.state["policy"].items())  # EMA != raw weights


def test_a_step_budget_replaces_epochs_and_stops_mid_pass(tmp_path, reach_demos):
    """bc.steps > 0 is the budget whatever the epochs say: the last pass stops where the budget ends."""
    algo = BCConfig(epochs=50, steps=7, batch_size=32)
    with Logger(tmp_path, tensorboard=False, progress=False) as log:
        _, metrics = behaviour_cloning(REACH, SMALL, algo, reach_demos, CPU, log, tmp_path, seed=0)
    per_pass = metrics["n_windows"] // 32
    assert per_pass < 7  # the budget spans more than one pass, and ends inside one
    assert metrics["steps"] == 7 and metrics["epochs"] == -(-7 // per_pass)
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl") if "train/epoch" in r]
    assert steps[-1] == 7 and len(steps) == metrics["epochs"]
    with pytest.raises(ValueError, match="bc.steps"):
        BCConfig(steps=-1)


def test_target_head_scores_each_labelled_point():
    """Two labelled points (object and goal): the loss is the box-scaled squared error over both, the
    reported error the mean distance per point, checked against a hand computation."""
    head = TargetHead(4, [0.0, 0.0, 0.0], [2.0, 2.0, 2.0], hidden=8, points=2)
    cond = torch.randn(5, 4)
    target = torch.rand(5, 6) * 2
    loss, error = head(cond, target)
    pred = head.net(cond).reshape(5, 2, 3)  # box units in [-1, 1] over a 2 m box: metres = pred + 1
    goal = target.reshape(5, 2, 3) - 1
    torch.testing.assert_close(loss, ((pred - goal) ** 2).mean())
    torch.testing.assert_close(error, (pred - goal).detach().norm(dim=-1).mean())
    loss.backward()  # and the head learns from it
    assert head.net[0].weight.grad.abs().sum() > 0


def test_translate_scene_shifts_every_observed_position_and_nothing_else():
    """bc.translate: points' xyz, the state's xyz triples and the label move by the window's offset; the
    points' colours, the image and the batch's own tensors stay as they were."""
    B, To, N = 2, 2, 5
    obs = {
        "points": torch.rand(B, To, N, 6),
        "state": torch.rand(B, To, 9),
        "rgb": torch.zeros(B, To, 4, 4, 3),
    }
    target = torch.rand(B, 6)
    offset = torch.tensor([[0.1, -0.2, 0.0], [0.0, 0.3, 0.0]])
    before = {k: v.clone() for k, v in obs.items()}
    out, moved = translate_scene(obs, target, offset, state=True)
    for b in range(B):
        torch.testing.assert_close(out["points"][b, ..., :3], before["points"][b, ..., :3] + offset[b])
        for j in range(3):  # hand, right pad, left pad
            torch.testing.assert_close(
                out["state"][b, :, 3 * j : 3 * j + 3], before["state"][b, :, 3 * j : 3 * j + 3] + offset[b]
            )
            if j < 2:
                torch.testing.assert_close(
                    moved[b, 3 * j : 3 * j + 3], target[b, 3 * j : 3 * j + 3] + offset[b]
                )
    torch.testing.assert_close(out["points"][..., 3:], before["points"][..., 3:])
    assert out["rgb"] is obs["rgb"]
    for k, v in obs.items():
        torch.testing.assert_close(v, before[k])  # the batch itself is untouched
    kept, _ = translate_scene(obs, None, offset, state=False)
    torch.testing.assert_close(kept["state"], before["state"])
    with pytest.raises(ValueError, match="xyz triples"):
        translate_scene({"state": torch.rand(B, To, 4)}, None, offset, state=True)
    with pytest.raises(ValueError, match="bc.translate"):
        BCConfig(translate=-0.1)


def test_behaviour_cloning_multimodal(tmp_path):
    """Multimodal BC with the auxiliary target loss and two noise draws per observation; the privileged
    label is recorded per step, served by the windows, logged as an error in cm, and not saved as policy."""
    demos = collect_demos(PICK, 1, 0, tmp_path / "pick")["path"]
    data = DemoWindows(demos, 1, 16)
    assert data.has_target and "target_pos" not in data.obs_keys  # a label, never an observation
    first = data.target(torch.tensor([0]))
    assert first.shape == (1, 3) and 0.0 < float(first[0, 2]) < 0.2  # a cube resting on the table
    algo = BCConfig(epochs=2, batch_size=16, target_aux_weight=1.0, noise_draws=2, translate=0.02)
    with Logger(tmp_path, tensorboard=False, progress=False) as log:
        policy, metrics = behaviour_cloning(
            PICK, SMALL, algo, demos, CPU, log, tmp_path, 0, text_backend="hash"
        )
    assert metrics["steps"] >= 1
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "losses/target_aux" in r]
    assert rows and all(0 < r["train/target_error_cm"] < 200 for r in rows)
    loaded, _, ckpt = load_policy(metrics["checkpoint"])
    assert ckpt.extra["obs_spec"] == {"rgb": [32, 32, 3], "points": [64, 6], "state": [10], "instruction": []}
    assert ckpt.extra["text_backend"] == "hash"
    assert not any(k.startswith("net.") for k in ckpt.state["policy"])  # the head stays out of the policy


def test_target_aux_needs_the_label(tmp_path, reach_demos):
    """A dataset that records no target_pos fails before training, with what to do."""
    with Logger(tmp_path, tensorboard=False, progress=False) as log:
        with pytest.raises(ValueError, match="record no 'target_pos'"):
            behaviour_cloning(REACH, SMALL, BCConfig(epochs=1, target_aux_weight=0.5), reach_demos, CPU,
                              log, tmp_path, 0)  # fmt: skip
        with pytest.raises(ValueError, match="observe none"):  # a state-only dataset has no cloud to shift
            behaviour_cloning(
                REACH, SMALL, BCConfig(epochs=1, translate=0.05), reach_demos, CPU, log, tmp_path, 0
            )
    with pytest.raises(ValueError, match="bc.noise_draws"):
        BCConfig(noise_draws=0)
    with pytest.raises(ValueError, match="bc.target_aux_weight"):
        BCConfig(target_aux_weight=-1.0)


def test_noise_draws_average_the_denoising_loss_over_repeated_draws(reach_demos):
    """bc_loss(draws=k) against a looped reference: the mean over k (t, eps) draws of each window."""
    data = DemoWindows(reach_demos, 1, 16)
    policy = build_policy(SMALL, data.obs_spec, data.action_dim)
    policy.fit_normalizers(actions=data.data["action"], state=data.data["state"])
    obs, actions = data.batch(torch.arange(5))
    got = policy.bc_loss(obs, actions, generator=torch.Generator().manual_seed(3), draws=3)
    gen = torch.Generator().manual_seed(3)
    T = policy.schedule.train_timesteps
    t = torch.randint(0, T, (15,), generator=gen)
    x0 = policy.action_normalizer.normalize(actions).repeat_interleave(3, 0)
    noise = torch.randn(x0.shape, generator=gen)
    cond = policy.encode(obs)
    terms = []
    for i in range(15):  # window i // 3, its (i % 3)-th draw
        a = policy.schedule.alphas_cumprod[t[i]]
        x_t = a.sqrt() * x0[i] + (1 - a).sqrt() * noise[i]
        eps = policy.denoiser(x_t[None], t[i : i + 1], cond[i // 3 : i // 3 + 1])[0]
        terms.append(((eps - noise[i]) ** 2).mean())
    torch.testing.assert_close(got, torch.stack(terms).mean(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="draws"):
        policy.bc_loss(obs, actions, draws=0)


@pytest.mark.parametrize("kind", ["diffusion", "gaussian"])
def test_unexecuted_weight_weighs_the_chunk_steps_outside_the_executed_window(reach_demos, kind):
    """policy.unexecuted_weight=w: the BC loss is the per-step mean weighted 1 on [To-1, To-1+Te) and w
    elsewhere, against a reference from the unweighted per-element losses of the same draw; w=0 learns only
    the executed steps."""
    data = DemoWindows(reach_demos, 1, 16)
    obs, actions = data.batch(torch.arange(6))

    def loss(weight, acts, draw=4):
        cfg = dataclasses.replace(SMALL, kind=kind, unexecuted_weight=weight)
        torch.manual_seed(0)
        policy = build_policy(cfg, data.obs_spec, data.action_dim)
        policy.fit_normalizers(actions=data.data["action"], state=data.data["state"])
        return policy, policy.bc_loss(obs, acts, generator=torch.Generator().manual_seed(draw))

    plain_policy, plain = loss(1.0, actions)
    assert plain_policy.chunk_loss_weights() is None
    policy, got = loss(0.25, actions)
    w = policy.chunk_loss_weights()
    assert w.tolist() == [1.0] * 8 + [0.25] * 8  # To = 1, Te = 8 of Ta = 16
    # reference: the unweighted per-element losses of the same draw, then the weighted per-step mean
    if kind == "gaussian":
        mean, std = policy.mean_std(policy.encode(obs))
        x = policy.action_normalizer.normalize(actions)
        element = -normal_log_prob(x, mean, std)
    else:
        gen = torch.Generator().manual_seed(4)
        t = torch.randint(0, policy.schedule.train_timesteps, (6,), generator=gen)
        x0 = policy.action_normalizer.normalize(actions)
        noise = torch.randn(x0.shape, generator=gen)
        a = policy.schedule.alphas_cumprod[t].view(6, 1, 1)
        element = (
            policy.denoiser(a.sqrt() * x0 + (1 - a).sqrt() * noise, t, policy.encode(obs)) - noise
        ) ** 2
    steps = element.mean(dim=(0, 2))
    torch.testing.assert_close(got, (steps * w).sum() / w.sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, element.mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss(0.0, actions)[1], steps[:8].mean(), rtol=1e-5, atol=1e-6)  # executed only
    assert got.item() != pytest.approx(plain.item(), rel=1e-4)
    with pytest.raises(ValueError, match="policy.unexecuted_weight"):
        dataclasses.replace(SMALL, unexecuted_weight=1.5)


def test_added_bc_fields_enter_the_cache_key_only_when_set():
    from diffpolicy.bc import bc_key

    base = BCConfig(epochs=1, batch_size=32, n_demos=2)
    key = bc_key(REACH, SMALL, base, 0)
    assert bc_key(REACH, SMALL, dataclasses.replace(base, noise_draws=1, target_aux_weight=0.0), 0) == key
    assert bc_key(REACH, SMALL, dataclasses.replace(base, noise_draws=2), 0) != key
    assert bc_key(REACH, SMALL, dataclasses.replace(base, target_aux_weight=0.1), 0) != key
    assert bc_key(REACH, SMALL, dataclasses.replace(base, steps=0), 0) == key
    assert bc_key(REACH, SMALL, dataclasses.replace(base, steps=100), 0) != key
    assert bc_key(REACH, dataclasses.replace(SMALL, unexecuted_weight=1.0), base, 0) == key
    assert bc_key(REACH, dataclasses.replace(SMALL, unexecuted_weight=0.5), base, 0) != key


def test_pretrained_checkpoint_is_cached(tmp_path, monkeypatch):
    algo = BCConfig(epochs=1, batch_size=32, n_demos=2)
    path = pretrained_checkpoint(REACH, SMALL, algo, CPU, tmp_path / "cache", run_dir=tmp_path / "run")
    assert checkpoint.exists(path) and path.parent.parent == tmp_path / "cache" / "bc"
    import diffpolicy.bc as bc

    def no_training(*args, **kwargs):
        raise AssertionError("trained again despite the cache")

    monkeypatch.setattr(bc, "behaviour_cloning", no_training)
    assert pretrained_checkpoint(REACH, SMALL, algo, CPU, tmp_path / "cache") == path
    other = BCConfig(epochs=2, batch_size=32, n_demos=2)
    with pytest.raises(AssertionError, match="trained again"):
        pretrained_checkpoint(REACH, SMALL, other, CPU, tmp_path / "cache")


def test_pretrain_cli(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'envs'}"}
    args = ["env=obstacle_reach", "device=cpu", "bc.n_demos=3", "bc.epochs=2", "bc.batch_size=32",
            "policy.horizon=16", "policy.down_dims=[16,32]", "policy.cond_dim=16", "policy.n_groups=4",
            "policy.ddim_steps=4", "algo.ft_steps=2", "log.tensorboard=false",
            f"cache_dir={tmp_path / 'cache'}", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "diffpolicy.pretrain", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"final_loss", "checkpoint", "epochs", "wall_time_s"} <= set(summary)
    assert summary["epochs"] == 2 and summary["demos_collected"] is True
    assert (tmp_path / "run" / "bc_loss.png").stat().st_size > 1000
    assert checkpoint.exists(summary["checkpoint"]) and checkpoint.exists(summary["cached"])
    # pretrain's default learner (filtered_bc) judges noise-free; its checkpoints say so, for evaluate
    assert summary["protocol"] == "noise_free"
    assert checkpoint.load(summary["checkpoint"]).extra["protocol"] == "noise_free"
    # reuse_cache: the same settings again evaluate the cached policy, reporting its run's training figures;
    # without it pretrain trains again
    again = [*args[:-1], f"hydra.run.dir={tmp_path / 'again'}", "reuse_cache=true", "eval_episodes=4"]
    proc = subprocess.run([sys.executable, "-m", "diffpolicy.pretrain", *again], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    reused = json.loads(proc.stdout.strip().splitlines()[-1])
    assert reused["reused"] == str(checkpoint.resolve(summary["cached"]))
    assert (reused["checkpoint"], reused["steps"], reused["final_loss"]) == (
        summary["checkpoint"], summary["steps"], summary["final_loss"],
    )  # fmt: skip
    assert reused["eval_episodes"] == 4 and "demos_collected" not in reused and reused["curve"] is None
    assert not (tmp_path / "again" / "checkpoints").exists()


def test_bimodal_benchmark_wiring(tmp_path):
    from diffpolicy.benchmarks.bimodal import run

    out = run(
        threads=1, n_demos=6, epochs=1, batch_size=64, eval_episodes=4, down_dims=[16, 32], work_dir=tmp_path
    )
    assert 0.0 <= out["diffusion_success"] <= 1.0 and 0.0 <= out["gaussian_success"] <= 1.0
    assert out["diffusion_runs"][0]["steps"] >= 1 and out["settings"]["n_demos"] == 6
    with pytest.raises(ValueError, match="unknown"):
        run(epoch=3)


@pytest.mark.slow
def test_bimodal_benchmark_separates_modes():
    """The full benchmark (a few minutes on 2 cores): diffusion keeps both modes, the Gaussian does not."""
    from diffpolicy.benchmarks.bimodal import run

    out = run(threads=2)
    assert out["diffusion_success"] >= 0.95 and out["gaussian_success"] <= 0.60, out
