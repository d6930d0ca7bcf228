"""A result as it is written: markdown (printed and written to --out) and its raw data as JSON beside it,
both stamped with the command that made them and the commit it ran at.

The command is the one a person would type: the script's own (`python -m bench.NAME ARGS`), or, when
`headroom bench reproduce NAME` runs it, that (the reproduce command sets COMMAND_ENV)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND_ENV = "HEADROOM_BENCH_COMMAND"


def git_commit() -> str:
    """HEAD's short hash, `+dirty` when the work tree has changes; `unknown` outside a checkout."""

    def git(*args: str) -> str:
        r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return r.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def command_line(prog: str, argv: list[str] | None = None) -> str:
    """`prog` (e.g. `python -m bench.oracle`) and the arguments (sys.argv[1:] by default), shell-quoted."""
    if os.environ.get(COMMAND_ENV):
        return os.environ[COMMAND_ENV]
    args = sys.argv[1:] if argv is None else argv
    return " ".join([prog, *(shlex.quote(a) for a in args)])


class Stamp:
    """The command and commit of one run, taken when the run starts."""

    def __init__(self, prog: str, argv: list[str] | None = None) -> None:
        self.command = command_line(prog, argv)
        self.commit = git_commit()

    def line(self) -> str:
        return f"Command: `{self.command}`, at commit {self.commit}."

    def fields(self) -> dict[str, str]:
        return {"command": self.command, "commit": self.commit}


def stamped(lines: list[str], stamp: Stamp) -> list[str]:
    """`lines` with the stamp line after the title (a first `# ` line), else first."""
    at = 1 if lines and lines[0].startswith("# ") else 0
    head = ["", stamp.line()] if at else [stamp.line(), ""]
    return [*lines[:at], *head, *lines[at:]]


def stamp_data(data: object, stamp: Stamp) -> dict[str, object]:
    """The JSON document: a dict gets `command` and `commit` first; anything else goes under `runs`."""
    body = data if isinstance(data, dict) else {"runs": data}
    return {**stamp.fields(), **{k: v for k, v in body.items() if k not in ("command", "commit")}}


def write_report(out: str | Path | None, lines: list[str], stamp: Stamp, data: object = None) -> None:
    """Print the stamped markdown and write it to `out`; `data` (if any) beside it, same name, .json.
    `data` None: the raw data already lives elsewhere (e.g. the matrix JSONs a report is built from)."""
    text = "\n".join(stamped(lines, stamp)) + "\n"
    print(text)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if data is not None:
            write_json(path.with_suffix(".json"), stamp_data(data, stamp))


def write_json(path: Path, doc: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
