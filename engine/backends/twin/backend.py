"""The `twin` backend: the RTX 4090 + Llama-3.1-8B seed engine as a model, behind the same Backend protocol
as the torch backend. The real scheduler and policies run unchanged; only step latency (virtual clock)
and device memory (allocator replay, OOM) come from models fitted to the calibration facts.

Why a twin at all: the controller has to be judged on the card the facts were measured on, in seconds
of CPU instead of hours of GPU, and deterministically (same inputs, same OOMs, same numbers).
"""

from __future__ import annotations

import time
from functools import lru_cache

from engine.backends.twin.allocator import DeviceOOM
from engine.backends.twin.latency import LatencyModel, StepWork
from engine.backends.twin.memo import LRUMemo
from engine.backends.twin.memory import MEMO_SIZE, MemoryModel, StepMemory, StepResult
from engine.backends.twin.profile import DEFAULT_PROFILE, Profile, load_profile
from engine.backends.twin.sensors import GraphMemory, NvmlSensor
from engine.config import TWIN_SENSORS
from engine.core.backend import Backend, BackendDefaults, BackendInfo
from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.kv.blocks import ResizePlan
from engine.core.sequence import TokenLogprob
from telemetry.probes.null import NullProbe
from telemetry.record import MemorySample, StepShape

FILLER_BASE = 1000  # filler tokens are FILLER_BASE + position % FILLER_SPAN: never the EOS id
FILLER_SPAN = 1000


def filler_token(position: int) -> int:
    """The token the twin 'samples' at `position`: deterministic, the same however the work is batched."""
    return FILLER_BASE + position % FILLER_SPAN


@lru_cache(maxsize=8)
def _latency_model(profile: Profile) -> LatencyModel:
    return LatencyModel(profile)


class TwinProbe(NullProbe):
    """Reports what torch.cuda.memory_stats (peak allocated/reserved since the step began, retries, OOMs)
    and NVML (device used/total) would have reported for the modelled step."""

    name = "twin"

    def __init__(self, capacity: int, idle_bytes: int) -> None:
        super().__init__(capacity=capacity, idle_bytes=idle_bytes)
        self.pending: MemorySample | None = None

    def measure(self, shape: StepShape) -> MemorySample:
        sample, self.pending = self.pending, None
        return sample if sample is not None else self._last


def as_twin(backend: Backend) -> TwinBackend:
    """`backend` as the twin, for a scenario that acts on the modelled card beside the engine (another process's
    memory, fragmentation, the NVML period): one handed any other backend fails here, by name, rather than on its
    first call of a method only the twin has."""
    if not isinstance(backend, TwinBackend):
        raise TypeError(f"this scenario runs on the twin (--backend twin), not on {type(backend).__name__}")
    return backend


