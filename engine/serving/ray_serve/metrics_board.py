"""Where replicas leave their latest `/metrics` text and process id, and the ingress reads them.

A named Ray actor, detached so that it outlives any one replica (the launcher kills it at shutdown). A dead
replica stops publishing and its entry ages out, so `/metrics` never shows a replica that is gone; a restarted
one appears under its new replica id.
"""

from __future__ import annotations

import time
from typing import Any

import ray

BOARD_NAME = "headroom-metrics-board"
NAMESPACE = "headroom"
MAX_AGE_S = 10.0  # an entry older than this belongs to a replica that is gone


@ray.remote(num_cpus=0)
class MetricsBoard:
    def __init__(self) -> None:
        self._entries: dict[str, dict[str, Any]] = {}

    def put(self, replica: str, text: str, pid: int) -> None:
        self._entries[replica] = {"text": text, "pid": pid, "at": time.time()}

    def entries(self, max_age_s: float = MAX_AGE_S) -> dict[str, dict[str, Any]]:
        """Live replicas' entries (text, pid, at), by replica id."""
        now = time.time()
        self._entries = {k: v for k, v in self._entries.items() if now - v["at"] <= max_age_s}
        return dict(self._entries)


def metrics_board() -> Any:
    """The fleet's board, created by whoever asks first."""
    return MetricsBoard.options(name=BOARD_NAME, namespace=NAMESPACE, get_if_exists=True, lifetime="detached").remote()
