"""The checks of what the model computes: greedy tokens with CUDA graphs and without, the fast kernels' logits
(flash-attn, Triton's decode) against sdpa's, and tokens across a KV pool grow and shrink while graphs are live.

Why ties are allowed where kernels differ: a random-weight Llama's logits are spread thin (on Llama-3.1-8B's shape
about 1.3 nats wide over 128,256 tokens, so the best two lie about 0.2 nats apart, often far less) and bf16 keeps 8
significant bits, so two correct kernels that add in different orders pick different tokens wherever the best two
lie within their rounding (the logit checks measure how far bf16 moves them, against fp32). A wrong kernel (a wrong
block, mask or scale) is off by the logits' own scale instead, and its pick is one of the best two of a correct
kernel's only by chance. Where nothing but the tensors' place in memory changes (a KV resize), the tokens must be
identical.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bench.device_checks.common import (
    GIB,
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
from bench.device_checks.roofline import kv_bytes_per_token
from engine.backends.torch_backend import TorchBackend, kernel_for
from engine.core.kv.blocks import ResizePlan
from engine.core.llm_engine import LLMEngine
from engine.model.attention import build_attention_metadata
from engine.model.cpu_kernels import unusable_reason as cpu_kernels_unusable_reason
from engine.model.cuda_graphs import DecodeGraphMetadata, bucket_for
from engine.model.kernel_choice import flash_unusable_reason
from engine.model.triton_decode import triton_unusable_reason

NO_CAPTURE = "n/a (the twin resizes its pool in place: no capture after start-up)"

TIE_NATS = 0.2  # logprob gap under which greedy picks may differ between correct bf16 kernels
TOP_K = 5  # logprobs asked for: a tie may be among more than two tokens


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where `a` and `b` differ (one ending first counts); None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare(a: RunLog, b: RunLog) -> tuple[int, list[float]]:
    """(requests with identical tokens, and for each other request, where it first differs, how far each run's pick
    lies below the other run's best there, the larger of the two (inf where a pick is outside the other's top
    TOP_K)). A tie at bf16's precision is a small gap both ways: each run would have picked the other's token had
    its rounding gone the other way. Among more than two near-equal tokens, the runners-up need not be each
    other's picks, so the gap is taken to the pick, not to the runner-up."""
    same, gaps = 0, []
    for rid in a.wanted:
        ta, tb = a.tokens.get(rid, []), b.tokens.get(rid, [])
        i = first_divergence(ta, tb)
        if i is None:
            same += 1
            continue
        la, lb = a.top.get(rid, []), b.top.get(rid, [])
        if i >= min(len(ta), len(tb), len(la), len(lb)):
            gaps.append(float("inf"))
            continue
        below = [max(top.values()) - top.get(pick, float("-inf")) for top, pick in ((la[i], tb[i]), (lb[i], ta[i]))]
        gaps.append(max(below))
    return same, gaps


