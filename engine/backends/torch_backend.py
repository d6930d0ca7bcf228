"""The real plant: a Llama, its paged KV pool and the sampler behind the Backend protocol."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from engine.core.sampler import Sampler
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledBatch, ScheduledSeq
from engine.core.sequence import Sequence
from engine.model import cpu_kernels
from engine.model.attention import (
    allocate_kv_cache,
    build_attention_metadata,
    kv_cache_bytes_per_block,
    resize_kv_cache,
    swap_in_blocks,
    swap_out_blocks,
)
from engine.model.batch_invariance import linear_min_rows
from engine.model.cpu_kernels import CpuKernelOps, head_dim_unsupported, linear_unusable_reason
from engine.model.cuda_graphs import Capture, DecodeGraphMetadata, DecodeGraphs, cuda_graph_capture
from engine.model.dtype_choice import choose_dtype
from engine.model.kernel_choice import KernelChoice, choose_kernel
from engine.model.loaders import LoadedModel, load
from engine.model.loaders.cache import ModelCache
from telemetry.probes import make_probe
from telemetry.probes.cpu import tensor_bytes
from telemetry.units import parse_bytes

if TYPE_CHECKING:
    from engine.core.kv_cache import ResizePlan

CPU_KV_TOKENS = 32 * 2048  # default CPU pool: 32 sequences of 2048 tokens
WARM_UP_TOKENS = 128  # the warm-up prefill (TorchBackend.warm_up): a short prompt's size
WARM_UP_PARAMS = SamplingParams(temperature=0, max_tokens=1)


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


class TorchBackend:
    graphs: DecodeGraphs | None = None  # captured decode steps; None: every step runs eagerly

    def __init__(
        self,
        model: str | LoadedModel = "default",
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = "auto",
        num_blocks: int | None = None,
        block_size: int | None = None,
        attention: str = "auto",
        probe: Any = None,
        device_memory: int | str | None = None,
        max_model_len: int | None = None,
        kv_memory_fraction: float = 0.5,
        seed: int | None = None,
        model_cache: bool = True,
        enforce_eager: bool = False,
    ) -> None:
        """model: a spec for engine/model/loaders (`default`, a GGUF file, an HF directory), or a model already
        loaded in this dtype on this device (engine/model/loaders/random_model.py). dtype: `auto` (default) is
        bf16 on CUDA and on CPUs with AMX-BF16 or AVX512-BF16, else float32 (engine/model/dtype_choice.py);
        `dtype_reason` says why. Batch invariance (a token's logits do not depend on what else is in the
        batch) on CPU: attention keeps it on every path; bf16 linears keep it on Headroom's kernel (AVX512-BF16)
        by construction, elsewhere with their inputs padded to `linear_min_rows` rows, as
        measured by engine/model/batch_invariance.py's probe (oneDNN does not promise it); float32 linears (MKL)
        round a row differently by batch size, so greedy outputs can differ between batched and alone. On
        CUDA nothing is promised.
        `device_memory` caps the device's capacity ("2GiB"; on CPU, an emulated device) for the probe
        and the default KV pool. num_blocks None: `kv_memory_fraction` of the capacity left after the
        weights (CUDA, or CPU with `device_memory`), else enough for 32 sequences of 2048 tokens.
        `probe` None: telemetry's probe for the device. `seed` seeds unseeded requests' draws.
        `attention` and `block_size` None: engine/model/kernel_choice.py (on the CPU, the C++ kernels of
        engine/model/cpu_kernels.py, which then run the norms, RoPE, SiLU and, in bf16 on AVX512-BF16,
        the linears too; flash-attn with 256-token blocks where it runs; else sdpa, plain torch, with 16);
        `kernel_reason` says why. Decode-only steps replay CUDA graphs (engine/model/cuda_graphs.py) on CUDA with
        the flash kernel, unless `enforce_eager`. `model_cache`: load through the warm-start cache
        (engine/model/loaders/cache.py)."""
        self.device = resolve_device(device)
        choice = choose_dtype(dtype, self.device)
        self.dtype, self.dtype_reason = choice.dtype, choice.reason
        kernel = choose_kernel(attention, block_size, self.device, self.dtype)
        self.attention, self.block_size, self.kernel_reason = kernel.attention, kernel.block_size, kernel.reason
        capacity = parse_bytes(device_memory) if device_memory is not None else None
        cache = ModelCache() if model_cache else None
        loaded = model if isinstance(model, LoadedModel) else load(model, self.dtype, self.device, cache)
        self.model = loaded.model
        self.model.linear_min_rows = linear_min_rows(self.device, self.dtype)
        if self.attention == "cpu" and (why := head_dim_unsupported(loaded.config.head_dim)):
            if attention == "cpu":
                raise ValueError(f"attention backend 'cpu' cannot run this model: {why}")
            self.attention, self.kernel_reason = "sdpa", f"auto: sdpa ({why})"  # same block size
        linear_blocker = "the C++ kernels are off" if self.attention != "cpu" else linear_unusable_reason(self.dtype)
        if self.attention == "cpu":  # the C++ kernels built: the elementwise ops run on them too
            self.model.ops = CpuKernelOps()
        if self.device.type == "cpu":
            linears = "the bf16 kernel" if linear_blocker is None else f"torch ({linear_blocker})"
            self.kernel_reason += f"; linears: {linears}"
        self.model.pack_linears(cpu_kernel=linear_blocker is None)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.eos_token_ids = set(self.tokenizer.eos_token_ids)
        self.num_blocks = num_blocks or self._default_num_blocks(capacity, kv_memory_fraction)
        self.kv_caches = allocate_kv_cache(self.config, self.num_blocks, self.block_size, self.dtype, self.device)
        # Preemption by swap only where host memory is not the device's: on the CPU a host copy would take
        # the memory the pool gave back (and count against a cgroup or --device-memory limit).
        self.can_swap = self.device.type == "cuda"
        self._context_cap = min(self.config.max_position_embeddings, max_model_len or 1 << 62)
        if probe is None:
            device_name = str(self.device) if self.device.type != "cuda" else f"cuda:{self.device.index or 0}"
            idle = tensor_bytes([self.model, *(t for kv in self.kv_caches for t in kv)])
            probe = make_probe(device_name, capacity, idle_bytes=idle)
        self.probe = probe
        self.sampler = Sampler(seed, cpu_kernels.draw_plain) if self.attention == "cpu" else Sampler(seed)
        self.sampler_seconds = 0.0  # cumulative: the engine's phase timer splits execute with it
        self.block_bytes = kv_cache_bytes_per_block(self.config, self.block_size, self.dtype)
        graphs_run = self.device.type == "cuda" and self.attention == "flash" and not enforce_eager
        self.graphs = (
            self.make_decode_graphs(cuda_graph_capture(torch.cuda.graph_pool_handle())) if graphs_run else None
        )

    @property
    def max_model_len(self) -> int:
        """The model's context, capped by --max-model-len and by the pool as it is now (it may be resized)."""
        return min(self._context_cap, self.num_blocks * self.block_size)

    def resize_kv(self, plan: ResizePlan) -> float:
        """Reallocate and copy each layer's K and V (engine/model/attention.py: resize_kv_cache); returns the
        measured seconds. The engine calls it between steps, so no step's activations are live.

        On CUDA the mechanism is the same, a new tensor and a copy per K and V per layer, followed by
        empty_cache so the old tensors go back to the driver: one contiguous tensor per layer is what
        flash-attn's paged kernel needs, the transient is the growth plus one tensor, and a copy at
        device bandwidth costs milliseconds. CUDA virtual memory (cuMemMap) would grow in place without
        the copy, but needs a binding we do not ship. A grow that runs out of memory part way raises
        torch.OutOfMemoryError with num_blocks unchanged: every tensor is whole and holds at least the
        old blocks, so the pool is still a correct pool of the old size. A shrink's transient is one
        new tensor, smaller than the old one it replaces.
        """
        t0 = time.perf_counter()
        resize_kv_cache(self.kv_caches, plan.num_blocks, plan.moves)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.num_blocks = plan.num_blocks
        if self.graphs is not None:  # they captured the old tensors
            self.graphs = self.make_decode_graphs(self.graphs.capture)
        if hasattr(self.probe, "idle_bytes"):  # computed probes (CPU) are told the new footprint
            self.probe.idle_bytes += plan.delta * self.block_bytes
        return time.perf_counter() - t0

    def swap(self, out: list[tuple[Sequence, list[int]]], into: list[tuple[Sequence, list[int]]]) -> float:
        """Preemption by swap (Backend.swap; only when `can_swap`, i.e. on CUDA, where host memory is not the
        device's): each `out` sequence's blocks of every layer's K and V are copied to host memory, then
        each `into` sequence's host copy is copied into its new blocks, one layer at a time (a transient of
        one layer's blocks on the device). Returns the measured seconds."""
        t0 = time.perf_counter()
        for seq, blocks in out:
            seq.kv_host = swap_out_blocks(self.kv_caches, blocks)
        for seq, blocks in into:
            swap_in_blocks(self.kv_caches, blocks, seq.kv_host)
            seq.kv_host = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def _default_num_blocks(self, capacity: int | None, fraction: float) -> int:
        per_block = kv_cache_bytes_per_block(self.config, self.block_size, self.dtype)
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

    def make_decode_graphs(self, capture: Capture) -> DecodeGraphs:
        """Decode graphs over the KV tensors as they are now; the width of their block tables holds the
        longest sequence the pool and the context allow."""
        width = min(-(-self._context_cap // self.block_size), self.num_blocks)

        def forward(ids: torch.Tensor, positions: torch.Tensor, meta: DecodeGraphMetadata) -> torch.Tensor:
            return self.model(ids, positions, self.kv_caches, meta)

        return DecodeGraphs(forward, width, self.device, capture)

    def _graph_decode(self, batch: ScheduledBatch, ids: list[int], positions: list[int]) -> torch.Tensor | None:
        """The hidden states of a decode-only step replayed from its CUDA graph; None where the step runs
        eagerly (no graphs, a prefill in it, a batch above the largest bucket, a failed capture)."""
        items = batch.items
        if self.graphs is None or not all(it.num_tokens == 1 and it.sample for it in items):
            return None
        tables = [it.seq.block_table for it in items]
        if not self.graphs.fits(len(items), max(map(len, tables))):
            return None
        bs = self.block_size
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        return self.graphs.run(ids, positions, slots, tables)

    def warm_up(self) -> float:
        """A prefill of up to WARM_UP_TOKENS tokens and one decode step, into the pool's first blocks before
        any request holds them; returns the seconds. Run on the thread that will run the steps (OpenMP
        starts a thread team per calling thread), so the first request does not pay for the team's start
        and the first touch of a step's buffers. In process, on a 2-vCPU CPU, the first 128-token prefill
        took 116 ms where the next ones took 101; after a warm-up the first took 91 like the rest. Behind
        the server the first request's forward is still slower than later ones (not explained)."""
        tokens = min(WARM_UP_TOKENS, self.max_model_len - 2)
        seq = Sequence("warm-up", [i % self.config.vocab_size for i in range(tokens)], WARM_UP_PARAMS, 2)
        seq.block_table = list(range(-(-(tokens + 1) // self.block_size)))
        start = time.perf_counter()
        for first, count in ((0, tokens), (tokens, 1)):
            batch = ScheduledBatch()
            batch.add(ScheduledSeq(seq, first, count, count > 1))
            seq.output_ids += self.execute(batch)
        return time.perf_counter() - start

    def recover_from_oom(self) -> None:
        """Hand the failed step's cached blocks back so the next, smaller step starts clean."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def now(self) -> float:
        return time.monotonic()

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int]:
        """One forward over every item's new tokens; one sampled token per item with `sample`, in order. An
        item whose request asks for logprobs gets them in `item.logprob`."""
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []  # flat-batch index of each sampling item's last new token
        for item in batch.items:
            end = item.start + item.num_tokens
            ids += item.seq.token_slice(item.start, end)
            positions += range(item.start, end)
            if item.sample:
                rows.append(len(ids) - 1)
        if not batch.items:
            return []
        hidden = self._graph_decode(batch, ids, positions)
        if hidden is None:
            meta = build_attention_metadata(
                [(it.start, it.num_tokens, it.seq.block_table) for it in batch.items],
                self.block_size,
                self.device,
                self.attention,
            )
            ids_t, positions_t = torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device)
            hidden = self.model(ids_t, positions_t, self.kv_caches, meta)[rows]
        if not rows:
            return []
        sampling = [it for it in batch.items if it.sample]
        logits = self.model.compute_logits(hidden)
        if self.device.type == "cuda":  # the sampler's .tolist() waits for the forward: time only its own work
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        tokens, logprobs = self.sampler.sample_sequences(logits, [it.seq for it in sampling], self.eos_token_ids)
        self.sampler_seconds += time.perf_counter() - start
        for item, logprob in zip(sampling, logprobs, strict=True):
            item.logprob = logprob
        return tokens
