"""The shared shell of every entry point (``python -m diffpolicy.<name>``): Hydra in, one JSON line out.

Only entry points (and this module, which they call) import Hydra. An entry point is a function
``main(cfg, run_dir) -> dict`` taking its typed config; :func:`launch` composes the configuration with
Hydra (overrides, ``-m`` multirun, ``--cfg job``), turns it into the typed dataclass (running every
``__post_init__`` validation), runs the job in its Hydra run directory, writes ``summary.json`` there and
prints the summary as the last line on stdout.

Bad input never produces a traceback wall: an unknown key, a wrong type, an out-of-range value, a missing
device or a bad checkpoint exits with status 2 and one line ``error: ...`` on stderr.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from diffpolicy.checkpoint import CheckpointError
from diffpolicy.device import DeviceError

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
"""The Hydra configuration tree shipped with the repository (found from any working directory)."""

USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    TypeError,
    DeviceError,
    CheckpointError,
    FileNotFoundError,
)
"""Exceptions that mean bad input: reported as one line, exit status 2."""

_HYDRA_FLAGS_NO_JOB = (
    "--help",
    "-h",
    "--hydra-help",
    "--cfg",
    "-c",
    "--info",
    "--version",
    "--shell-completion",
)


class NotBuiltYet(RuntimeError):
    """A stage of the pipeline that a later milestone delivers."""


def fail(message: str, code: int = 2) -> None:
    """Print ``error: message`` (one line) on stderr and exit with ``code``."""
    line = " ".join(str(message).split())
    sys.stderr.write(f"error: {line}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def _omegaconf_line(exc: BaseException) -> str:
    """One line from an OmegaConf / Hydra composition error, naming the key when known."""
    cause = exc.__cause__ or exc
    key = getattr(cause, "full_key", None)
    msg = getattr(cause, "msg", None) or str(cause)
    msg = msg.splitlines()[0] if msg else type(cause).__name__
    if key:
        return f"config key '{key}': {msg}"
    return f"{str(exc).splitlines()[0]} ({msg})" if cause is not exc else msg


def _first_of_sweeps(overrides: list[str]) -> list[str]:
    """Replace every sweep (``a=1,2`` / ranges / choices) by its first value, for up-front validation."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    out = []
    for ov in parser.parse_overrides(overrides):
        if ov.is_sweep_override():
            first = next(iter(ov.sweep_string_iterator()))
            out.append(f"{ov.get_key_element()}={first}")
        else:
            out.append(ov.input_line)
    return out


def to_typed(cfg: Any) -> Any:
    """OmegaConf (structured) config -> its dataclass, running every ``__post_init__`` validation."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)


def compose(config_name: str, overrides: list[str] | None = None) -> Any:
    """Compose ``conf/<config_name>.yaml`` with overrides and return the typed, validated dataclass.

    This is the programmatic face used by tests and benchmarks (no run directory, no logging setup).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from diffpolicy.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
    return to_typed(cfg)


def _prevalidate(config_name: str, args: list[str]) -> None:
    """Compose once before Hydra starts the job so that bad overrides fail in one line."""
    if any(a in _HYDRA_FLAGS_NO_JOB or a.startswith("--cfg") for a in args):
        return
    overrides = [a for a in args if not a.startswith("-")]
    try:
        if "-m" in args or "--multirun" in args:
            overrides = _first_of_sweeps(overrides)
        overrides = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
        compose(config_name, overrides)
    except USER_ERRORS as exc:  # raised by __post_init__
        fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    except Exception as exc:  # Hydra / OmegaConf composition errors
        fail(_omegaconf_line(exc))


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        return obj.item()
    return obj


def summary_line(summary: dict[str, Any]) -> str:
    """The one JSON line an entry point prints last."""
    return json.dumps(_json_safe(summary), sort_keys=False)


def _first_override(args: list[str]) -> int:
    """Index of the first Hydra override in ``args`` (``key=value``, ``+key=v``, ``~key``), else len(args).
    Option values (``--cfg job``, ``--info defaults``) hold neither ``=`` nor a leading ``~``."""
    for i, a in enumerate(args):
        if not a.startswith("-") and (a.startswith("~") or "=" in a):
            return i
    return len(args)


def launch(
    config_name: str, main: Callable[[Any, Path], dict[str, Any]], argv: list[str] | None = None
) -> None:
    """Run ``main(typed_cfg, run_dir)`` under Hydra for ``conf/<config_name>.yaml``.

    Args:
        config_name: primary config name (``train``, ``collect``, ...).
        main: the job; returns the summary dict printed as the last stdout line.
        argv: command-line arguments (defaults to ``sys.argv[1:]``).
    """
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from diffpolicy.config import register_configs

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("MUJOCO_GL", "egl")
    args = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    _prevalidate(config_name, args)

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")
    def _job(cfg: Any) -> None:
        try:
            typed = to_typed(cfg)
        except Exception as exc:
            fail(_omegaconf_line(exc) if not isinstance(exc, USER_ERRORS) else str(exc))
        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            summary = main(typed, run_dir)
        except NotBuiltYet as exc:
            fail(f"not built yet: {exc}", code=3)
        except (DeviceError, CheckpointError, FileNotFoundError) as exc:
            fail(str(exc) or type(exc).__name__)
        except (ValueError, TypeError) as exc:
            if os.environ.get("DIFFPOLICY_DEBUG"):
                raise
            fail(f"{str(exc) or type(exc).__name__} (DIFFPOLICY_DEBUG=1 shows the traceback)")
        if summary is None:
            return
        line = summary_line(summary)
        (run_dir / "summary.json").write_text(line + "\n")
        sys.stdout.flush()
        print(line, flush=True)

    if not any(a.lstrip("+~").startswith("hydra.job.name=") for a in args):
        # Hydra names the job after the module that calls hydra.main (this one): name it after the entry
        # point instead, so runs land in runs/<entry>/<date>/ as documented
        # beside the other overrides: argparse takes Hydra's overrides as one run of positional arguments
        # (``algo=x --cfg job hydra.job.name=...`` would split them)
        args.insert(_first_override(args), f"hydra.job.name={config_name}")
    sys.argv = [sys.argv[0], *args]
    _job()
