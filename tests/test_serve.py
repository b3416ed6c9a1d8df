"""The gRPC action server on loopback: client round trip, INVALID_ARGUMENT, batching, warm-up, shutdown."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

grpc = pytest.importorskip("grpc")

from diffpolicy.serving import policy_pb2 as pb  # noqa: E402
from diffpolicy.serving.client import PolicyClient  # noqa: E402
from diffpolicy.serving.server import PolicyServer  # noqa: E402
from diffpolicy.serving.wire import Modality, encode_observation, to_tensor  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TA, DA = 6, 2


class FakeSampler:
    """actions[b] = sum(state[b]) + rgb[b].mean() + len(instruction[b]) everywhere; records batch sizes."""

    obs_spec = {
        "state": Modality("state", (4,), "float32"),
        "rgb": Modality("rgb", (8, 8, 3), "uint8"),
        "instruction": Modality("instruction", (), "text"),
    }
    action_shape = (TA, DA)

    def __init__(self, delay_s: float = 0.0, server: PolicyServer | None = None) -> None:
        self.delay_s = delay_s
        self.calls: list[tuple[int, bool, str]] = []  # (batch size, server serving at the time, thread)
        self.server = server

    def act(self, obs_batch):
        B = obs_batch["state"].shape[0]
        assert obs_batch["rgb"].shape == (B, 8, 8, 3) and len(obs_batch["instruction"]) == B
        self.calls.append((B, bool(self.server and self.server.serving), threading.current_thread().name))
        if any(s == "explode" for s in obs_batch["instruction"]):
            raise RuntimeError("boom")
        time.sleep(self.delay_s)
        value = obs_batch["state"].sum(1) + obs_batch["rgb"].reshape(B, -1).mean(1)
        value = value + np.array([len(s) for s in obs_batch["instruction"]])
        return np.broadcast_to(value[:, None, None], (B, TA, DA)).astype(np.float32)


def _obs(i: float = 0.0, text: str = "pick") -> dict:
    return {
        "state": np.full(4, i, np.float32),
        "rgb": np.full((8, 8, 3), 2, np.uint8),
        "instruction": text,
    }


def _expected(i: float = 0.0, text: str = "pick") -> float:
    return 4 * i + 2 + len(text)


@pytest.fixture
def serve():
    started: list[PolicyServer] = []

    def _start(sampler, **kw) -> tuple[PolicyServer, PolicyClient]:
        server = PolicyServer(sampler, host="127.0.0.1", port=0, **kw)
        if isinstance(sampler, FakeSampler):
            sampler.server = server
        started.append(server.start())
        client = PolicyClient(server.address, timeout_s=10)
        client.wait_ready(10)
        return server, client

    yield _start
    for s in started:
        s.stop(grace_s=1)


def test_round_trip_health_and_warmup_before_port(serve):
    sampler = FakeSampler()
    server, client = serve(sampler, max_batch=4, warmup_rounds=1)
    warm = [(b, thread) for b, serving, thread in sampler.calls if not serving]
    assert sorted({b for b, _ in warm}) == [1, 2, 3, 4]  # every batch size warmed before the port opened
    assert {thread for _, thread in warm} == {"diffpolicy-batcher"}  # on the thread that serves
    chunk = client.act(_obs(1.5, "put it down"))
    assert chunk.shape == (TA, DA) and chunk.dtype == np.float32
    np.testing.assert_allclose(chunk, _expected(1.5, "put it down"))
    obs = _obs(1.0)
    obs["state"] = obs["state"].astype(np.float64)  # cast to the spec's dtype by the client
    np.testing.assert_allclose(client.act(obs), _expected(1.0))
    health = client.health()
    assert health["status"] == "SERVING" and health["action_shape"] == (TA, DA)
    assert health["obs_spec"]["rgb"] == Modality("rgb", (8, 8, 3), "uint8") and health["served"] == 2
    assert client.last_info["batch_size"] == 1


def _raw(**changes) -> pb.Observation:
    obs = _obs()
    obs.update(changes)
    return encode_observation({k: v for k, v in obs.items() if v is not None})


@pytest.mark.parametrize(
    "request_, message",
    [
        (lambda: _raw(rgb=None), "missing modality 'rgb'"),
        (lambda: _raw(state=np.zeros(5, np.float32)), "'state' has shape (5,), expected (4,)"),
        (lambda: _raw(state=np.array([0, np.nan, 0, 0], np.float32)), "'state' contains NaN"),
        (lambda: _raw(rgb=np.zeros((8, 8, 3), np.float32)), "'rgb' has dtype float32, expected uint8"),
        (lambda: _raw(instruction=None), "missing text modality 'instruction'"),
        (lambda: _raw(instruction="   "), "text 'instruction' must have"),
        (lambda: _raw(depth=np.zeros(2, np.float32)), "unknown modality ['depth']"),
    ],
)
def test_malformed_requests_get_invalid_argument(serve, request_, message):
    server, client = serve(FakeSampler(), max_batch=2, warmup_rounds=0)
    with pytest.raises(grpc.RpcError) as err:
        client.act_raw(request_())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    np.testing.assert_allclose(client.act(_obs(2.0)), _expected(2.0))  # still serving
    assert server.stats()["invalid"] == 1


def test_truncated_bytes_and_policy_failure_keep_serving(serve):
    server, client = serve(FakeSampler(), max_batch=2, warmup_rounds=0)
    bad = _raw()
    bad.tensors["state"].CopyFrom(pb.Tensor(shape=[4], dtype="float32", data=b"\x00" * 7))
    with pytest.raises(grpc.RpcError) as err:
        client.act_raw(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "carries 7 bytes" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.act(_obs(text="explode"))
    assert err.value.code() == grpc.StatusCode.INTERNAL and "boom" in err.value.details()
    np.testing.assert_allclose(client.act(_obs(3.0)), _expected(3.0))
    assert server.worker.failed_batches == 1


def test_concurrent_requests_are_batched_and_routed(serve):
    sampler = FakeSampler(delay_s=0.03)
    server, client = serve(sampler, max_batch=8, max_wait_ms=20, warmup_rounds=0)
    n_threads, per_thread = 8, 4
    errors: list[str] = []
    sizes: list[int] = []
    barrier = threading.Barrier(n_threads)

    def worker(tid: int) -> None:
        own = PolicyClient(server.address)
        barrier.wait()
        for r in range(per_thread):
            i = tid + 0.01 * r
            chunk = own.act(_obs(i, "x" * (tid + 1)))
            sizes.append(own.last_info["batch_size"])
            if not np.allclose(chunk, _expected(i, "x" * (tid + 1)), atol=1e-5):
                errors.append(f"thread {tid} request {r} got {chunk[0, 0]}")
        own.close()

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors
    stats = server.stats()
    assert stats["served"] == n_threads * per_thread
    assert max(sizes) > 1 and stats["mean_batch"] >= 2.0, stats  # requests shared policy calls
    assert max(int(b) for b in stats["batch_sizes"]) <= 8


def test_closed_loop_clients_regroup_into_full_batches():
    """Requests queued during a call must still wait for the clients that call answered (they come back)."""
    from diffpolicy.serving.batching import BatchingWorker

    worker = BatchingWorker(FakeSampler(delay_s=0.03), max_batch=4, max_wait_ms=25)
    worker.wait_ready(5)
    rounds = 10

    def client(tid: int) -> None:
        time.sleep(0.005 * tid)  # staggered starts: the first call serves whoever came first
        for _ in range(rounds):
            worker.submit(_obs(float(tid))).result(10)
            time.sleep(0.002)  # the client's own round trip before it asks again

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    worker.close(5)
    assert worker.served == 4 * rounds
    assert worker.batch_sizes[4] >= rounds - 3, worker.batch_sizes  # full batches once the peak is known


def test_lone_client_never_waits_for_a_batch(serve):
    server, client = serve(FakeSampler(), max_batch=8, max_wait_ms=500, warmup_rounds=0)
    t0 = time.perf_counter()
    for i in range(5):
        client.act(_obs(float(i)))
        assert client.last_info["queue_ms"] < 100
    assert time.perf_counter() - t0 < 2.0  # 5 x max_wait_ms would be 2.5 s


def test_graceful_stop_finishes_in_flight_then_refuses(serve):
    server, client = serve(FakeSampler(delay_s=0.3), max_batch=2, warmup_rounds=0)
    result: dict = {}
    th = threading.Thread(target=lambda: result.update(chunk=client.act(_obs(1.0))))
    th.start()
    time.sleep(0.1)  # the request is inside the sampler
    server.stop(grace_s=5)
    th.join(5)
    np.testing.assert_allclose(result["chunk"], _expected(1.0))
    with pytest.raises(grpc.RpcError) as err:
        client.act(_obs(), timeout_s=1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_failed_warmup_never_opens_the_port():
    class Broken(FakeSampler):
        def act(self, obs_batch):
            raise RuntimeError("no weights")

    server = PolicyServer(Broken(), port=0)
    with pytest.raises(RuntimeError, match="no weights"):
        server.start()
    assert not server.serving and server.port == 0


def test_a_sampler_factory_runs_on_the_serving_thread(serve):
    built: list[str] = []

    def build() -> FakeSampler:
        built.append(threading.current_thread().name)
        return FakeSampler()

    server, client = serve(build, max_batch=2, warmup_rounds=0)
    assert built == ["diffpolicy-batcher"]  # loading, warm-up and every request share one thread
    assert isinstance(server.sampler, FakeSampler)
    assert {thread for _, _, thread in server.sampler.calls} == {"diffpolicy-batcher"}
    np.testing.assert_allclose(client.act(_obs(2.0)), _expected(2.0))
    assert client.health()["action_shape"] == (TA, DA)


def test_a_failing_factory_never_opens_the_port():
    def build() -> FakeSampler:
        raise FileNotFoundError("no checkpoint at /nowhere")

    server = PolicyServer(build, port=0)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        server.start()
    assert not server.serving and server.port == 0


def test_wire_roundtrip_big_endian_and_wrong_dtype():
    from diffpolicy.serving.wire import from_tensor

    a = np.arange(6, dtype=">f4").reshape(2, 3)
    np.testing.assert_array_equal(from_tensor(to_tensor(a)), a.astype("<f4"))
    with pytest.raises(ValueError, match="dtype 'int64'"):
        from_tensor(pb.Tensor(shape=[1], dtype="int64", data=b"\x00" * 8))


# ------------------------------------------------------------------------------ a real (tiny) checkpoint
def _tiny_checkpoint(root: Path) -> Path:
    import torch

    from diffpolicy import checkpoint
    from diffpolicy.config import EncoderConfig, PolicyConfig
    from diffpolicy.policies import make_policy

    cfg = PolicyConfig(
        down_dims=[8, 16],
        n_groups=4,
        cond_dim=16,
        horizon=8,
        n_action_steps=4,
        ddim_steps=3,
        train_timesteps=20,
        step_embed_dim=16,
        kernel_size=3,
        encoder=EncoderConfig(token_dim=16, fusion_heads=2, state_hidden=16),
    )
    obs_spec = {"state": [5], "instruction": None}
    policy = make_policy(cfg, obs_spec, 3, text_backend="hash")
    policy.fit_normalizers(actions=torch.randn(100, 3), state=torch.randn(100, 5))
    return checkpoint.save(
        root,
        1,
        {"policy": policy.state_dict()},
        config={"policy": dataclasses.asdict(cfg)},
        extra={"obs_spec": obs_spec, "action_dim": 3, "text_backend": "hash"},  # as policy_io writes it
    )


def test_policy_sampler_matches_the_policy(tmp_path):
    import torch

    from diffpolicy.policy_io import load_policy
    from diffpolicy.serving.sampler import sampler_from_checkpoint

    path = _tiny_checkpoint(tmp_path)
    sampler = sampler_from_checkpoint(path, deterministic=True)  # the checkpoint's text backend (hash)
    assert sampler.policy.obs_encoder.text.backend_name == "hash"
    assert sampler.action_shape == (8, 3) and sampler.obs_spec["instruction"].is_text
    batch = {
        "state": np.random.default_rng(0).normal(size=(3, 5)).astype(np.float32),
        "instruction": ["a"] * 3,
    }
    actions = sampler.act(batch)
    policy, _, _ = load_policy(path, deploy=True)
    obs = {"state": torch.from_numpy(batch["state"]), "instruction": batch["instruction"]}
    ref = policy.sample(obs, deterministic=True, generator=torch.Generator().manual_seed(0)).actions
    np.testing.assert_allclose(actions, ref.numpy(), atol=1e-6)


def test_serve_entry_point_ready_act_sigterm(tmp_path):
    path = _tiny_checkpoint(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "diffpolicy.serve",
        f"checkpoint={path}",
        "port=0",
        "max_batch=2",
        "device.threads=1",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["action_shape"] == [8, 3]
        with PolicyClient(ready["address"]) as client:
            chunk = client.act({"state": np.zeros(5, np.float32), "instruction": "pick the cube"})
            assert chunk.shape == (8, 3) and np.isfinite(chunk).all()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["served"] == 1 and summary["invalid"] == 0
    assert json.loads((tmp_path / "run" / "endpoint.json").read_text())["address"] == ready["address"]


def test_committed_stubs_match_the_proto(tmp_path):
    """The installed grpcio-tools, whichever release, regenerates stubs that define what the committed ones
    do (messages, fields, services, methods); the generator's version lines are not compared."""
    pytest.importorskip("grpc_tools")
    from diffpolicy.serving.codegen import check

    assert check(tmp_path) == []


