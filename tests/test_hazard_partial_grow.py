"""Hazard 2 of #25, a partial grow: a KV resize that runs out of memory after some layers' tensors were replaced
must leave a cache of whole tensors of the old size and no CUDA graph that captured a replaced tensor. Before the
fix the grown layers stayed grown and the graphs were kept, so the next decode replayed graphs over freed memory.

Run on the CPU with the fake flash_attn of tests/fakes and a capture that, like a real graph, is bound to the
tensors it captured: its replay fails when one of them is no longer the cache's."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.core.kv import tensors
from engine.model.cuda_graphs import Replay
from tests import test_cuda_graphs
from tests.test_cuda_graphs import backend, generate, prompts

tiny = test_cuda_graphs.tiny  # the tiny model fixture, shared with its tests


class BoundCapture:
    """A graph's view of memory: the KV tensors at capture time. Replaying it over tensors the cache no
    longer holds is what reads freed device memory on a GPU; here it raises."""

    def __init__(self, kv_caches: list) -> None:
        self.kv_caches = kv_caches
        self.stale_replays = 0

    def tensors(self) -> list[torch.Tensor]:
        return [t for kv in self.kv_caches for t in kv]

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Replay:
        bound = self.tensors()
        fn()

        def replay() -> torch.Tensor:
            if any(a is not b for a, b in zip(bound, self.tensors(), strict=True)):
                self.stale_replays += 1
                raise AssertionError("replayed a CUDA graph over KV tensors a resize replaced")
            return fn()

        return replay


def fail_after(calls: int) -> Callable:
    """zeroed_kv_tensor that runs out of memory from its `calls`+1-th call on (a grow part way)."""
    real, made = tensors.zeroed_kv_tensor, []

    def zeroed(*args, **kwargs) -> torch.Tensor:
        if len(made) >= calls:
            raise torch.OutOfMemoryError("CUDA out of memory (injected part way through a grow)")
        made.append(1)
        return real(*args, **kwargs)

    return zeroed


def test_hazard_partial_grow_leaves_a_whole_cache_and_valid_graphs(tiny, fake_flash, monkeypatch) -> None:
    eager_tokens, _ = generate(backend(tiny), prompts(backend(tiny), 2), max_tokens=8)
    b = backend(tiny, num_blocks=8)
    capture = BoundCapture(b.kv_caches)
    b.graphs = b.make_decode_graphs(capture, "flash_decode")
    _, engine = generate(b, prompts(b, 2), max_tokens=3)  # graphs captured over the 8-block tensors
    assert b.graphs.replays

    with monkeypatch.context() as m:
        m.setattr(tensors, "zeroed_kv_tensor", fail_after(1))  # the first K tensor grows, the next fails
        with pytest.raises(torch.OutOfMemoryError):
            engine.resize_kv_pool(16)
    assert b.num_blocks == engine.allocator.num_blocks == 8
    assert all(t.shape[0] == 8 for kv in b.kv_caches for t in kv)  # rolled back: every tensor whole, old size

    # The same prompts again on this backend: their decodes replay graphs, which must be over today's tensors.
    tokens, _ = generate(b, prompts(b, 2), max_tokens=8)
    assert capture.stale_replays == 0
    assert tokens == eager_tokens
