"""The reliability benchmark's schema fuzz: schemathesis against /openapi.json on a fresh twin server per
part, then its JSON and HAR reports read for 5xx, non-OpenAI errors and unanswered requests."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.harness import http
from bench.harness.machine import load_average
from bench.harness.server import headroom
from bench.reliability_answers import (
    REQUEST_TIMEOUT_S,
    Check,
    ScenarioResult,
    idle_check,
    openai_error_problem,
    wait_idle,
    with_problems,
)

FUZZ_MAX_MODEL_LEN = 128
FUZZ_REQUEST_TIMEOUT_S = 30  # 3x the longest generation the fuzz context allows


# Each part on a fresh server: the fuzzer's valid PATCHes (a cap of 1 sequence, say) would otherwise slow
# every later API case past its timeout, through a config the fuzzer itself set.
FUZZ_PARTS = (("API", ["--exclude-method", "PATCH"]), ("controller PATCH", ["--include-method", "PATCH"]))


def run_fuzz(workdir: Path, max_examples: int, seed: int, phases: str | None = None) -> ScenarioResult:
    """`phases`: schemathesis's --phases (None: all of them; the coverage phase's boundary cases take most
    of the time)."""
    flags = ["--max-model-len", str(FUZZ_MAX_MODEL_LEN)]
    load_before, t0 = load_average(), time.monotonic()
    checks: list[Check] = []
    notes = []
    for i, (part, selection) in enumerate(FUZZ_PARTS):
        json_path, har_path = workdir / f"fuzz{i}.json", workdir / f"fuzz{i}.har"
        out_path = workdir / f"fuzz{i}-schemathesis.txt"
        with headroom(flags, workdir / f"fuzz{i}-server.log", backend="twin") as server:
            st = [
                sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json", *selection,
                "--checks", "all", "--mode", "all", "--max-examples", str(max_examples), "--seed", str(seed),
                "--workers", "1", "--continue-on-failure", "--no-shrink",
                "--request-timeout", str(FUZZ_REQUEST_TIMEOUT_S),
                "--report", "json,har", "--report-json-path", str(json_path), "--report-har-path", str(har_path),
                *(["--phases", phases] if phases else []),
            ]  # fmt: skip
            with out_path.open("wb") as fh:
                subprocess.run(st, cwd=workdir, stdout=fh, stderr=subprocess.STDOUT, check=False)
            report, har = json.loads(json_path.read_text()), json.loads(har_path.read_text())
            part_checks = fuzz_checks(report, har, out_path.read_text(errors="replace"))
            part_checks += asyncio.run(_after_fuzz(server.url))
            command = server.command
        checks += [dataclasses.replace(c, name=c.name.replace("fuzz:", f"fuzz ({part}):", 1)) for c in part_checks]
        notes.append(f"schemathesis's own output ({part}): `{out_path}` (with a curl line for each failure).")
    return ScenarioResult(
        "Schema fuzz (schemathesis)", command, checks, time.monotonic() - t0, load_before, load_average(), notes
    )


# Rules that tie two fields (or a field to the model's context, or to how the server was started) together: JSON
# Schema cannot state them, so a schema-valid request can break one and get its 400, as from vLLM and OpenAI.
# Matched on the error body.
CROSS_FIELD_RULES = {
    "context_length_exceeded": "prompt + max_tokens over the context",
    "min_tokens must not exceed max_tokens": "min_tokens > max_tokens",
    "top_logprobs needs logprobs": "top_logprobs without logprobs",
    # vLLM's options (issue #42): engine/serving/protocol.py `check_rules`, prompts.py, beam_search.py
    "prompt tokens the context leaves": "truncate_prompt_tokens over the context left beside max_tokens",
    "outside the vocabulary": "a logit_bias token id past the model's vocabulary",
    "0 only with echo": "max_tokens 0 without echo",
    "stream_options can only be set when stream is true": "stream_options without stream",
    "prompt_logprobs are not available when stream is true": "prompt_logprobs with stream",
    "not supported with beam search": "use_beam_search with stream",
    "beam search takes n": "use_beam_search with n over 10",
    "applies to beam search only": "length_penalty without use_beam_search",
    "answers without prompt logprobs": "use_beam_search with prompt logprobs",
    "cannot both be true": "continue_final_message with add_generation_prompt",
    "cannot render the chat template": "a chat template (a program) that fails on the conversation",
    "tool choice needs the server started with": "tool_choice auto on a server without --tool-call-parser",
    "structured outputs need the model's tokenizer": "a structured output on the twin, which has no tokenizer",
    # a stream resumed by the fleet's ingress (engine/serving/ray_serve/resend.py)
    "stream of one choice without echo or prompt logprobs resumes": "resume on an answer that cannot resume",
    "does not resume": "resume with tools or a structured output",
    "resumed with": "resume with as many tokens as the request may make",
}
ST202 = "ST202"


def cross_field_rejections(output: str) -> tuple[Counter[str], int]:
    """From schemathesis's text output: the ST202 (schema-valid request rejected) cases whose error names a
    cross-field rule, by rule, and how many ST202 cases did not."""
    explained: Counter[str] = Counter()
    other = 0
    for block in output.split(f"- {ST202} ")[1:]:
        body = next((line for line in block.splitlines() if '`{"error"' in line), "")
        rule = next((name for key, name in CROSS_FIELD_RULES.items() if key in body), None)
        if rule is None:
            other += 1
        else:
            explained[rule] += 1
    return explained, other


def fuzz_checks(report: dict[str, Any], har: dict[str, Any], output: str = "") -> list[Check]:
    entries = har["log"]["entries"]
    statuses = Counter(e["response"]["status"] for e in entries)
    server_errors = sum(n for s, n in statuses.items() if s >= 500)
    unanswered = statuses.get(0, 0)
    errors, bad_shape = error_shapes(entries)
    cases = report["test_cases"]
    explained, unexplained = cross_field_rejections(output)
    # ST202 cases that only broke a cross-field rule are not failures of the schema (see CROSS_FIELD_RULES)
    failures = [f for f in report["failures"] if f["code"] != ST202 or unexplained]
    failed_cases = sum(f["count"] for f in failures)
    checks = [
        Check(
            "fuzz: cases run",
            cases["generated"] > 0 and len(entries) >= cases["generated"],
            f"{cases['generated']} cases generated, {len(entries)} requests sent, "
            f"statuses {dict(sorted(statuses.items()))}; stop reason {report['stop_reason']}",
        ),
        Check("fuzz: 0 responses 5xx", server_errors == 0, f"{server_errors} responses 5xx"),
        Check(
            "fuzz: every error OpenAI-shaped",
            not bad_shape,
            with_problems(f"{errors - sum(bad_shape.values())} of {errors} error bodies OpenAI-shaped", bad_shape),
        ),
        Check(
            "fuzz: every request answered",
            unanswered == 0 and not report["errors"],
            f"{unanswered} requests without an answer; schemathesis errors {report['errors']}",
        ),
        Check(
            "fuzz: schema-valid requests refused only by cross-field rules",
            unexplained == 0,
            with_problems(f"{sum(explained.values())} refused by a rule JSON Schema cannot state", explained)
            + f"; {unexplained} refused otherwise",
        ),
        Check(
            "fuzz: schemathesis checks (all)",
            not failures,
            f"{len(failures)} kinds of failure in {failed_cases} cases",
        ),
    ]
    return checks + [
        Check(f"fuzz: {f['code']} {f['title']}", False, f"{f['count']} cases on {', '.join(f['operations'])}")
        for f in failures
    ]


def error_shapes(entries: list[dict[str, Any]]) -> tuple[int, Counter[str]]:
    """How many answers were errors (4xx/5xx), and the ones whose body is not an OpenAI error, by problem."""
    errors, bad_shape = 0, Counter[str]()
    for e in entries:
        if e["response"]["status"] < 400:
            continue
        errors += 1
        try:
            problem = openai_error_problem(json.loads(e["response"]["content"].get("text") or ""))
        except ValueError:
            problem = "body is not JSON"
        if problem:
            bad_shape[f"{e['request']['method']} {e['response']['status']}: {problem}"] += 1
    return errors, bad_shape


async def _after_fuzz(url: str) -> list[Check]:
    async with http.client(url, 4, REQUEST_TIMEOUT_S) as client:
        r = await client.get("/health")
        health = Check("fuzz: /health 200 afterwards", r.status_code == 200, f"{r.status_code} {r.text[:200]}")
        return [health, idle_check("fuzz: server idle afterwards", await wait_idle(client))]
