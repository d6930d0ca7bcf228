"""NVML device memory (what `nvidia-smi` shows): used/total bytes on the whole device, every process.

Why besides torch's allocator stats: it sees memory outside the caching allocator (CUDA context,
cuBLAS/NCCL workspaces, other processes). It is a driver call, so it is rate-limited (default at most
every 100 ms) rather than made every step. Without a driver or the `pynvml` module it reports None
and never raises: a CPU box or a container without NVML must not break telemetry.

On a MIG slice the bus id and the index name the parent GPU, whose memory info is the whole card's: there the
probe reads the MIG device whose UUID CUDA reports for this process, and reports None (unknown) if it cannot
find it, since the parent's numbers would put the controller's capacity at the whole card.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

from telemetry.record import MemorySample, StepShape

log = logging.getLogger(__name__)


def _bare_uuid(uuid: str | bytes) -> str:
    """CUDA prints a device's UUID bare; NVML prefixes it with "GPU-" or "MIG-" (older pynvml returns bytes)."""
    text = uuid.decode() if isinstance(uuid, bytes) else uuid
    return text.lower().removeprefix("gpu-").removeprefix("mig-")


class NvmlProbe:
    """Rate-limited NVML reader; usable alone as a (coarse) MemoryProbe or inside CudaProbe."""

    name = "nvml"

    def __init__(
        self,
        index: int = 0,
        *,
        pci_bus_id: str | None = None,
        uuid: str | None = None,
        min_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`pci_bus_id` (preferred when known) survives CUDA_VISIBLE_DEVICES renumbering; `index` is the
        NVML index, which is not the CUDA index when devices are hidden or reordered. `uuid` is the CUDA
        device's (with or without NVML's "GPU-"/"MIG-" prefix): on a GPU in MIG mode it picks the slice."""
        self.index = index
        self.pci_bus_id = pci_bus_id
        self.uuid = uuid
        self.min_interval = min_interval
        self._clock = clock
        self._nvml: Any = None
        self._handle: Any = None
        self._state = "new"  # new -> ok | unavailable
        self._last_time: float | None = None
        self._used: int | None = None
        self._total: int | None = None
        self._fresh = False
        self.reads = 0  # driver calls made, for tests and overhead accounting

    @property
    def available(self) -> bool:
        self._init()
        return self._state == "ok"

    def _init(self) -> None:
        if self._state != "new":
            return
        try:
            import pynvml  # nvidia-ml-py

            pynvml.nvmlInit()
            handle = None
            if self.pci_bus_id:
                try:
                    handle = pynvml.nvmlDeviceGetHandleByPciBusId(self.pci_bus_id)
                except Exception:  # fall back to the index
                    handle = None
            if handle is None:
                handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            handle = self._mig_slice(pynvml, handle)
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver errors
            log.info("NVML not available (%s); device_used/device_total will be None", exc)
            self._state = "unavailable"
            return
        if handle is None:
            log.warning(
                "the GPU is in MIG mode and NVML finds no MIG device with this process's UUID (%s): its reads would "
                "be the whole GPU's, so device_used/device_total will be None",
                self.uuid,
            )
            self._state = "unavailable"
            return
        self._nvml, self._handle, self._state = pynvml, handle, "ok"

    def _mig_slice(self, nvml: Any, handle: Any) -> Any:
        """`handle`, or where its GPU is in MIG mode the handle of the MIG device with our UUID (None if none)."""
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except Exception:  # NVMLError_NotSupported: a GPU without MIG
            return handle
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return handle
        if not self.uuid:
            return None
        for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except Exception:  # NVMLError_NotFound: an empty slot
                continue
            if _bare_uuid(nvml.nvmlDeviceGetUUID(mig)) == _bare_uuid(self.uuid):
                return mig
        return None

    def read(self, force: bool = False) -> tuple[int | None, int | None]:
        """(used, total) bytes; refreshed from the driver at most every `min_interval` seconds."""
        self._init()
        self._fresh = False
        if self._state != "ok":
            return None, None
        now = self._clock()
        if force or self._last_time is None or now - self._last_time >= self.min_interval:
            try:
                info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
            except Exception as exc:  # e.g. GPU fell off the bus: report unknown, go on
                log.warning("NVML read failed (%s); disabling NVML sampling", exc)
                self._state, self._used, self._total = "unavailable", None, None
                return None, None
            self.reads += 1
            self._used, self._total = int(info.used), int(info.total)
            self._last_time = now
            self._fresh = True
        return self._used, self._total

    @property
    def fresh(self) -> bool:
        """Whether the last `read()` went to the driver (False: cached value)."""
        return self._fresh

    @contextmanager
    def step(self, shape: StepShape) -> Iterator[None]:
        try:
            yield
        finally:
            self.read()

    def sample(self) -> MemorySample:
        """Alone, NVML can only say how full the device is: used stands in for the peak."""
        used, total = self._used, self._total
        return MemorySample(
            peak_allocated=used or 0,
            capacity=total or 0,
            device_used=used,
            device_total=total,
            sampled=self._fresh,
        )

    def close(self) -> None:
        if self._state == "ok":
            with suppress(Exception):
                self._nvml.nvmlShutdown()
        self._state = "unavailable"
