"""Serving a trained policy to a robot: gRPC service, dynamic batching, client.

- ``policy.proto``: the wire format (``Act(Observation) -> ActionChunk``, ``Health``); ``policy_pb2*.py``
  are the committed stubs (``python -m diffpolicy.serving.codegen`` regenerates them).
- :mod:`~diffpolicy.serving.wire`: observation spec, array <-> message, request validation.
- :mod:`~diffpolicy.serving.batching`: the ``Sampler`` protocol and the dynamic-batching worker.
- :mod:`~diffpolicy.serving.server`: :class:`PolicyServer` (warm-up, gRPC, graceful stop).
- :mod:`~diffpolicy.serving.client`: :class:`PolicyClient` (``act(obs) -> (Ta, Da)``).
- :mod:`~diffpolicy.serving.sampler`: the checkpoint -> ``Sampler`` adapter over ``DiffusionPolicy``, and
  the per-step ``ResidualSampler`` of a base + residual checkpoint (one action per control step of a
  session).

The entry point is ``python -m diffpolicy.serve checkpoint=PATH port=50051``. Nothing here imports torch
except the checkpoint adapter, so a robot-side process needs only numpy, grpcio and protobuf.
"""
