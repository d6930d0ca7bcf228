"""`bench replay` reads vLLM's per-request JSONL (epoch arrival times, extra fields ignored) and reports
TTFT, TPOT, ITL and E2EL as `vllm bench serve` names them."""

from __future__ import annotations

import json

import pytest

from bench.loadgen import load_trace, run_trace
from bench.report import latency_table, metrics
from engine.backends.twin.backend import TwinBackend
from engine.baselines.seed import FixedPolicy
from engine.core.llm_engine import LLMEngine
from headroom.cli import main

EPOCH = 1_760_000_000.25  # seconds since 1970: what vLLM writes


def write_trace(tmp_path, records: list[dict]) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return str(path)


def vllm_record(i: int, arrival: float, inp: int = 40, out: int = 8) -> dict:
    return {
        "request_id": f"cmpl-{i}",
        "input_toks": inp,
        "output_toks": out,
        "arrival_time": arrival,
        "ttft": 0.03,  # fields the reader does not use
        "itl": [0.01] * (out - 1),
        "prompt": "hello",
    }


def test_reader_keeps_ids_and_ignores_extra_fields(tmp_path):
    path = write_trace(tmp_path, [vllm_record(0, EPOCH, 100, 20), vllm_record(1, EPOCH + 0.5, 7, 3)])
    reqs = load_trace(path)
    assert [(r.request_id, r.input_len, r.output_len) for r in reqs] == [("cmpl-0", 100, 20), ("cmpl-1", 7, 3)]
    assert reqs[1].arrival_time - reqs[0].arrival_time == pytest.approx(0.5)


def test_request_id_is_optional(tmp_path):
    path = write_trace(tmp_path, [{"input_toks": 5, "output_toks": 2, "arrival_time": 3.0}])
    assert load_trace(path)[0].request_id is None


@pytest.mark.parametrize(
    "bad", [{"input_toks": 5, "arrival_time": 1.0}, {"input_toks": "x", "output_toks": 2, "arrival_time": 1.0}]
)
def test_a_malformed_line_names_its_line(tmp_path, bad):
    path = write_trace(tmp_path, [vllm_record(0, EPOCH), bad])
    with pytest.raises(ValueError, match=r"trace.jsonl:2"):
        load_trace(path)


def test_epoch_arrivals_replay_relative_to_the_first(tmp_path):
    """Two requests 10 s apart on an idle twin: each is served at once, so TTFT is a prefill, not 1.7e9 s,
    and the second arrives 10 s into the run."""
    path = write_trace(tmp_path, [vllm_record(0, EPOCH), vllm_record(1, EPOCH + 10.0)])
    engine = LLMEngine(TwinBackend(num_blocks=64, block_size=16), FixedPolicy(max_batched_tokens=2048))
    run = run_trace(engine, load_trace(path))
    m = metrics(run, num_prompts=2)
    assert m["completed"] == 2 and m["failed"] == 0
    assert 0 < m["mean_ttft_ms"] < 100
    assert 10.0 < run.duration < 11.0
    second = max(run.sequences, key=lambda s: s.arrival_time)
    assert second.arrival_time == pytest.approx(10.0)


def test_replay_reports_vllm_bench_serve_names(tmp_path, capsys):
    path = write_trace(tmp_path, [vllm_record(i, EPOCH + 0.1 * i, 30 + i, 5 + i) for i in range(6)])
    out = tmp_path / "r.json"
    argv = ["bench", "replay", "--trace", path, "--block-size", "16", "--num-blocks", "256", "--out", str(out)]
    assert main(argv) == 0
    point = json.loads(out.read_text())["points"][0]
    for key in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p95", "p99"):
            assert f"{stat}_{key}_ms" in point
    assert point["p90_ttft_ms"] <= point["p95_ttft_ms"] <= point["p99_ttft_ms"]
    assert point["completed"] == 6 and point["total_output_tokens"] == sum(5 + i for i in range(6))
    assert "| TTFT |" in latency_table(point) and "| E2EL |" in capsys.readouterr().out
