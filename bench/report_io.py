"""Where a benchmark script's results go: the markdown report on stdout and in --out, its raw data (if
any) beside it as JSON (same name, .json)."""

from __future__ import annotations

import json
from pathlib import Path


def write_report(out: str | Path | None, lines: list[str], data: object = None) -> None:
    """`data` None: the raw data already lives elsewhere (e.g. the matrix JSONs a report is built from)."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if data is not None:
            path.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
