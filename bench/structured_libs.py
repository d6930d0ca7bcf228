"""xgrammar against llguidance for structured outputs, on the default model's tokenizer (SmolLM2, 49,152 tokens):
what chose the library engine/core/structured.py runs on.

For one JSON-schema grammar (a short object: a bounded string, an integer range, a boolean, an enum, an array of
at most three strings), each library's
- setup: its tokenizer info, built once per model from the engine's own tokenizer (no transformers);
- compile: the schema to the first token mask, cold (each run a schema the library has not seen: its maxLength
  changes); xgrammar precomputes its token-mask cache here, llguidance builds its parser lazily, so the first
  mask is in the time;
- mask: one decode step's token masks, per step, for a batch of 1 and of 16 (16 matchers, each on its own valid
  document, filled into one [batch, 1536] int32 bitmask), serially and with the library's own 2-thread batch
  fill; then the sampled tokens accepted;
- install: what `pip install` adds to Headroom's runtime dependencies (the package and the dependencies it
  requires that Headroom's runtime does not), installed bytes as the wheels' RECORDs list them; and its import
  time in a fresh interpreter, beyond torch's.

The documents are what a model writes: each valid JSON text, compact as both grammars are set up here (", " and
": " separators, no other whitespace), tokenized by the model's tokenizer.

    python -m bench.structured_libs [--runs 5] [--out bench/results/structured_libs.md]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bench.harness.machine import load_average, machine_line
from bench.harness.report import Stamp, write_report

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "active", "role", "tags"],
    "additionalProperties": False,
}
NAMES = ["Alice", "Bob Smith", "Chen Wei", "Dana", "Émile Zola", "Farah", "Gus", "Hiro Tanaka"]
BATCH = 16
THREADS = 2


def documents(n: int) -> list[str]:
    """n valid documents, each different (so the batch's matchers are in different states at each step)."""
    docs = []
    for i in range(n):
        doc = {
            "name": NAMES[i % len(NAMES)],
            "age": (17 + 7 * i) % 120,
            "active": i % 2 == 0,
            "role": ["admin", "user", "guest"][i % 3],
            "tags": ["red", "green", "blue"][: i % 4],
        }
        docs.append(json.dumps(doc, ensure_ascii=False, separators=(", ", ": ")))
    return docs


def schema_variant(i: int) -> dict[str, Any]:
    """The schema with name's maxLength changed: a grammar neither library has cached."""
    variant = json.loads(json.dumps(SCHEMA))
    variant["properties"]["name"]["maxLength"] = 24 + i
    return variant


@dataclass
class Lib:
    """One library behind the calls the benchmark makes."""

    name: str
    setup: Callable[[], None]
    compile: Callable[[dict[str, Any]], Any]  # schema -> a matcher with its first mask computed
    matcher: Callable[[dict[str, Any]], Any]  # schema (compiled before) -> a fresh matcher
    fill: Callable[[list[Any], torch.Tensor], None]  # matchers -> rows 0..n-1 of the bitmask, one by one
    fill_batch: Callable[[list[Any], torch.Tensor], None]  # the same, the library's threaded batch fill
    accept: Callable[[Any, int], bool]


def xgrammar_lib(tok: Any, vocab: int, eos: list[int]) -> Lib:
    import xgrammar as xgr

    state: dict[str, Any] = {}

    def setup() -> None:
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.hf.to_str())
        encoded = [tok.hf.id_to_token(i) or "" for i in range(tok.vocab_size)]
        info = xgr.TokenizerInfo(encoded, meta["vocab_type"], vocab_size=vocab, stop_token_ids=eos,
                                 add_prefix_space=meta["add_prefix_space"])  # fmt: skip
        state["compiler"] = xgr.GrammarCompiler(info, max_threads=THREADS)
        state["batch"] = xgr.BatchGrammarMatcher(THREADS)

    def compiled(schema: dict[str, Any]) -> Any:
        return state["compiler"].compile_json_schema(json.dumps(schema), any_whitespace=False)

    def compile_first(schema: dict[str, Any]) -> Any:
        m = xgr.GrammarMatcher(compiled(schema))
        m.fill_next_token_bitmask(xgr.allocate_token_bitmask(1, vocab))
        return m

    def fill(ms: list[Any], bitmask: torch.Tensor) -> None:
        for i, m in enumerate(ms):
            m.fill_next_token_bitmask(bitmask, i)

    return Lib(
        "xgrammar", setup, compile_first, lambda s: xgr.GrammarMatcher(compiled(s)), fill,
        lambda ms, bitmask: state["batch"].batch_fill_next_token_bitmask(ms, bitmask),
        lambda m, t: m.accept_token(t),
    )  # fmt: skip


