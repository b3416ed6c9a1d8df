"""Regenerate the committed gRPC stubs from ``policy.proto``: ``python -m diffpolicy.serving.codegen``.

Needs ``grpcio-tools`` (the ``deploy`` extra). The stubs are generated relative to the repository root, so
``policy_pb2_grpc.py`` imports ``diffpolicy.serving.policy_pb2`` (a package import, not a top-level one).
The generated files carry a protobuf runtime-version check: the installed ``protobuf`` must be at least the
version of the ``protoc`` bundled with the ``grpcio-tools`` that generated them (see ``policy_pb2.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO = Path(__file__).with_name("policy.proto")
ROOT = Path(__file__).resolve().parents[2]


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Run grpc_tools.protoc on ``policy.proto``; return the written files (under ``out_dir``)."""
    from grpc_tools import protoc

    rel = PROTO.resolve().relative_to(ROOT)
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main([*args, str(rel)]) != 0:
        raise RuntimeError(f"protoc failed on {rel}")
    stem = rel.with_suffix("")
    return [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2_grpc.py"]


if __name__ == "__main__":
    for path in generate():
        print(path)
    sys.exit(0)
