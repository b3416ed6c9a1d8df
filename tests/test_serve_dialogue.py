"""Serving a policy that reads a dialogue (issue 62): the server keeps each session's utterances, a request
says only what is new, a correction mid-episode reaches the policy beside the instruction it corrects; through
the real client and ``python -m diffpolicy.serve``."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from diffpolicy import checkpoint
from diffpolicy.serving.client import PolicyClient
from diffpolicy.serving.dialogue import Dialogues
from diffpolicy.serving.wire import InvalidObservation

ROOT = Path(__file__).resolve().parents[1]
FIRST = "put the red cube in the yellow tray"
CORRECTION = "no, not the red one, the blue one"


def _memory_checkpoint(root: Path) -> Path:
    """A tiny state + instruction diffusion policy that reads its instruction through a memory of 2 tokens."""
    import torch

    from diffpolicy.config import EncoderConfig, PolicyConfig
    from diffpolicy.policies import make_policy

    cfg = PolicyConfig(
        down_dims=[16, 32], cond_dim=16, horizon=8, n_action_steps=4, ddim_steps=3, train_timesteps=20,
        step_embed_dim=16, kernel_size=3,
        encoder=EncoderConfig(token_dim=16, fusion_heads=2, state_hidden=16, text_memory=2),
    )  # fmt: skip
    obs_spec = {"state": [5], "instruction": None}
    torch.manual_seed(0)
    policy = make_policy(cfg, obs_spec, 3, text_backend="hash")
    policy.fit_normalizers(actions=torch.randn(100, 3), state=torch.randn(100, 5))
    return checkpoint.save(
        root,
        1,
        {"policy": policy.state_dict()},
        config={"policy": dataclasses.asdict(cfg)},
        extra={"obs_spec": obs_spec, "action_dim": 3, "text_backend": "hash"},
    )


def test_dialogues_keep_each_sessions_utterances():
    d = Dialogues(max_sessions=2, max_turns=3)
    assert d.hear("a", FIRST) == FIRST
    assert d.hear("a", None) == FIRST and d.hear("a", "") == FIRST  # nothing new said
    assert d.hear("a", CORRECTION) == f"{FIRST}\n{CORRECTION}"
    assert d.hear("b", "one\ntwo") == "one\ntwo"  # several utterances in one request, one per line
    assert d.hear("a", "x\ny") == f"{CORRECTION}\nx\ny"  # at most 3 turns kept
    d.hear("c", "hello")  # a third session: the least recently heard ("b") is forgotten
    assert d.turns("b") == [] and len(d) == 2


@pytest.mark.parametrize("session,said,match", [("", FIRST, "session"), ("new", None, "first request")])
def test_dialogues_refuse_in_one_line(session, said, match):
    with pytest.raises(InvalidObservation, match=match):
        Dialogues().hear(session, said)


def test_server_gives_the_policy_the_whole_dialogue(tmp_path):
    from diffpolicy.serving.sampler import sampler_from_checkpoint
    from diffpolicy.serving.server import PolicyServer

    sampler = sampler_from_checkpoint(_memory_checkpoint(tmp_path), deterministic=True)
    assert sampler.dialogue
    seen: list[list[str]] = []
    act = sampler.act

    def recording(batch):
        seen.append(list(batch["instruction"]))
        return act(batch)

    sampler.act = recording
    state = np.zeros(5, np.float32)
    with PolicyServer(sampler, max_batch=1, warmup_rounds=0, warmup_sizes="ends") as server:
        seen.clear()  # warm-up calls
        with PolicyClient(server.address) as client:
            assert client.health()["dialogue"] is True
            a = client.act({"state": state, "instruction": FIRST}, session="robot/1")
            b = client.act({"state": state}, session="robot/1")
            c = client.act({"state": state, "instruction": CORRECTION}, session="robot/1")
            other = client.act(
                {"state": state, "instruction": "put the green cube in the purple tray"}, session="robot/2"
            )
            with pytest.raises(grpc.RpcError) as err:
                client.act({"state": state}, session="robot/3")
            assert (
                err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                and "first request" in err.value.details()
            )
            with pytest.raises(grpc.RpcError) as err:
                client.act({"state": state, "instruction": FIRST})
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "session" in err.value.details()
    assert seen == [[FIRST], [FIRST], [f"{FIRST}\n{CORRECTION}"], ["put the green cube in the purple tray"]]
    assert a.shape == b.shape == c.shape == other.shape == (8, 3)
    assert not np.allclose(a, c)  # the correction changes what the policy does


def test_serve_entry_point_answers_a_corrected_session(tmp_path):
    path = _memory_checkpoint(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "diffpolicy.serve", f"checkpoint={path}", "port=0", "max_batch=2",
           "device.threads=1", f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready"
        with PolicyClient(ready["address"]) as client:
            assert client.health()["dialogue"] is True
            state = np.zeros(5, np.float32)
            for said in (FIRST, None, CORRECTION, None):
                obs = {"state": state, **({"instruction": said} if said else {})}
                chunk = client.act(obs, session="arm/episode-7")
                assert chunk.shape == (8, 3) and np.isfinite(chunk).all()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["served"] == 4 and summary["invalid"] == 0
