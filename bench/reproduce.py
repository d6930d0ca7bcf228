"""`headroom bench reproduce NAME|all`: run experiments of bench/experiments.py and rewrite their results;
`--list` lists every result with its command; `--check` re-runs deterministic (twin) experiments into a temp
dir and compares them with the committed files, every field but the wall time and the command stamp."""

from __future__ import annotations

import argparse
import difflib
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.experiments import BY_NAME, EXPERIMENTS, RESULTS, Experiment
from bench.harness.report import COMMAND_ENV, ROOT

MAX_DIFF_LINES = 40
VOLATILE_KEYS = frozenset({"wall_s", "command", "commit"})
# a command in backticks (the stamp, or a command quoted in a report's text) and a wall time are not results
COMMAND_SPAN = re.compile(r"`(?:LD_PRELOAD=\S+ )?(?:\.venv/bin/)?(?:python|headroom)\b[^`]*`:?\s*")
VOLATILE_LINE = re.compile(r"^Command:|wall[ _]time|at commit", re.IGNORECASE)


def argv_of(command: str) -> list[str]:
    """A typed command as this interpreter runs it: `headroom ...` is `python -m headroom.cli ...`; leading
    VAR=value words set the environment (through `env`)."""
    words = shlex.split(command)
    assignments = list(itertools.takewhile(lambda w: re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w), words))
    words = words[len(assignments) :]
    prefix = ["env", *assignments] if assignments else []
    if words[0] == "headroom":
        return [*prefix, sys.executable, "-m", "headroom.cli", *words[1:]]
    if words[0] == "python":
        return [*prefix, sys.executable, *words[1:]]
    return ["bash", "-c", command]


def run(exp: Experiment, out: Path, extra: tuple[str, ...] = ()) -> None:
    """Run every command of `exp` with its outputs under `out`; raises if one fails."""
    if exp.kind == "notes":
        raise SystemExit(f"{exp.name}: written by hand from `{exp.typed()[0]}`; nothing to run")
    env = {**os.environ, COMMAND_ENV: f"headroom bench reproduce {exp.name}"}
    for command in exp.commands:
        argv = argv_of(command.format(out=out)) + list(extra)
        print(f"[{exp.name}] {shlex.join(argv)}", file=sys.stderr, flush=True)
        subprocess.run(argv, cwd=ROOT, env=env, check=True)


def normalise_json(doc: object) -> object:
    if isinstance(doc, dict):
        kept = {k: normalise_json(v) for k, v in doc.items() if k not in VOLATILE_KEYS}
        return kept["runs"] if set(kept) == {"runs"} else kept  # a list document, stamped
    if isinstance(doc, list):
        return [normalise_json(v) for v in doc]
    return doc


def normalise_markdown(text: str) -> list[str]:
    lines = (COMMAND_SPAN.sub("", line).strip() for line in text.splitlines() if not VOLATILE_LINE.search(line))
    return [line for line in lines if line]


def differences(new: Path, old: Path, out: Path) -> list[str]:
    """What differs between a re-run output and the committed one (empty: it reproduces)."""
    if not new.exists():
        return [f"{new.name}: not written"]
    text_new, text_old = new.read_text().replace(str(out), RESULTS), old.read_text()
    if new.suffix == ".json":
        a, b = normalise_json(json.loads(text_new)), normalise_json(json.loads(text_old))
        return [] if a == b else [f"{old}: {d}" for d in json_diff(a, b)]
    lines = normalise_markdown if new.suffix == ".md" else str.splitlines
    diff = difflib.unified_diff(lines(text_old), lines(text_new), f"{old} (committed)", "now", n=0, lineterm="")
    return list(itertools.islice(diff, MAX_DIFF_LINES))


def json_diff(a: object, b: object, path: str = "") -> list[str]:
    """The first differing fields (path: now, committed)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only {'now' if k in a else 'committed'}" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out += json_diff(a[k], b[k], f"{path}/{k}")
        return out[:MAX_DIFF_LINES]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in json_diff(x, y, f"{path}[{i}]")][
            :MAX_DIFF_LINES
        ]
    return [] if a == b else [f"{path}: now {a!r}, committed {b!r}"]


def check(exp: Experiment) -> list[str]:
    """Re-run a deterministic experiment into a temp dir; its differences from the committed results."""
    with tempfile.TemporaryDirectory(prefix=f"reproduce-{exp.name}-") as tmp:
        out = Path(tmp)
        run(exp, out, ("--no-plot",) if any(o.endswith(".png") for o in exp.outputs) else ())
        return [d for o in exp.checked_outputs() for d in differences(out / o, ROOT / RESULTS / o, out)]


def listing() -> str:
    lines = []
    for e in EXPERIMENTS:
        suite = f", {e.suite} suite" if e.suite else ""
        lines.append(f"{e.name}  [{e.kind}, ~{e.seconds:g} s{suite}]  -> {', '.join(e.outputs)}")
        lines += [f"    {c}" for c in e.typed()]
        if e.needs:
            lines.append(f"    needs: {e.needs}")
    return "\n".join(lines)


def selected(names: list[str], deterministic_only: bool) -> list[Experiment]:
    if names == ["all"]:
        return [
            e for e in EXPERIMENTS if e.kind not in ("notes", "gpu") and (e.deterministic or not deterministic_only)
        ]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise SystemExit(f"unknown experiment(s) {unknown}; `headroom bench reproduce --list` lists them")
    return [BY_NAME[n] for n in names]


def reproduce(args: argparse.Namespace) -> int:
    if args.list or not args.names:
        print(listing())
        return 0
    exps = selected(args.names, deterministic_only=args.check)
    if not args.check:
        for e in exps:
            run(e, Path(RESULTS))  # relative: the results name their paths as typed
        return 0
    failed = 0
    for e in exps:
        if not e.deterministic:
            print(f"{e.name}: {e.kind} result, not checked (wall time)")
            continue
        diffs = check(e)
        failed += bool(diffs)
        print(f"{e.name}: {'reproduces' if not diffs else 'DIFFERS'}", *diffs, sep="\n  ")
    return 1 if failed else 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reproduce", help="re-run committed experiments (bench/experiments.py)")
    p.add_argument("names", nargs="*", help="experiment names, or `all` (all: every runnable one)")
    p.add_argument("--list", action="store_true", help="list every committed result with its command")
    p.add_argument(
        "--check",
        action="store_true",
        help="re-run deterministic experiments into a temp dir and compare with the committed results",
    )
    p.set_defaults(func=reproduce)
