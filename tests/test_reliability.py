"""The reliability benchmark (bench/reliability.py) at a small scale against a live twin server, and its
checkers on made-up answers, so that a broken server (or a broken checker) fails here.

The full runs (10,000 soak requests, 100 fuzz cases per operation, 256 overload clients) are
`python -m bench.reliability all`; results in bench/results/reliability.md.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bench import reliability_answers as answers
from bench import reliability_fuzz as fuzz
from bench import reliability_soak as soak
from bench.harness.http import Answer
from engine.model.standin_tokenizer import FILLER


def failed(result: answers.ScenarioResult) -> list[str]:
    return [c.line() for c in result.checks if not c.ok]


# ---- live, small --------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_soak_small(tmp_path: Path) -> None:
    result = soak.run_soak(tmp_path, requests=200, concurrency=32, seed=1)
    assert not failed(result), "\n".join(failed(result))
    assert len(result.checks) == 7


@pytest.mark.timeout(120)
def test_overload_small(tmp_path: Path) -> None:
    result = soak.run_overload(tmp_path, max_waiting=8)
    assert not failed(result), "\n".join(failed(result))


@pytest.mark.timeout(180)
def test_fuzz_short(tmp_path: Path) -> None:
    result = fuzz.run_fuzz(tmp_path, max_examples=10, seed=0, phases="fuzzing")
    runs = [c for c in result.checks if c.name.endswith(": cases run")]
    assert len(runs) == len(fuzz.FUZZ_PARTS) and all(c.ok for c in runs), [c.line() for c in runs]
    assert not failed(result), "\n".join(failed(result))


# ---- the checkers catch what they must ------------------------------------------------------------------


def test_openai_error_shape() -> None:
    good = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert answers.openai_error_problem(good) is None
    assert answers.openai_error_problem({"detail": "x"})
    assert answers.openai_error_problem({"error": {"message": "m", "type": "t"}})
    assert answers.openai_error_problem({"error": {"message": 1, "type": "t", "param": None, "code": None}})


def test_answer_problem_counts_tokens() -> None:
    spec = answers.RequestSpec(chat=False, stream=False, prompt_tokens=3, max_tokens=4, seed=0)
    usage = {"prompt_tokens": 3, "completion_tokens": 4}
    assert answers.answer_problem(spec, FILLER * 4, ["length"], usage) is None
    assert answers.answer_problem(spec, FILLER * 3, ["length"], usage)
    assert answers.answer_problem(spec, FILLER * 4, ["length", "length"], usage)
    assert answers.answer_problem(spec, FILLER * 4, ["stop"], usage)
    assert answers.answer_problem(spec, FILLER * 4, ["length"], {**usage, "completion_tokens": 5})
    assert answers.answer_problem(spec, FILLER * 4, ["length"], None)


def test_stream_events_count_done_and_finishes() -> None:
    tally = Answer()
    for payload in (
        '{"choices":[{"text":" the","finish_reason":null}]}',
        '{"choices":[{"text":" the","finish_reason":"length"}]}',
        '{"choices":[],"usage":{"completion_tokens":2}}',
        "[DONE]",
        "[DONE]",
    ):
        tally.add_event(payload, chat=False)
    assert (tally.text, tally.finishes, tally.done, tally.after_done) == (FILLER * 2, ["length"], 2, 1)
    assert tally.usage == {"completion_tokens": 2}


def har_entry(status: int, text: str) -> dict:
    return {"request": {"method": "POST"}, "response": {"status": status, "content": {"text": text}}}


def fuzz_report(generated: int, code: str, title: str, count: int) -> dict:
    """A schemathesis JSON report with one kind of failure."""
    failure = {"code": code, "title": title, "count": count, "operations": ["POST /x"]}
    return {"test_cases": {"generated": generated}, "stop_reason": "completed", "errors": [], "failures": [failure]}


def test_fuzz_checks_fail_on_5xx_bad_errors_and_schemathesis_failures() -> None:
    report = fuzz_report(3, "ST103", "Undocumented status code", 2)
    har = {"log": {"entries": [har_entry(200, "{}"), har_entry(500, '{"detail": "boom"}'), har_entry(0, "")]}}
    results = {c.name: c.ok for c in fuzz.fuzz_checks(report, har)}
    assert results == {
        "fuzz: cases run": True,
        "fuzz: 0 responses 5xx": False,
        "fuzz: every error OpenAI-shaped": False,
        "fuzz: every request answered": False,
        "fuzz: schema-valid requests refused only by cross-field rules": True,
        "fuzz: schemathesis checks (all)": False,
        "fuzz: ST103 Undocumented status code": False,
    }


ST202_OUTPUT = """
- ST202 Schema-valid request rejected
[400] Bad Request:
    `{"error":{"message":"min_tokens must not exceed max_tokens","param":"min_tokens"}}`
