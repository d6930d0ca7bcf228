"""The memory cgroup this process runs in: its limit is the CPU plant's capacity, its usage the used memory.

Why: under a container's memory limit the kernel kills a process whose cgroup goes over it, exactly as a
GPU raises OOM at its capacity, so the limit is a real device budget on a CPU. Used memory is
the cgroup's usage less the page cache the kernel would reclaim before it kills anything (`inactive_file`
in memory.stat): a model file read through the page cache must not look like memory the engine holds.

cgroup v2 (`0::/path` in /proc/self/cgroup): memory.max ("max": no limit), memory.current, memory.stat
`inactive_file`, memory.peak. v1 (`N:memory:/path`; the v1 hierarchy is searched first, as the kernel charges
there when both are mounted): memory.limit_in_bytes (a page-rounded 2^63 means no limit), memory.usage_in_bytes,
memory.stat `total_inactive_file` (hierarchical) or `inactive_file`, memory.max_usage_in_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NO_LIMIT_V1 = 1 << 62  # v1 reports "no limit" as LONG_MAX rounded down to a page


@dataclass(frozen=True)
class CgroupMemory:
    path: Path
    version: int  # 1 or 2

    @property
    def _files(self) -> tuple[str, str, str, tuple[str, ...]]:
        """(limit, usage, peak, inactive-file keys in memory.stat, best first) for this version."""
        if self.version == 2:
            return "memory.max", "memory.current", "memory.peak", ("inactive_file",)
        return (
            "memory.limit_in_bytes",
            "memory.usage_in_bytes",
            "memory.max_usage_in_bytes",
            ("total_inactive_file", "inactive_file"),
        )

    def _read(self, name: str) -> str:
        return (self.path / name).read_text().strip()

    def limit(self) -> int | None:
        """The limit in bytes, or None when the cgroup has none."""
        text = self._read(self._files[0])
        if text == "max":
            return None
        value = int(text)
        return None if self.version == 1 and value >= NO_LIMIT_V1 else value

    def used(self) -> int:
        """Usage less reclaimable page cache."""
        usage = int(self._read(self._files[1]))
        stat = dict(line.split() for line in self._read("memory.stat").splitlines() if line.strip())
        inactive = next((int(stat[k]) for k in self._files[3] if k in stat), 0)
        return max(0, usage - inactive)

    def peak(self) -> int | None:
        """The highest usage the kernel recorded (None where the kernel has no such file)."""
        try:
            return int(self._read(self._files[2]))
        except FileNotFoundError:
            return None


def find_cgroup(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> CgroupMemory | None:
    """The memory cgroup of this process, or None where there is none to read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = CgroupMemory(root / "memory" / rel.lstrip("/"), 1)
        elif controllers == "":
            v2 = CgroupMemory(root / rel.lstrip("/"), 2)
    for cg in (v1, v2):
        if cg is not None and (cg.path / cg._files[0]).exists():
            return cg
    unified = root / "unified"  # hybrid hosts mount v2 beside v1
    if v2 is not None and unified.is_dir():
        cg = CgroupMemory(unified / v2.path.relative_to(root), 2)
        if (cg.path / "memory.max").exists():
            return cg
    return None


def cgroup_limit() -> tuple[CgroupMemory, int] | None:
    """This process's memory cgroup and its limit, when it has one."""
    cg = find_cgroup()
    if cg is None:
        return None
    try:
        limit = cg.limit()
    except (OSError, ValueError):
        return None
    return None if limit is None else (cg, limit)
