"""Prebuild the compiled kernels for this machine: ``python -m diffpolicy.ops [--verbose]``.

Prints one JSON line, kernel -> device type -> "compiled" or why the pure-torch path will run. Exits 0
even when a kernel cannot be built (the pure-torch implementation then runs), 1 when a CPU kernel
cannot and ``--strict`` is given.
"""

import argparse
import json
import sys

from diffpolicy.ops import build


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m diffpolicy.ops", description=__doc__.splitlines()[0])
    parser.add_argument("--verbose", action="store_true", help="show compiler output")
    parser.add_argument("--strict", action="store_true", help="fail when a CPU kernel cannot be built")
    args = parser.parse_args()
    status = build(verbose=args.verbose)
    print(json.dumps(status))
    failed = [k for k, devices in status.items() if devices.get("cpu", "compiled") != "compiled"]
    return 1 if args.strict and failed else 0


if __name__ == "__main__":
    sys.exit(main())
