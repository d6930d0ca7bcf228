"""Memory probes against fakes: torch.cuda and pynvml are replaced, so these run on any CPU box."""

from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass

import pytest
import torch

from telemetry.probes import NullProbe, make_probe
from telemetry.probes.cpu import CpuProbe, shape_bucket, tensor_bytes
from telemetry.probes.cuda import CudaProbe
from telemetry.probes.nvml import NvmlProbe
from telemetry.record import MemorySample, StepShape
from telemetry.units import GIB as GiB
from telemetry.units import MIB as MiB
from telemetry.units import format_bytes, parse_bytes

# ---- units ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * GiB),
        ("1.5GiB", 3 * GiB // 2),
        ("512MiB", 512 * MiB),
        ("512 mib", 512 * MiB),
        ("4096", 4096),
        ("4096B", 4096),
        ("2G", 2 * GiB),
        ("2GB", 2 * 10**9),
        ("1e9", 10**9),
        (12345, 12345),
    ],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "GiB", "2 GiBs", "-1GiB", "two", -5, True])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(bad)  # type: ignore[arg-type]


def test_format_bytes() -> None:
    assert format_bytes(3 * GiB // 2) == "1.50 GiB"
    assert format_bytes(10) == "10 B"


# ---- fakes ------------------------------------------------------------------------------------------


@dataclass
class FakeMemInfo:
    used: int
    total: int
    free: int = 0


class FakeNvml(types.ModuleType):
    """Stands in for `pynvml`; counts the driver calls."""

    def __init__(self, used: int = 3 * GiB, total: int = 80 * GiB, fail_init: bool = False) -> None:
        super().__init__("pynvml")
        self.used, self.total, self.fail_init = used, total, fail_init
        self.calls: list[str] = []

    def nvmlInit(self) -> None:  # pynvml's camelCase names
        self.calls.append("init")
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        self.calls.append(f"index:{index}")
        return f"gpu{index}"

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> str:
        self.calls.append(f"pci:{bus_id}")
        return f"gpu@{bus_id}"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> FakeMemInfo:
        self.calls.append("meminfo")
        return FakeMemInfo(used=self.used, total=self.total)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")


class FakeCuda:
    """torch.cuda's memory functions, with an allocator the test drives."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.current = 1 * GiB
        self.peak = self.current
        self.reserved_peak = 2 * GiB
        self.retries = 0
        self.ooms = 0
        self.free, self.total = 70 * GiB, 80 * GiB

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "memory_stats", self.memory_stats)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peak_memory_stats)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        return self

    def alloc(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def memory_stats(self, device: object = None) -> dict[str, int]:
        self.calls.append("memory_stats")
        return {
            "allocated_bytes.all.current": self.current,
            "allocated_bytes.all.peak": self.peak,
            "reserved_bytes.all.peak": self.reserved_peak,
            "num_alloc_retries": self.retries,
            "num_ooms": self.ooms,
        }

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.calls.append("reset")
        self.peak = self.current

    def mem_get_info(self, device: object = None) -> tuple[int, int]:
        self.calls.append("mem_get_info")
        return self.free, self.total


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    module = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


# ---- CUDA -------------------------------------------------------------------------------------------


def test_cuda_probe_resets_peak_every_step(fake_cuda: FakeCuda) -> None:
    probe = CudaProbe(0)  # nvml=None: mem_get_info fallback
    for step_bytes in (100 * MiB, 300 * MiB, 50 * MiB):
        fake_cuda.calls.clear()
        with probe.step(StepShape(decode_seqs=4)):
            assert fake_cuda.calls[0] == "reset"  # before any work
            fake_cuda.alloc(step_bytes)
            fake_cuda.alloc(-step_bytes)  # the step's temporaries are freed again
        sample = probe.sample()
        assert sample.idle_baseline == 1 * GiB
        assert sample.peak_allocated == 1 * GiB + step_bytes  # not the max over all steps
        assert sample.step_peak == step_bytes
        assert fake_cuda.calls.count("reset") == 1
    assert sample.reserved == 2 * GiB
    assert sample.capacity == 80 * GiB
    assert sample.device_total == 80 * GiB
    assert sample.device_used == 10 * GiB  # total - free
    assert isinstance(sample.peak_allocated, int)


def test_cuda_probe_counts_what_the_process_maps_outside_the_allocator(fake_cuda: FakeCuda) -> None:
    """A KV pool in CUDA virtual memory (engine/core/kv/vmm.py) is not in the allocator's stats: the probe adds
    it where the pool of tensors would be (allocated, reserved, idle), so NVML's bytes above it are not taken
    for another process's."""
    mapped = [3 * GiB]
    probe = CudaProbe(0, outside=lambda: mapped[0])
    with probe.step(StepShape(decode_seqs=4)):
        fake_cuda.alloc(100 * MiB)
        fake_cuda.alloc(-100 * MiB)
    sample = probe.sample()
    assert sample.idle_baseline == 1 * GiB + 3 * GiB and sample.peak_allocated == 1 * GiB + 100 * MiB + 3 * GiB
    assert sample.reserved == 2 * GiB + 3 * GiB and sample.step_peak == 100 * MiB


def test_cuda_probe_reads_after_oom(fake_cuda: FakeCuda) -> None:
    probe = CudaProbe(0, capacity=40 * GiB)
    with pytest.raises(torch.OutOfMemoryError), probe.step(StepShape(prefill_tokens=8192)):
        fake_cuda.alloc(39 * GiB)
        fake_cuda.ooms, fake_cuda.retries = 1, 2
        raise torch.OutOfMemoryError("CUDA out of memory")
    sample = probe.sample()
    assert sample.step_peak == 39 * GiB
    assert (sample.ooms, sample.alloc_retries) == (1, 2)
    assert sample.capacity == 40 * GiB  # the override, not the device total


def test_cuda_probe_device_memory_is_rate_limited(fake_cuda: FakeCuda) -> None:
    clock = Clock()
    probe = CudaProbe(0, min_interval=0.1, clock=clock)
    fake_cuda.calls.clear()
    for _ in range(5):
        with probe.step(StepShape()):
            pass
    assert fake_cuda.calls.count("mem_get_info") == 0  # within 100 ms of construction
    clock.t = 0.2
    with probe.step(StepShape()):
        fake_cuda.free = 60 * GiB
    assert fake_cuda.calls.count("mem_get_info") == 1
    assert probe.sample().device_used == 20 * GiB


def test_cuda_probe_uses_nvml(fake_cuda: FakeCuda, fake_nvml: FakeNvml) -> None:
    clock = Clock()
    probe = CudaProbe(0, nvml=NvmlProbe(0, pci_bus_id="00000000:3b:00.0", clock=clock), clock=clock)
    for i in range(10):
        clock.t = i * 0.03  # 10 steps over 0.27 s -> reads at 0, 0.12 (>= 0.1 later), 0.24
        with probe.step(StepShape()):
            pass
    sample = probe.sample()
    assert (sample.device_used, sample.device_total) == (3 * GiB, 80 * GiB)
    assert fake_nvml.calls[:2] == ["init", "pci:00000000:3b:00.0"]
    assert fake_nvml.calls.count("meminfo") == 3


def test_make_probe_cuda(fake_cuda: FakeCuda, fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_props(device: int) -> None:
        raise RuntimeError("no device")

    monkeypatch.setattr(torch.cuda, "get_device_properties", no_props)
    probe = make_probe("cuda:1", "40GiB")
    assert isinstance(probe, CudaProbe)
    assert probe.device == 1 and probe.capacity == 40 * GiB
    with probe.step(StepShape()):
        pass
    assert "index:1" in fake_nvml.calls  # no bus id -> NVML index
    assert probe.sample().device_used == 3 * GiB


# ---- NVML -------------------------------------------------------------------------------------------


def test_nvml_missing_module_is_tolerated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    probe = NvmlProbe()
    assert not probe.available
    assert probe.read() == (None, None)
    with probe.step(StepShape()):
        pass
    sample = probe.sample()
    assert sample.device_used is None and sample.device_total is None
    probe.close()


def test_nvml_without_driver_is_tolerated(monkeypatch: pytest.MonkeyPatch, fake_cuda: FakeCuda) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(fail_init=True))
    probe = CudaProbe(0, nvml=NvmlProbe())
    with probe.step(StepShape()):
        pass
    assert probe.sample().device_used == 10 * GiB  # fell back to mem_get_info


def test_nvml_rate_limit_and_units(fake_nvml: FakeNvml) -> None:
    clock = Clock()
    probe = NvmlProbe(2, min_interval=0.5, clock=clock)
    assert probe.read() == (3 * GiB, 80 * GiB) and probe.fresh
    fake_nvml.used = 5 * GiB
    clock.t = 0.4
    assert probe.read() == (3 * GiB, 80 * GiB) and not probe.fresh  # cached
    clock.t = 0.5
    assert probe.read() == (5 * GiB, 80 * GiB)
    assert probe.reads == 2
    assert "index:2" in fake_nvml.calls
    probe.close()
    assert fake_nvml.calls[-1] == "shutdown"


def test_nvml_read_failure_disables(fake_nvml: FakeNvml) -> None:
    def broken(handle: str) -> None:
        raise RuntimeError("GPU is lost")

    fake_nvml.nvmlDeviceGetMemoryInfo = broken  # type: ignore[method-assign]
    probe = NvmlProbe()
    assert probe.read() == (None, None)
    assert not probe.available


# ---- CPU --------------------------------------------------------------------------------------------


def test_cpu_probe_measures_known_peak() -> None:
    probe = CpuProbe(4 * GiB, idle_bytes=100 * MiB, sample_every=1)
    with probe.step(StepShape(decode_seqs=8, max_context=100)):
        a = torch.empty(4 * MiB, dtype=torch.uint8)  # 4 MiB
        v = a.view(2, -1).t()  # views add nothing
        b = torch.empty(MiB // 4, dtype=torch.float32)  # 1 MiB -> 5 MiB live
        del a, v, b
        c = torch.zeros(2 * MiB, dtype=torch.uint8)  # after the frees: 2 MiB live
        del c
    sample = probe.sample()
    assert sample.sampled
    assert sample.idle_baseline == 100 * MiB
    assert 5 * MiB <= sample.step_peak <= 5 * MiB + 4096
    assert sample.peak_allocated == 100 * MiB + sample.step_peak
    assert probe.ops_tracked >= 3
    assert probe.overhead_seconds > 0


def test_cpu_probe_counts_op_outputs() -> None:
    probe = CpuProbe(GiB, sample_every=1)
    x = torch.randn(256, 256)  # before the step: not counted
    with probe.step(StepShape(prefill_tokens=256)):
        y = x @ x  # 256 KiB
        z = torch.relu(y)  # 256 KiB, both live
        z.add_(1)  # in place: nothing new
        del y, z
    assert 512 * 1024 <= probe.sample().step_peak <= 512 * 1024 + 4096


def test_cpu_probe_samples_every_nth_and_new_shapes() -> None:
    probe = CpuProbe(GiB, sample_every=4, overhead_budget=None)
    decode = StepShape(decode_seqs=8, max_context=64)
    sampled = []
    for _ in range(9):
        with probe.step(decode):
            torch.empty(MiB, dtype=torch.uint8)
        sampled.append(probe.sample().sampled)
    assert sampled == [True, False, False, False, True, False, False, False, True]
    assert probe.sample().step_peak == MiB
    with probe.step(decode):
        pass  # unsampled: the bucket's last measurement, not this step's zero
    assert not probe.sample().sampled and probe.sample().step_peak == MiB
    with probe.step(StepShape(decode_seqs=8, max_context=200)):  # new context bucket
        torch.empty(2 * MiB, dtype=torch.uint8)
    assert probe.sample().sampled and probe.sample().step_peak == 2 * MiB
    assert probe.sampled_steps == 4 and probe.steps == 11


def test_cpu_probe_overhead_budget_skips_periodic_samples() -> None:
    probe = CpuProbe(GiB, sample_every=1, overhead_budget=0.01)
    shape = StepShape(decode_seqs=2)
    with probe.step(shape):  # new shape: sampled
        torch.empty(MiB, dtype=torch.uint8)
    probe.step_seconds, probe.overhead_seconds = 100.0, 0.5  # within 1%: the next periodic step samples
    with probe.step(shape):
        pass
    assert probe.sample().sampled
    probe.step_seconds, probe.overhead_seconds = 100.0, 2.0  # over 1%: periodic samples stop
    for _ in range(3):
        with probe.step(shape):
            pass
        assert not probe.sample().sampled
    with probe.step(StepShape(decode_seqs=64)):  # a new shape is sampled regardless
        torch.empty(MiB, dtype=torch.uint8)
    assert probe.sample().sampled and probe.sampled_steps == 3


def test_cpu_probe_overhead_is_paired_against_unsampled_steps() -> None:
    probe = CpuProbe(GiB, sample_every=2, overhead_budget=None)
    shape = StepShape(decode_seqs=2)
    with probe.step(shape):  # new shape: sampled, no unsampled step to compare with yet
        torch.empty(MiB, dtype=torch.uint8)
    assert probe.last_step_overhead == pytest.approx(probe.hook_overhead_seconds)
    with probe.step(shape):  # unsampled: sets the bucket's plain duration
        pass
    with probe.step(shape):  # sampled, and 50 ms slower than the plain step: charged as overhead
        time.sleep(0.05)
    assert probe.sample().sampled
    assert probe.last_step_overhead >= 0.01
    assert probe.overhead_seconds >= probe.last_step_overhead


def test_shape_bucket_powers_of_two() -> None:
    assert shape_bucket(StepShape(decode_seqs=5, max_context=100)) == shape_bucket(
        StepShape(decode_seqs=7, max_context=127)
    )
    assert shape_bucket(StepShape(decode_seqs=8)) != shape_bucket(StepShape(decode_seqs=7))


def test_cpu_probe_emulated_oom() -> None:
    probe = CpuProbe(10 * MiB, idle_bytes=8 * MiB, sample_every=1, overhead_budget=None)
    with pytest.raises(torch.OutOfMemoryError), probe.step(StepShape(prefill_tokens=1024)):
        torch.empty(MiB, dtype=torch.uint8)  # 9 MiB: fits
        torch.empty(3 * MiB, dtype=torch.uint8)  # 11 MiB: over
    sample = probe.sample()
    assert sample.ooms == 1
    assert sample.peak_allocated > sample.capacity  # the record shows how far over it went
    with probe.step(StepShape(prefill_tokens=1024)):  # the probe is usable after an OOM
        torch.empty(MiB, dtype=torch.uint8)
    assert probe.sample().step_peak == MiB


def test_cpu_probe_oom_emulation_optional() -> None:
    probe = CpuProbe(MiB, sample_every=1, emulate_oom=False)
    with probe.step(StepShape()):
        torch.empty(2 * MiB, dtype=torch.uint8)
    assert probe.sample().peak_allocated == 2 * MiB and probe.sample().ooms == 0


def test_cpu_probe_frees_from_earlier_steps_do_not_count() -> None:
    probe = CpuProbe(GiB, sample_every=1, overhead_budget=None)
    with probe.step(StepShape(decode_seqs=1)):
        kept = torch.empty(MiB, dtype=torch.uint8)  # outlives the step
    with probe.step(StepShape(decode_seqs=1)):
        del kept  # freed here: must not make this step's live bytes negative
        torch.empty(MiB // 2, dtype=torch.uint8)
    assert probe.sample().step_peak == MiB // 2


def test_tensor_bytes() -> None:
    lin = torch.nn.Linear(16, 8)  # 16*8*4 + 8*4 bytes
    kv = torch.zeros(2, 4, 8)
    assert tensor_bytes([lin, kv, kv[0]]) == 16 * 8 * 4 + 8 * 4 + 2 * 4 * 8 * 4


def test_make_probe_cpu() -> None:
    probe = make_probe("cpu", "2GiB", idle_bytes=5, sample_every=3)
    assert isinstance(probe, CpuProbe)
    assert (probe.capacity, probe.idle_bytes, probe.sample_every, probe.emulate_oom) == (2 * GiB, 5, 3, True)
    host = make_probe("cpu", None)
    assert isinstance(host, CpuProbe) and host.capacity > 0 and not host.emulate_oom


# ---- null -------------------------------------------------------------------------------------------


def test_null_probe() -> None:
    probe = make_probe("null", 1024)
    assert isinstance(probe, NullProbe)
    with probe.step(StepShape(decode_seqs=3)):
        pass
    assert probe.sample() == MemorySample(capacity=1024)
    assert NullProbe().sample().step_peak == 0


def test_null_probe_subclass_measures_after_failed_step() -> None:
    class Computed(NullProbe):
        def measure(self, shape: StepShape) -> MemorySample:
            return MemorySample(peak_allocated=shape.tokens * 10, capacity=100)

    probe = Computed()
    with pytest.raises(torch.OutOfMemoryError), probe.step(StepShape(prefill_tokens=20)):
        raise torch.OutOfMemoryError("twin says no")
    assert probe.sample().peak_allocated == 200


def test_make_probe_unknown() -> None:
    with pytest.raises(ValueError):
        make_probe("tpu")
