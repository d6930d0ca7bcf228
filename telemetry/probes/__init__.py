"""Memory probes, one per device kind, and `make_probe` to pick one from the CLI's --device flags."""

from __future__ import annotations

import os
from collections.abc import Callable

from telemetry.probes.base import MemoryProbe
from telemetry.probes.null import NullProbe
from telemetry.units import parse_bytes

__all__ = ["MemoryProbe", "NullProbe", "make_probe", "physical_memory"]


def physical_memory() -> int:
    """Host RAM in bytes: the CPU probe's capacity when no --device-memory is given."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def make_probe(
    device: str,
    device_memory: int | str | None = None,
    *,
    idle_bytes: int = 0,
    sample_every: int = 8,
    emulate_oom: bool | None = None,
    nvml_interval: float = 0.1,
    outside: Callable[[], int] = lambda: 0,
) -> MemoryProbe:
    """The probe for `device` ("cuda", "cuda:N", "cpu", "null").

    `device_memory` (bytes or "2GiB") caps capacity: on CUDA it overrides the device total, on CPU it
    is the emulated device size. Without it, on CPU, the process's memory cgroup limit is the capacity
    where there is one (telemetry/probes/cgroup.py), else host RAM. `emulate_oom` (CPU only) defaults to
    on exactly when an emulated size is given: otherwise the kernel, not the probe, decides about OOMs.
    Probes import torch/pynvml lazily, so asking for "null" needs neither. `outside` (CUDA): bytes the caller
    maps outside the caching allocator (CudaProbe).
    """
    capacity = parse_bytes(device_memory) if device_memory is not None else None
    kind, _, index = device.partition(":")
    if kind == "cuda":
        from telemetry.probes.cuda import CudaProbe, pci_bus_id
        from telemetry.probes.nvml import NvmlProbe

        dev = int(index) if index else 0
        nvml = NvmlProbe(dev, pci_bus_id=pci_bus_id(dev), min_interval=nvml_interval)
        return CudaProbe(dev, capacity=capacity, nvml=nvml, min_interval=nvml_interval, outside=outside)
    if kind == "cpu":
        from telemetry.probes.cgroup import cgroup_limit
        from telemetry.probes.cpu import CpuProbe

        limited = cgroup_limit() if capacity is None else None
        return CpuProbe(
            capacity if capacity is not None else limited[1] if limited else physical_memory(),
            idle_bytes=idle_bytes,
            sample_every=sample_every,
            emulate_oom=capacity is not None if emulate_oom is None else emulate_oom,
            cgroup=limited[0] if limited else None,
        )
    if kind in ("null", "none"):
        return NullProbe(capacity=capacity or 0, idle_bytes=idle_bytes)
    raise ValueError(f"no memory probe for device {device!r} (expected cuda[:N], cpu or null)")