def graphs_vs_eager(s: Session) -> Result:
    """Greedy decode of staggered requests on one float32 backend, eager and then replaying its CUDA graphs.
    float32, not the serving dtype: the graphs must not change what is computed (no stale buffer, padding row or
    block table), and in bf16 two runs differ anyway wherever the GEMMs pick another kernel for another batch
    size, by as much as two correct attention kernels do (the logit checks measure that); fp32's rounding is far
    below a random-weight model's top-2 gaps, so a pick that differs there is a defect, not a tie."""
    r = Result(
        "graphs_vs_eager",
        "Token equality: eager vs CUDA-graph decode (float32)",
        f"each request's greedy tokens are equal, or where they first differ each run's pick is less than {TIE_NATS} "
        f"nats below the other run's best, among its top {TOP_K} (a tie); decode steps replayed graphs, and graphs "
        "were still on at the end",
    )
    work = staggered(s.plan.decode)
    predicted = mean_ms(run(fixed_engine(twin()), work).decode_seconds)
    r.figure("requests (staggered lengths)", len(work), len(work))
    if not s.cuda:
        return r.skip(NO_CUDA)
    weights = s.model(torch.float32)
    need = sum(p.numel() for p in weights.model.parameters()) * torch.float32.itemsize
    if (free := torch.cuda.mem_get_info(s.device)[0]) < 1.2 * need:
        return r.skip(f"a float32 copy of the model needs about {need / GIB:.0f} GiB, {free / GIB:.0f} free")
    backend = s.backend(weights, pool_tokens=s.plan.decode_pool_tokens)
    graphs, backend.graphs = backend.graphs, None
    eager = run(fixed_engine(backend), work, logprobs=TOP_K)
    backend.graphs = graphs
    r.figure("mean decode step, eager (ms)", mean_ms(eager.decode_seconds), predicted)
    if graphs is None:
        r.figure("mean decode step, CUDA graphs (ms)", backend.kernel_reason, predicted)
        return r.skip(f"no CUDA graphs ({backend.kernel_reason})")
    replayed = run(fixed_engine(backend), work, logprobs=TOP_K)
    same, gaps = compare(eager, replayed)
    ties = sum(g < TIE_NATS for g in gaps)
    live = backend.graphs is not None and not backend.graphs.disabled
    buckets = sorted({bucket_for(n, graphs.sizes) or 0 for n in replayed.decode_batches} - {0})
    r.figure("mean decode step, CUDA graphs (ms)", mean_ms(replayed.decode_seconds), predicted)
    r.figure("requests with identical tokens", f"{same}/{len(work)}")
    r.figure(f"first differences at a tie (each pick < {TIE_NATS} nats below the other's best)", f"{ties}/{len(gaps)}")
    r.figure("gaps where they first differ (nats)", ", ".join(f"{g:.3g}" for g in gaps) or "-")
    r.figure("graph buckets replayed", ", ".join(map(str, buckets)) or "none")
    r.figure("graphs on at the end", live)
    r.figure("capture of one bucket, all captured again (s)", capture_seconds(backend), NO_CAPTURE)
    r.passed = ties == len(gaps) and bool(buckets) and live
    return r


def capture_seconds(backend: TorchBackend) -> float:
    """Seconds a bucket's capture takes, averaged over every bucket captured again into the kept pool: what the
    start-up pays per bucket, and what a resize of a copied pool (no cuda-bindings) pays per bucket used after
    it. No request holds a block here."""
    graphs = backend.make_decode_graphs(backend.graphs.capture, backend.graphs.kernel)
    torch.cuda.synchronize(backend.device)
    t0 = time.perf_counter()
    graphs.capture_all()
    torch.cuda.synchronize(backend.device)
    backend.graphs = graphs
    return (time.perf_counter() - t0) / len(graphs.sizes)


@torch.inference_mode()
def step_logits(backend: TorchBackend, prompts: list[list[int]], decode: str | None = None) -> torch.Tensor:
    """Every prompt token's logits, the prompts prefilled together in one forward, then one more token each,
    decoded together: the kernel's prefill and decode paths, called directly so that every row's logits stay.
    `decode`: the decode step's kernel where it is not the backend's own ("triton_decode", a graph's)."""
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
    for i, step in enumerate(steps):
        meta = build_attention_metadata([(start, len(ids), t) for start, ids, t in step], bs, dev, backend.attention)
        if i == 1 and decode is not None:
            seq_lens = torch.tensor(meta.context_lens, dtype=torch.int32, device=dev)
            meta = DecodeGraphMetadata(meta.slot_mapping, meta.block_tables, seq_lens, decode)
        ids = torch.tensor([x for _, new, _ in step for x in new], device=dev)
        positions = torch.tensor([q for start, new, _ in step for q in range(start, start + len(new))], device=dev)
        out.append(backend.model.compute_logits(backend.model(ids, positions, backend.kv_caches, meta)))
    return torch.cat(out)


