"""What the device checks share: the plan of shapes, a check's result, the session that builds random-weight
models and backends on the device, and running requests through an engine (torch or twin) while recording what
each step did, so that every check runs the same requests on the device and on the twin."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any, NamedTuple

import torch

from engine.backends.torch_backend import TorchBackend, kernel_for
from engine.backends.twin.backend import TwinBackend
from engine.baselines.seed import FixedPolicy
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.core.stats import FinishedRequest
from engine.factory import build_policy
from engine.model.llama import LlamaModel
from engine.model.loaders import LoadedModel
from engine.model.loaders.random_model import random_llama
from engine.model.model_config import ModelConfig
from telemetry.record import StepRecord
from telemetry.units import GIB as GIB  # re-exported: the checks import their units with the rest from here
from telemetry.units import MIB as MIB

NO_NUMERICS = "n/a (the twin models memory and time, not numerics)"
NO_CUDA = "no CUDA device"
PREFILL_CHUNK = 1024  # prompt tokens per step in the fixed-policy runs (fixed_engine says why)

Value = int | float | str | bool | None


class Load(NamedTuple):
    requests: int
    prompt: int  # prompt tokens
    tokens: int  # output tokens


@dataclass(frozen=True)
class Plan:
    """The shapes the checks run: one set for the GPU, a tiny one for the CPU smoke run."""

    pool_tokens: int  # KV pool of the fixed-pool checks, in tokens (the blocks follow the kernel's block size)
    decode: Load  # graphs vs eager and the KV resize, as staggered() requests
    decode_pool_tokens: int  # graphs vs eager's own pool (float32), in tokens: what `decode` needs
    logit_prompts: tuple[int, ...]  # flash vs sdpa: prompts prefilled together, then one decode token each
    nvml: Load  # NVML vs allocator: `nvml_batch` of them running at once
    nvml_batch: int
    resize_tokens: int  # the KV grow, in tokens
    oom: Load  # requests decoding when the ballast comes; as many again arrive after it
    follow: Load  # pool following: `requests` clients in a closed loop
    follow_steps: tuple[int, int, int, int]  # warm-up steps, most steps to take, steps held, most to grow back
    copy_bytes: int  # the bandwidth ceiling's copy
    matmul_size: int  # the matmul ceiling's square product
    decode_batches: tuple[int, ...]  # the roofline's decode steps: batches of requests with
    decode_context: int  # prompts of this many tokens
    decode_tokens: int  # and this many output tokens
    prefill_tokens: int  # the roofline's prefill: one prompt of this many tokens in one step,
    prefill_runs: int  # this many times


@dataclass
class Result:
    """One check: passed (None: skipped, `skipped` says why), its criterion, and its figures, each measured
    beside the twin's prediction for the same requests."""

    name: str
    title: str
    criterion: str
    passed: bool | None = None
    skipped: str | None = None
    seconds: float = 0.0
    figures: list[dict[str, Value]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    series: dict[str, list[Value]] = field(default_factory=dict)  # per-step figures, for the JSON only

    def figure(self, label: str, measured: Value, twin: Value = NO_NUMERICS) -> None:
        self.figures.append({"figure": label, "measured": measured, "twin": twin})

    def skip(self, reason: str) -> Result:
        self.passed, self.skipped = None, reason
        return self


@dataclass
class Session:
    """The device, the model's shape and the plan: builds the random-weight models and backends checks run."""

    device: torch.device
    config: ModelConfig
    plan: Plan
    model_name: str
    dtype: torch.dtype = torch.bfloat16
    memo: dict[str, Any] = field(default_factory=dict, init=False, repr=False)  # what checks share: computed once
    _shared: TorchBackend | None = field(default=None, init=False, repr=False)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def model(self, dtype: torch.dtype | None = None, like: LoadedModel | None = None) -> LoadedModel:
        """Random weights (seeded: the same on every call), or `like`'s weights in `dtype`."""
        dtype = dtype or self.dtype
        if like is None:
            return random_llama(self.config, dtype, self.device, name=self.model_name)
        model = LlamaModel(self.config, dtype=dtype, device=self.device)
        with torch.no_grad():
            for mine, theirs in zip(model.parameters(), like.model.parameters(), strict=True):
                mine.copy_(theirs)
        return LoadedModel(model, self.config, like.tokenizer, like.name)

    def backend(
        self, model: LoadedModel | None = None, attention: str = "auto", pool_tokens: int | None = None, **kwargs: Any
    ) -> TorchBackend:
        """A backend over `model` (default: fresh random weights) with a pool of `pool_tokens` (default: the plan's)."""
        model = model or self.model()
        dtype = model.model.dtype
        tokens = pool_tokens or self.plan.pool_tokens
        blocks = -(-tokens // kernel_for(attention, None, self.device, dtype).block_size)
        return TorchBackend(
            model, dtype=dtype, device=self.device, num_blocks=blocks, attention=attention, model_cache=False, **kwargs
        )

    def shared(self) -> TorchBackend:
        """The default backend of the checks that can share one: on CUDA its graphs are captured once."""
        if self._shared is None:
            self._shared = self.backend()
        return self._shared

    def free(self, shared: bool = False) -> None:
        """Hand the device memory of dropped objects (and of the shared backend) back to the driver."""
        if shared:
            self._shared = None
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def staggered(load: Load) -> list[tuple[int, int]]:
    """(prompt tokens, max_tokens) per request: prompts of growing length and output lengths up to `tokens`,
    so requests finish one after another and the decode batch passes through every size below `requests` (with
    CUDA graphs: through their batch buckets)."""
    n = load.requests
    return [(load.prompt + 13 * i, max(1, load.tokens * (i + 1) // n)) for i in range(n)]


def prompt_ids(index: int, length: int, vocab: int) -> list[int]:
    """Request `index`'s prompt: the same on every run, different for every request."""
    return [(7 + 31 * (index * 1009 + j)) % vocab for j in range(length)]


@dataclass
class RunLog:
    """What a run gave each request and how its steps went."""

    wanted: dict[str, int] = field(default_factory=dict)  # every sent request's max_tokens
    tokens: dict[str, list[int]] = field(default_factory=dict)  # finished requests' output ids
    top: dict[str, list[dict[int, float]]] = field(default_factory=dict)  # per token, if asked: top logprobs
    decode_seconds: list[float] = field(default_factory=list)  # decode-only steps
    decode_batches: list[int] = field(default_factory=list)
    prefill_peaks: list[int] = field(default_factory=list)  # bytes above idle of steps with a prompt
    prefill_seconds: list[float] = field(default_factory=list)  # steps with a prompt
    steps: int = 0
    ooms: int = 0

    @property
    def lost(self) -> int:
        """Sent requests that did not finish with all their tokens (none stops early: EOS is ignored)."""
        return sum(len(self.tokens.get(rid, ())) != n for rid, n in self.wanted.items())

    def send(self, engine: LLMEngine, index: int, prompt: int, tokens: int, logprobs: int | None = None) -> None:
        ids = prompt_ids(index, prompt, engine.backend.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=logprobs)
        engine.add_request(f"r{index}", ids, params)
        self.wanted[f"r{index}"] = tokens

    def finished(self, request: FinishedRequest) -> None:
        self.tokens[request.request_id] = list(request.output_ids)
        self.top[request.request_id] = [dict(lp.top) for lp in request.output_logprobs]

    def stepped(self, record: StepRecord, _batch: object) -> None:
        self.steps += 1
        self.ooms += record.oom
        shape = record.shape
        if record.oom:
            return
        if shape.prefill_tokens:
            self.prefill_peaks.append(record.memory.step_peak)
            self.prefill_seconds.append(record.duration)
        elif shape.decode_seqs:
            self.decode_seconds.append(record.duration)
            self.decode_batches.append(shape.decode_seqs)


def attach(engine: LLMEngine) -> RunLog:
    log = RunLog()
    engine.finish_listeners.append(log.finished)
    engine.step_listeners.append(log.stepped)
    return log


def run(
    engine: LLMEngine,
    requests: list[tuple[int, int]],
    logprobs: int | None = None,
    before_step: Callable[[LLMEngine], None] | None = None,
    max_steps: int = 100_000,
    first_index: int = 0,
) -> RunLog:
    """Send `requests` ((prompt tokens, max_tokens) each; their prompts are prompt_ids from `first_index` on), then
    step until every one finished or `max_steps` steps passed, calling `before_step` before each."""
    log = attach(engine)
    for i, (prompt, tokens) in enumerate(requests, first_index):
        log.send(engine, i, prompt, tokens, logprobs)
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        if before_step is not None:
            before_step(engine)
        engine.step()
    return log


def fixed_engine(backend: Any, max_num_seqs: int = 1024, prefill_chunk: int = PREFILL_CHUNK) -> LLMEngine:
    """Requests admitted at once, no KV held back, prompts in chunks of `prefill_chunk` tokens: the twin's seed
    engine computes logits for every prompt token, and whole prompts of a batch in one step would run its 4090
    out of memory. FixedPolicy's worker dies on an OOM, as the seed's did: the runs on it expect none."""
    policy = FixedPolicy(max_num_seqs=max_num_seqs, kv_reserve_ratio=0.0, max_prefill_tokens=prefill_chunk)
    return LLMEngine(backend, policy)


def adaptive_engine(backend: Any) -> LLMEngine:
    """The production policy over a fixed pool, with its defaults for the backend's kind of device."""
    on_twin = isinstance(backend, TwinBackend)
    cfg = EngineConfig(backend="twin") if on_twin else EngineConfig(device=str(backend.device))
    return LLMEngine(backend, build_policy(cfg))


def twin() -> TwinBackend:
    """The twin (an RTX 4090 running Llama-3.1-8B) with the sensors a real card has."""
    return TwinBackend(sensors="realistic")


def mean_ms(seconds: list[float]) -> float | None:
    return fmean(seconds) * 1e3 if seconds else None
