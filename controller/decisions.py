"""The controller's decision log: the last DECISIONS_KEPT actions with their reasons, for GET /controller/state.
The parts of the policy (the law, the pool sizer) return their decisions as values; the policy logs them
stamped with its step."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DECISIONS_KEPT = 50

Reason = str | Callable[[], str]  # a function formats the reason when state() reads the log


@dataclass(frozen=True, slots=True)
class Decision:
    action: str
    reason: Reason


def new_log() -> deque[dict[str, Any]]:
    return deque(maxlen=DECISIONS_KEPT)


def log_decision(log: deque[dict[str, Any]], step: int, action: str, reason: Reason, quiet: bool = False) -> None:
    """Append a decision; a `quiet` one replaces the last entry when that has the same action (memory-bound
    serving logs a `pack` every step, each replacing the last)."""
    entry = {"step": step, "action": action, "reason": reason}
    if quiet and log and log[-1]["action"] == action:
        log[-1] = entry
        return
    log.append(entry)


def export(log: deque[dict[str, Any]]) -> list[dict[str, Any]]:
    """The log with every reason formatted."""
    return [{**d, "reason": d["reason"]()} if callable(d["reason"]) else d for d in log]
