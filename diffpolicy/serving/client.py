"""A small blocking client of the action server.

::

    from diffpolicy.serving.client import PolicyClient

    with PolicyClient("127.0.0.1:50051") as client:
        client.wait_ready(timeout_s=30)
        chunk = client.act({"state": state, "rgb": image, "instruction": "put the red cube in the tray"})
        # chunk: (Ta, Da) float32; execute the first Te rows, then ask again

A server of a base + residual policy (``health()["per_step"]``) answers one control step at a time: send
every step's observation with the episode's session id and execute the one action (1, Da) it returns::

        action = client.act(obs, session=f"{robot}/{episode}")[0]  # (Da,)

A server of a policy that reads a dialogue (``health()["dialogue"]``) keeps each session's utterances: send the
session id with every request, and ``instruction`` only when something new is said::

        chunk = client.act({**obs, "instruction": "put the red cube in the yellow tray"}, session=episode)
        chunk = client.act(obs, session=episode)  # nothing new said: the same dialogue
        chunk = client.act({**obs, "instruction": "no, not the red one, the blue one"}, session=episode)

Arrays are cast to the dtype the server's spec asks for (fetched once with ``Health``); strings are sent
as text. Errors are ``grpc.RpcError``: ``code()`` is INVALID_ARGUMENT for a malformed observation (the
message names the modality), UNAVAILABLE when the server is down or shutting down.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
import numpy as np

from diffpolicy.serving import policy_pb2 as pb
from diffpolicy.serving import policy_pb2_grpc as pb_grpc
from diffpolicy.serving.wire import ObsSpec, encode_observation, from_tensor, spec_from_pb

_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class PolicyClient:
    """Blocking client: ``act(obs) -> (Ta, Da)``; thread-safe (one channel, many concurrent calls)."""

    def __init__(self, address: str, *, timeout_s: float = 10.0) -> None:
        """
        Args:
            address: ``host:port`` of a running ``python -m diffpolicy.serve``.
            timeout_s: deadline of each call (s).
        """
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address, options=_OPTIONS)
        self._stub = pb_grpc.PolicyStub(self._channel)
        self._spec: ObsSpec | None = None
        self.last_info: dict[str, float] = {}
        """How the latest :meth:`act` (of any thread) was served: batch_size, queue_ms, compute_ms."""

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the channel connects (the server opens its port only after warm-up)."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout_s)

    def health(self) -> dict[str, Any]:
        """Status (``SERVING`` / ``NOT_SERVING``), spec, action shape (Ta, Da), max_batch, requests served
        ``per_step`` (True: the server answers one action per control step of a session) and ``dialogue``
        (True: the server keeps each session's utterances; send ``instruction`` only when one is said)."""
        resp = self._stub.Health(pb.HealthRequest(), timeout=self.timeout_s)
        self._spec = spec_from_pb(resp.modalities)
        return {
            "status": pb.HealthResponse.Status.Name(resp.status),
            "obs_spec": self._spec,
            "action_shape": tuple(resp.action_shape),
            "max_batch": resp.max_batch,
            "served": resp.served,
            "per_step": resp.per_step,
            "dialogue": resp.dialogue,
        }

    @property
    def obs_spec(self) -> ObsSpec:
        """The server's observation spec (fetched on first use)."""
        if self._spec is None:
            self.health()
        return self._spec  # type: ignore[return-value]

    def act(
        self, obs: Mapping[str, np.ndarray | str], *, session: str = "", timeout_s: float | None = None
    ) -> np.ndarray:
        """One observation (no batch axis) -> action chunk (Ta, Da) float32 in environment units.

        ``session``: id of the robot's episode, required by a per-step server (then the chunk is (1, Da):
        this control step's action); a new id starts a new episode (a fresh base chunk)."""
        request = encode_observation(obs, self.obs_spec)
        request.session = session
        resp = self._stub.Act(request, timeout=self.timeout_s if timeout_s is None else timeout_s)
        self.last_info = {
            "batch_size": resp.batch_size,
            "queue_ms": resp.queue_ms,
            "compute_ms": resp.compute_ms,
        }
        return from_tensor(resp.actions, "actions").copy()

    def act_raw(self, request: pb.Observation, *, timeout_s: float | None = None) -> pb.ActionChunk:
        """Send a hand-built ``Observation`` message (no casting, no checks); returns the raw reply."""
        return self._stub.Act(request, timeout=self.timeout_s if timeout_s is None else timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