def test_stub_interface_sees_a_changed_proto(tmp_path):
    """The comparison is not blind: a renamed field, a new method or a changed request type all differ."""
    pytest.importorskip("grpc_tools")
    from diffpolicy.serving import codegen

    text = codegen.PROTO.read_text()
    edits = [
        ("string session = 3;", "string session_id = 3;"),
        ("rpc Act(Observation) returns (ActionChunk);", "rpc Act(Observation) returns (ActionChunk);\n"
         "  rpc Reset(HealthRequest) returns (HealthResponse);"),
        ("rpc Act(Observation) returns (ActionChunk);", "rpc Act(Tensor) returns (ActionChunk);"),
    ]  # fmt: skip
    committed = codegen.interface(*codegen.STUBS)
    for i, (old, new) in enumerate(edits):
        assert old in text
        root = tmp_path / str(i)
        proto = root / codegen.PROTO.relative_to(codegen.ROOT)
        proto.parent.mkdir(parents=True)
        proto.write_text(text.replace(old, new))
        assert codegen.interface(*codegen.generate(root, proto, root)) != committed, new


def test_committed_stubs_run_on_every_release_the_deploy_extra_admits():
    """The stubs refuse a grpcio older than the grpcio-tools that generated them, and protobuf older than
    its protoc: the deploy extra's floors must be at least those versions, and the installed ones (which
    imported the stubs above) satisfy them."""
    import importlib.metadata as md
    import re

    from packaging.requirements import Requirement
    from packaging.version import Version

    from diffpolicy.serving import codegen, policy_pb2_grpc

    floors = {}
    for line in md.requires("diffpolicy") or []:
        req = Requirement(line)
        deploy = req.marker is not None and req.marker.evaluate({"extra": "deploy"})
        if deploy and req.name in ("grpcio", "protobuf"):
            floors[req.name] = min(Version(s.version) for s in req.specifier if s.operator in (">=", "=="))
    pb2 = codegen.STUBS[0].read_text()
    gencode = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),", pb2)
    assert gencode, "policy_pb2.py has no protobuf runtime-version check"
    assert floors["protobuf"] >= Version(".".join(gencode.groups()))
    assert floors["grpcio"] >= Version(policy_pb2_grpc.GRPC_GENERATED_VERSION)
    assert Version(grpc.__version__) >= Version(policy_pb2_grpc.GRPC_GENERATED_VERSION)
    assert Version(md.version("protobuf")) >= Version(".".join(gencode.groups()))


def test_serve_benchmark_wiring():
    """The benchmark builds its policy on the serving thread and reports the sampler time from there; the
    client levels run in a separate process, once per repeat, and their latencies are pooled."""
    from diffpolicy.benchmarks.serve import run

    out = run(
        repeats=2, clients=(1, 2), duration_s=0.2, min_requests=2, max_batch=2, horizon=16, ddim_steps=2
    )
    assert out["inprocess_ms"] > 0 and out["served_ms"] >= out["inprocess_ms"]
    assert out["requests_1"] >= 2 * 2 and out["requests_2"] >= 2 * 2 * 2  # repeats x clients x min_requests
    assert out["rps_1"] > 0 and out["rps_2"] > 0 and out["inprocess_ms_b2"] > 0 and out["batch_bound"] > 0