def llguidance_lib(tok: Any, vocab: int, eos: list[int]) -> Lib:
    import llguidance as llg

    state: dict[str, Any] = {}
    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

    def setup() -> None:
        state["tokenizer"] = llg.LLTokenizer(tok.hf.to_str(), n_vocab=vocab, eos_token=eos)
        state["executor"] = llg.LLExecutor(THREADS)

    def matcher(schema: dict[str, Any]) -> Any:
        m = llg.LLMatcher(state["tokenizer"], llg.LLMatcher.grammar_from_json_schema(schema, overrides=options))
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def fill(ms: list[Any], bitmask: torch.Tensor) -> None:
        row = bitmask.shape[1] * 4
        for i, m in enumerate(ms):
            m.unsafe_compute_mask_ptr(bitmask.data_ptr() + i * row, row)

    def fill_batch(ms: list[Any], bitmask: torch.Tensor) -> None:
        state["executor"].unsafe_compute_mask_ptr(list(zip(ms, range(len(ms)), strict=True)), bitmask.data_ptr(),
                                                  bitmask.shape[1] * 4, bitmask.shape[0])  # fmt: skip

    def compile_first(schema: dict[str, Any]) -> Any:
        m = matcher(schema)
        fill([m], torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)[None])
        return m

    return Lib("llguidance", setup, compile_first, matcher, fill, fill_batch, lambda m, t: m.consume_token(t))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def decode(lib: Lib, docs: list[list[int]], vocab: int, batched: bool) -> dict[str, float]:
    """Every document decoded in lock step: per step, the batch's masks filled, then each row's token accepted
    (rows whose document ended drop out). Returns the mean microseconds per step of each."""
    matchers = [lib.matcher(SCHEMA) for _ in docs]
    bitmask = torch.full((len(docs), (vocab + 31) // 32), -1, dtype=torch.int32)
    fill_s = accept_s = 0.0
    steps = max(len(d) for d in docs)
    for step in range(steps):
        live = [i for i, d in enumerate(docs) if step < len(d)]
        ms = [matchers[i] for i in live]
        dt, _ = timed(lambda ms=ms: (lib.fill_batch if batched else lib.fill)(ms, bitmask))
        fill_s += dt
        for row, i in enumerate(live):
            token = docs[i][step]
            if not (bitmask[row, token // 32] >> (token % 32)) & 1:
                raise AssertionError(f"{lib.name}: token {token} of document {i} masked at step {step}")
            t0 = time.perf_counter()
            if not lib.accept(matchers[i], token):
                raise AssertionError(f"{lib.name}: token {token} of document {i} refused at step {step}")
            accept_s += time.perf_counter() - t0
    return {"fill_us": 1e6 * fill_s / steps, "accept_us": 1e6 * accept_s / steps, "steps": steps}


def apply_times(vocab: int, runs: int) -> dict[str, float]:
    """Microseconds to apply a [16, vocab] bitmask to float32 logits: xgrammar's CPU kernel; plain torch, the bits
    unpacked with a shift and a masked_fill; and what engine/core/structured.py does, which needs neither library:
    each byte of the bitmask looked up in a [256, 8] table of 0 and -inf (an embedding), added in place."""
    import xgrammar as xgr

    from engine.core.structured import byte_table

    bitmask = torch.randint(-(2**31), 2**31 - 1, (BATCH, (vocab + 31) // 32), dtype=torch.int32)
    shifts, table = torch.arange(32, dtype=torch.int32), byte_table()

    def plain(logits: torch.Tensor) -> None:
        bits = (bitmask[:, :, None] >> shifts) & 1
        logits.masked_fill_(bits.view(BATCH, -1)[:, :vocab] == 0, float("-inf"))

    def table_add(logits: torch.Tensor) -> None:
        logits.add_(torch.nn.functional.embedding(bitmask.view(torch.uint8).int(), table).view(BATCH, -1)[:, :vocab])

    out = {}
    fns = (("xgrammar_cpu", lambda x: xgr.apply_token_bitmask_inplace(x, bitmask)), ("torch", plain),
           ("table_add", table_add))  # fmt: skip
    for name, fn in fns:
        times = []
        for _ in range(runs * 10):
            logits = torch.randn(BATCH, vocab)
            times.append(timed(lambda fn=fn, logits=logits: fn(logits))[0])
        out[name] = 1e6 * statistics.median(times)
    return out


def install_cost(package: str) -> dict[str, Any]:
    """Bytes `pip install package` adds beside Headroom's runtime dependencies, from the installed RECORDs: the
    package and every dependency it requires (no extras; a dependency whose marker excluded it here is not
    installed and not counted) that Headroom's own requirements do not already bring."""

    def closure(names: list[str]) -> set[str]:
        seen: set[str] = set()
        todo = list(names)
        while todo:
            name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
            if name in seen:
                continue
            try:
                dist = md.distribution(name)
            except md.PackageNotFoundError:
                continue
            seen.add(name)
            todo += [re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in dist.requires or [] if "extra ==" not in r]
        return seen

    runtime = closure([re.match(r"[A-Za-z0-9_.-]+", r).group(0) for r in md.requires("headroom") or []
                       if "extra ==" not in r])  # fmt: skip
    added = sorted(closure([package]) - runtime)
    sizes = {name: sum(f.size or 0 for f in md.distribution(name).files or []) for name in added}
    module = package.replace("-", "_")
    code = f"import time, torch; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    imports = [float(subprocess.check_output([sys.executable, "-c", code], text=True)) for _ in range(3)]
    return {"added": sizes, "bytes": sum(sizes.values()), "import_s": min(imports)}


def measure(lib: Lib, docs: list[list[int]], vocab: int, runs: int) -> dict[str, Any]:
    setup_s, _ = timed(lib.setup)
    compile_s = [timed(lambda i=i: lib.compile(schema_variant(i)))[0] for i in range(runs * 2)]
    one = [decode(lib, docs[:1], vocab, False) for _ in range(runs)]
    serial = [decode(lib, docs, vocab, False) for _ in range(runs)]
    batched = [decode(lib, docs, vocab, True) for _ in range(runs)]

    def med(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    return {
        "setup_s": setup_s,
        "compile_ms_median": 1e3 * statistics.median(compile_s),
        "compile_ms_max": 1e3 * max(compile_s),
        "mask_us_batch1": med(one, "fill_us"),
        "accept_us_batch1": med(one, "accept_us"),
        "mask_us_batch16_serial": med(serial, "fill_us"),
        "mask_us_batch16_threads": med(batched, "fill_us"),
        "accept_us_batch16": med(serial, "accept_us"),
        "steps": one[0]["steps"],
    }


def report(results: dict[str, dict[str, Any]], apply_us: dict[str, float], machine: str) -> list[str]:
    lines = [
        "# Structured outputs: xgrammar against llguidance on the default model's tokenizer",
        "",
        machine,
        "",
        f"The JSON schema of `bench/structured_libs.py` (SCHEMA), vocabulary 49,152; mask times are per decode step "
        f"(every row of the batch), {THREADS} threads for the batch fills.",
        "",
        "| | xgrammar | llguidance |",
        "|---|---|---|",
    ]
    x, g = results["xgrammar"], results["llguidance"]
    rows = [
        ("tokenizer setup, once per model (s)", "setup_s", "{:.2f}"),
        ("compile to first mask, cold, median (ms)", "compile_ms_median", "{:.1f}"),
        ("compile to first mask, cold, max (ms)", "compile_ms_max", "{:.1f}"),
        ("mask, batch 1 (us/step)", "mask_us_batch1", "{:.0f}"),
        ("accept, batch 1 (us/step)", "accept_us_batch1", "{:.0f}"),
        ("mask, batch 16, one by one (us/step)", "mask_us_batch16_serial", "{:.0f}"),
        (f"mask, batch 16, library's {THREADS}-thread fill (us/step)", "mask_us_batch16_threads", "{:.0f}"),
        ("accept, batch 16 (us/step)", "accept_us_batch16", "{:.0f}"),
        ("import beyond torch, fresh interpreter (s)", "import_s", "{:.2f}"),
        ("install beside Headroom's runtime (MB)", "install_mb", "{:.1f}"),
    ]
    for label, key, fmt in rows:
        lines.append(f"| {label} | {fmt.format(x[key])} | {fmt.format(g[key])} |")
    for name in ("xgrammar", "llguidance"):
        added = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in results[name]["install"]["added"].items())
        lines.append(f"\n{name} installs: {added}.")
    ratio16 = g["mask_us_batch16_serial"] / x["mask_us_batch16_serial"]
    lines += [
        "",
        "## What it chose: llguidance",
        "",
        f"xgrammar masks a step faster ({x['mask_us_batch16_serial']:.0f} against {g['mask_us_batch16_serial']:.0f} us "
        f"at batch 16, {ratio16:.0f}x), llguidance compiles faster ({g['compile_ms_median']:.1f} against "
        f"{x['compile_ms_median']:.1f} ms) and installs in {g['install_mb']:.0f} MB against "
        f"{x['install_mb']:.0f} MB: xgrammar requires triton and transformers on Linux x86-64, which a CPU server "
        "never runs. A decode step of 16 sequences takes about 20-25 ms on this CPU (structured_tpot.md), so "
        "llguidance's masks are a few percent of it, and engine/core/structured.py fills them on a worker thread "
        "while the engine finishes the step and runs the next forward. structured_tpot.md measures the result "
        "against the 1.1x TPOT target.",
        "",
        f"Applying a [16, 49152] bitmask to float32 logits (either library's mask): xgrammar's CPU kernel "
        f"{apply_us['xgrammar_cpu']:.0f} us, plain torch (shift, masked_fill) {apply_us['torch']:.0f} us, a byte "
        f"table's 0/-inf looked up and added in place (what Headroom runs) {apply_us['table_add']:.0f} us.",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    stamp, load_before = Stamp("python -m bench.structured_libs", argv), load_average()
    torch.set_num_threads(THREADS)
    from engine.model.loaders import default_model_path
    from engine.model.loaders.gguf import GGUFFile

    tok = GGUFFile(default_model_path()).tokenizer("default")
    vocab, eos = tok.vocab_size, sorted(tok.eos_token_ids)
    docs = [tok.encode(d) for d in documents(BATCH)]
    results = {}
    for make in (xgrammar_lib, llguidance_lib):
        lib = make(tok, vocab, eos)
        results[lib.name] = measure(lib, docs, vocab, args.runs)
        install = install_cost(lib.name)
        results[lib.name].update(install=install, import_s=install["import_s"], install_mb=install["bytes"] / 1e6)
    apply_us = apply_times(vocab, args.runs)
    data = {"schema": SCHEMA, "documents": documents(BATCH), "results": results, "apply_us": apply_us}
    write_report(args.out, report(results, apply_us, machine_line(load_before)), stamp, data)


if __name__ == "__main__":
    main()
