"""One typed engine configuration: built from flags, keyword arguments or JSON, with unknown fields named."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.cli import engine_config
from engine.config import ConfigError, EngineConfig, ServerConfig
from engine.factory import build_engine

ROOT = Path(__file__).resolve().parents[1]


def imports_argparse(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        if any(n.split(".")[0] == "argparse" for n in names):
            return True
    return False


def test_argparse_only_in_cli_modules() -> None:
    offenders = [
        str(path.relative_to(ROOT))
        for package in ("engine", "controller", "telemetry")
        for path in (ROOT / package).rglob("*.py")
        if path.name != "cli.py" and imports_argparse(path)
    ]
    assert offenders == []


def test_the_check_sees_an_argparse_import(tmp_path: Path) -> None:
    sample = tmp_path / "x.py"
    sample.write_text("from argparse import Namespace\n")
    assert imports_argparse(sample)


def run(cfg: EngineConfig) -> tuple[object, ...]:
    """What an engine built from `cfg` does with three requests: tokens, clock, steps, pool and policy."""
    engine = build_engine(cfg)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(str(i), list(range(1, n + 1)), params) for i, n in enumerate((5, 300, 40))]
    while engine.has_unfinished():
        engine.step()
    outputs = [s.output_ids for s in seqs]
    return outputs, engine.backend.now(), engine.step_id, engine.allocator.num_blocks, engine.policy.name


def test_engine_config_round_trips_through_json_to_the_same_engine() -> None:
    cfg = engine_config(["--backend", "twin", "--policy", "fixed", "--num-blocks", "40", "--max-num-seqs", "2"])
    again = EngineConfig.from_json(cfg.to_json())
    assert again == cfg
    assert run(again) == run(cfg) == run(EngineConfig.from_dict(cfg.to_dict()))


def test_server_config_round_trips_through_json() -> None:
    cfg = ServerConfig(port=0, served_model_name=("a", "b"), max_waiting=3)
    assert ServerConfig.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    "make",
    [
        lambda: LLM("default", num_blokcs=8),
        lambda: EngineConfig.from_json('{"num_blokcs": 8}'),
        lambda: EngineConfig.from_dict({"backend": "twin", "num_blokcs": 8}),
    ],
    ids=["LLM", "json", "dict"],
)
def test_a_misspelled_field_is_named(make) -> None:
    with pytest.raises(ConfigError, match=r"'num_blokcs' \(did you mean 'num_blocks'\?\)"):
        make()


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"backend": "gpu"}, "backend"),
        ({"num_blocks": 0}, "num_blocks"),
        ({"inject_oom_rate": 1.5}, "inject_oom_rate"),
        ({"device_memory": "lots"}, "device_memory"),
        ({"policy": "adaptive", "max_num_seqs": 4}, "max_num_seqs"),
    ],
)
def test_an_invalid_value_is_named(values: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig.from_dict(values)


@pytest.mark.parametrize(
    ("argv", "named"),
    [(["--num-blokcs", "8"], "--num-blokcs"), (["--policy", "adaptive", "--max-num-seqs", "4"], "max_num_seqs")],
)
def test_the_cli_names_a_bad_flag(argv: list[str], named: str) -> None:
    cmd = [sys.executable, "-m", "headroom.cli", "generate", "--prompt", "x", "--backend", "twin", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and named in done.stderr


def test_architecture_lists_only_files_that_exist() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"`((?:engine|controller|telemetry|bench|dashboards|tests|docs)/[\w/.\-]+)`", text))
    assert paths, "the check found no paths"
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []
