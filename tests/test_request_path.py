"""docs/architecture.md lists every file of ours that one streamed chat request on the default model crosses,
and says how many: the request, traced through the running server (bench/request_path.py), must cross exactly
those. So the table cannot drift from the code: a file the path grows into, or one it stops using, fails here."""

from __future__ import annotations

import re
from pathlib import Path

from bench.request_path import trace_request
from engine.config import EngineConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def documented_path() -> tuple[int, list[str]]:
    """(the number of files the doc states, the files its table lists)."""
    section = DOC.read_text().split("## One streamed chat request, HTTP to token", 1)[1].split("\n## ", 1)[0]
    stated = int(re.search(r"crosses (\d+) of our files", section).group(1))
    return stated, re.findall(r"^\| \d+ \| `([^`]+)` \|", section, flags=re.MULTILINE)


def test_a_streamed_chat_request_crosses_exactly_the_files_the_architecture_doc_lists() -> None:
    stated, listed = documented_path()
    assert len(listed) == len(set(listed)) == stated, (stated, listed)
    seen = set(trace_request(EngineConfig()))
    assert seen == set(listed), f"crossed, not listed: {sorted(seen - set(listed))}; listed, not crossed: " + str(
        sorted(set(listed) - seen)
    )