def reference_logits(s: Session, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor] | str:
    """sdpa's logits in bf16 and in fp32 over the same weights (computed once a session), or why they cannot be:
    an fp32 copy of the model that does not fit the card beside what is free. The shared backend is freed first:
    on a 24 GB card no second 8B model fits beside it."""
    if "reference" not in s.memo:
        s.free(shared=True)
        weights = s.model()
        pool = s.plan.pool_tokens * kv_bytes_per_token(s.config, torch.float32.itemsize)
        need = sum(p.numel() for p in weights.model.parameters()) * torch.float32.itemsize + pool
        free = torch.cuda.mem_get_info(s.device)[0] if s.cuda else need
        if free < need:
            s.memo["reference"] = f"an fp32 copy of the model needs about {need / GIB:.0f} GiB, {free / GIB:.0f} free"
        else:
            s.memo["reference"] = tuple(
                step_logits(s.backend(s.model(dtype, weights), "sdpa", enforce_eager=True), prompts)
                for dtype in (s.dtype, torch.float32)
            )
        s.free()
    return s.memo["reference"]


def against_sdpa(s: Session, r: Result, name: str, logits: Callable[[list[list[int]]], torch.Tensor]) -> Result:
    """`name`'s logits beside sdpa's in bf16, with twice bf16's own error on them (sdpa bf16 vs fp32) as the
    tolerance, and the top-1 pick wherever fp32's best two lie further apart than that. `logits` builds its
    backend only once the references are done and freed: one 8B model on the card at a time."""
    prompts = [prompt_ids(i, n, s.config.vocab_size) for i, n in enumerate(s.plan.logit_prompts)]
    reference = reference_logits(s, prompts)
    if isinstance(reference, str):
        return r.skip(reference)
    sdpa, ref = reference
    ours = logits(prompts)
    s.free()
    tol = 2 * (sdpa - ref).abs().max().item()
    diff = (ours - sdpa).abs().max().item()
    top2 = ref.topk(2, dim=-1).values
    decided = top2[:, 0] - top2[:, 1] > tol
    agree = ours.argmax(-1) == sdpa.argmax(-1)
    r.figure("logit rows (every prompt token, then one decode token each)", ours.shape[0])
    r.figure(f"max |{name} - sdpa|", diff)
    r.figure("tolerance: 2 x max |sdpa bf16 - sdpa fp32|", tol)
    r.figure(f"max |{name} - sdpa fp32|", (ours - ref).abs().max().item())
    r.figure("logits' standard deviation (fp32)", ref.std().item())
    r.figure("top-1 agreement, every row (%)", 100 * agree.float().mean().item())
    r.figure(f"top-1 agreement where fp32's top-2 gap > tolerance (%), {int(decided.sum())} rows",
             100 * agree[decided].float().mean().item() if decided.any() else None)  # fmt: skip
    r.passed = diff <= tol and bool(agree[decided].all())
    return r


CRITERION = (
    "max |{} - sdpa| over every logit <= twice bf16's own error on them (max |sdpa bf16 - sdpa fp32|, the same "
    "weights), and the same top-1 token wherever fp32's top two differ by more than that"
)


def fast_vs_sdpa(s: Session) -> Result:
    """flash-attn's prefill and decode (on the CPU: the C++ kernel's) against sdpa's, over the same weights."""
    fast = "flash" if s.cuda else "cpu"
    r = Result("fast_vs_sdpa", f"Logits: {fast} attention vs sdpa", CRITERION.format(fast))
    blocker = (flash_unusable_reason if s.cuda else cpu_kernels_unusable_reason)(s.device, s.dtype)
    if blocker is not None:
        return r.skip(blocker)
    return against_sdpa(
        s, r, fast, lambda prompts: step_logits(s.backend(s.model(), fast, enforce_eager=True), prompts)
    )


def triton_vs_sdpa(s: Session) -> Result:
    """Triton's decode kernel (what CUDA graphs capture without flash-attn) against sdpa's decode, over the KV the
    same sdpa prefill wrote."""
    r = Result("triton_vs_sdpa", "Logits: Triton's decode kernel vs sdpa", CRITERION.format("triton"))
    blocker = triton_unusable_reason(
        s.device, s.config.head_dim, kernel_for("sdpa", None, s.device, s.dtype).block_size
    )
    if blocker is not None:
        return r.skip(blocker)
    return against_sdpa(
        s,
        r,
        "triton",
        lambda prompts: step_logits(s.backend(s.model(), "sdpa", enforce_eager=True), prompts, "triton_decode"),
    )


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
