"""CUDA caching-allocator probe: the exact per-step peak the controller learns from.

`reset_peak_memory_stats` on step entry makes `allocated_bytes.all.peak` the step's own peak (with the
idle baseline under it); the allocator counts on the host at allocation time, so no synchronize is
needed. NVML (when present) adds what the allocator cannot see (context, library workspaces, other
processes); otherwise (also on a MIG slice NVML cannot find: CUDA scopes `mem_get_info` to the slice)
`mem_get_info` stands in for it at the same rate limit. Between reads the device-wide
value is held, so a sample reports it with the allocator's reserved bytes of the moment it was read
(`device_used_reserved`): after an empty_cache the held value still counts the bytes given back.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from telemetry.probes.nvml import NvmlProbe
from telemetry.record import MemorySample, StepShape


def _torch() -> Any:
    import torch  # lazy: telemetry must import on machines without torch/CUDA

    return torch


def pci_bus_id(device: int) -> str | None:
    """The NVML-style bus id of a CUDA device, so NVML reads the same GPU under CUDA_VISIBLE_DEVICES."""
    try:
        props = _torch().cuda.get_device_properties(device)
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except Exception:  # older torch without the fields, or no device
        return None


def device_uuid(device: int) -> str | None:
    """The CUDA device's UUID: on a MIG slice the slice's own, which NVML needs to read the slice, not its GPU."""
    try:
        return str(_torch().cuda.get_device_properties(device).uuid)
    except Exception:  # older torch without the field, or no device
        return None


def _reserved_now(stats: dict[str, Any]) -> int:
    """The allocator's reserved bytes at the moment of `stats` (the peak where the current value is missing)."""
    return int(stats.get("reserved_bytes.all.current", stats.get("reserved_bytes.all.peak", 0)))


class CudaProbe:
    name = "cuda"

    def __init__(
        self,
        device: int = 0,
        *,
        capacity: int | None = None,
        nvml: NvmlProbe | None = None,
        min_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
        outside: Callable[[], int] = lambda: 0,
    ) -> None:
        """`capacity` overrides the device total (e.g. to leave room for another process); `nvml` None
        means fall back to rate-limited `mem_get_info` for device_used/device_total. `outside`: bytes this
        process maps outside the caching allocator (a KV pool in CUDA virtual memory, engine/core/kv/vmm.py),
        reported as the allocator's own, where the controller expects the pool; else NVML alone would show
        them, and as another process's."""
        torch = _torch()
        self.device = device
        self.outside = outside
        self.nvml = nvml
        if nvml is not None and nvml.uuid is None:  # NVML resolves its device on first use, after this
            nvml.uuid = device_uuid(device)
        self.min_interval = min_interval
        self._clock = clock
        free, total = torch.cuda.mem_get_info(device)
        self.device_total = int(total)
        self.capacity = int(capacity) if capacity is not None else self.device_total
        self._used: int | None = int(total) - int(free)
        self._info_time = clock()
        self._last = MemorySample(capacity=self.capacity, device_used=self._used, device_total=total)
        # the allocator's reserved bytes when device_used was last read (see MemorySample.device_used_reserved)
        self._read_reserved = _reserved_now(torch.cuda.memory_stats(device)) + outside()

    def add_idle(self, nbytes: int) -> None:
        """The allocator and NVML see the pool's bytes themselves."""

    def _device_memory(self) -> tuple[int | None, int | None, bool]:
        """(used, total, whether this call read them from the driver rather than returning held values)."""
        if self.nvml is not None and self.nvml.available:
            used, total = self.nvml.read()
            return used, total, self.nvml.fresh
        now = self._clock()
        if now - self._info_time >= self.min_interval:
            free, total = _torch().cuda.mem_get_info(self.device)
            self._used, self._info_time = int(total) - int(free), now
            return self._used, self.device_total, True
        return self._used, self.device_total, False

    @contextmanager
    def step(self, shape: StepShape) -> Iterator[None]:
        cuda = _torch().cuda
        cuda.reset_peak_memory_stats(self.device)
        idle = int(cuda.memory_stats(self.device).get("allocated_bytes.all.current", 0))
        try:
            yield
        finally:
            # Read even when the step raised (an OOM step's peak is the most informative one).
            stats = cuda.memory_stats(self.device)
            used, total, fresh = self._device_memory()
            outside = self.outside()  # a step does not map or unmap: the same at its start and end
            if fresh:  # nothing allocates between the stats and the read: the same moment
                self._read_reserved = _reserved_now(stats) + outside
            self._last = MemorySample(
                peak_allocated=int(stats.get("allocated_bytes.all.peak", 0)) + outside,
                reserved=int(stats.get("reserved_bytes.all.peak", 0)) + outside,
                idle_baseline=idle + outside,
                capacity=self.capacity,
                device_used=used,
                device_used_reserved=None if fresh else self._read_reserved,
                device_total=total,
                alloc_retries=int(stats.get("num_alloc_retries", 0)),
                ooms=int(stats.get("num_ooms", 0)),
            )

    def sample(self) -> MemorySample:
        return self._last
