"""Structured outputs: every output token of a request keeps to its grammar (a JSON schema, a regex, a choice of
strings, a Lark or GBNF grammar), on llguidance. bench/results/structured_libs.md is why llguidance and not
xgrammar: both mask a step in well under a millisecond here, and xgrammar brings 1.1 GB of dependencies (triton,
transformers) that a CPU server never runs.

- `Grammars`: one model's grammars, each compiled once from its spec (an LRU of matchers in their start state,
  copied for each request). The API compiles a request's spec when it arrives, so a bad one is a 400 there, and
  the engine thread finds it compiled.
- `StructuredOutputs`: the backend's side. One matcher per request. Each step, before the draw, the whole batch's
  token masks go onto the logits at once: -inf wherever the grammar refuses the token (EOS included, until the
  grammar accepts). After the draw each matcher takes its row's token; a request whose grammar can take nothing
  more is complete, and the engine ends it there (`ModelOutput.structured_done`). The next step's masks of those
  rows are filled right then on a worker thread, while the engine finishes the step and runs the next forward
  (llguidance drops the GIL while it computes a mask); `HEADROOM_GRAMMAR_OVERLAP=0` fills them in the step instead.

A row's mask depends only on its own request's tokens, and is added to its own row: a constrained request draws
the same tokens alone and in a batch. Every tensor the masks take is allocated inside the step, on the engine
thread, so the CPU probe (a dispatch mode on that thread) counts it; the worker only writes into them. What the
matchers and compiled grammars hold is llguidance's own memory, outside torch: no probe of tensors sees it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import llguidance as llg
import torch
import torch.nn.functional as F

from engine.core.batch import ModelOutput, ScheduledItem
from engine.core.sampling_params import StructuredOutput

CACHE_SIZE = 256  # compiled grammars kept per model
OVERLAP_ENV = "HEADROOM_GRAMMAR_OVERLAP"  # "0": masks filled in the step, not ahead on the worker thread
# JSON as json.dumps writes it (what models saw most): no whitespace but the separators' spaces. Any whitespace
# lets a small model wander in newlines until max_tokens cuts the document short.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
FLEXIBLE = {"whitespace_flexible": True}

logger = logging.getLogger("headroom.engine")


class GrammarError(ValueError):
    """A spec no grammar compiles from (a bad schema, regex or grammar): the API answers 400 naming its field."""


def closed(schema: Any) -> Any:
    """The schema with every object type that does not say otherwise closed (additionalProperties false), as
    vLLM's `disable_additional_properties` does it."""
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if out.get("type") == "object" and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_of(spec: StructuredOutput) -> str:
    """The llguidance grammar a spec stands for."""
    if spec.kind == "regex":  # \d and \w are ASCII, as in JSON Schema's patterns (Rust's are Unicode)
        return llg.LLMatcher.grammar_from_lark(f"start: /{llg.regex_to_lark(spec.value, 'dw')}/")
    if spec.kind in ("choice", "grammar"):
        return llg.grammar_from(spec.kind, spec.value)  # a grammar is Lark, or GBNF (llguidance converts it)
    schema = {"type": "object"} if spec.kind == "json_object" else json.loads(spec.value)
    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be a JSON object")
    if spec.strict:
        schema = closed(schema)
    return llg.LLMatcher.grammar_from_json_schema(schema, overrides=FLEXIBLE if spec.any_whitespace else COMPACT)


class Grammars:
    """One model's grammars, compiled once per spec. Shared by the API (which compiles at admission) and the engine
    thread (which copies the compiled matcher for each request), so the cache is behind a lock."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """`tokenizer`: engine/model/tokenizer.py's (its `tokenizers` JSON and EOS ids); `vocab_size`: the logits'
        width, which the masks cover."""
        eos = sorted(tokenizer.eos_token_ids)
        self._tokenizer = llg.LLTokenizer(tokenizer.hf.to_str(), n_vocab=vocab_size, eos_token=eos)
        self._compiled: OrderedDict[StructuredOutput, llg.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> llg.LLMatcher:
        """The spec's matcher in its start state (never advanced: callers copy it). Raises GrammarError."""
        with self._lock:
            matcher = self._compiled.get(spec)
            if matcher is not None:
                self._compiled.move_to_end(spec)
                return matcher
        try:
            matcher = llg.LLMatcher(self._tokenizer, grammar_of(spec), log_level=0)
        except (ValueError, RecursionError) as e:  # a schema that is not JSON or nests too deep, a bad GBNF grammar
            raise GrammarError(str(e) or type(e).__name__) from e
        if matcher.is_error():
            raise GrammarError(matcher.get_error().strip())
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return matcher

    def matcher(self, spec: StructuredOutput) -> llg.LLMatcher:
        """A fresh matcher of the spec's grammar, for one request."""
        return self.compile(spec).deep_copy()


@lru_cache(maxsize=8)
def grammars_for(tokenizer: Any, vocab_size: int) -> Grammars:
    """The one `Grammars` of a model's tokenizer, made on first use (building llguidance's token trie takes a
    quarter of a second, which a server that never sees a structured request does not pay)."""
    if not hasattr(tokenizer, "hf"):
        raise GrammarError("structured outputs need the model's tokenizer, and this backend has none (the twin)")
    try:
        return Grammars(tokenizer, vocab_size)
    except (ValueError, RuntimeError) as e:
        raise GrammarError(f"llguidance cannot read this model's tokenizer: {e}") from e


def check(spec: StructuredOutput | None, tokenizer: Any, vocab_size: int) -> None:
    """Compile a request's spec before the engine takes it (the offline API's admission; the server's routes
    compile off the event loop): a bad one raises GrammarError here, not inside a step."""
    if spec is not None:
        grammars_for(tokenizer, vocab_size).compile(spec)


