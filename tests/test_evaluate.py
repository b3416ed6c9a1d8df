"""evaluate: held-out success rate of a checkpoint, video and curves; one sampling path for eval and training."""

import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from diffpolicy import evaluation
from diffpolicy.config import DeviceConfig, EncoderConfig, EnvConfig, EvaluateConfig, PolicyConfig
from diffpolicy.logger import Logger
from diffpolicy.policies.base import act
from diffpolicy.policy_io import build_policy, save_policy

ROOT = Path(__file__).resolve().parents[1]
REACH = EnvConfig(name="obstacle_reach", id="diffpolicy_envs:ObstacleReach-v0", obs_mode="state", num_envs=2)
SMALL = PolicyConfig(encoder=EncoderConfig(state_hidden=16, token_dim=16, fusion_heads=2), cond_dim=16,
                     down_dims=[16, 32], n_groups=4, step_embed_dim=16, horizon=16, n_action_steps=8,
                     train_timesteps=20, ddim_steps=4)  # fmt: skip

SAMPLING_USERS = [
    ("diffpolicy.evaluation", "evaluate"),
    ("diffpolicy.evaluation", "record_video"),
    ("diffpolicy.rl.chain.rollout", "collect_rollout"),
]
"""(module, function) pairs that must act through ``policies.base.act``. Lead: add the PPO collector of
``diffpolicy.train`` here if it ever stops being ``rl.chain.rollout.collect_rollout``."""


