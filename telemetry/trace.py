"""Step traces: the last N StepRecords in memory (for /controller/state and tests) and, optionally,
every record as one JSON line in a file (`--trace-file`) for offline analysis and replay.

Lines are flushed per step so a crashed or killed run keeps its trace up to the last step. Append and
read take a lock: the engine thread appends while the API thread reads.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import asdict, is_dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from telemetry.record import StepRecord


def _json_default(value: object) -> object:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    item = getattr(value, "item", None)  # numpy / torch scalars
    if callable(item):
        return item()
    return str(value)


def record_json(record: StepRecord) -> str:
    """One JSON line, equal to json.dumps(record.to_dict()) but far cheaper, for a record written every
    step: dataclasses.asdict deep-copies every value, this copies the two nested dataclasses' dicts."""
    d = dict(getattr(record, "__dict__", None) or record.to_dict())  # slotted dataclass: the slow way
    for key, value in d.items():
        if is_dataclass(value) and not isinstance(value, type):
            d[key] = getattr(value, "__dict__", None) or asdict(value)
    return json.dumps(d, separators=(",", ":"), default=_json_default)


class StepTrace:
    def __init__(self, capacity: int = 1024, path: str | Path | None = None, *, append: bool = False) -> None:
        """`path`: JSONL file to write (truncated unless `append`); None keeps the ring buffer only."""
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self._ring: deque[StepRecord] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.path = Path(path) if path is not None else None
        self._file: IO[str] | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115
        self.count = 0  # records appended since start (the ring keeps the last `capacity`)

    def append(self, record: StepRecord) -> None:
        line = record_json(record) + "\n" if self._file else None
        with self._lock:
            self._ring.append(record)
            self.count += 1
            if self._file is not None and line is not None:
                self._file.write(line)
                self._file.flush()

    def records(self, last: int | None = None) -> list[StepRecord]:
        """The buffered records, oldest first; `last` limits to the most recent few."""
        with self._lock:
            items = list(self._ring)
        return items if last is None else items[-last:] if last > 0 else []

    def __len__(self) -> int:
        return len(self._ring)

    def close(self) -> None:
        """Close the file (idempotent). The ring buffer keeps working; later records are not written."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_trace(path: str | Path) -> list[dict]:
    """The records of a JSONL trace file as dicts (a truncated last line, from a killed run, is skipped)."""
    out: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break
    return out
