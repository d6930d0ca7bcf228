"""Which of Headroom's files one streamed chat request runs through, from HTTP to its last token.

    python -m bench.request_path [--backend twin]

Serves the request in process (FastAPI's TestClient) with a profile hook on every thread, after one warm-up
request, and prints each of our files whose functions ran, with those functions. docs/architecture.md traces
the request's own path through thirteen of them; tests/test_request_path.py checks that those are real.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from fastapi.testclient import TestClient

from engine.config import EngineConfig, ServerConfig
from engine.serving.launch import build_app

ROOT = Path(__file__).resolve().parents[1]
OURS = ("engine", "controller", "telemetry")
CHAT = {
    "model": "default",
    "messages": [{"role": "user", "content": "Say hi"}],
    "max_tokens": 4,
    "stream": True,
    "temperature": 0,
}


def trace_request(config: EngineConfig) -> dict[str, set[str]]:
    """Our files (relative to the repository) and the functions of each that one streamed chat request ran."""
    seen: dict[str, set[str]] = {}
    active = False

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if active and event == "call":
            path = os.path.relpath(frame.f_code.co_filename, ROOT)
            if path.split(os.sep, 1)[0] in OURS:
                seen.setdefault(path, set()).add(frame.f_code.co_name)

    threading.setprofile(profile)  # the engine thread starts with the app, below
    sys.setprofile(profile)
    try:
        with TestClient(build_app(config, ServerConfig())) as client:
            client.post("/v1/chat/completions", json=CHAT).raise_for_status()  # first-use costs out of the way
            active = True
            client.post("/v1/chat/completions", json=CHAT).raise_for_status()
            active = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="torch", choices=["torch", "twin"])
    args = p.parse_args()
    seen = trace_request(EngineConfig(backend=args.backend))
    for path, functions in seen.items():
        print(f"{path}: {', '.join(sorted(functions))}")
    print(f"{len(seen)} files")


if __name__ == "__main__":
    main()
