"""Issue #25, hazard 5: on a MIG slice, NVML's handle by bus id or index is the parent GPU's, whose memory info is
the whole card's (80 GiB here, where the process has a 10 GiB slice). The probes must read the slice, found by the
UUID CUDA reports for the device, or report unknown rather than the card's numbers."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from telemetry.probes.cuda import CudaProbe
from telemetry.probes.nvml import NvmlProbe
from telemetry.record import StepShape
from telemetry.units import GIB as GiB
from tests.test_probes import Clock, FakeCuda, FakeMemInfo, FakeNvml

SLICE_UUID = "3f9c1a2e-7b4d-5e6f-8a9b-0c1d2e3f4a5b"  # as CUDA prints it: no prefix


class FakeMigNvml(FakeNvml):
    """A parent GPU in MIG mode (80 GiB, 30 GiB used across slices) with two 10 GiB MIG devices in slots 0 and 2."""

    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, mig_mode: int = 1) -> None:
        super().__init__(used=30 * GiB, total=80 * GiB)
        self.mig_mode = mig_mode
        self.slices = {0: ("MIG-00000000-1111-2222-3333-444444444444", 1 * GiB), 2: (f"MIG-{SLICE_UUID}", 4 * GiB)}

    def nvmlDeviceGetMigMode(self, handle: str) -> list[int]:
        return [self.mig_mode, self.mig_mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: str) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: str, index: int) -> str:
        if index not in self.slices:
            raise RuntimeError("NVMLError_NotFound")
        return f"mig{index}"

    def nvmlDeviceGetUUID(self, handle: str) -> bytes:
        return self.slices[int(handle.removeprefix("mig"))][0].encode()  # older pynvml answers bytes

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> FakeMemInfo:
        self.calls.append(f"meminfo:{handle}")
        if handle.startswith("mig"):
            return FakeMemInfo(used=self.slices[int(handle.removeprefix("mig"))][1], total=10 * GiB)
        return FakeMemInfo(used=self.used, total=self.total)


@pytest.fixture
def mig(monkeypatch: pytest.MonkeyPatch) -> FakeMigNvml:
    module = FakeMigNvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


def test_nvml_reads_the_mig_slice_not_the_parent_gpu(mig: FakeMigNvml) -> None:
    probe = NvmlProbe(0, pci_bus_id="00000000:3b:00.0", uuid=f"MIG-{SLICE_UUID}")
    assert probe.read() == (4 * GiB, 10 * GiB)
    assert mig.calls[-1] == "meminfo:mig2"


def test_the_cuda_probe_hands_nvml_the_slice_uuid(
    mig: FakeMigNvml, monkeypatch: pytest.MonkeyPatch, fake_cuda: FakeCuda
) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(uuid=SLICE_UUID))
    clock = Clock()
    probe = CudaProbe(0, nvml=NvmlProbe(0, pci_bus_id="00000000:3b:00.0", clock=clock), clock=clock)
    with probe.step(StepShape()):
        pass
    sample = probe.sample()
    assert (sample.device_used, sample.device_total) == (4 * GiB, 10 * GiB)


def test_a_mig_slice_nvml_cannot_find_is_unknown_not_the_whole_gpu(
    mig: FakeMigNvml, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="telemetry.probes.nvml"):
        probe = NvmlProbe(0, uuid="GPU-ffffffff-ffff-ffff-ffff-ffffffffffff")
        assert probe.read() == (None, None)
    assert not probe.available
    assert any("MIG mode" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    with probe.step(StepShape()):
        pass
    assert (probe.sample().device_used, probe.sample().device_total) == (None, None)


def test_a_gpu_out_of_mig_mode_is_read_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", FakeMigNvml(mig_mode=0))
    assert NvmlProbe(0, uuid=SLICE_UUID).read() == (30 * GiB, 80 * GiB)
