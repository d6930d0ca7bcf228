"""Hazard 3 of #25, graph memory the controller never sees: decode graphs were captured lazily inside measured
steps (the start-up profiling decode among them), so their pool was never in the idle footprint the KV pool is
sized against, and every resize captured them again inside a step. Now every bucket is captured at start-up,
before the profiling steps, into a pool the backend keeps; after a resize a bucket is captured again between
steps (Backend.prepare), into that pool."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch

from engine.backends import torch_backend
from engine.backends.twin.backend import TwinBackend
from engine.config import EngineConfig
from engine.factory import build_engine
from engine.model.cuda_graphs import CAPTURE_SIZES, Replay
from tests import test_cuda_graphs
from tests.test_cuda_graphs import backend, generate, prompts

tiny = test_cuda_graphs.tiny  # the tiny model fixture, shared with its tests


class MeasuredProbe:
    """The backend's probe, noting whether a step's measurement is open."""

    def __init__(self, inner: object) -> None:
        self.inner, self.open = inner, False

    @contextmanager
    def step(self, shape: object) -> Iterator[None]:
        self.open = True
        try:
            with self.inner.step(shape):
                yield
        finally:
            self.open = False

    def sample(self) -> object:
        return self.inner.sample()

    def add_idle(self, nbytes: int) -> None:
        self.inner.add_idle(nbytes)


def test_hazard_graph_memory_unseen_a_capture_after_a_resize_runs_outside_the_measured_step(tiny, fake_flash):
    b = backend(tiny, num_blocks=8)
    b.probe = probe = MeasuredProbe(b.probe)
    inside: list[bool] = []

    def capture(fn: Callable[[], torch.Tensor]) -> Replay:
        inside.append(probe.open)
        fn()
        return fn

    b.graphs = b.make_decode_graphs(capture, "flash_decode")
    _, engine = generate(b, prompts(b, 2), max_tokens=3)
    engine.resize_kv_pool(12)
    generate(b, prompts(b, 2), max_tokens=3)
    assert len(inside) == 2 and not any(inside)  # bucket 2, before and after the resize: never inside a step


def twin_engine(sensors: str):
    return build_engine(EngineConfig(backend="twin", policy="adaptive", twin_sensors=sensors))


def test_hazard_graph_memory_unseen_the_sized_pool_leaves_room_for_the_graphs():
    ideal, realistic = twin_engine("ideal"), twin_engine("realistic")
    twin: TwinBackend = realistic.backend
    graphs = twin.memory.graph_bytes
    assert graphs == twin.graphs.reserved > 64 << 20  # the pool of every bucket, held from start-up
    # the start-up profile measured them in the idle footprint, so the pool is smaller by their blocks
    assert realistic.allocator.num_blocks <= ideal.allocator.num_blocks - graphs // twin.block_bytes


def test_hazard_graph_memory_unseen_every_bucket_is_captured_when_the_backend_is_built(tiny, fake_flash, monkeypatch):
    """The torch backend on a (stood-in) CUDA device captures every bucket in its constructor, into one pool it
    keeps, before anyone can run a step: so the start-up profiling, which comes after, measures the graphs' memory
    in the idle footprint. Without the capture at start-up no bucket would be captured here."""
    captured: list[int] = []
    pools: list[object] = []

    def capture_into(pool: object) -> Callable[[Callable[[], torch.Tensor]], Replay]:
        pools.append(pool)

        def capture(fn: Callable[[], torch.Tensor]) -> Replay:
            captured.append(fn().shape[0])
            return fn

        return capture

    monkeypatch.setattr(torch_backend, "decode_graph_kernel", lambda *args: ("flash_decode", "stood in"))
    monkeypatch.setattr(torch_backend, "cuda_graph_capture", capture_into)
    monkeypatch.setattr(torch.cuda, "MemPool", lambda: SimpleNamespace(id=(0, 1)))
    b = backend(tiny)
    assert b.graph_kernel == "flash_decode" and pools == [(0, 1)]
    assert captured == sorted(CAPTURE_SIZES, reverse=True) and set(b.graphs.replays) == set(CAPTURE_SIZES)
