"""The real plant: a Llama, its paged KV pool and the sampler behind the Backend protocol."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from engine.backends.warm_up import run_warm_up
from engine.core.backend import BackendDefaults, BackendInfo
from engine.core.batch import EMPTY, ModelOutput, SchedulerOutput
from engine.core.kv.tensors import kv_cache_bytes_per_block, resize_kv_cache, swap_in_blocks, swap_out_blocks
from engine.core.kv.vmm import KVArena, allocate_pool
from engine.core.sampler import Sampler, score_prompts
from engine.core.structured import StructuredOutputs
from engine.model import cpu_kernels
from engine.model.attention import build_attention_metadata
from engine.model.batch_invariance import linear_min_rows
from engine.model.cpu_forward import fused_layers, loop_reason
from engine.model.cpu_kernels import CpuKernelOps, head_dim_unsupported, linear_unusable_reason
from engine.model.cuda_graphs import (
    Capture,
    DecodeGraphMetadata,
    DecodeGraphs,
    cuda_graph_capture,
    decode_graph_kernel,
    decode_inputs,
)
from engine.model.dtype_choice import DtypeChoice, choose_dtype, choose_kv_dtype
from engine.model.kernel_choice import KernelChoice, choose_kernel
from engine.model.loaders import LoadedModel, load
from engine.model.loaders.cache import ModelCache
from engine.model.quant import choose_quantization
from engine.model.tensor_parallel import RankShard, shard_model
from telemetry.probes import MemoryProbe, make_probe
from telemetry.probes.cpu import tensor_bytes
from telemetry.units import parse_bytes

if TYPE_CHECKING:
    from engine.core.kv.blocks import ResizePlan

CPU_KV_TOKENS = 32 * 2048  # default CPU pool: 32 sequences of 2048 tokens

logger = logging.getLogger("headroom.engine")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """`auto` (or None): CUDA when there is one, else the CPU."""
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def kernel_for(
    attention: str, block_size: int | None, device: str | torch.device | None, dtype: str | torch.dtype
) -> KernelChoice:
    """The attention kernel and block size a TorchBackend with these arguments runs (engine/model/kernel_choice.py),
    known before the model loads: the factory sizes the KV pool in blocks of this size."""
    resolved = resolve_device(device)
    return choose_kernel(attention, block_size, resolved, choose_dtype(dtype, resolved).dtype)


class TorchBackend(BackendDefaults):
    graphs: DecodeGraphs | None = None  # captured decode steps; None: every step runs eagerly
    kv_arena: KVArena | None = None  # the pool in CUDA virtual memory; None: tensors copied on a resize

    def __init__(
        self,
        model: str | LoadedModel = "default",
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = "auto",
        kv_cache_dtype: str = "auto",
        quantization: str = "auto",
        num_blocks: int | None = None,
        block_size: int | None = None,
        attention: str = "auto",
        probe: MemoryProbe | None = None,
        device_memory: int | str | None = None,
        max_model_len: int | None = None,
        kv_memory_fraction: float = 0.5,
        seed: int | None = None,
        model_cache: bool = True,
        enforce_eager: bool = False,
        shard: RankShard | None = None,
    ) -> None:
        """model: a spec for engine/model/loaders (`default`, a GGUF file, an HF directory), or a model already
        loaded in this dtype on this device (engine/model/loaders/random_model.py). dtype `auto`:
        engine/model/dtype_choice.py; `dtype_reason` says why, and `kv_reason` why the KV cache holds `kv_dtype`
        (`kv_cache_dtype`: auto or a dtype; `choose_kv_dtype`). `quantization` (auto, none or a GGUF type):
        engine/model/quant.py `choose_quantization`; `quant_reason` says why. `attention` and `block_size` None:
        engine/model/kernel_choice.py (on the CPU the C++ kernels, `_use_kernels`; flash-attn with 256-token
        blocks where it runs; else sdpa, plain torch, with 16); `kernel_reason` says why.
        `device_memory` caps the device's capacity ("2GiB"; on CPU, an emulated device) for the probe and the
        default KV pool. num_blocks None: `kv_memory_fraction` of the capacity left after the weights (CUDA,
        or CPU with `device_memory`), else CPU_KV_TOKENS. `probe` None: telemetry's probe for the device.
        `seed` seeds unseeded requests' draws. Decode-only steps replay CUDA graphs (engine/model/cuda_graphs.py)
        on CUDA, of flash-attn's decode or else Triton's (`graph_kernel`), unless `enforce_eager`. `model_cache`:
        load through the warm-start cache (engine/model/loaders/cache.py). `shard`: this process is one rank of a
        tensor-parallel group and runs its shard of the model (engine/model/tensor_parallel.py), eagerly, with no
        swap.

        Batch invariance on CPU (a token's logits do not depend on what else is in the batch): attention keeps it on
        every path; bf16 linears on Headroom's kernel by construction, elsewhere with their inputs padded to
        `linear_min_rows` rows (engine/model/batch_invariance.py probes it: oneDNN does not promise it); float32
        linears (MKL) round a row differently by batch size. On CUDA nothing is promised."""
        self.device = resolve_device(device)
        choice = choose_dtype(dtype, self.device)
        self.dtype, self.dtype_reason = choice.dtype, choice.reason
        kernel = choose_kernel(attention, block_size, self.device, self.dtype)
        self.block_size = kernel.block_size
        capacity = parse_bytes(device_memory) if device_memory is not None else None
        self._load(model, quantization, model_cache, shard)
        self.model.linear_min_rows = linear_min_rows(self.device, self.dtype)
        self._use_kernels(kernel, attention)
        self._allocate_kv(choose_kv_dtype(kv_cache_dtype, self.dtype, dtype == "auto", self.attention), num_blocks,
                          capacity, kv_memory_fraction)  # fmt: skip
        # Preemption by swap only where host memory is not the device's: on the CPU a host copy would take
        # the memory the pool gave back (and count against a cgroup or --device-memory limit).
        self.can_swap = self.device.type == "cuda" and shard is None
        self._context_cap = min(self.config.max_position_embeddings, max_model_len or 1 << 62)
        self.probe = probe if probe is not None else self._default_probe(capacity)
        self.sampler = Sampler(seed, cpu_kernels.draw_plain) if self.attention == "cpu" else Sampler(seed)
        self._kv_host: dict[str, Any] = {}  # swapped-out requests' KV in host memory, by request id
        self.sampler_seconds = 0.0  # cumulative: the engine's phase timer splits execute with it
        self._capture_graphs_at_start(enforce_eager)

    def _load(self, model: str | LoadedModel, quantization: str, model_cache: bool, shard: RankShard | None) -> None:
        """The model, the tokenizer and the quantization's reason. A tensor-parallel rank loads the float weights
        and keeps its shard: the sharding slices float matrices, not quantized blocks."""
        quant = choose_quantization(quantization, self.device, cpu_kernels.unusable_reason(self.device, self.dtype))
        mode, self.quant_reason = quant.mode, quant.reason
        if shard is not None and mode is not None:
            mode, self.quant_reason = None, "tensor parallel: float weights, sharded (quantized blocks are not)"
        cache = ModelCache() if model_cache else None
        loaded = model if isinstance(model, LoadedModel) else load(model, self.dtype, self.device, cache, mode)
        self.model, self.config, self.model_name = loaded.model, loaded.config, loaded.name
        if shard is not None:
            self.config = shard_model(self.model, shard.rank, shard.size, shard.reduce)
        self.shard = shard
        self.tokenizer = loaded.tokenizer
        self.structured = StructuredOutputs(self.tokenizer, self.config.vocab_size)  # grammar masks, by request
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)

    def _allocate_kv(self, kv: DtypeChoice, num_blocks: int | None, capacity: int | None, fraction: float) -> None:
        """The KV pool in the chosen dtype, sized by `num_blocks` or by `fraction` of what the weights leave."""
        self.kv_dtype, self.kv_reason = kv.dtype, kv.reason
        self.num_blocks = num_blocks or self._default_num_blocks(capacity, fraction)
        pool = allocate_pool(self.config, self.block_size, self.kv_dtype, self.device, self.num_blocks, capacity)
        self.kv_arena, self.kv_caches, self.kv_layout = pool

    def _capture_graphs_at_start(self, enforce_eager: bool) -> None:
        """Every bucket's decode graph, now, so the idle footprint the controller profiles holds them, into a
        pool kept for the process: graphs a resize drops give their blocks back to it, not to the driver."""
        eager = "--enforce-eager" if enforce_eager else "a tensor-parallel rank" if self.shard is not None else None
        self.graph_kernel, why = decode_graph_kernel(self.device, self.attention, self.config, self.block_size, eager)
        if self.device.type == "cuda":
            self.kernel_reason += f"; decode CUDA graphs: {self.graph_kernel or 'off'} ({why})"
        if self.graph_kernel is not None:
            self._graph_pool = torch.cuda.MemPool()
            self.graphs = self.make_decode_graphs(cuda_graph_capture(self._graph_pool.id), self.graph_kernel)
            self.graphs.capture_all()

    def _use_kernels(self, kernel: KernelChoice, asked: str) -> None:
        """Run the model's attention and elementwise ops on the C++ kernels where `kernel` chose them and the
        model's head size suits them, and its linears too in bf16 where the CPU has AVX512-BF16
        (engine/model/cpu_kernels.py). A CPU model left on plain torch logs a warning that says why: it runs
        slower, and a build that failed is a defect to fix, not a property of the machine."""
        self.attention, self.kernel_reason = kernel.attention, kernel.reason
        if self.attention == "cpu" and (why := head_dim_unsupported(self.config.head_dim)):
            if asked == "cpu":
                raise ValueError(f"attention backend 'cpu' cannot run this model: {why}")
            self.attention, self.kernel_reason = "sdpa", f"auto: sdpa ({why})"  # same block size
        linear_blocker = "the C++ kernels are off" if self.attention != "cpu" else linear_unusable_reason(self.dtype)
        if self.attention == "cpu":
            self.model.ops = CpuKernelOps()
        if self.device.type == "cpu":
            if self.attention != "cpu":
                why = "--attention sdpa" if asked == "sdpa" else self.kernel_reason
                logger.warning("CPU kernels off, the model runs in plain torch (slower): %s", why)
            elif linear_blocker is not None and not self.model.all_quantized:
                logger.warning("linears on torch, not the C++ kernel: %s", linear_blocker)
            name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(self.dtype)
            linears = f"the {name} kernel" if linear_blocker is None else f"torch ({linear_blocker})"
            if self.model.quantized:
                rest = "" if self.model.all_quantized else f" (float ones: {linears})"
                linears = f"the quantized kernel, {cpu_kernels.qlinear_isa()}{rest}"
            self.kernel_reason += f"; linears: {linears}"
        self.model.pack_linears(cpu_kernel=linear_blocker is None)
        self.model.fused = fused_layers(self.model) if self.shard is None else None  # one call has no all-reduce
        if self.model.fused is not None:
            self.kernel_reason += "; decoder layers: one C++ call a step"
        elif self.attention == "cpu" and self.shard is None and (why := loop_reason(self.model)):
            self.kernel_reason += f"; decoder layers: Python loop ({why})"

    def _default_probe(self, capacity: int | None) -> MemoryProbe:
        """telemetry's probe for this device, told what the weights and the KV pool hold at rest."""
        device_name = str(self.device) if self.device.type != "cuda" else f"cuda:{self.device.index or 0}"
        idle = tensor_bytes([self.model, *(t for kv in self.kv_caches for t in kv)])
        outside = (lambda: self.kv_arena.mapped_bytes) if self.kv_arena is not None else (lambda: 0)
        return make_probe(device_name, capacity, idle_bytes=idle, outside=outside)

    @property
    def block_bytes(self) -> int:
        """Device bytes of one KV block, all layers (a pool in virtual memory maps whole granules of them)."""
        return kv_cache_bytes_per_block(self.config, self.block_size, self.kv_dtype)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def info(self) -> BackendInfo:
        return BackendInfo(
            dtype=f"{str(self.dtype).removeprefix('torch.')} ({self.dtype_reason}); KV "
            f"{str(self.kv_dtype).removeprefix('torch.')} ({self.kv_reason})",
            quantization=self.quant_reason,
            attention=f"{self.attention}, block size {self.block_size} ({self.kernel_reason})",
            kv_pool=self.kv_layout,
        )

    @property
    def max_model_len(self) -> int:
        """The model's context, capped by --max-model-len and by the pool as it is now (it may be resized)."""
        return min(self._context_cap, self.num_blocks * self.block_size)

    def resize_kv(self, plan: ResizePlan) -> float:
        """Resize the KV pool between steps (no step's activations are live); returns the measured seconds. In
        CUDA virtual memory (engine/core/kv/vmm.py) blocks are mapped or unmapped in place and the CUDA graphs
        stay valid; otherwise the tensors are copied (`_resize_copied`). Either way a grow the device cannot hold
        raises torch.OutOfMemoryError with the pool as it was."""
        t0 = time.perf_counter()
        if self.kv_arena is not None:
            try:
                self.kv_arena.resize(plan.num_blocks, plan.moves)
            except torch.OutOfMemoryError:
                if self.device.type != "cuda":
                    raise
                torch.cuda.empty_cache()  # the allocator's cached segments back to the driver, then once more
                self.kv_arena.resize(plan.num_blocks, plan.moves)
            if plan.delta < 0 and self.device.type == "cuda":  # a shrink is for memory someone is short of:
                torch.cuda.empty_cache()  # the cached segments go back with the blocks
            self.kv_caches = self.kv_arena.caches()
        else:
            self._resize_copied(plan)
        self.num_blocks = plan.num_blocks
        self.probe.add_idle(plan.delta * self.block_bytes)  # a computed probe's (CPU) footprint moves with it
        return time.perf_counter() - t0

    def _resize_copied(self, plan: ResizePlan) -> None:
        """Reallocate and copy each layer's K and V (engine/core/kv/tensors.py: resize_kv_cache), then empty_cache on
        CUDA so the old tensors go back to the driver: the transient is the growth plus one tensor. A grow that
        runs out of memory part way is rolled back (a shrink to the old size never needs more memory than it
        frees) and raises torch.OutOfMemoryError. Either way some tensors were replaced, so the CUDA graphs, which
        captured the old ones, are dropped; `prepare` captures them again."""
        try:
            resize_kv_cache(self.kv_caches, plan.num_blocks, plan.moves)
        except torch.OutOfMemoryError:
            if plan.num_blocks > plan.old_num_blocks:
                resize_kv_cache(self.kv_caches, plan.old_num_blocks, {})
            raise
        finally:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if self.graphs is not None:
                self.graphs = self.make_decode_graphs(self.graphs.capture, self.graphs.kernel)

    def swap(self, out: list[tuple[str, list[int]]], into: list[tuple[str, list[int]]]) -> float:
        """Preemption by swap (Backend.swap; only when `can_swap`, i.e. on CUDA, where host memory is not the
        device's): each `out` request's blocks of every layer's K and V are copied to host memory (kept here
        by request id), then each `into` request's host copy is copied into its new blocks, one layer at a
        time (a transient of one layer's blocks on the device). Returns the measured seconds."""
        t0 = time.perf_counter()
        for rid, blocks in out:
            self._kv_host[rid] = swap_out_blocks(self.kv_caches, blocks)
        for rid, blocks in into:
            swap_in_blocks(self.kv_caches, blocks, self._kv_host.pop(rid))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _default_num_blocks(self, capacity: int | None, fraction: float) -> int:
        per_block = self.block_bytes
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            available = free if capacity is None else capacity - torch.cuda.memory_allocated(self.device)
        elif capacity is not None:
            available = capacity - tensor_bytes([self.model])
        else:
            return -(-CPU_KV_TOKENS // self.block_size)
        blocks = int(available * fraction) // per_block
        if blocks < 1:
            raise ValueError(f"no room for a KV cache: {available} bytes left after loading the weights")
        return blocks

    def make_decode_graphs(self, capture: Capture, kernel: str) -> DecodeGraphs:
        """Decode graphs of attention `kernel` over the KV tensors as they are now; the width of their block
        tables holds the longest sequence the pool and the context allow."""
        pool = self.kv_arena.max_blocks if self.kv_arena is not None else self.num_blocks  # the most it can hold
        width = min(-(-self._context_cap // self.block_size), pool)

        def forward(ids: torch.Tensor, positions: torch.Tensor, meta: DecodeGraphMetadata) -> torch.Tensor:
            arena = self.kv_arena  # its whole range: the graph outlives every resize (KVArena.caches)
            return self.model(ids, positions, arena.caches(arena.max_blocks) if arena else self.kv_caches, meta)

        return DecodeGraphs(forward, width, self.device, capture, kernel)

    def capture_graphs(self) -> None:
        """Every bucket's graph, after the start-up pool sizing resized the pool, which drops the graphs of a
        copied pool (not of one in CUDA virtual memory): serving then starts with all of them, as vLLM's does."""
        if self.graphs is not None:
            self.graphs.capture_all()

    def _graph_fits(self, batch: SchedulerOutput) -> bool:
        """Whether the step replays a CUDA graph: decode-only, within the largest bucket and the tables' width."""
        items = batch.items
        return (
            self.graphs is not None
            and all(it.num_tokens == 1 and it.sample for it in items)
            and self.graphs.fits(len(items), max(len(it.block_table) for it in items))
        )

    def prepare(self, batch: SchedulerOutput) -> None:
        """Before the step, outside its measurement (Backend.prepare): the graph it replays, if a resize dropped it."""
        if batch.items and self._graph_fits(batch) and not self.graphs.has_graph(len(batch.items)):
            self.graphs.capture_for(*decode_inputs(batch.items, self.block_size))

    def _graph_decode(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """The hidden states of a decode-only step replayed from its CUDA graph; None where the step runs
        eagerly (no graphs, a prefill in it, a batch above the largest bucket, a failed capture)."""
        return self.graphs.run(*decode_inputs(batch.items, self.block_size)) if self._graph_fits(batch) else None

    def warm_up(self) -> float:
        """engine/backends/warm_up.py, into the pool's first blocks before any request holds them."""
        return run_warm_up(self)

    def recover_from_oom(self) -> None:
        """Nothing to let go: the failed step's tensors were freed as its exception unwound, and no output is kept
        between steps. The cache stays: PyTorch's allocator empties it and retries inside a cudaMalloc that
        fails, for this process, where an empty_cache here would hand it to another process short of memory and
        the next step would fail for want of it (bench/results/fault_campaign.md)."""

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """One forward over every item's new tokens; one sampled token per item with `sample`, in order, and
        its logprobs where its request asks for them. Finished requests' state is dropped first."""
        if batch.finished:
            self.sampler.drop(batch.finished)
            self.structured.drop(batch.finished)
            for rid in batch.finished:
                self._kv_host.pop(rid, None)
        hidden = self.forward(batch)
        if hidden is None or not len(hidden):
            return EMPTY
        sampling = [it for it in batch.items if it.sample]
        logits = self.model.compute_logits(hidden[: len(sampling)]) if sampling else None
        if self.device.type == "cuda":  # the sampler's .tolist() waits for the forward: time only its own work
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        if logits is not None:  # structured outputs: the grammars' masks go on before the draw
            self.structured.apply(logits, sampling)
        result = EMPTY if logits is None else self.sampler.sample_items(logits, sampling, self.eos_token_ids)
        if len(hidden) > len(sampling):  # the rows of prompts that ask for their logprobs
            scored = score_prompts(batch.items, hidden[len(sampling) :], self.model.compute_logits)
            result = replace(result, prompt_logprobs=scored)
        result = self.structured.advance(sampling, result)  # last: a step that fails before leaves the grammars be
        self.sampler_seconds += time.perf_counter() - start
        return result

    @torch.inference_mode()
    def forward(self, batch: SchedulerOutput) -> torch.Tensor | None:
        """The final hidden states of the sampling items' last tokens, in order, then those of the items'
        `prompt_logprob_positions`, in order (every item's KV written); None for an empty batch. What a
        tensor-parallel rank that does not sample runs."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # flat-batch index of each sampling item's last new token
        prompt_rows: list[int] = []  # flat-batch index of each position whose prompt logprob is asked for
        for item in batch.items:
            if item.params.prompt_logprobs is not None:
                prompt_rows += (len(ids) + p - item.start for p in item.prompt_logprob_positions)
            ids += item.token_ids
            positions += range(item.start, item.start + item.num_tokens)
            if item.sample:
                rows.append(len(ids) - 1)
        rows += prompt_rows
        if not batch.items:
            return None
        hidden = self._graph_decode(batch)
        if hidden is None:
            meta = build_attention_metadata(
                [(it.start, it.num_tokens, it.block_table) for it in batch.items],
                self.block_size,
                self.device,
                self.attention,
            )
            ids_t, positions_t = torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device)
            hidden = self.model(ids_t, positions_t, self.kv_caches, meta)[rows]
        return hidden