- ST202 Schema-valid request rejected
[400] Bad Request:
    `{"error":{"message":"...","code":"context_length_exceeded"}}`
"""


def test_only_cross_field_rejections_excuse_st202() -> None:
    report = fuzz_report(2, "ST202", "Schema-valid request rejected", 2)
    har = {
        "log": {
            "entries": [har_entry(400, '{"error": {"message": "m", "type": "t", "param": null, "code": null}}')] * 2
        }
    }
    excused = {c.name: c.ok for c in fuzz.fuzz_checks(report, har, ST202_OUTPUT)}
    assert (
        excused["fuzz: schemathesis checks (all)"]
        and excused["fuzz: schema-valid requests refused only by cross-field rules"]
    )
    other = ST202_OUTPUT + '- ST202 Schema-valid request rejected\n    `{"error":{"message":"the prompt is empty"}}`\n'
    flagged = {c.name: c.ok for c in fuzz.fuzz_checks(report, har, other)}
    assert not flagged["fuzz: schemathesis checks (all)"]
    assert not flagged["fuzz: schema-valid requests refused only by cross-field rules"]


def soak_run(outcomes: list[answers.Outcome], **changes: object) -> soak.SoakRun:
    counters = {"kv_blocks_used": 0, "kv_blocks_total": 64, "num_running": 0, "num_waiting": 0, "ooms": 2,
                "ooms_recovered": 2, "steps": 100}  # fmt: skip
    polls = soak.PollStats(statuses=Counter({("GET /metrics", 200): 1}), rounds=1)
    finished = {"length": float(sum(not o.disconnected for o in outcomes)), "abort": 1.0}
    run = soak.SoakRun(outcomes, polls, 1000, 1050, counters, finished, 1.0)
    for name, value in changes.items():
        setattr(run, name, value)
    return run


# soak_checks' order
COMPLETED, ONCE, NO_5XX, POLLED, OOMS, KV, RSS = range(7)


def test_soak_checks_pass_on_a_clean_run_and_fail_on_each_defect() -> None:
    plan = soak.soak_plan(20, seed=0, disconnect_share=0.0)
    ok = [answers.Outcome(200) for _ in plan[:-1]] + [answers.Outcome(200, disconnected=True)]

    def failing(run: soak.SoakRun) -> set[int]:
        return {i for i, c in enumerate(soak.soak_checks(plan, run)) if not c.ok}

    assert failing(soak_run(ok)) == set()
    assert failing(soak_run([answers.Outcome(200, "text of 3 characters")] + ok[1:])) == {COMPLETED}
    assert failing(soak_run([answers.Outcome(500, "status 500")] + ok[1:])) == {COMPLETED, NO_5XX}
    assert failing(soak_run(ok, rss_end_kib=1200)) == {RSS}
    assert failing(soak_run(ok, finished={"length": 19.0, "abort": 2.0})) == {ONCE}
    counters = soak_run(ok).counters
    assert failing(soak_run(ok, counters={**counters, "kv_blocks_used": 3})) == {KV}
    assert failing(soak_run(ok, counters={**counters, "ooms_recovered": 1})) == {OOMS}
    bad_polls = soak.PollStats(Counter({("GET /controller/state", 500): 1}), Counter({"state: 500": 1}), 1)
    assert failing(soak_run(ok, polls=bad_polls)) == {POLLED, NO_5XX}


def test_overload_checks_need_retry_after_and_complete_answers() -> None:
    idle = {"kv_blocks_used": 0, "kv_blocks_total": 64, "num_running": 0, "num_waiting": 0}
    refused = answers.Outcome(429, "status 429", retry_after="1", openai_error=True)
    good = [answers.Outcome(200)] * 2 + [refused] * 6
    assert all(c.ok for c in soak.overload_checks(good, idle, max_waiting=2))
    no_header = [answers.Outcome(200)] * 2 + [answers.Outcome(429, "status 429", openai_error=True)]
    assert not soak.overload_checks(no_header, idle, max_waiting=2)[1].ok
    incomplete = [answers.Outcome(200, "finish reasons []"), answers.Outcome(200), refused]
    assert not soak.overload_checks(incomplete, idle, max_waiting=2)[2].ok
    nothing_refused = [answers.Outcome(200)] * 8
    assert not soak.overload_checks(nothing_refused, idle, max_waiting=2)[0].ok
