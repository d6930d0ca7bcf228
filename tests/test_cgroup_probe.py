"""The memory cgroup as the CPU plant's capacity (issue #15): limit, used memory less reclaimable page cache,
peak, for cgroup v1 and v2, on fake cgroup files."""

from __future__ import annotations

from pathlib import Path

import pytest

from telemetry.probes import cgroup as cgroup_mod
from telemetry.probes import make_probe
from telemetry.probes.cgroup import CgroupMemory, find_cgroup
from telemetry.record import StepShape
from telemetry.units import MIB


def fake_host(tmp: Path, version: int, limit: str, usage: int, stat: str) -> tuple[Path, Path]:
    """A /proc/self/cgroup and a /sys/fs/cgroup tree holding one memory cgroup, /job."""
    root = tmp / "sys"
    if version == 1:
        proc = "4:memory:/job\n3:cpu,cpuacct:/job\n0::/\n"
        d = root / "memory" / "job"
        files = {
            "memory.limit_in_bytes": limit,
            "memory.usage_in_bytes": str(usage),
            "memory.max_usage_in_bytes": str(usage + MIB),
        }
    else:
        proc = "0::/job\n"
        d = root / "job"
        files = {"memory.max": limit, "memory.current": str(usage), "memory.peak": str(usage + MIB)}
    d.mkdir(parents=True)
    for name, text in {**files, "memory.stat": stat}.items():
        (d / name).write_text(text + "\n")
    (tmp / "cgroup").write_text(proc)
    return tmp / "cgroup", root


@pytest.mark.parametrize(
    ("version", "stat"),
    [(1, "cache 900\ninactive_file 1\ntotal_inactive_file 104857600\n"), (2, "anon 5\ninactive_file 104857600\n")],
)
def test_limit_and_used_less_inactive_file(tmp_path, version, stat):
    proc, root = fake_host(tmp_path, version, str(512 * MIB), 300 * MIB, stat)
    cg = find_cgroup(proc, root)
    assert cg is not None and cg.version == version
    assert cg.limit() == 512 * MIB
    assert cg.used() == 200 * MIB  # v1 takes the hierarchical total_inactive_file
    assert cg.peak() == 301 * MIB


@pytest.mark.parametrize(("version", "limit"), [(1, "9223372036854771712"), (2, "max")])
def test_no_limit_reads_as_none(tmp_path, version, limit):
    proc, root = fake_host(tmp_path, version, limit, MIB, "inactive_file 0")
    assert find_cgroup(proc, root).limit() is None


def test_hybrid_host_finds_v2_under_unified(tmp_path):
    root = tmp_path / "sys"
    d = root / "unified" / "job"
    d.mkdir(parents=True)
    (d / "memory.max").write_text("1048576\n")
    (tmp_path / "cgroup").write_text("1:cpu:/\n0::/job\n")
    cg = find_cgroup(tmp_path / "cgroup", root)
    assert cg == CgroupMemory(d, 2) and cg.limit() == MIB


def test_no_cgroup_file_means_none(tmp_path):
    assert find_cgroup(tmp_path / "missing", tmp_path) is None


def test_cpu_probe_takes_the_limit_as_capacity_and_reports_used(tmp_path, monkeypatch):
    proc, root = fake_host(tmp_path, 2, str(512 * MIB), 300 * MIB, "inactive_file 104857600")
    monkeypatch.setattr(cgroup_mod, "find_cgroup", lambda: find_cgroup(proc, root))
    probe = make_probe("cpu", idle_bytes=64 * MIB)
    assert probe.capacity == 512 * MIB and not probe.emulate_oom  # the kernel, not the probe, kills
    with probe.step(StepShape(decode_seqs=1)):
        pass
    m = probe.sample()
    assert (m.device_used, m.device_total) == (200 * MIB, 512 * MIB)
    (root / "job" / "memory.current").write_text(str(400 * MIB))  # the plant moved: the next step sees it
    with probe.step(StepShape(decode_seqs=1)):
        pass
    assert probe.sample().device_used == 300 * MIB
    assert make_probe("cpu", "1GiB").cgroup is None  # --device-memory wins


def test_cpu_engine_sizes_its_pool_under_a_cgroup_limit(monkeypatch):
    from engine import factory
    from engine.cli import engine_config

    cfg = engine_config(["--device", "cpu"])
    monkeypatch.setattr(factory, "cgroup_limit", lambda: None)
    assert not factory.sizes_kv_pool(cfg)  # host RAM is not the engine's to fill
    monkeypatch.setattr(factory, "cgroup_limit", lambda: (CgroupMemory(Path("/x"), 2), 512 * MIB))
    assert factory.sizes_kv_pool(cfg)
    assert not factory.sizes_kv_pool(engine_config(["--device", "cpu", "--num-blocks", "64"]))