class TwinBackend(BackendDefaults):
    tokenizer = None
    samples = True  # False: a tensor-parallel rank other than the driver, which computes no logits

    def __init__(
        self,
        profile: str | Profile = DEFAULT_PROFILE,
        num_blocks: int | None = None,
        block_size: int | None = None,
        realtime: bool = False,
        max_model_len: int | None = None,
        sensors: str = "realistic",
    ) -> None:
        """`num_blocks`, `block_size` None: the profile's (the pool its engine ran with). `realtime`: sleep in
        execute() so virtual time tracks wall time (for `headroom serve`). `sensors`: what the probe sees and
        the memory outside the step trace (engine/backends/twin/sensors.py); realistic by default, as for every
        command (EngineConfig.twin_sensors), "ideal" for exact bytes every step."""
        if sensors not in TWIN_SENSORS:
            raise ValueError(f"sensors must be one of {', '.join(TWIN_SENSORS)}; got {sensors!r}")
        self.profile = profile if isinstance(profile, Profile) else load_profile(profile)
        eng, model = self.profile.section("engine"), self.profile.section("model")
        block_size = block_size or int(eng["default_block_size"])
        num_blocks = int(eng["default_num_blocks"]) if num_blocks is None else num_blocks
        if block_size % int(eng["block_size_multiple"]) and block_size not in eng["extra_block_sizes"]:
            raise ValueError(
                f"block size {block_size} is not supported by the paged attention of this profile: use a "
                f"multiple of {eng['block_size_multiple']} (or one of {eng['extra_block_sizes']})"
            )
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.model_name = str(self.profile.data["model_name"])
        self.max_model_len = min(max_model_len or int(model["max_model_len"]), int(model["max_model_len"]))
        self.eos_token_ids = {int(model["eos_token_id"])}
        self.vocab_size = int(model["vocab"])  # the API checks prompt token ids against it
        self.logits_all = bool(eng["logits_all_prompt_tokens"])
        self.latency = _latency_model(self.profile)  # read-only after construction: shared
        self.memory = MemoryModel(self.profile, num_blocks, block_size)
        self.sensors = sensors
        self.graphs = GraphMemory.from_profile(self.profile) if sensors == "realistic" else None
        if self.graphs is not None:
            self.memory.set_graph_bytes(self.graphs.reserved)
        period = float(self.profile.section("sensors")["nvml_period_s"]) if self.graphs is not None else None
        self.nvml = NvmlSensor(period, self.memory.device_used(), self._reserved_now())
        self.probe = TwinProbe(self.memory.cuda_total, self.memory.persistent)
        self.probe._last = self._sample(0, 0, 0, (self.nvml.value, None))
        self.realtime = realtime
        self._t = 0.0
        self._wall0 = time.monotonic()
        self.steps = 0
        self.busy_time = 0.0
        # identical steps report one (read-only) sample; the key holds cumulative counters, hence the bound
        self._samples: LRUMemo[tuple, MemorySample] = LRUMemo(MEMO_SIZE)

    @property
    def block_bytes(self) -> int:
        return self.memory.block_bytes

    def info(self) -> BackendInfo:
        """The twin chooses nothing: it says what it models, and from which profile."""
        return BackendInfo(
            dtype=f"not modelled: twin profile {self.profile.name} models time and memory, not numerics",
            quantization="not modelled: the profile's weight bytes, as measured",
            attention=f"the profile's kernel tables, block size {self.block_size} ({self.sensors} sensors)",
            kv_pool="modelled as resized in place, as in CUDA virtual memory",
        )

    # -- clock -----------------------------------------------------------------------------------
    def now(self) -> float:
        if self.realtime:
            return time.monotonic() - self._wall0
        return self._t

    def advance_to(self, t: float) -> None:
        """Let the idle device wait until virtual time `t` (open-loop arrivals); never goes back."""
        self._t = max(self._t, t)

    # -- the step --------------------------------------------------------------------------------
    def work(self, batch: SchedulerOutput) -> StepWork:
        prefills, n, ctx, sampled, new_max = [], 0, 0, 0, 0
        for it in batch.items:
            if it.is_prefill:
                prefills.append((it.num_tokens, it.start))
                if it.start == 0:
                    new_max += it.max_tokens
            else:
                n += 1
                ctx += it.start + 1
            sampled += it.sample
        pre_tokens = sum(c for c, _ in prefills)
        rows = pre_tokens + n if self.logits_all else sampled
        if not self.samples:
            rows = sampled = 0
        return StepWork(tuple(prefills), n, ctx, rows, sampled, new_max)

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """Advance the virtual clock by the modelled step time and replay the step's allocations; raises
        torch.OutOfMemoryError (after charging the time) when the allocator cannot place them."""
        work = self.work(batch)
        res = self._run(self.latency.step_time(work), StepMemory(work.logits_rows, work.sampled, len(work.prefills)))
        if res.oom is not None:
            import torch  # only for the exception type a real device raises

            raise torch.OutOfMemoryError(res.oom)
        tokens = [filler_token(it.start + it.num_tokens) for it in batch.items if it.sample]
        if all(it.params.logprobs is None for it in batch.items):
            return ModelOutput(tokens)
        # no logits here: each token is certain, so logprob 0 and the only top entry
        sampling = [it for it in batch.items if it.sample]
        logprobs = [
            None if (k := it.params.logprobs) is None else TokenLogprob(0.0, [(token, 0.0)][:k])
            for it, token in zip(sampling, tokens, strict=True)
        ]
        return ModelOutput(tokens, logprobs)

    def decode_step(self, positions: list[int], until: float) -> list[int] | None:
        """One decode-only step of sequences writing their KV at `positions`, exactly as execute() would model
        it (Backend.decode_step, for LLMEngine.decode_burst); their tokens. None, and nothing changed, when the
        step would start at or after `until` or would run out of memory: the engine runs that one."""
        if self.now() >= until:
            return None
        m, n = self.memory, len(positions)
        saved = m.checkpoint()
        res = m.run_step(StepMemory(n, n, 0))  # every decode row is sampled, so logits rows = n either way
        if res.oom is not None:
            m.restore(saved)
            return None
        self._finish_step(self.latency.decode_step_time(n, sum(positions) + n, n, n), res)
        return [filler_token(pos + 1) for pos in positions]

    def _run(self, duration: float, mem: StepMemory) -> StepResult:
        res = self.memory.run_step(mem)
        self._finish_step(duration, res)
        return res

    def _finish_step(self, duration: float, res: StepResult) -> None:
        m = self.memory
        # the probe reads NVML at the step's end
        used = self.nvml.at(self.now() + duration, m.device_used(), self._reserved_now())
        skey = (res, m.state_id, m.retries, m.ooms, m.persistent, m.external, used)
        sample = self._samples.get(skey)
        if sample is None:
            sample = self._sample(res.peak_allocated, res.peak_reserved, res.allocated_before, used)
            sample = self._samples.put(skey, sample)
        self.probe.pending = self.probe._last = sample
        start = self.now()
        self.steps += 1
        self.busy_time += duration
        if self.realtime:
            time.sleep(max(0.0, start + duration - self.now()))
        else:
            self._t = start + duration

    def resize_kv(self, plan: ResizePlan) -> float:
        """Resize the modelled KV pool in place, as the torch backend's pool in CUDA virtual memory does
        (MemoryModel.resize_pool): the CUDA graphs keep their addresses. Charged what it costs on the card: the
        moved blocks read and written, the added blocks zeroed, one map or unmap per block ([kv_resize]). Raises
        torch.OutOfMemoryError (pool unchanged, nothing charged) when a grow does not fit."""
        m = self.memory
        try:
            m.resize_pool(plan.num_blocks)
        except DeviceOOM as e:
            import torch  # only for the exception type a real device raises

            raise torch.OutOfMemoryError(str(e)) from e
        self.num_blocks = plan.num_blocks
        self.probe.idle_bytes = m.persistent
        self._refresh_sample()
        return self._charge(self.resize_cost(plan))

    can_swap = True

    def swap(self, out: list[tuple[str, list[int]]], into: list[tuple[str, list[int]]]) -> float:
        """Preemption by swap (Backend.swap): the blocks cross PCIe 4.0 x16 to pinned host memory and back
        (the torch backend swaps through pinned memory) at `[kv_resize] pinned_copy_bytes_per_s`, charged to
        the virtual clock before the step; host memory is not the card's, so device memory does not change.
        Nothing is kept: the twin's tokens do not depend on KV contents."""
        blocks = sum(len(b) for _, b in out) + sum(len(b) for _, b in into)
        return self._charge(
            blocks * self.memory.block_bytes / float(self.profile.section("kv_resize")["pinned_copy_bytes_per_s"])
        )

    def _charge(self, cost: float) -> float:
        """Seconds the device spends between steps (a resize, a swap): on the clock, and busy."""
        self._t += 0.0 if self.realtime else cost
        if self.realtime:
            time.sleep(cost)
        self.busy_time += cost
        return cost

    def resize_cost(self, plan: ResizePlan) -> float:
        """Seconds one resize takes on the card (see resize_kv)."""
        r, block = self.profile.section("kv_resize"), self.memory.block_bytes
        written = (2 * len(plan.moves) + max(plan.delta, 0)) * block
        return written / float(r["copy_bytes_per_s"]) + abs(plan.delta) * float(r["map_s"])

    def set_external(self, nbytes: int) -> int:
        """Another process on the card asks for `nbytes` in all (0: it lets go); it gets what the driver
        has free (MemoryModel.set_external) and the bytes it holds are returned. A scenario calls this
        between steps, as often as the other process retries. The probe's latest sample is refreshed: ideal
        sensors see the new bytes at once, realistic ones at the probe's next NVML read."""
        held = self.memory.set_external(nbytes)
        self._refresh_sample()
        return held

    def _refresh_sample(self) -> None:
        """The probe's latest sample as the device is now, between steps (no NVML read there): what a step that
        never reached the device (an injected OOM) reports, as a real probe reads fresh stats after any step."""
        m = self.memory
        used = self.nvml.at(None, m.device_used(), self._reserved_now())
        self.probe._last = self._sample(m.allocated, m.reserved, m.allocated, used)

    def recover_from_oom(self) -> None:
        """After a failed step: let go of the previous step's output, which would pin its cached segment through
        every retry. The cache is not emptied: a cudaMalloc that fails releases it and retries at once, for this
        process, where an empty_cache between steps hands it to another process short of memory and the step
        run again fails for want of it, step after step (bench/results/fault_campaign.md)."""
        self.memory.drop_output()

    def _reserved_now(self) -> int:
        """The allocator's reserved bytes now (reserved_bytes.all.current), as the sample's `reserved` counts them."""
        m = self.memory
        return m.persistent + m.graph_bytes + m.reserved

    def _sample(self, peak: int, reserved: int, before: int, used: tuple[int, int | None]) -> MemorySample:
        """The allocator's stats (graph pools and workspaces count in them) and NVML's (used, reserved beside a
        held reading) as reported."""
        m = self.memory
        held = m.persistent + (self.graphs.allocated if self.graphs is not None else 0)
        return MemorySample(
            peak_allocated=held + peak,
            reserved=m.persistent + m.graph_bytes + reserved,
            idle_baseline=held + before,
            capacity=m.cuda_total,
            device_used=used[0],
            device_used_reserved=used[1],
            device_total=m.nvml_total,
            alloc_retries=m.retries,
            ooms=m.ooms,
        )
