"""`headroom serve`: the server's and the engine's flags, made into their configs, then `launch.serve`.

Also runnable as `python -m engine.serving.cli [flags]` (same flags), which tests use so they do not depend
on the other subcommands importing.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from functools import partial
from typing import Any

from engine.cli import add_config_flags, config_from_args
from engine.config import EngineConfig, ServerConfig
from engine.openmp import reexec_with_intel_openmp


def add_serve_args(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, ServerConfig)
    # the twin backend sleeps its modelled step time, so clients see real latency
    add_config_flags(p, EngineConfig, policy="adaptive", realtime=True)


def configs(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    """The configs the flags describe; keys not given as flags come from $HEADROOM_API_KEY / $HEADROOM_ADMIN_KEY."""
    scfg = config_from_args(p, ServerConfig, args)
    scfg = dataclasses.replace(
        scfg,
        api_key=scfg.api_key or os.environ.get("HEADROOM_API_KEY") or None,
        admin_key=scfg.admin_key or os.environ.get("HEADROOM_ADMIN_KEY") or None,
    )
    return config_from_args(p, EngineConfig, args), scfg


def _serve(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    ecfg, scfg = configs(p, args)
    if scfg.on_ray:
        try:
            from engine.serving.ray_serve.launcher import serve_fleet
        except ImportError as e:
            p.error(f"--replicas and --ray-address need Ray Serve ({e}): pip install 'headroom[ray]'")
        return serve_fleet(ecfg, scfg)
    from engine.serving.launch import serve

    return serve(ecfg, scfg)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API", description=__doc__)
    add_serve_args(p)
    p.set_defaults(func=partial(_serve, p))


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a command line, not a call from Python: the process is ours to re-execute
        reexec_with_intel_openmp()
    p = argparse.ArgumentParser(prog="headroom serve", description=__doc__)
    add_serve_args(p)
    return _serve(p, p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
