"""Serving a base + residual checkpoint per control step: the sessions' actions are StepActor's, requests
without a session are refused, the entry point says ``per_step``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

grpc = pytest.importorskip("grpc")

from diffpolicy.policies.residual import StepActor  # noqa: E402
from diffpolicy.policy_io import load_policy  # noqa: E402
from diffpolicy.serving.client import PolicyClient  # noqa: E402
from diffpolicy.serving.sampler import ResidualSampler, sampler_from_checkpoint  # noqa: E402
from diffpolicy.serving.server import PolicyServer  # noqa: E402
from diffpolicy.serving.wire import collate  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from residual_checkpoint import residual_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEED = 5


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return residual_checkpoint(tmp_path_factory.mktemp("residual"))


def _envs(path: Path, n: int):
    from diffpolicy.env_factory import make_envs

    policy, env_cfg, _ = load_policy(path, env_overrides={"vectorization": "sync"})
    return policy, make_envs(env_cfg, policy.n_action_steps, n, seed=11, chunked=False)


def _step_actor_rollout(policy, venv, steps: int) -> np.ndarray:
    actor = StepActor(policy, venv.num_envs, torch.device("cpu"))
    torch.manual_seed(SEED)  # the base's x_K: global generator vs the sampler's own, same seed
    obs, _ = venv.reset(seed=SEED)
    executed = []
    for _ in range(steps):
        action, _ = actor.act(obs, deterministic=True)
        executed.append(action)
        obs, _, term, trunc, _ = venv.step(action)
        actor.reset(term | trunc)
    return np.stack(executed)  # (steps, N, Da)


def _session_rollout(act, venv, steps: int) -> np.ndarray:
    """``act(obs_batch, sessions) -> (N, Da)``; a finished episode continues under a new session id."""
    episode = np.zeros(venv.num_envs, int)
    obs, _ = venv.reset(seed=SEED)
    executed = []
    for _ in range(steps):
        action = act(obs, [f"robot{i}/{e}" for i, e in enumerate(episode)])
        executed.append(action)
        obs, _, term, trunc, _ = venv.step(action)
        episode += term | trunc
    return np.stack(executed)


@pytest.mark.parametrize("cond", [False, True])
def test_sessions_execute_what_step_actor_executes(tmp_path, cond):
    path = residual_checkpoint(tmp_path, cond=cond)
    sampler = sampler_from_checkpoint(path, seed=SEED)
    assert isinstance(sampler, ResidualSampler) and sampler.action_shape == (1, 2)
    policy, venv = _envs(path, 2)
    steps = 2 * policy.n_action_steps + 3
    try:
        ref = _step_actor_rollout(policy, venv, steps)

        def act(obs, sessions):
            return sampler.act(collate([{"state": s} for s in obs["state"]], sampler.obs_spec), sessions)[
                :, 0
            ]

        got = _session_rollout(act, venv, steps)
    finally:
        venv.close()
    np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)


def test_one_sessions_requests_in_one_batch_run_in_order_and_old_sessions_are_forgotten(ckpt):
    rng = np.random.default_rng(0)
    states = rng.uniform(-0.5, 0.5, size=(3, 6)).astype(np.float32)
    batched = sampler_from_checkpoint(ckpt, seed=1)
    one_by_one = sampler_from_checkpoint(ckpt, seed=1)
    spec = batched.obs_spec
    got = batched.act(collate([{"state": s} for s in states], spec), ["a", "b", "a"])
    want = [one_by_one.act(collate([{"state": states[i]}], spec), [s])[0] for i, s in [(0, "a"), (1, "b")]]
    want.append(one_by_one.act(collate([{"state": states[2]}], spec), ["a"])[0])
    np.testing.assert_allclose(got, np.stack(want), atol=1e-6, rtol=0)  # batch size: rounding only
    assert batched.sessions["a"].phase == 2 and batched.sessions["b"].phase == 1

    small = ResidualSampler(batched.policy, {"state": [6]}, max_sessions=1)
    small.act(collate([{"state": states[0]}], spec), ["a"])
    small.act(collate([{"state": states[1]}], spec), ["b"])
    assert list(small.sessions) == ["b"]  # "a" forgotten: it replans on its next request


def test_grpc_rollout_matches_step_actor_and_session_is_required(ckpt):
    server = PolicyServer(lambda: sampler_from_checkpoint(ckpt, seed=SEED), port=0, max_batch=2)
    server.start()  # warm-up plans fresh sessions, then the sampler forgets them and restarts its seed
    try:
        client = PolicyClient(server.address)
        health = client.health()
        assert health["per_step"] and health["action_shape"] == (1, 2)
        with pytest.raises(grpc.RpcError) as err:
            client.act({"state": np.zeros(6, np.float32)})
        assert (
            err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            and "Observation.session" in err.value.details()
        )
        policy, venv = _envs(ckpt, 1)
        steps = 2 * policy.n_action_steps + 3
        try:
            ref = _step_actor_rollout(policy, venv, steps)
            got = _session_rollout(
                lambda obs, s: client.act({"state": obs["state"][0]}, session=s[0]), venv, steps
            )
        finally:
            venv.close()
        np.testing.assert_allclose(got, ref, atol=1e-6, rtol=0)
        assert server.stats()["invalid"] == 1
        client.close()
    finally:
        server.stop(grace_s=1)


def test_serve_entry_point_serves_a_residual_checkpoint_per_step(ckpt, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "diffpolicy.serve", f"checkpoint={ckpt}", "port=0", "max_batch=2",
        "device.threads=1", f"hydra.run.dir={tmp_path / 'run'}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["per_step"] is True and ready["action_shape"] == [1, 2]
        with PolicyClient(ready["address"]) as client:
            for _ in range(3):
                action = client.act({"state": np.zeros(6, np.float32)}, session="robot/0")
                assert action.shape == (1, 2) and np.abs(action).max() <= 1.0
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert json.loads(out.strip().splitlines()[-1])["served"] == 3
