"""The checks of what the model computes: greedy tokens with CUDA graphs and without, flash-attn's logits against
sdpa's, and tokens across a KV pool grow and shrink while graphs are live.

Why ties are allowed where kernels differ: a random-weight Llama's logits are spread thin (on Llama-3.1-8B's shape
about 1.3 nats wide over 128,256 tokens, so the best two lie about 0.2 nats apart, often far less) and bf16 keeps
8 significant bits, so two correct kernels that add in different orders pick different tokens wherever the best
two lie within their rounding. On a smaller random Llama on the CPU, bf16 and fp32 logits differ by up to 0.035
and 3% of the top-1 picks differ. A wrong kernel (a wrong block, mask or scale) is off by the logits' own scale
instead, and its pick is one of the best two of a correct kernel's only by chance. Where nothing but the tensors'
place in memory changes (a KV resize), the tokens must be identical.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bench.device_checks.common import (
    NO_CUDA,
    NO_NUMERICS,
    Result,
    RunLog,
    Session,
    fixed_engine,
    mean_ms,
    prompt_ids,
    run,
    staggered,
    twin,
)
from engine.backends.torch_backend import TorchBackend
from engine.core.kv_cache import ResizePlan
from engine.core.llm_engine import LLMEngine
from engine.model.attention import build_attention_metadata
from engine.model.cpu_kernels import unusable_reason as cpu_kernels_unusable_reason
from engine.model.cuda_graphs import bucket_for
from engine.model.kernel_choice import flash_unusable_reason

NO_CAPTURE = "n/a (the twin resizes its pool in place: no capture after start-up)"

TIE_NATS = 0.2  # top-2 logprob gap under which greedy picks may differ between correct bf16 kernels
TOP2 = 2  # logprobs asked for: the chosen token's and the runner-up's


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ (one ending first counts); None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(a: RunLog, b: RunLog) -> tuple[int, list[float]]:
    """(requests with identical tokens, and for each other request the top-2 gap where it first differs, the
    smaller of the two runs'; nan unless both runs have the same best two tokens there, swapped: a tie)."""
    same, gaps = 0, []
    for rid in a.wanted:
        i = first_divergence(a.tokens.get(rid, []), b.tokens.get(rid, []))
        if i is None:
            same += 1
            continue
        ta, tb = a.top2.get(rid, []), b.top2.get(rid, [])
        swapped = i < min(len(ta), len(tb)) and ta[i][:2] == tb[i][1::-1]
        gaps.append(min(ta[i][2], tb[i][2]) if swapped else float("nan"))
    return same, gaps


def graphs_vs_eager(s: Session) -> Result:
    """Greedy decode of staggered requests on one backend, eager and then replaying its CUDA graphs."""
    r = Result(
        "graphs_vs_eager",
        "Token equality: eager vs CUDA-graph decode",
        f"each request's greedy tokens are equal, or where they first differ the two runs' best two tokens are the "
        f"same two, swapped, less than {TIE_NATS} nats apart (a tie at bf16's precision); decode steps replayed "
        "graphs, and graphs were still on at the end",
    )
    backend, work = s.shared(), staggered(s.plan.decode)
    graphs, backend.graphs = backend.graphs, None
    eager = run(fixed_engine(backend), work, logprobs=TOP2)
    backend.graphs = graphs
    predicted = mean_ms(run(fixed_engine(twin()), work).decode_seconds)
    r.figure("requests (staggered lengths)", len(work), len(work))
    r.figure("mean decode step, eager (ms)", mean_ms(eager.decode_seconds), predicted)
    if graphs is None:
        why = NO_CUDA if not s.cuda else f"skipped: no CUDA graphs (they need flash-attn: {backend.kernel_reason})"
        r.figure("mean decode step, CUDA graphs (ms)", why, predicted)
        r.notes.append(f"the eager run finished {len(eager.tokens)} of {len(work)} requests")
        return r.skip(why)
    replayed = run(fixed_engine(backend), work, logprobs=TOP2)
    same, gaps = compare(eager, replayed)
    ties = sum(g < TIE_NATS for g in gaps)
    live = backend.graphs is not None and not backend.graphs.disabled
    buckets = sorted({bucket_for(n, graphs.sizes) or 0 for n in replayed.decode_batches} - {0})
    r.figure("mean decode step, CUDA graphs (ms)", mean_ms(replayed.decode_seconds), predicted)
    r.figure("requests with identical tokens", f"{same}/{len(work)}")
    r.figure(f"first differences at a tie (best two swapped, < {TIE_NATS} nats apart)", f"{ties}/{len(gaps)}")
    r.figure("top-2 gaps where they first differ (nats)", ", ".join(f"{g:.3g}" for g in gaps) or "-")
    r.figure("graph buckets replayed", ", ".join(map(str, buckets)) or "none")
    r.figure("graphs on at the end", live)
    r.figure("capture of one bucket, all captured again (s)", capture_seconds(backend), NO_CAPTURE)
    r.passed = ties == len(gaps) and bool(buckets) and live
    return r


def capture_seconds(backend: TorchBackend) -> float:
    """Seconds a bucket's capture takes, averaged over every bucket captured again into the kept pool: what the
    start-up pays per bucket, and what a resize of a copied pool (no cuda-bindings) pays per bucket used after
    it. No request holds a block here."""
    graphs = backend.make_decode_graphs(backend.graphs.capture)
    torch.cuda.synchronize(backend.device)
    t0 = time.perf_counter()
    graphs.capture_all()
    torch.cuda.synchronize(backend.device)
    backend.graphs = graphs
    return (time.perf_counter() - t0) / len(graphs.sizes)


@torch.inference_mode()
def step_logits(backend: TorchBackend, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt token's logits, the prompts prefilled together in one forward, then one more token each,
    decoded together: the kernel's prefill and decode paths, called directly so that every row's logits stay."""
    bs, dev = backend.block_size, backend.device
    tables, used = [], 0
    for p in prompts:
        tables.append(list(range(used, used + -(-(len(p) + 1) // bs))))
        used += len(tables[-1])
    steps = (
        [(0, p, t) for p, t in zip(prompts, tables, strict=True)],
        [(len(p), p[:1], t) for p, t in zip(prompts, tables, strict=True)],
    )
    out = []
    for step in steps:
        meta = build_attention_metadata([(start, len(ids), t) for start, ids, t in step], bs, dev, backend.attention)
        ids = torch.tensor([x for _, new, _ in step for x in new], device=dev)
        positions = torch.tensor([q for start, new, _ in step for q in range(start, start + len(new))], device=dev)
        out.append(backend.model.compute_logits(backend.model(ids, positions, backend.kv_caches, meta)))
    return torch.cat(out)


def flash_vs_sdpa(s: Session) -> Result:
    """The same weights under flash-attn (the C++ kernel on the CPU) and sdpa in bf16, and sdpa in fp32 as the
    reference whose distance from bf16 sdpa sets the tolerance."""
    fast = "flash" if s.cuda else "cpu"
    r = Result(
        "flash_vs_sdpa",
        f"Logits: {fast} attention vs sdpa",
        f"max |{fast} - sdpa| over every logit <= twice bf16's own error on them (max |sdpa bf16 - sdpa fp32|, the "
        "same weights), and the same top-1 token wherever fp32's top two differ by more than that",
    )
    blocker = (flash_unusable_reason if s.cuda else cpu_kernels_unusable_reason)(s.device, s.dtype)
    if blocker is not None:
        r.figure("max |difference|", f"skipped: {blocker}")
        return r.skip(f"skipped: {blocker}")
    prompts = [prompt_ids(i, n, s.config.vocab_size) for i, n in enumerate(s.plan.logit_prompts)]
    weights, logits = s.model(), {}
    for name, attention, dtype in ((fast, fast, s.dtype), ("sdpa", "sdpa", s.dtype), ("fp32", "sdpa", torch.float32)):
        logits[name] = step_logits(s.backend(s.model(dtype, weights), attention, enforce_eager=True), prompts)
        s.free()
    ours, sdpa, ref = logits[fast], logits["sdpa"], logits["fp32"]
    tol = 2 * (sdpa - ref).abs().max().item()
    diff = (ours - sdpa).abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    decided = top2[:, 0] - top2[:, 1] > tol
    agree = ours.argmax(-1) == sdpa.argmax(-1)
    r.figure("logit rows (every prompt token, then one decode token each)", ours.shape[0])
    r.figure(f"max |{fast} - sdpa|", diff)
    r.figure("tolerance: 2 x max |sdpa bf16 - sdpa fp32|", tol)
    r.figure(f"max |{fast} - sdpa fp32|", (ours - ref).abs().max().item())
    r.figure("logits' standard deviation (fp32)", ref.std().item())
    r.figure("top-1 agreement, every row (%)", 100 * agree.float().mean().item())
    r.figure(f"top-1 agreement where fp32's top-2 gap > tolerance (%), {int(decided.sum())} rows",
             100 * agree[decided].float().mean().item() if decided.any() else None)  # fmt: skip
    r.passed = diff <= tol and bool(agree[decided].all())
    return r


def timed_resize(s: Session, engine: LLMEngine, target: int) -> tuple[int, int, int, float]:
    """Resize the pool to `target` blocks: (blocks before, after, moved, seconds to the device's end)."""
    old = engine.allocator.num_blocks
    s.synchronize()
    t0 = time.perf_counter()
    plan = engine.resize_kv_pool(target)
    s.synchronize()
    return old, engine.allocator.num_blocks, len(plan.moves) if plan else 0, time.perf_counter() - t0


def resizer(s: Session, requests: int, grow: int, done: list) -> Callable[[LLMEngine], None]:
    """Before the third step, grow the pool by `grow` blocks; once a third of the requests finished (their freed
    blocks are holes below blocks in use), shrink it to what the unfinished ones need to their end, moving the
    blocks in use above. No less: a request preempted for blocks would be computed again as a prompt, by another
    kernel, and on CUDA that changes its tokens' rounding."""
    steps = 0

    def before_step(engine: LLMEngine) -> None:
        nonlocal steps
        steps += 1
        alloc, unfinished = engine.allocator, engine.requests.values()
        if steps == 3:
            done.append(timed_resize(s, engine, alloc.num_blocks + grow))
        elif len(done) == 1 and 3 * (requests - len(unfinished)) >= requests:
            need = sum(alloc.blocks_for(q.prompt_len + q.max_tokens) for q in unfinished)
            done.append(timed_resize(s, engine, need))

    return before_step


def blocks(old: int, new: int, moved: int, block_size: int) -> str:
    return f"{old} -> {new} of {block_size} tokens, {moved} moved"


def twin_resize(resize: tuple[int, int, int, float], block_size: int) -> tuple[str, float]:
    """The twin's cost (ms) of the same resize, in its own blocks: the same tokens."""
    backend = twin()
    old, new, moved = (-(-n * block_size // backend.block_size) for n in resize[:3])
    plan = ResizePlan(new, old, {i: i for i in range(moved)})
    return blocks(old, new, moved, backend.block_size), backend.resize_cost(plan) * 1e3


def kv_resize(s: Session) -> Result:
    """The staggered requests twice on one backend: as they are, and with the pool grown and shrunk mid-run."""
    r = Result(
        "kv_resize",
        "KV pool grow and shrink with CUDA graphs live",
        "the pool grew, then shrank to what the unfinished requests need (moving the blocks in use above that), "
        "mid-run, and every request's tokens equal a run without resizes (graphs that replayed freed KV tensors "
        "would not); with graphs, they were still on at the end",
    )
    backend, work = s.shared(), staggered(s.plan.decode)
    graphs = backend.graphs is not None
    plain = run(fixed_engine(backend), work)
    resizes: list[tuple[int, int, int, float]] = []
    grow = -(-s.plan.resize_tokens // backend.block_size)
    resized = run(fixed_engine(backend), work, before_step=resizer(s, len(work), grow, resizes))
    for name, resize in zip(("grow", "shrink"), resizes, strict=False):
        predicted, ms = twin_resize(resize, backend.block_size)
        r.figure(f"{name}: pool blocks", blocks(*resize[:3], backend.block_size), predicted)
        r.figure(f"{name} (ms)", resize[3] * 1e3, ms)
    same, _ = compare(plain, resized)
    live = backend.graphs is not None and not backend.graphs.disabled
    r.figure("requests with identical tokens, resized run vs plain run", f"{same}/{len(work)}")
    r.figure("graphs on at the end", live if graphs else "no graphs (decode runs eagerly here)", NO_NUMERICS)
    resized_both = len(resizes) == 2 and all(old != new for old, new, *_ in resizes)
    r.passed = resized_both and same == len(work) and (live or not graphs)
    return r
