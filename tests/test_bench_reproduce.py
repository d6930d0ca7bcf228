"""bench/experiments.py covers every committed result, and the deterministic (twin) ones still come out of
today's code: every field but the wall time and the command stamp. The fast experiments run here; the rest
behind the `slow` marker (the registry says which)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from bench import reproduce
from bench.experiments import EXPERIMENTS, RESULTS

ROOT = Path(__file__).resolve().parents[1]


def test_every_committed_result_has_an_entry_and_every_entry_its_files() -> None:
    committed = {p.relative_to(ROOT / RESULTS).as_posix() for p in (ROOT / RESULTS).rglob("*") if p.is_file()}
    listed = [o for e in EXPERIMENTS for o in e.outputs]
    assert len(listed) == len(set(listed)), "a result listed by two entries"
    assert committed - set(listed) == set(), "results no experiment makes"
    assert set(listed) - committed == set(), "entries whose result is not committed"


def test_every_command_is_a_module_or_the_cli() -> None:
    for e in EXPERIMENTS:
        assert e.kind in ("twin", "cpu", "notes", "gpu")
        assert e.suite in (("default", "slow") if e.deterministic else ("",))
        for command in e.commands:
            words = shlex.split(command)
            while re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # VAR=value before the command
                words = words[1:]
            if words[0] == "python":
                assert words[1] == "-m" and importlib.util.find_spec(words[2]) is not None, command
            elif words[0] != "headroom":
                assert e.needs, f"{e.name}: a shell command needs a `needs` note"


def test_the_comparison_ignores_wall_time_and_stamp_but_not_a_result(tmp_path: Path) -> None:
    committed = ROOT / RESULTS / "matrix/seed-static_64.json"
    doc = json.loads(committed.read_text())
    doc.update(wall_s=doc["wall_s"] + 1, command="headroom bench reproduce x", commit="abc+dirty")
    doc["points"][0]["wall_s"] += 1
    new = tmp_path / "new.json"
    new.write_text(json.dumps(doc))
    assert reproduce.differences(new, committed, tmp_path) == []
    doc["points"][3]["output_throughput"] += 1e-9
    new.write_text(json.dumps(doc))
    assert reproduce.differences(new, committed, tmp_path) == [
        f"{committed}: /points[3]/output_throughput: now {doc['points'][3]['output_throughput']!r}, "
        f"committed {doc['points'][3]['output_throughput'] - 1e-9!r}"
    ]
    md = tmp_path / "new.md"
    md.write_text(
        "# T\n\nCommand: `python -m bench.x --out /elsewhere`, at commit 1234567.\n\nwall time 3 s\n\n| 1.5 |\n"
    )
    old = tmp_path / "old.md"
    old.write_text("# T\n\nCommand: `python bench/x.py`\n\n| 1.5 |\n")
    assert reproduce.differences(md, old, tmp_path) == []
    old.write_text("# T\n\n| 1.6 |\n")
    assert reproduce.differences(md, old, tmp_path) != []


def _params(suite: str) -> list:
    marks = [pytest.mark.slow] if suite == "slow" else []
    return [pytest.param(e, id=e.name, marks=marks) for e in EXPERIMENTS if e.suite == suite]


@pytest.mark.parametrize("experiment", _params("default") + _params("slow"))
def test_twin_result_reproduces(experiment) -> None:
    if experiment.commit and subprocess.run(["git", "cat-file", "-e", experiment.commit], cwd=ROOT).returncode:
        pytest.skip(f"needs {experiment.needs}")
    assert reproduce.check(experiment) == []
