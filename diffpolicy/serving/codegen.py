"""Regenerate the committed gRPC stubs from ``policy.proto``: ``python -m diffpolicy.serving.codegen``
(``--check``: only say whether the committed stubs define what the proto does).

Needs ``grpcio-tools`` (the ``deploy`` extra). The stubs are generated relative to the repository root, so
``policy_pb2_grpc.py`` imports ``diffpolicy.serving.policy_pb2`` (a package import, not a top-level one).
The generated files carry runtime-version checks: the installed ``protobuf`` must be at least the version
of the ``protoc`` bundled with the ``grpcio-tools`` that generated them (``policy_pb2.py``), and ``grpcio``
at least that ``grpcio-tools`` release (``GRPC_GENERATED_VERSION`` in ``policy_pb2_grpc.py``); the deploy
extra's floors are those versions.

:func:`interface` reads what a pair of stubs defines — messages, fields, enums, services and methods — and
nothing of who generated them, so stubs from two ``grpcio-tools`` releases compare equal when they describe
the same proto.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

PROTO = Path(__file__).with_name("policy.proto")
ROOT = Path(__file__).resolve().parents[2]


def generate(out_dir: Path = ROOT, proto: Path = PROTO, root: Path = ROOT) -> list[Path]:
    """Run grpc_tools.protoc on ``proto`` (a file under ``root``, whose relative path names the generated
    modules); return the written ``*_pb2.py`` and ``*_pb2_grpc.py`` (under ``out_dir``)."""
    from grpc_tools import protoc

    rel = proto.resolve().relative_to(root.resolve())
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{root}", f"-I{include}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"]
    if protoc.main([*args, str(rel)]) != 0:
        raise RuntimeError(f"protoc failed on {rel}")
    stem = rel.with_suffix("")
    return [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2_grpc.py"]


STUBS = (PROTO.with_name("policy_pb2.py"), PROTO.with_name("policy_pb2_grpc.py"))
_CALL_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _file_descriptor(pb2_source: str):
    """The FileDescriptorProto a ``*_pb2.py`` registers (the bytes literal of its ``AddSerializedFile``)."""
    from google.protobuf import descriptor_pb2

    for node in ast.walk(ast.parse(pb2_source)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "AddSerializedFile":
            return descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(node.args[0]))
    raise ValueError("no AddSerializedFile(...) call: not a protoc-generated *_pb2.py")


def _message_name(node: ast.expr) -> str:
    """``module.Observation.SerializeToString`` -> ``Observation``."""
    inner = node.value if isinstance(node, ast.Attribute) else None
    return inner.attr if isinstance(inner, ast.Attribute) else "?"


def interface(pb2: Path, pb2_grpc: Path) -> dict[str, Any]:
    """What the stubs define, whatever release generated them.

    ``messages``: per message, its fields as (name, number, label, type, type name, proto3 optional, oneof
    index), its oneofs, whether it is a map's entry, and its nested messages and enums; ``enums``: per
    top-level enum its values; ``services``: per method of the proto's services (``/package.Service/Method``)
    its (request, response, client streaming, server streaming); ``client`` and ``server``: the same four per
    method as ``policy_pb2_grpc.py``'s stub and servicer registration wire them (streaming from the call's
    kind)."""
    fd = _file_descriptor(pb2.read_text())

    def message(m) -> dict[str, Any]:
        return {
            "fields": [
                (
                    f.name,
                    f.number,
                    f.label,
                    f.type,
                    f.type_name,
                    f.proto3_optional,
                    f.oneof_index if f.HasField("oneof_index") else None,
                )
                for f in m.field
            ],  # fmt: skip
            "oneofs": [o.name for o in m.oneof_decl],
            "map_entry": m.options.map_entry,
            "nested": {n.name: message(n) for n in m.nested_type},
            "enums": {e.name: [(v.name, v.number) for v in e.value] for e in m.enum_type},
        }

    def short(type_name: str) -> str:  # ".diffpolicy.serving.Observation" -> "Observation"
        return type_name.rsplit(".", 1)[-1]

    services = {
        f"/{fd.package}.{s.name}/{m.name}": (
            short(m.input_type),
            short(m.output_type),
            m.client_streaming,
            m.server_streaming,
        )
        for s in fd.service
        for m in s.method
    }
    client: dict[str, tuple] = {}
    server: dict[str, tuple] = {}
    for node in ast.walk(ast.parse(pb2_grpc.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        kw = {k.arg: k.value for k in node.keywords}
        kind = node.func.attr
        if kind in _CALL_KINDS and getattr(node.func.value, "id", "") == "channel":  # the stub's __init__
            path = ast.literal_eval(node.args[0])
            req, resp = _message_name(kw["request_serializer"]), _message_name(kw["response_deserializer"])
            client[path] = (req, resp, kind.startswith("stream"), kind.endswith("_stream"))
        elif kind.endswith("_rpc_method_handler") and kind.removesuffix("_rpc_method_handler") in _CALL_KINDS:
            kind = kind.removesuffix("_rpc_method_handler")
            method = node.args[0].attr  # servicer.Act
            req, resp = _message_name(kw["request_deserializer"]), _message_name(kw["response_serializer"])
            server[method] = (req, resp, kind.startswith("stream"), kind.endswith("_stream"))
    return {
        "package": fd.package,
        "messages": {m.name: message(m) for m in fd.message_type},
        "enums": {e.name: [(v.name, v.number) for v in e.value] for e in fd.enum_type},
        "services": services,
        "client": client,
        "server": {f"/{fd.package}.{s.name}/{m}": v for s in fd.service for m, v in server.items()},
    }


def check(out_dir: Path) -> list[str]:
    """Regenerate into ``out_dir`` and list how the committed stubs differ from the proto (empty: in step)."""
    fresh, committed = interface(*generate(out_dir)), interface(*STUBS)
    problems = [f"{key} differ from policy.proto's" for key in fresh if fresh[key] != committed[key]]
    if committed["client"] != committed["services"] or committed["server"] != committed["services"]:
        problems.append("policy_pb2_grpc.py wires other methods than the proto's services declare")
    return problems


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            problems = check(Path(tmp))
        for line in problems:
            print(f"stale stubs: {line}; regenerate: python -m diffpolicy.serving.codegen", file=sys.stderr)
        sys.exit(1 if problems else 0)
    if sys.argv[1:]:
        sys.exit("usage: python -m diffpolicy.serving.codegen [--check]")
    for path in generate():
        print(path)
    sys.exit(0)