def _has_ffmpeg() -> bool:
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory with a metrics.jsonl and a checkpoint root, like pretrain/train leave behind."""
    run_dir = tmp_path_factory.mktemp("run")
    policy = _small_policy()
    with Logger(run_dir, tensorboard=False, progress=False) as log:
        for step in range(1, 30):
            log.log({"losses/bc": 1.0 / step, "train/lr": 1e-3}, step)
    save_policy(run_dir / "checkpoints", 29, policy, env_cfg=REACH, policy_cfg=SMALL)
    return run_dir


@pytest.fixture
def act_calls(monkeypatch) -> list[bool]:
    """The ``deterministic`` flag of every evaluation call of ``act``, in order (the real act still runs)."""
    calls: list[bool] = []
    real_act = evaluation.act

    def recording_act(policy, obs, **kwargs):
        calls.append(kwargs.get("deterministic", False))
        return real_act(policy, obs, **kwargs)

    monkeypatch.setattr(evaluation, "act", recording_act)
    return calls


def _small_policy():
    torch.manual_seed(0)
    policy = build_policy(SMALL, {"state": [6]}, 2, text_backend="hash")
    policy.fit_normalizers(actions=torch.rand(20, 2) * 2 - 1, state=torch.randn(20, 6))
    return policy


def test_evaluate_main_uses_shared_act(run, tmp_path, act_calls):
    from diffpolicy import evaluate

    calls = act_calls
    cfg = EvaluateConfig(checkpoint=str(run / "checkpoints"), n_episodes=3, num_envs=2, video_episodes=1)
    summary = evaluate.main(cfg, tmp_path)
    assert {"success_rate", "n_episodes", "mean_return"} <= set(summary)
    assert summary["n_episodes"] == 3 and 0.0 <= summary["success_rate"] <= 1.0
    assert len(calls) >= 2 + 1  # two waves of evaluation and at least one video decision
    assert summary["video"] == str(tmp_path / "eval.mp4")
    if _has_ffmpeg():  # the `video` extra: an mp4
        assert (tmp_path / "eval.mp4").stat().st_size > 0
    else:  # without it, as designed, PNG frames in eval/
        assert sorted((tmp_path / "eval").glob("*.png"))
    assert (tmp_path / "curve_losses_bc.png").is_file() and summary["curves"]


@pytest.mark.parametrize(
    ("recorded", "override", "expect"),
    [
        ("noise_free", None, (True, "noise_free", "checkpoint")),
        ("exploration", None, (False, "exploration", "checkpoint")),
        (None, None, (False, "exploration", "default")),
        ("noise_free", False, (False, "exploration", "override")),
        (None, True, (True, "noise_free", "override")),
    ],
)
def test_sampling_protocol_follows_the_checkpoint_unless_told(recorded, override, expect):
    from types import SimpleNamespace

    from diffpolicy.policy_io import sampling_protocol

    extra = {} if recorded is None else {"protocol": recorded}
    assert sampling_protocol(SimpleNamespace(extra=extra, path="ck"), override) == expect


def test_a_named_protocol_wins_and_may_not_contradict_deterministic():
    from types import SimpleNamespace

    from diffpolicy.policy_io import sampling_protocol

    ck = SimpleNamespace(extra={"protocol": "noise_free"}, path="ck")
    assert sampling_protocol(ck, None, "dppo") == (False, "dppo", "override")
    with pytest.raises(ValueError, match="protocol=dppo and deterministic=True disagree"):
        sampling_protocol(ck, True, "dppo")
    assert sampling_protocol(ck, None, "ddim") == (True, "ddim", "override")
    with pytest.raises(ValueError, match="protocol='ddpm' is not one of"):
        sampling_protocol(ck, None, "ddpm")


def test_sampling_under_a_protocol_gives_the_schedule_back():
    """``held_out(..., protocol=)`` evaluates under a protocol inside ``sampling_under``: the policy's own
    schedule is back afterwards, even when the block raises; config names are checked once, clearly."""
    from diffpolicy.config import PROTOCOLS
    from diffpolicy.config.jobs import check_protocols
    from diffpolicy.diffusion.schedule import NoiseSchedule
    from diffpolicy.policy_io import sampling_under

    class Holder:
        schedule = NoiseSchedule(100, 10, 5, eta=1.0, min_std=0.1)

    p, own = Holder(), Holder.schedule
    for name in PROTOCOLS:
        with sampling_under(p, name) as deterministic:
            assert deterministic == PROTOCOLS[name]
            assert (p.schedule is own) == (name in ("noise_free", "exploration"))
        assert p.schedule is own
    with pytest.raises(RuntimeError), sampling_under(p, "ddim"):
        assert p.schedule.eta == 0.0
        raise RuntimeError
    assert p.schedule is own
    with pytest.raises(ValueError, match="report_protocols='mean' is not allowed"):
        check_protocols("", ["dppo", "mean"], False)
    with pytest.raises(ValueError, match="eval_protocol=dppo samples noise but eval_deterministic=true"):
        check_protocols("dppo", [], True)


def test_a_protocol_the_code_does_not_know_is_one_clear_error():
    from types import SimpleNamespace

    from diffpolicy.checkpoint import CheckpointError
    from diffpolicy.policy_io import sampling_protocol

    with pytest.raises(CheckpointError, match="extra\\['protocol'\\]='ddpm' is not one of noise_free"):
        sampling_protocol(SimpleNamespace(extra={"protocol": "ddpm"}, path="ck"), None)


def test_evaluate_says_what_train_said(tmp_path, monkeypatch, act_calls):
    """A checkpoint that records ``noise_free`` (train's filtered_bc figure) is evaluated noise-free by
    default, and the summary names the protocol and where it came from; ``deterministic=false`` overrides."""
    from diffpolicy import evaluate

    policy = _small_policy()
    root = tmp_path / "checkpoints"
    save_policy(root, 5, policy, env_cfg=REACH, policy_cfg=SMALL, extra={"protocol": "noise_free"})
    calls = act_calls
    cfg = EvaluateConfig(checkpoint=str(root), n_episodes=2, num_envs=2, video_episodes=0)
    summary = evaluate.main(cfg, tmp_path / "a")
    assert (summary["protocol"], summary["protocol_from"]) == ("noise_free", "checkpoint")
    assert (summary["step"], summary["deployed_iteration"]) == (5, 5)  # no keep_best record: its own step
    assert calls and all(calls)
    calls.clear()
    summary = evaluate.main(EvaluateConfig(**{**cfg.__dict__, "deterministic": False}), tmp_path / "b")
    assert (summary["protocol"], summary["protocol_from"]) == ("exploration", "override")
    assert calls and not any(calls)
    calls.clear()
    stds = []
    real_sample = type(policy).sample

    def spying_sample(self, *args, **kwargs):
        stds.append(self.schedule.std.clone())
        return real_sample(self, *args, **kwargs)

    monkeypatch.setattr(type(policy), "sample", spying_sample)
    summary = evaluate.main(EvaluateConfig(**{**cfg.__dict__, "protocol": "dppo"}), tmp_path / "c")
    assert (summary["protocol"], summary["protocol_from"]) == ("dppo", "override")
    assert calls and not any(calls)  # sampled, with the natural stds: none at the last step, floor 1e-3
    assert stds and all(float(s[-1]) == 0.0 and float(s[:-1].min()) >= 1e-3 for s in stds)


def test_evaluate_names_the_iteration_a_keep_best_checkpoint_deploys(tmp_path):
    """train with algo.keep_best writes its last checkpoint with an earlier iteration's weights and records
    which (``deployed``); evaluate's summary says so beside the checkpoint's step."""
    from diffpolicy import evaluate

    root = tmp_path / "checkpoints"
    save_policy(root, 44, _small_policy(), env_cfg=REACH, policy_cfg=SMALL, extra={"deployed": 36})
    cfg = EvaluateConfig(checkpoint=str(root), n_episodes=1, num_envs=1, video_episodes=0)
    summary = evaluate.main(cfg, tmp_path / "run")
    assert (summary["step"], summary["deployed_iteration"]) == (44, 36)


def test_evaluate_runs_in_the_checkpoints_waves_unless_told(tmp_path):
    """Without ``num_envs``, evaluate steps as many environments at once as the checkpoint's run did
    (``env.num_envs``), so the sampled chain draws its noise in train's order and the figure is train's own
    held-out evaluation to the digit; ``num_envs=`` still overrides."""
    from diffpolicy import evaluate
    from diffpolicy.config import TrainConfig
    from diffpolicy.device import Runtime

    policy = _small_policy()
    env = dataclasses.replace(REACH, num_envs=3)
    root = tmp_path / "checkpoints"
    save_policy(root, 5, policy, env_cfg=env, policy_cfg=SMALL, extra={"protocol": "exploration"})
    cfg = EvaluateConfig(
        checkpoint=str(root), n_episodes=6, video_episodes=0, device=DeviceConfig(type="cpu")
    )
    own = evaluate.main(cfg, tmp_path / "a")
    assert own["num_envs"] == 3
    train_cfg = TrainConfig(env=env, eval_episodes=6, device=DeviceConfig(type="cpu"))
    runtime = Runtime.from_config(train_cfg.device)
    runtime.manual_seed(cfg.eval_seed)
    trained = evaluation.held_out(policy.eval(), train_cfg, runtime, protocol="exploration")
    assert own["mean_return"] == pytest.approx(trained.mean_return, abs=1e-9)
    other = evaluate.main(dataclasses.replace(cfg, num_envs=1), tmp_path / "b")
    assert other["num_envs"] == 1 and other["mean_return"] != own["mean_return"]


def test_video_is_an_mp4_with_the_video_extra(tmp_path):
    pytest.importorskip("imageio_ffmpeg", reason='mp4 needs the `video` extra: pip install -e ".[video]"')
    frames = [np.full((16, 16, 3), 10 * i, np.uint8) for i in range(5)]
    assert evaluation.write_video(str(tmp_path / "v.mp4"), frames, fps=10) == str(tmp_path / "v.mp4")
    assert (tmp_path / "v.mp4").stat().st_size > 0 and not (tmp_path / "v").exists()


@pytest.mark.parametrize("module, function", SAMPLING_USERS)
def test_one_sampling_path(module, function):
    """Evaluation and training rollouts call the global ``act`` of policies/base.py and never sample on their own."""
    fn = inspect.unwrap(getattr(importlib.import_module(module), function))  # under @torch.no_grad()
    names = fn.__code__.co_names
    assert "act" in names, f"{module}.{function} does not act through policies.base.act"
    assert fn.__globals__["act"] is act
    assert not {"sample", "plan"} & set(names), f"{module}.{function} samples the policy directly"


def test_training_entry_point_shares_act():
    """Hook for the lead: an entry point that imports ``act`` must import policies.base's, not define its own."""
    for name in ("diffpolicy.train", "diffpolicy.evaluate", "diffpolicy.pretrain"):
        mod = importlib.import_module(name)
        if hasattr(mod, "act"):
            assert mod.act is act, f"{name}.act is not diffpolicy.policies.base.act"


def test_evaluate_cli(run, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'envs'}"}
    args = [f"checkpoint={run / 'checkpoints'}", "n_episodes=2", "num_envs=2", "video_episodes=0", "device=cpu",
            f"hydra.run.dir={tmp_path / 'ev'}"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "diffpolicy.evaluate", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["n_episodes"] == 2 and "success_rate" in summary and "mean_return" in summary
    bad = subprocess.run([sys.executable, "-m", "diffpolicy.evaluate", f"checkpoint={tmp_path / 'none'}",
                          f"hydra.run.dir={tmp_path / 'bad'}", "device=cpu"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: no checkpoint")


def test_train_and_pretrain_evaluate_bc_alike(run):
    """One held-out protocol (evaluation.held_out): a TrainConfig and a PretrainConfig with the same settings
    score a policy identically, whatever the global RNG holds; with algo=residual (both entry points'
    default) or eval_deterministic the chain takes its means, otherwise it samples."""
    from diffpolicy.cli import compose
    from diffpolicy.device import Runtime
    from diffpolicy.policy_io import load_policy

    policy, _, _ = load_policy(run / "checkpoints")
    common = ["env=obstacle_reach", "env.num_envs=2", "eval_episodes=3", "device=cpu"]
    results = {}
    for name in ("train", "pretrain"):
        for algo in ("residual", "ppo"):
            cfg = compose(name, [*common, f"algo={algo}"])
            torch.manual_seed(len(results))  # a different global RNG state for every evaluation
            result = evaluation.held_out(policy, cfg, Runtime.from_config(cfg.device))
            results[name, algo] = (result.successes, result.mean_return, result.env_steps)
    assert results["train", "residual"] == results["pretrain", "residual"]
    assert results["train", "ppo"] == results["pretrain", "ppo"]
    assert results["train", "residual"][1] != results["train", "ppo"][1]  # means vs samples
    cfg = compose("pretrain", [*common, "algo=ppo", "eval_deterministic=true"])
    det = evaluation.held_out(policy, cfg, Runtime.from_config(cfg.device))
    assert (det.successes, det.mean_return, det.env_steps) == results["train", "residual"]


def test_return_interval_against_tabulated_t_quantiles() -> None:
    """The summary's return intervals: t quantiles against tables, mean -+ t s / sqrt(n) against a hand sum."""
    for dof, want in ((10, 2.228139), (49, 2.009575), (199, 1.971957)):
        assert abs(evaluation.t_quantile(0.975, dof) - want) < 2e-4
    values = [float(v) for v in range(1, 12)]  # mean 6, s = sqrt(11)
    lo, hi = evaluation.mean_interval(values)
    half = 2.228139 * np.sqrt(11.0) / np.sqrt(11.0)
    assert abs(lo - (6 - half)) < 1e-3 and abs(hi - (6 + half)) < 1e-3
    assert all(np.isnan(evaluation.mean_interval([3.0])))
    result = evaluation.EvalResult(0.0, 6.0, 11, 0, [False] * 11, returns=values)
    assert result.return_ci() == (lo, hi)


def test_env_kwargs_change_the_environment_for_this_evaluation_only(tmp_path):
    """``env_kwargs`` are merged over the checkpoint's ``env.kwargs`` for one evaluation (the same episodes
    then score differently) and recorded in the summary; the checkpoint is untouched."""
    from diffpolicy import checkpoint, evaluate

    policy = _small_policy()
    root = tmp_path / "checkpoints"
    save_policy(root, 5, policy, env_cfg=REACH, policy_cfg=SMALL, extra={"protocol": "noise_free"})
    cfg = EvaluateConfig(checkpoint=str(root), n_episodes=2, num_envs=2, video_episodes=0)
    plain = evaluate.main(cfg, tmp_path / "a")
    weights = {"success": 0.0, "collision": 0.0, "distance_improvement": 0.0}
    changed = evaluate.main(
        EvaluateConfig(**{**cfg.__dict__, "env_kwargs": {"reward_weights": weights}}), tmp_path / "b"
    )
    assert "env_kwargs" not in plain and changed["env_kwargs"] == {"reward_weights": weights}
    assert plain["mean_return"] != 0.0 and changed["mean_return"] == 0.0
    assert "reward_weights" not in checkpoint.load(root).config["env"]["kwargs"]


def test_n_action_steps_replans_more_often_for_this_evaluation_only(tmp_path, act_calls):
    """``n_action_steps`` executes fewer actions of each chunk: the same episodes take more decisions (about
    8 / 2 = 4x), the summary records the value, the checkpoint keeps its own, and more rows than a chunk has
    fail in one line."""
    from diffpolicy import checkpoint, evaluate

    root = tmp_path / "checkpoints"
    save_policy(root, 5, _small_policy(), env_cfg=REACH, policy_cfg=SMALL, extra={"protocol": "noise_free"})
    cfg = EvaluateConfig(checkpoint=str(root), n_episodes=2, num_envs=2, video_episodes=0)
    plain = evaluate.main(cfg, tmp_path / "a")
    n_plain = len(act_calls)
    changed = evaluate.main(EvaluateConfig(**{**cfg.__dict__, "n_action_steps": 2}), tmp_path / "b")
    n_changed = len(act_calls) - n_plain
    assert "n_action_steps" not in plain and changed["n_action_steps"] == 2
    assert n_changed >= 3 * n_plain, (n_plain, n_changed)
    assert checkpoint.load(root).config["policy"]["n_action_steps"] == 8
    with pytest.raises(ValueError, match="exceeds the 16 rows"):
        evaluate.main(EvaluateConfig(**{**cfg.__dict__, "n_action_steps": 17}), tmp_path / "c")
    with pytest.raises(ValueError, match="n_action_steps"):
        EvaluateConfig(checkpoint=str(root), n_action_steps=0)