def byte_table() -> torch.Tensor:
    """[256, 8] float32: for each byte of a bitmask, what its 8 tokens' logits get (0 where the bit allows the
    token, -inf where not). One embedding lookup turns a bitmask into the additive mask: an in-place add of it
    is several times faster on the CPU than a masked_fill with a boolean mask."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))


def fill(executor: llg.LLExecutor, rows: list[tuple[llg.LLMatcher, int]], bitmask: torch.Tensor) -> None:
    """Each matcher's next-token mask into its row of `bitmask` (int32, contiguous, on the CPU), in one call that
    holds the GIL only to start: a Python loop of one call a row would take it back between rows, and the engine
    thread, busy in Python at that time, would wait for it."""
    if rows:
        executor.unsafe_compute_mask_ptr(rows, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


@dataclass
class _Request:
    spec: StructuredOutput
    matcher: llg.LLMatcher
    consumed: int = 0  # output tokens the matcher has taken
    ready: torch.Tensor | None = None  # its next token's mask, filled ahead (valid until it takes a token)


class StructuredOutputs:
    """The backend's matchers, one per structured request, by request id; `apply` before the draw, `advance` after
    it, `drop` for requests that left."""

    def __init__(self, tokenizer: Any, vocab_size: int, overlap: bool | None = None) -> None:
        self._model = (tokenizer, vocab_size)
        self._words = (vocab_size + 31) // 32
        self._requests: dict[str, _Request] = {}
        if overlap is None:
            overlap = os.environ.get(OVERLAP_ENV, "1") != "0"
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="headroom-grammar") if overlap else None
        # llguidance's own threads: one beside the forward (the worker's), every core inside the step
        self._executor = llg.LLExecutor(1 if overlap else None)
        self._pending: Future[None] | None = None
        self._tables: dict[torch.device, torch.Tensor] = {}

    def drop(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

    def apply(self, logits: torch.Tensor, items: Sequence[ScheduledItem]) -> None:
        """Row i of `logits` is items[i]'s next token: each structured row gets its grammar's mask, in place."""
        rows = [i for i, item in enumerate(items) if item.params.structured is not None]
        if not rows:
            return
        self._wait()
        requests = [self._request(items[i]) for i in rows]
        if all(request.ready is not None for request in requests):  # filled ahead: one copy
            bitmask = torch.stack([request.ready for request in requests])  # type: ignore[misc]
        else:
            bitmask = torch.empty((len(rows), self._words), dtype=torch.int32)
            for r, request in enumerate(requests):
                if request.ready is not None:
                    bitmask[r] = request.ready
            late = [(request.matcher, r) for r, request in enumerate(requests) if request.ready is None]
            fill(self._executor, late, bitmask)
        device = logits.device
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = byte_table().to(device)
        indices = bitmask.to(device).view(torch.uint8).int()
        masks = F.embedding(indices, table).view(len(rows), -1)[:, : logits.shape[1]]
        if len(rows) == len(items):
            logits.add_(masks)
        else:
            logits.index_add_(0, torch.tensor(rows, device=device), masks)

    def advance(self, items: Sequence[ScheduledItem], result: ModelOutput) -> ModelOutput:
        """Each structured row's matcher takes its sampled token. Returns `result` with the requests whose grammar
        is complete (it can take nothing more, or it took EOS) in `structured_done`; fills the others' next masks
        ahead."""
        rows = [i for i, item in enumerate(items) if item.params.structured is not None]
        if not rows:
            return result
        # allocated first: memory short here (an emulated OOM) leaves every matcher as it was
        bitmask = torch.empty((len(rows), self._words), dtype=torch.int32)  # in the step: the probe counts it
        done, ahead = set(), []
        for i in rows:
            item = items[i]
            request = self._requests[item.request_id]
            request.consumed += 1
            request.ready = None
            if not request.matcher.consume_token(result.sampled[i]):
                # only a token the mask let through reaches here, unless another control left the row no token
                # at all (every logit -inf): the request cannot go on within its grammar
                logger.warning("request %s left its grammar: %s", item.request_id, request.matcher.get_error()[:200])
                done.add(item.request_id)
            elif request.matcher.is_stopped():
                done.add(item.request_id)
            else:
                ahead.append(request)
        if ahead:
            self._fill_ahead(ahead, bitmask)
        return replace(result, structured_done=frozenset(done)) if done else result

    def _fill_ahead(self, requests: list[_Request], bitmask: torch.Tensor) -> None:
        rows = [(request.matcher, r) for r, request in enumerate(requests)]
        for r, request in enumerate(requests):
            request.ready = bitmask[r]
        if self._worker is None:
            fill(self._executor, rows, bitmask)
        else:
            self._pending = self._worker.submit(fill, self._executor, rows, bitmask)

    def _wait(self) -> None:
        """The worker's fills done: only then may this thread touch a matcher or read a mask."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _request(self, item: ScheduledItem) -> _Request:
        spec = item.params.structured
        request = self._requests.get(item.request_id)
        if request is None or request.spec != spec:  # new (or a new request under a finished one's id)
            grammars = grammars_for(*self._model)
            request = self._requests[item.request_id] = _Request(spec, grammars.matcher(spec))  # type: ignore[arg-type]
        elif request.consumed > item.num_output:
            # more taken than the request has output: the step that took them did not count (it failed after the
            # draw), or a new request under a finished one's id. Back to where this item stands.
            request.matcher.rollback(request.consumed - item.num_output)
            request.consumed, request.ready = item.num_output, None
        return request
