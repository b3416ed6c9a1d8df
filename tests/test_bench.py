"""Every benchmark ``make bench`` runs, at a tiny size: it runs and reports finite, consistent numbers.

bc_step, bimodal and serve have their tiny runs beside the code they measure (tests/test_filtered_bc.py,
tests/test_pretrain.py, tests/test_serve.py); :func:`test_every_make_bench_benchmark_has_a_tiny_run`
checks that each benchmark in the Makefile's list has one somewhere under tests/.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from diffpolicy.bench import BENCHMARKS, STUDIES

ROOT = Path(__file__).resolve().parents[1]


def _make_bench_list() -> list[str]:
    """The benchmarks ``make bench`` runs (the Makefile's ``BENCH``)."""
    found = re.search(r"^BENCH \?=(.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile has no 'BENCH ?= ...' line"
    return found.group(1).split()


def _finite_positive(*values: float) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


@pytest.fixture
def keep_threads(monkeypatch: pytest.MonkeyPatch):
    """One torch thread for the benchmark; torch's intra-op threads and OMP_NUM_THREADS restored after it."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_make_bench_runs_every_benchmark_but_the_studies() -> None:
    assert set(STUDIES) <= set(BENCHMARKS)
    assert _make_bench_list() == [name for name in BENCHMARKS if name not in STUDIES]


def test_every_make_bench_benchmark_has_a_tiny_run() -> None:
    """Each benchmark's module exposes ``run``, and a test calls the ``run`` of each one ``make bench`` runs."""
    import importlib

    for name in BENCHMARKS:
        assert callable(importlib.import_module(f"diffpolicy.benchmarks.{name}").run), name
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py"))
    missing = [
        n
        for n in _make_bench_list()
        if not re.search(rf"from diffpolicy\.benchmarks\.{n} import .*\brun\b", tests)
    ]
    assert not missing, f"no test runs these benchmarks: {missing}"


def test_env_benchmark_tiny(keep_threads) -> None:
    from diffpolicy.benchmarks.env import run

    out = run(steps=8, repeats=1, state_steps=8, image_size=32, n_points=64)
    keys = [
        "full_obs_sps",
        "replan_obs_sps",
        "state_obs_sps",
        "obstacle_reach_sps",
        "state_sps",
        "physics_sps",
    ]
    assert _finite_positive(*(out[k] for k in keys)), out
    # the ratio is reported; how large it is is the benchmark's finding, not a test's (a loaded machine moves it)
    assert _finite_positive(out["state_over_physics"])
    if "metaworld_task" in out:  # the metaworld extra is installed
        assert _finite_positive(
            out["metaworld_state_sps"], out["metaworld_replan_sps"], out["metaworld_full_sps"]
        )
    assert (out["steps"], out["state_steps"], out["repeats"]) == (8, 8, 1)


def test_gae_benchmark_tiny(keep_threads) -> None:
    from diffpolicy.benchmarks.gae import SHAPES, run

    out = run(repeats=1)
    for T, N in SHAPES:
        tag = f"{T}x{N}"
        assert _finite_positive(out[f"op_ms_{tag}"], out[f"torch_loop_ms_{tag}"], out[f"numpy_loop_ms_{tag}"])
    assert out["speedup_vs_numpy_2048x64"] == pytest.approx(
        out["numpy_loop_ms_2048x64"] / out["op_ms_2048x64"]
    )
    assert out["ratio_vs_copy_1024x1024"] == pytest.approx(out["op_ms_1024x1024"] / out["copy_ms_1024x1024"])
    assert out["gae_kernel"] != "not run"


def test_sampler_benchmark_tiny(keep_threads) -> None:
    """The uncompiled fast backend (the default, ``compiled``, spends most of a tiny run compiling)."""
    from diffpolicy.benchmarks.sampler import run

    out = run(repeats=1, threads=1, backend="fast", ks=[2], sizes=["small"], horizon=16, warmup=0)
    assert _finite_positive(out["small_t16_k2_ms"], out["eager_reference_ms"]["small_t16_k2"])
    assert _finite_positive(out["film_eager_ms"]["small_t16_k2"], out["speedup_vs_eager"]["small_t16_k2"])
    assert out["max_abs_diff_vs_eager"] < 1e-4  # every timed path samples the eager loop's chunk
    assert out["small_dims"] == [64, 128, 256] and out["fold"] == 1
    folded = run(repeats=1, threads=1, backend="fast", ks=[2], sizes=["small"], horizon=64, warmup=0, fold=4)
    assert (
        folded["fold"] == 4 and folded["small_t64_convs"] == out["small_t16_convs"]
    )  # a 16-step chunk's kernels
    assert folded["max_abs_diff_vs_eager"] < 1e-4


def test_ppo_update_benchmark_tiny(keep_threads) -> None:
    """The chain PPO update (``algo=ppo``, whatever the train default) and the residual update."""
    from diffpolicy.benchmarks.ppo_update import run

    out = run(repeats=1, threads=1, num_envs=2, n_steps=2, minibatch_size=4, grad_steps=(0, 1))
    assert out["algo"] == "ppo" and out["decisions_per_epoch"] == 4
    held = out["action_space"]
    assert set(held["seconds_per_epoch"]) == {"0", "1"} and held["share_of_whole_chain"]["0"] == 1.0
    assert _finite_positive(*held["seconds_per_epoch"].values())
    assert _finite_positive(out["decisions_per_s"], out["seconds_per_epoch"])
    assert out["decisions_per_s"] == pytest.approx(4 / out["seconds_per_epoch"])
    assert out["ft_steps"] >= 1
    residual = out["residual"]
    assert _finite_positive(residual["seconds_per_update"], residual["control_steps_per_s"])


def test_stabledrl_benchmark_run_tiny(keep_threads) -> None:
    """run(): both variants' curves and bounds, the control runs (the learning effect itself:
    tests/test_ppo_loss.py)."""
    from diffpolicy.benchmarks.stabledrl import run

    out = run(repeats=1, threads=1, iterations=2, batch=32, minibatch=16, epochs=1, eval_size=32)
    for name in ("ppo", "stable"):
        assert len(out[f"{name}_reward_curve"]) == 5
        assert 0.0 <= out[f"{name}_grad_bound_ok_frac"] <= 1.0
        assert f"{name}_control_final_reward" in out and f"{name}_max_grad_norm" in out
    assert all(math.isfinite(v) for v in out["stable_reward_curve"])  # StableDRL stays bounded
    assert out["stable_grad_bound_ok_frac"] == 1.0
    assert out["logratio_noise_std"] == pytest.approx(3.0) and out["repeats"] == 1


def test_encoders_benchmark_tiny(keep_threads) -> None:
    from diffpolicy.benchmarks.encoders import run

    out = run(repeats=1, threads=1, batch=2, warmup=0, text_backend="hash")
    parts = {"rgb", "points", "state", "text", "encoder", "unet"}
    assert set(out["samples_per_s"]) == parts and set(out["ms"]) == parts
    assert _finite_positive(*out["samples_per_s"].values(), *out["ms"].values())
    # the BC step is the whole encoder plus the U-Net
    assert out["share_of_bc_step"]["encoder"] + out["share_of_bc_step"]["unet"] == pytest.approx(1, abs=0.01)
    assert out["batch"] == 2


@pytest.mark.parametrize(
    ("algo", "budget", "learner"),
    [
        ("filtered_bc", {"round_episodes": 2, "bc_steps": 1}, "filtered_bc"),
        ("ppo", {"n_steps": 2, "update_epochs": 1}, "chain"),
    ],
)
def test_scaling_jobs_get_the_budget_their_learner_has(tmp_path, algo, budget, learner) -> None:
    """The timed jobs' overrides compose; each learner gets only its own budget fields; filtered_bc's
    demonstrations are collected before the jobs start."""
    from diffpolicy.benchmarks.scaling import _prepare
    from diffpolicy.cli import compose

    candidates = {"round_episodes": 2, "bc_steps": 1, "n_steps": 2, "update_epochs": 1}
    args, applied, name = _prepare(
        tmp_path, env="mujoco_pick", algo=algo, num_envs=2, iterations=2, n_demos=2, budget=candidates,
        overrides=["policy.down_dims=[16,32]"],
    )  # fmt: skip
    assert applied == budget and name == learner
    cfg = compose("train", [*args, "dist=ddp", "device.threads=1"])
    assert {k: getattr(cfg.algo, k) for k in budget} == budget
    assert cfg.algo.iterations == 2 and cfg.env.num_envs == 2 and list(cfg.policy.down_dims) == [16, 32]
    assert (tmp_path / "init").is_dir() and cfg.policy.init == str(tmp_path / "init")
    demos = list((tmp_path / "cache" / "demos").glob("*")) if (tmp_path / "cache").exists() else []
    assert len(demos) == (1 if learner == "filtered_bc" else 0)


@pytest.mark.slow
@pytest.mark.dist
def test_scaling_benchmark_tiny() -> None:
    """End to end (three torchrun jobs, ~1.5 min on 2 busy cores: mostly process start-up, and the
    2-thread job contending for the cores): the default learner's throughput with 1 and 2 processes."""
    from test_train import TINY_POLICY

    from diffpolicy.benchmarks.scaling import run

    out = run(
        iterations=2, num_envs=2, bc_steps=1, n_demos=2,
        overrides=["env.vectorization=sync", *TINY_POLICY],
    )  # fmt: skip
    assert out["algo"] == "filtered_bc" and out["learner"] == "filtered_bc"
    assert out["budget"] == {"round_episodes": 2, "bc_steps": 1} and out["n_demos"] == 2
    assert _finite_positive(out["sps_1"], out["sps_2"], out["sps_1_2threads"])
    assert out["speedup_2_vs_1"] == pytest.approx(out["sps_2"] / out["sps_1"])


# ------------------------------------------------------------------------------------------------ the peer
FAKE_UNET = '''
import torch
from torch import nn


class ConditionalUnet1D(nn.Module):
    """Stands in for the peer's U-Net in tests: its constructor and forward signature, a tiny network."""

    def __init__(self, input_dim, global_cond_dim, diffusion_step_embed_dim, down_dims, kernel_size,
                 n_groups, cond_predict_scale):
        super().__init__()
        self.net = nn.Linear(input_dim + global_cond_dim + 1, input_dim)

    def forward(self, sample, timestep, global_cond=None):
        t = torch.as_tensor(timestep, dtype=sample.dtype).expand(sample.shape[0]).reshape(-1, 1, 1)
        cond = global_cond[:, None, :].expand(-1, sample.shape[1], -1)
        return self.net(torch.cat([sample, cond, t.expand(-1, sample.shape[1], 1) / 100], dim=-1))
'''
FAKE_EMA = """
import torch


class EMAModel:
    def __init__(self, model, power=2 / 3):
        self.averaged_model, self.steps = model, 0

    @torch.no_grad()
    def step(self, new_model):
        for a, p in zip(self.averaged_model.parameters(), new_model.parameters()):
            a.mul_(0.9).add_(p, alpha=0.1)
        self.steps += 1
"""


@pytest.fixture
def fake_peer(tmp_path: Path) -> Path:
    """A directory laid out as a diffusion_policy checkout, with stand-ins for the two modules the bench reads."""
    pytest.importorskip("diffusers")
    pytest.importorskip("einops")
    pkg = tmp_path / "diffusion_policy" / "model" / "diffusion"
    pkg.mkdir(parents=True)
    (pkg / "conditional_unet1d.py").write_text(FAKE_UNET)
    (pkg / "ema_model.py").write_text(FAKE_EMA)
    yield tmp_path
    import sys

    for name in [n for n in sys.modules if n == "diffusion_policy" or n.startswith("diffusion_policy.")]:
        del sys.modules[name]


def test_peer_is_skipped_with_one_line_when_absent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diffpolicy.benchmarks import peer

    monkeypatch.delenv(peer.ENV_VAR, raising=False)
    assert "peer=<dir>" in peer.missing(None)
    assert "not a diffusion_policy checkout" in peer.missing(tmp_path)
    with pytest.raises(RuntimeError, match="not a diffusion_policy checkout"):
        peer.load(tmp_path)


def test_sampler_and_bc_step_time_the_peer_in_the_same_run(fake_peer: Path, keep_threads) -> None:
    """With peer=<dir>, both benchmarks time the peer beside this project's path and report their ratio."""
    from diffpolicy.benchmarks.bc_step import run as bc_step
    from diffpolicy.benchmarks.sampler import run as sampler

    out = sampler(repeats=1, threads=1, backend="fast", ks=[2], sizes=["small"], horizons=[16], warmup=0,
                  eager=False, peer=str(fake_peer))  # fmt: skip
    assert _finite_positive(out["peer_ms"]["small_t16_k2"], out["small_t16_k2_ms"])
    assert out["speedup_vs_peer"]["small_t16_k2"] == pytest.approx(  # reported to 3 decimals
        out["peer_ms"]["small_t16_k2"] / out["small_t16_k2_ms"], rel=1e-2, abs=1e-3
    )
    assert out["min_speedup_vs_peer"] == out["speedup_vs_peer"]["small_t16_k2"]
    out = bc_step(repeats=1, warmup=0, batches=[8], reference=8, peer=str(fake_peer), floor=True)
    row = out["batches"]["8"]
    assert _finite_positive(row["peer_s_per_step"], row["speedup_vs_peer"], row["floor_speedup_vs_peer"])
    # the ratios are of the unrounded medians, reported to 3 decimals beside times rounded to 0.1 ms
    assert _ratio_of_rounded(row["floor_speedup_vs_peer"], row["peer_s_per_step"], row["floor_s_per_step"])
    assert _ratio_of_rounded(row["speedup_vs_peer"], row["peer_s_per_step"], row["s_per_step"])


def _ratio_of_rounded(ratio: float, num: float, den: float, time_step: float = 1e-4) -> bool:
    """Whether ``ratio`` (rounded to 3 decimals) can be num / den of two times each rounded to ``time_step``."""
    half = time_step / 2
    low, high = (num - half) / (den + half), (num + half) / max(den - half, 1e-12)
    return low - 5e-4 <= ratio <= high + 5e-4


def test_peer_sampler_runs_the_peers_ddim_chain(fake_peer: Path) -> None:
    """The peer's chain is diffusers' DDIM (eta 0) over K steps: it matches a loop written from the DDIM update
    on the same noise-prediction network, so the bench times the peer's real sampler, not a shortcut."""
    from diffpolicy.benchmarks import peer as peer_lib

    peer = peer_lib.load(fake_peer)
    torch.manual_seed(0)
    model = peer_lib.unet(peer, 3, 4, [8])
    noise, cond = torch.randn(2, 6, 3), torch.randn(2, 4)
    with torch.inference_mode():
        got = peer_lib.sampler(peer, model, 5)(noise, cond)

        def alpha_bar(s: float) -> float:  # the squared-cosine schedule (Nichol & Dhariwal), offset 0.008
            return math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2

        betas = [min(1 - alpha_bar((t + 1) / 100) / alpha_bar(t / 100), 0.999) for t in range(100)]
        abar = torch.cumprod(1 - torch.tensor(betas, dtype=torch.float64), 0)
        x = noise.double()
        for t in range(80, -1, -20):
            eps = model(x.float(), torch.tensor(t), global_cond=cond).double()
            x0 = ((x - (1 - abar[t]).sqrt() * eps) / abar[t].sqrt()).clamp(-1, 1)
            prev = abar[t - 20] if t >= 20 else torch.tensor(1.0, dtype=torch.float64)
            x = prev.sqrt() * x0 + (1 - prev).sqrt() * eps
    torch.testing.assert_close(got.double(), x, atol=1e-4, rtol=1e-4)
