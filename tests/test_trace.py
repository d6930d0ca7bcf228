"""StepTrace: the ring buffer keeps the last N, the JSONL file keeps every step, close is safe."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from telemetry.record import MemorySample, StepRecord, StepShape
from telemetry.trace import StepTrace, read_trace, record_json


def rec(i: int) -> StepRecord:
    return StepRecord(
        step_id=i,
        time=float(i),
        duration=0.01,
        shape=StepShape(decode_seqs=i),
        memory=MemorySample(peak_allocated=100 + i, idle_baseline=100, sampled=i % 2 == 0),
        kv_blocks_used=i,
        kv_blocks_free=10 - i,
        kv_blocks_total=10,
        limits={"max_num_seqs": 8},
    )


def test_ring_keeps_last_n() -> None:
    trace = StepTrace(capacity=3)
    for i in range(5):
        trace.append(rec(i))
    assert [r.step_id for r in trace.records()] == [2, 3, 4]
    assert [r.step_id for r in trace.records(last=2)] == [3, 4]
    assert trace.records(last=0) == []
    assert len(trace) == 3 and trace.count == 5


def test_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "trace.jsonl"
    with StepTrace(capacity=2, path=path) as trace:
        for i in range(4):
            trace.append(rec(i))
        # flushed per line: readable while the run goes on
        assert len(path.read_text().splitlines()) == 4
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["step_id"] for d in lines] == [0, 1, 2, 3]
    assert lines[3] == rec(3).to_dict()
    assert lines[3]["memory"]["peak_allocated"] == 103 and lines[3]["shape"]["decode_seqs"] == 3


def test_close_is_safe(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    trace = StepTrace(path=path)
    trace.append(rec(1))
    trace.close()
    trace.close()
    trace.append(rec(2))  # ring only after close
    assert [r.step_id for r in trace.records()] == [1, 2]
    assert [d["step_id"] for d in read_trace(path)] == [1]


def test_truncated_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with StepTrace(path=path) as trace:
        trace.append(rec(1))
    with open(path, "a") as f:
        f.write('{"step_id": 2, "ti')  # killed mid-write
    assert [d["step_id"] for d in read_trace(path)] == [1]


def test_append_mode(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with StepTrace(path=path) as trace:
        trace.append(rec(1))
    with StepTrace(path=path, append=True) as trace:
        trace.append(rec(2))
    assert [d["step_id"] for d in read_trace(path)] == [1, 2]


def test_concurrent_readers() -> None:
    trace = StepTrace(capacity=50)

    def write() -> None:
        for i in range(2000):
            trace.append(rec(i))

    writer = threading.Thread(target=write)
    writer.start()
    while writer.is_alive():
        assert len(trace.records()) <= 50
    writer.join()
    assert trace.records()[-1].step_id == 1999


def test_bad_capacity() -> None:
    with pytest.raises(ValueError):
        StepTrace(capacity=0)


def test_record_json_matches_to_dict() -> None:
    r = rec(3)
    r.limits["ratio"] = 0.5
    assert json.loads(record_json(r)) == json.loads(json.dumps(r.to_dict()))
