"""bench/harness: a server that cannot start fails with its log's tail; a result is stamped with the command
as typed (or the reproduce command that ran it) and the commit; the machine line names the kernels' flags."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.harness import machine, report
from bench.harness.server import headroom


def test_a_server_that_exits_fails_with_its_log_tail(tmp_path: Path) -> None:
    server = headroom(["--no-such-flag"], tmp_path / "server.log", start_timeout=60)
    with pytest.raises(RuntimeError, match=r"(?s)exited with 2.*log tail.*--no-such-flag"):
        server.start()
    assert server.proc is not None and server.proc.poll() is not None


def test_the_report_is_stamped_with_command_and_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(report.COMMAND_ENV, raising=False)
    stamp = report.Stamp("python -m bench.x", ["--out", "a b.md"])
    assert stamp.command == "python -m bench.x --out 'a b.md'"
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?|unknown", stamp.commit)
    out = tmp_path / "r.md"
    report.write_report(out, ["# Title", "", "body"], stamp, [1, 2])
    assert out.read_text().splitlines()[:3] == ["# Title", "", stamp.line()]
    assert json.loads(out.with_suffix(".json").read_text()) == {**stamp.fields(), "runs": [1, 2]}
    monkeypatch.setenv(report.COMMAND_ENV, "headroom bench reproduce x")
    assert report.Stamp("python -m bench.x", []).command == "headroom bench reproduce x"


def test_the_machine_line_names_cpu_flags_and_versions() -> None:
    m = machine.machine()
    assert set(m.flags) <= set(machine.KERNEL_FLAGS) and m.cores >= 1
    line = machine.machine_line("1.00 1.00 1.00")
    assert line.startswith(f"Machine: {m.cpu}, {m.cores} CPUs") and f"torch {m.torch}" in line
    assert "load average 1.00 1.00 1.00 before" in line
