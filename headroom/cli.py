"""The `headroom` console script: generate, serve, bench.

It lives above engine/ and bench/ so that neither imports the other's commands: bench drives the engine, the
engine knows nothing of bench, and this module is the one place that names both. Each command module has
`register(subparsers)`; flags come from the config dataclasses (engine/config.py), each documented once there.
"""

from __future__ import annotations

import argparse
import sys

from bench import cli as bench_cli
from engine import cli as generate_cli
from engine.openmp import reexec_with_intel_openmp
from engine.serving import cli as serve_cli


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="headroom", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    for commands in (generate_cli, serve_cli, bench_cli):
        commands.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a command line, not a call from Python: the process is ours to re-execute
        reexec_with_intel_openmp()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
