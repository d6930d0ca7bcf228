"""docs/architecture.md traces one streamed chat request through twelve files: each of them must really run
for such a request on the default model (bench/request_path.py profiles one)."""

from __future__ import annotations

import re
from pathlib import Path

from bench.request_path import trace_request
from engine.config import EngineConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def documented_path() -> list[str]:
    section = DOC.read_text().split("## One streamed chat request, HTTP to token", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| \d+ \| `([^`]+)` \|", section, flags=re.MULTILINE)


def test_the_documented_request_path_is_twelve_files_that_a_streamed_chat_request_runs_through() -> None:
    path = documented_path()
    assert len(path) == len(set(path)) == 12, path
    seen = trace_request(EngineConfig())
    missing = [f for f in path if f not in seen]
    assert not missing, f"documented but not run: {missing}"
