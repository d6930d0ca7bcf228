"""The device check's smoke run (`bash bench/device_check.sh --cpu`): the script a lent GPU runs is known to work
before one appears. It runs the CUDA-marked tests (each reported NOT RUN with pytest's reason) and every check whose
mechanism exists on a CPU, names what needs CUDA as NOT RUN with its reason, writes its report where it is told and
again in $OUT, and fails the run when a check fails; the twin's side of the GPU's plan and the second process that
holds memory run here too."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from bench import device_check
from bench.device_checks.ballast import ProcessBallast, TwinBallast
from bench.device_checks.common import Result, Session, adaptive_engine, twin
from bench.device_checks.memory import follow_scenario, oom_scenario, sized_engine
from engine.config import EngineConfig
from engine.factory import build_engine

CUDA_ONLY = {"vmm_pool", "graphs_vs_eager", "nvml_vs_allocator", "triton_vs_sdpa", "pool_follows"}


def test_the_script_runs_the_cuda_tests_then_the_checks_and_names_what_did_not_run(tmp_path: Path) -> None:
    out, report = tmp_path / "out", tmp_path / "device_check.md"
    env = {**os.environ, "OUT": str(out)}
    run = subprocess.run(["bash", "bench/device_check.sh", "--cpu", "--out", str(report)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    data = json.loads(report.with_suffix(".json").read_text())
    results = {r["name"]: r for r in data["results"]}
    tests = {name: r for name, r in results.items() if "::" in name}
    assert (
        "tests.test_kv_vmm::test_the_pool_on_a_real_card_is_in_virtual_memory_packs_its_blocks_and_gives_them_back"
        in tests
    )
    assert tests and all(r["passed"] is None and r["skipped"] for r in tests.values())
    assert [name for name in results if "::" not in name] == [check.__name__ for check in device_check.CHECKS]
    verdict = data["verdict"]
    assert verdict.startswith("PASS") and all(f"{name} (" in verdict for name in [*tests, *CUDA_ONLY])
    assert sorted(p.name for p in out.iterdir()) == [
        "cuda_tests.xml", "device_check.json", "device_check.md", "device_check_cuda_tests.txt"
    ]  # fmt: skip


def smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, str]:
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    report = tmp_path / "report" / "device_check.md"
    device_check.main(["--device", "cpu", "--tiny", "--out", str(report)])
    copy = tmp_path / "out" / "device_check.md"
    assert copy.read_text() == report.read_text()
    return json.loads(report.with_suffix(".json").read_text()), report.read_text()


def test_the_smoke_run_checks_what_a_cpu_can_and_skips_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    report, text = smoke(tmp_path, monkeypatch)
    results = {r["name"]: r for r in report["results"]}
    assert list(results) == [check.__name__ for check in device_check.CHECKS]
    for name, r in results.items():
        assert all({"figure", "measured", "twin"} <= set(f) for f in r["figures"])
        assert f"| {r['title']} | " in text and (not r["figures"] or f"## {r['title']}: " in text)
        if name in CUDA_ONLY:
            assert r["passed"] is None and r["skipped"].startswith(
                ("no CUDA device", "Triton's decode kernel needs CUDA")
            )
        else:
            assert r["passed"] is True and r["figures"], name
    assert results["kv_resize"]["passed"] and results["oom_recovery"]["passed"]
    assert any(n.startswith("simulated") for n in results["oom_recovery"]["notes"])
    twin_says = {f["figure"]: f["twin"] for f in results["pool_follows"]["figures"]}
    assert twin_says["meets the criterion"] is True and results["pool_follows"]["series"]["twin_pool_blocks"]
    assert "twin (RTX 4090 model)" in text and "smoke run (not a device result)" in text


def test_a_failing_or_crashing_check_fails_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(_s: Session) -> Result:
        r = Result("failing", "A check that fails", "never")
        r.figure("figure", 1.0, 2.0)
        r.passed = False
        return r

    def crashing(_s: Session) -> Result:
        raise RuntimeError("boom")

    monkeypatch.setattr(device_check, "CHECKS", (failing, crashing))
    with pytest.raises(SystemExit) as exit_:
        smoke(tmp_path, monkeypatch)
    assert exit_.value.code == 1
    text = (tmp_path / "report" / "device_check.md").read_text()
    assert "## A check that fails: FAIL" in text and "## crashing: FAIL" in text and "RuntimeError: boom" in text


def test_the_gpu_plan_meets_each_criterion_on_the_twin() -> None:
    """The GPU's shapes give each memory scenario what it needs on the twin: an OOM while the ballast holds, a pool
    that shrinks for the other process and grows back within the step limits."""
    plan = device_check.GPU_PLAN
    backend = twin()
    assert oom_scenario(adaptive_engine(backend), TwinBallast(backend), plan.oom)[1]
    engine = build_engine(EngineConfig(backend="twin", twin_sensors="realistic"))
    assert follow_scenario(engine, TwinBallast(engine.backend), plan.follow, plan.follow_steps)[0][1]


def test_the_sized_engine_sizes_its_pool_over_random_weights() -> None:
    """The GPU's pool check builds the production engine as engine/factory.py does, over a model it made."""
    s = Session(torch.device("cpu"), device_check.TINY, device_check.TINY_PLAN, "tiny")
    engine = sized_engine(s, device_memory="256MiB")  # an emulated capacity: the CPU's is all of its RAM
    pool = engine.allocator.num_blocks * engine.backend.block_bytes
    assert engine.policy.pool.enabled and 0 < pool < 256 << 20


def test_the_second_process_holds_what_it_is_asked_for_and_exits() -> None:
    ballast = ProcessBallast(torch.device("cpu"))  # the protocol is the device's; CUDA only adds retries
    try:
        for nbytes in (3 << 20, 1 << 20):
            ballast.take(nbytes)
            assert ballast.wait(60) and ballast.held == nbytes
    finally:
        ballast.close()
    assert ballast.process.returncode == 0 and ballast.held == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where the second process cannot start")
def test_a_second_process_that_cannot_start_says_so_at_once() -> None:
    with pytest.raises(RuntimeError, match="was not ready"):
        ProcessBallast(torch.device("cuda"))


def test_the_script_fits_8_minutes() -> None:
    script = Path(device_check.__file__).with_suffix(".sh").read_text()
    budget = sum(int(kill or 0) + int(limit) for kill, limit in re.findall(r"timeout (?:-k (\d+) )?(\d+)", script))
    assert budget <= 8 * 60


def test_the_gpu_model_has_llama_3_1_8b_shape() -> None:
    cfg = device_check.llama31_8b_config()
    params = (
        cfg.vocab_size * cfg.hidden_size * 2
        + cfg.num_layers
        * (
            cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            + cfg.num_heads * cfg.head_dim * cfg.hidden_size
            + 3 * cfg.hidden_size * cfg.intermediate_size
            + 2 * cfg.hidden_size
        )
        + cfg.hidden_size
    )
    assert params == 8_030_261_248  # Llama-3.1-8B's parameter count (the twin profile's weight_bytes / 2)
