"""CUDA graphs for decode (engine/model/cuda_graphs.py): buckets, padding, the static buffers, invalidation on a
KV resize and the fallback to eager, exercised on the CPU with an eager stand-in for torch.cuda.graph and
the fake flash_attn of tests/fakes; the real capture runs under the `cuda` marker."""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from engine.backends.torch_backend import TorchBackend
from engine.baselines.seed import FixedPolicy
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.model.cuda_graphs import CAPTURE_SIZES, Replay, bucket_for, pad_rows
from tests.fixtures_llama import build_tiny_llama


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


class EagerCapture:
    """Stands in for cuda_graph_capture: 'capturing' keeps the function, a replay runs it again over the
    same static buffers, which is what a graph replay computes. Counts captures by batch size."""

    def __init__(self, fail: bool = False) -> None:
        self.captured: Counter[int] = Counter()
        self.replays = 0
        self.fail = fail

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Replay:
        if self.fail:
            raise RuntimeError("capture failed")
        self.captured[fn().shape[0]] += 1

        def replay() -> torch.Tensor:
            self.replays += 1
            return fn()

        return replay


def backend(tiny, num_blocks: int = 8) -> TorchBackend:
    """The tiny model on the CPU in float32 with 256-token blocks (the size the flash kernels page)."""
    return TorchBackend(str(tiny.hf_dir), dtype="float32", device="cpu", num_blocks=num_blocks, block_size=256)


def generate(b: TorchBackend, prompts: list[list[int]], max_tokens: int = 6) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(b, FixedPolicy(kv_reserve_ratio=0.0, allow_mixed=False, prefill_first=True))
    seqs = [engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
            for i, p in enumerate(prompts)]  # fmt: skip
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs], engine


def prompts(b: TorchBackend, n: int) -> list[list[int]]:
    return [b.tokenizer.encode("The capital of France is Paris. " * (i + 1)) for i in range(n)]


def test_buckets_are_the_smallest_capture_size_that_holds_the_batch() -> None:
    assert [bucket_for(n, CAPTURE_SIZES) for n in (1, 2, 3, 5, 8, 9, 250, 256)] == [1, 2, 4, 8, 8, 16, 256, 256]
    assert bucket_for(257, CAPTURE_SIZES) is None
    assert pad_rows([3, 4, 5], 5) == [3, 4, 5, 5, 5]


def test_graph_decode_gives_the_eager_tokens_and_captures_each_bucket_once(tiny, fake_flash) -> None:
    """Three prompts decode as a padded batch of 4 through the graph path (flash_attn_with_kvcache),
    prefills eagerly; tokens equal the eager sdpa run's; as sequences finish the bucket shrinks."""
    eager_tokens, _ = generate(backend(tiny), prompts(backend(tiny), 3))
    b = backend(tiny)
    b.graphs = b.make_decode_graphs(capture := EagerCapture(), "flash_decode")
    tokens, _ = generate(b, prompts(b, 3))
    assert tokens == eager_tokens
    assert capture.captured == Counter({4: 1})  # 3 sequences padded to the bucket of 4, captured once
    assert capture.replays == 5  # 6 tokens: the first from the prefill, 5 decode steps replayed
    assert "flash_attn_with_kvcache" in fake_flash.CALLS


def test_padding_rows_write_only_the_last_real_rows_slot(tiny, fake_flash) -> None:
    """Padding repeats the last real row, so the KV pool after a padded graph step is the one the eager
    step leaves: no block outside the batch's is touched."""
    pools = []
    for graphs in (False, True):
        b = backend(tiny)
        if graphs:
            b.graphs = b.make_decode_graphs(EagerCapture(), "flash_decode")
        generate(b, prompts(b, 3), max_tokens=3)
        pools.append(torch.stack([torch.stack(kv) for kv in b.kv_caches]))
    torch.testing.assert_close(pools[1], pools[0], atol=1e-5, rtol=1e-5)
    assert pools[1][:, :, 3:].abs().sum() == 0  # 3 one-block sequences: blocks 3.. never written


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(tiny, fake_flash) -> None:
    eager_tokens, _ = generate(backend(tiny), prompts(backend(tiny), 2))
    b = backend(tiny)
    b.graphs = b.make_decode_graphs(EagerCapture(fail=True), "flash_decode")
    tokens, _ = generate(b, prompts(b, 2))
    assert tokens == eager_tokens
    assert b.graphs.disabled and not b.graphs.replays


def test_a_batch_above_the_largest_bucket_or_a_prefill_runs_eagerly(tiny, fake_flash) -> None:
    b = backend(tiny)
    b.graphs = b.make_decode_graphs(capture := EagerCapture(), "flash_decode")
    b.graphs.sizes = (1, 2)
    generate(b, prompts(b, 3), max_tokens=3)
    assert capture.replays == 0 and fake_flash.CALLS.count("flash_attn_with_kvcache") == 0


def test_a_kv_resize_drops_the_graphs_that_captured_the_old_tensors(tiny, fake_flash) -> None:
    b = backend(tiny, num_blocks=8)
    b.graphs = b.make_decode_graphs(capture := EagerCapture(), "flash_decode")
    _, engine = generate(b, prompts(b, 2), max_tokens=3)
    assert b.graphs.replays
    engine.resize_kv_pool(12)
    assert b.num_blocks == 12 and not b.graphs.replays and b.graphs.capture is capture
    assert b.graphs.width == -(-b.max_model_len // b.block_size)  # tables address the longest sequence


def test_enforce_eager_is_a_config_field_and_graphs_are_off_off_cuda(tiny) -> None:
    assert EngineConfig.from_dict({"enforce_eager": True}).enforce_eager
    assert backend(tiny).graphs is None  # CPU: eager


@pytest.mark.cuda
def test_real_cuda_graphs_on_triton_match_eager(tiny) -> None:
    """On a real GPU without flash-attn's kernels: graphs capture Triton's decode, every bucket at start-up, and
    give the eager sdpa path's greedy tokens (float32: the two kernels' orders of summation differ by far less
    than the tiny model's top-2 gaps)."""
    runs = {}
    for eager in (True, False):
        b = TorchBackend(str(tiny.hf_dir), dtype="float32", device="cuda", num_blocks=8, enforce_eager=eager)
        assert b.attention == "sdpa" and (b.graph_kernel is None) == eager
        if not eager:
            assert not b.graphs.disabled and set(b.graphs.replays) == set(CAPTURE_SIZES)
        runs[eager] = generate(b, prompts(b, 3))[0]
    assert runs[False] == runs[True]


@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn is not installed")
def test_real_cuda_graphs_on_flash_match_eager(tiny) -> None:
    """On a real GPU with flash-attn: the captured graph path gives the eager flash path's greedy tokens."""
    runs = {}
    for eager in (True, False):
        b = TorchBackend(str(tiny.hf_dir), dtype="bfloat16", device="cuda", num_blocks=8, enforce_eager=eager)
        assert b.attention == "flash" and b.block_size == 256
        runs[eager] = generate(b, prompts(b, 3))[0]
        assert (b.graphs is None) == eager
    assert runs[False] == runs[True]
