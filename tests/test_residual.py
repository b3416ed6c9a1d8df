"""Residual head: exact base actions at initialisation, bounded corrections, log-probs, the evidence measure,
the signal-scaled update, the artifact round trip and tiny end-to-end runs (with SIGKILL + resume)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from diffpolicy import checkpoint
from diffpolicy.config import ResidualConfig
from diffpolicy.distributed import DistInfo
from diffpolicy.models.residual import ResidualCritic, ResidualHead
from diffpolicy.rl.residual.update import (
    Evidence,
    ResidualModules,
    batch_evidence,
    residual_update,
    signal_drift,
    step_scale,
)

INFO = DistInfo()


def _head(**kw) -> ResidualHead:
    torch.manual_seed(0)
    return ResidualHead(10, 3, 4, hidden=(32, 32), **kw)


def test_head_is_exactly_the_base_at_init_and_bounded_by_alpha() -> None:
    head = _head(alpha=0.1)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, head.input_dim, generator=g)
    base = torch.rand(64, 3, generator=g) * 1.6 - 0.8
    u, _ = head.sample(x, deterministic=True)
    assert torch.equal(head.correct(base, u), base)  # bit-exact: mean 0, tanh(0) = 0
    for w in (0.0, 10.0):  # any weights, any noise: the correction stays inside the alpha-box
        torch.nn.init.normal_(head.mean_net[-1].weight, std=w)
        u, _ = head.sample(x, generator=g)
        u = u * 100
        assert (head.correct(base, u) - base).abs().max() <= 0.1 + 1e-6


def test_log_prob_matches_torch_distributions() -> None:
    head = _head()
    torch.nn.init.normal_(head.mean_net[-1].weight, std=0.3)
    with torch.no_grad():
        head.log_std.copy_(torch.tensor([-1.0, -0.5, 0.2]))
    x = torch.randn(32, head.input_dim)
    u, logp = head.sample(x, generator=torch.Generator().manual_seed(1))
    ref = torch.distributions.Normal(head(x), head.std).log_prob(u).sum(-1)
    torch.testing.assert_close(logp, ref)
    torch.testing.assert_close(head.log_prob(x, u), ref)
    ent = torch.distributions.Normal(torch.zeros(3), head.std).entropy().sum()
    torch.testing.assert_close(head.entropy(), ent)


def test_a_capped_std_bounds_sampling_log_probs_and_entropy() -> None:
    """``max_std`` caps sigma wherever it is used (draws, log-probs against ``torch.distributions`` at the
    capped std, entropy), and ``log_std`` beyond the cap gets no gradient, so exploration cannot outgrow it."""
    head = _head(init_std=0.5)
    head.max_std = 0.05
    x = torch.randn(4096, head.input_dim, generator=torch.Generator().manual_seed(2))
    u, logp = head.sample(x, generator=torch.Generator().manual_seed(3))
    assert abs(float(u.detach().std()) - 0.05) < 0.003  # mean 0 at init: u is the noise
    ref = torch.distributions.Normal(head(x), torch.full((3,), 0.05)).log_prob(u).sum(-1)
    torch.testing.assert_close(logp, ref)
    torch.testing.assert_close(head.log_prob(x, u), ref)
    want_h = torch.distributions.Normal(torch.zeros(3), torch.full((3,), 0.05)).entropy().sum()
    torch.testing.assert_close(head.entropy(), want_h)
    head.log_prob(x[:8], u[:8]).sum().backward()
    assert float(head.log_std.grad.abs().max()) == 0.0


def _fake_score(fragility: float, base: float = 2320.0, success: bool = False):
    """A base whose figure falls linearly with the action noise std: return base - fragility * std."""
    from diffpolicy.evaluation import EvalResult

    def score(std: float) -> EvalResult:
        value = base - fragility * std
        return EvalResult(success_rate=value if success else 0.0, mean_return=value, episodes=10,
                          env_steps=100, reports_success=success)  # fmt: skip

    return score


def test_tolerated_std_halves_until_the_base_keeps_its_figure() -> None:
    """The residual's exploration bound (issue: Hopper's noiseless BC fell 2320 -> 1129 under a head exploring
    with 0.02 env units): a fragile base (-50 000 return per unit of noise std) gets the largest halving of the
    start whose return stays within 10 %; a robust one keeps the start; a success rate is judged in absolute
    terms; a base that tolerates nothing gets the smallest level tried."""
    from diffpolicy.rl.exploration import tolerated as tolerated_std

    std, seen, steps = tolerated_std(_fake_score(50_000.0), 0.02, 0.1)
    assert std == 0.02 / 8 and seen[0.0] == 2320.0 and seen[0.02] < 0.9 * 2320 <= seen[std]
    assert steps == 100 * 5  # noise-free + 4 levels
    assert tolerated_std(_fake_score(100.0), 0.02, 0.1)[0] == 0.02
    assert tolerated_std(_fake_score(10.0, base=0.9, success=True), 0.02, 0.1)[0] == 0.02 / 2
    assert tolerated_std(_fake_score(1e9), 0.02, 0.1, levels=3)[0] == 0.02 / 4


def test_inputs_encode_state_action_phase_and_need_cond_when_sized() -> None:
    head = ResidualHead(5, 2, 3, cond_dim=4, hidden=(8,))
    x = head.inputs(torch.zeros(2, 5), torch.ones(2, 2), torch.tensor([0, 2]), torch.full((2, 4), 3.0))
    assert x.shape == (2, 5 + 2 + 3 + 4)
    assert x[0, 7:10].tolist() == [1, 0, 0] and x[1, 7:10].tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="give cond"):
        head.inputs(torch.zeros(2, 5), torch.ones(2, 2), torch.tensor([0, 2]))


def _batch(head: ResidualHead, seed: int, signal_strength: float, n: int = 2000):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, head.input_dim, generator=g)
    with torch.no_grad():
        u, _ = head.sample(x, generator=g)
        noise = (u - head(x))[:, 0]
    adv = signal_strength * noise + torch.randn(n, generator=g)  # reward for pushing dimension 0 up
    return x, u, (adv - adv.mean()) / adv.std(), g


def _signal(head: ResidualHead, seed: int, strength: float, kind: str = "signs") -> float:
    x, u, adv, g = _batch(head, seed, strength)
    grad, refs = batch_evidence(head, x, u, adv, references=4, kind=kind, generator=g, info=INFO)
    return signal_drift(head, x, grad, refs)[0]


@pytest.mark.parametrize("kind", ["signs", "shuffle"])
def test_signal_drift_is_about_one_on_noise_and_above_on_a_known_direction(kind: str) -> None:
    head = _head()
    torch.nn.init.normal_(head.mean_net[-1].weight, std=0.1)
    noise = [_signal(head, seed, 0.0, kind) for seed in range(12)]
    known = [_signal(head, seed, 3.0, kind) for seed in range(12)]
    assert 0.75 < float(np.mean(noise)) < 1.25, noise
    assert float(np.mean(known)) > 2.0 and min(known) > 1.25, known


def test_pooled_evidence_grows_with_batches_of_a_weak_signal() -> None:
    head = _head()
    torch.nn.init.normal_(head.mean_net[-1].weight, std=0.1)
    pool, single = Evidence(), []
    for seed in range(16):
        x, u, adv, g = _batch(head, seed, 0.5)
        grad, refs = batch_evidence(head, x, u, adv, references=4, kind="signs", generator=g, info=INFO)
        single.append(signal_drift(head, x, grad, refs)[0])
        pool.add(grad, refs, x.shape[0])
    pooled = signal_drift(head, x, *pool.mean())[0]
    assert pooled > 2 * float(np.mean(single)) - 1 and pooled > 2.0, (pooled, single)
    state = pool.state()
    again = Evidence()
    again.load(state)
    assert again.batches == 16 and all(torch.equal(a, b) for a, b in zip(again.grad, pool.grad))


def test_step_scale_is_the_positive_part_shrinkage() -> None:
    assert step_scale(1.0, 1.25) == 0.0 and step_scale(0.0, 1.0) == 0.0
    assert step_scale(2.5, 1.25) == pytest.approx(0.75)
    assert step_scale(1e9, 1.25) == pytest.approx(1.0)


def _update(head: ResidualHead, strength: float, seed: int, **cfg_kw) -> tuple[dict, float]:
    critic = ResidualCritic(head.input_dim, (16,))
    learner = ResidualModules(
        head, critic, torch.optim.Adam(head.parameters(), lr=3e-3), torch.optim.Adam(critic.parameters())
    )
    x, u, adv, _ = _batch(head, seed, strength, n=1024)
    with torch.no_grad():
        logp = head.log_prob(x, u)
        before = head(x).clone()
    data = {
        "x": x.view(64, 16, -1), "u": u.view(64, 16, -1), "logprobs": logp.view(64, 16),
        "elapsed": torch.zeros(64, 16),
    }  # fmt: skip
    cfg = ResidualConfig(
        update_epochs=2, minibatch_size=256, target_kl=0.0, **{"residual_update": "ppo", **cfg_kw}
    )
    out = residual_update(
        learner, data, adv.view(64, 16), adv.view(64, 16), cfg, generator=torch.Generator().manual_seed(seed),
        info=INFO,
    )  # fmt: skip
    with torch.no_grad():
        moved = float((head(x) - before).abs().max())
    return out, moved


def test_update_without_evidence_does_not_move_the_policy() -> None:
    stills = 0
    for seed in range(6):
        head = _head()
        out, moved = _update(head, 0.0, seed, max_drift=0.0)
        assert "losses/signal_drift" in out and 0.0 <= out["losses/step_scale"] <= 1.0
        stills += moved == 0.0
    assert stills >= 4  # pure-noise advantages: mostly w = 0, the head stays at exactly zero


@pytest.mark.parametrize("norm_adv", ["minibatch", "batch", "none"])
def test_update_with_evidence_moves_the_right_way_within_the_trust_region(norm_adv: str) -> None:
    head = _head()
    out, moved = _update(head, 3.0, 0, max_drift=0.005, norm_adv=norm_adv)
    assert out["losses/step_scale"] > 0.3 and moved > 0
    assert out["losses/action_drift"] <= 0.005 + 1e-6
    x = torch.randn(512, head.input_dim)
    with torch.no_grad():
        assert float(head(x)[:, 0].mean()) > 0  # advantages rewarded pushing dimension 0 up


def test_trust_region_step_moves_exactly_w_times_max_drift_along_the_evidence() -> None:
    head = _head()
    out, moved = _update(head, 3.0, 0, residual_update="trust_region", max_drift=0.004)
    assert out["losses/step_scale"] > 0.3 and out["losses/evidence_batches"] == 1.0
    assert out["losses/action_drift"] == pytest.approx(out["losses/step_scale"] * 0.004, rel=0.05)
    x = torch.randn(512, head.input_dim)
    with torch.no_grad():
        assert float(head(x)[:, 0].mean()) > 0


def test_rollback_trust_halves_the_step() -> None:
    full, _ = _update(_head(), 3.0, 0, residual_update="trust_region", max_drift=0.004)
    head = _head()
    critic = ResidualCritic(head.input_dim, (16,))
    learner = ResidualModules(
        head, critic, torch.optim.Adam(head.parameters()), torch.optim.Adam(critic.parameters()), trust=0.5
    )
    x, u, adv, _ = _batch(head, 0, 3.0, n=1024)
    data = {"x": x.view(64, 16, -1), "u": u.view(64, 16, -1), "logprobs": torch.zeros(64, 16)}
    data["elapsed"] = torch.zeros(64, 16)
    cfg = ResidualConfig(update_epochs=2, minibatch_size=256, max_drift=0.004)
    half = residual_update(
        learner,
        data,
        adv.view(64, 16),
        adv.view(64, 16),
        cfg,
        generator=torch.Generator().manual_seed(0),
        info=INFO,
    )
    assert half["losses/trust"] == 0.5
    assert half["losses/action_drift"] == pytest.approx(0.5 * full["losses/action_drift"], rel=0.1)


def test_trust_region_pools_batches_while_the_policy_stands_still() -> None:
    head = _head()
    critic = ResidualCritic(head.input_dim, (16,))
    learner = ResidualModules(
        head, critic, torch.optim.Adam(head.parameters()), torch.optim.Adam(critic.parameters())
    )
    cfg = ResidualConfig(update_epochs=1, minibatch_size=256, signal_margin=1e6)  # never enough evidence
    for seed in range(3):
        x, u, adv, _ = _batch(head, seed, 0.5, n=512)
        data = {"x": x.view(32, 16, -1), "u": u.view(32, 16, -1), "logprobs": torch.zeros(32, 16)}
        data["elapsed"] = torch.zeros(32, 16)
        out = residual_update(
            learner, data, adv.view(32, 16), adv.view(32, 16), cfg, generator=torch.Generator().manual_seed(seed),
            info=INFO,
        )  # fmt: skip
        assert out["losses/step_scale"] == 0.0 and out["losses/evidence_batches"] == seed + 1
    assert all(float(p.detach().abs().max()) == 0 for p in head.mean_net[-1].parameters())


# ------------------------------------------------------------------------------------ end to end
RESIDUAL_RUN = [
    "algo=residual",
    "algo.iterations=3",
    "algo.n_steps=12",
    "algo.minibatch_size=12",
    "algo.update_epochs=2",
    "algo.residual_hidden=[16,16]",
    "algo.signal_scaled_lr=false",  # a tiny batch carries no evidence: force the update to move
]


def _train(run_dir: Path, init: Path, *extra: str, wait: bool = True):
    from test_train import TINY_POLICY, TINY_RUN

    run = [a for a in TINY_RUN if not a.startswith("algo.ft_steps")]  # the residual learner samples no chain
    args = [*run, *TINY_POLICY, *RESIDUAL_RUN, f"policy.init={init}", f"hydra.run.dir={run_dir}", *extra]
    cmd = [sys.executable, "-m", "diffpolicy.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def residual_run(tmp_path_factory: pytest.TempPathFactory, init_ckpt: Path) -> tuple[Path, dict]:
    run_dir = tmp_path_factory.mktemp("residual")
    out = _train(run_dir, init_ckpt)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir, json.loads(out.stdout.strip().splitlines()[-1])


def test_residual_tiny_run_end_to_end(residual_run: tuple[Path, dict]) -> None:
    from diffpolicy.logger import read_metrics
    from diffpolicy.policies.residual import ResidualPolicy
    from diffpolicy.policy_io import load_policy

    run_dir, summary = residual_run
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (bound,) = [r for r in lines if r.get("event") == "residual_std_bound"]  # measured once, before rollouts
    assert 0 < bound["sigma_max"] <= ResidualConfig().residual_init_std + 1e-9
    tolerance_steps = summary["env_steps"] - 3 * 12 * 2  # the bound's validation episodes count as env steps
    assert summary["learner"] == "residual" and tolerance_steps > 0
    assert summary["eval_episodes"] == 4 and len(summary["ppo_ci"]) == 2 and summary["env_sps"] > 0
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "losses/signal_drift" in r]
    assert len(rows) == 3 and all(r["losses/step_scale"] == 1.0 for r in rows)
    policy, _, _ = load_policy(run_dir / "checkpoints")
    assert isinstance(policy, ResidualPolicy)
    ckpt = checkpoint.load(run_dir / "checkpoints")
    assert any(
        not torch.equal(v, torch.zeros_like(v)) for k, v in ckpt.state["residual"].items() if "2." in k
    )


def test_residual_sigkill_then_resume_is_bit_exact(
    tmp_path: Path, init_ckpt: Path, residual_run: tuple[Path, dict]
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
    got, want = json.loads(resumed.stdout.strip().splitlines()[-1]), residual_run[1]
    for key in ("bc_success_rate", "ppo_success_rate", "env_steps"):
        assert got[key] == want[key], key
    a = checkpoint.load(residual_run[0] / "checkpoints").state["residual"]
    b = checkpoint.load(tmp_path / "checkpoints").state["residual"]
    assert all(torch.equal(a[k], b[k]) for k in a)
