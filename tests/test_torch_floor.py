"""Issue #41, defect 7: pyproject declared torch>=2.4, but the backend keeps its CUDA graphs' memory in a
torch.cuda.MemPool, which torch 2.5 added (pytorch/pytorch#131152, opened in July 2024, after 2.4 branched; the
2.5 docs are the first to list it). The floor must be the newest version any torch API the engine calls needs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ADDED_IN = {"torch.cuda.MemPool": (2, 5)}  # torch API -> the release that added it


def declared_floor() -> tuple[int, ...]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = [m.group(1) for dep in deps if (m := re.fullmatch(r"torch>=([\d.]+)", dep.replace(" ", "")))]
    assert len(floors) == 1, f"pyproject must declare torch with a >= floor, got {deps}"
    return tuple(int(n) for n in floors[0].split("."))


def test_the_torch_floor_has_every_torch_api_the_engine_calls() -> None:
    source = "\n".join(path.read_text() for path in (REPO / "engine").rglob("*.py"))
    used = {api: version for api, version in ADDED_IN.items() if re.search(rf"\b{re.escape(api)}\(", source)}
    assert used, "the engine no longer calls torch.cuda.MemPool: this test checks nothing"
    floor = declared_floor()
    assert all(floor >= version for version in used.values()), f"torch>={floor} lacks some of {used}"
