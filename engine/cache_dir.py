"""Where Headroom keeps what it builds once and reuses: prepared models (engine/model/loaders/cache.py) and compiled
kernels (engine/model/cpu_kernels.py)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "HEADROOM_CACHE_DIR"


def default_cache_dir() -> Path:
    """$HEADROOM_CACHE_DIR, else headroom/ under $XDG_CACHE_HOME (default ~/.cache)."""
    if root := os.environ.get(CACHE_DIR_ENV):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headroom"
