"""The sharded model's arithmetic, without processes: the ranks as threads of this process over gloo (an
in-memory store), their logits against one device's, with the KV heads split (size 2) and replicated (size 4:
more ranks than the tiny model's 2 KV heads). And the sizes a model refuses, with the reason."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from engine.backends.torch_backend import TorchBackend
from engine.backends.tp_collectives import StepCollectives
from engine.core.batch import ScheduledItem, SchedulerOutput
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from engine.model.model_config import ModelConfig
from engine.model.tensor_parallel import RankShard, kv_head_range, tp_refusal
from tests.fixtures_llama import build_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny_shards")).hf_dir)


def prefill_batch() -> SchedulerOutput:
    batch = SchedulerOutput()
    for i, prompt in enumerate(([5, 17, 33, 40, 9], [6, 17, 34, 40, 9, 11])):
        seq = Sequence(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=1), 1)
        seq.block_table = [2 * i, 2 * i + 1]
        batch.add(ScheduledItem.of(seq, 0, seq.num_tokens, True))
    return batch


def backend(model: str, shard: RankShard | None = None) -> TorchBackend:
    return TorchBackend(model, dtype="float32", num_blocks=8, model_cache=False, shard=shard)


def sharded_logits(model: str, size: int) -> torch.Tensor:
    store, out, errors = dist.HashStore(), {}, []

    def rank(r: int) -> None:
        try:
            collectives = StepCollectives()
            b = backend(model, RankShard(r, size, collectives.reduce))
            collectives.shape(2 * b.config.num_layers, b.config.hidden_size)
            collectives.group = dist.ProcessGroupGloo(store, r, size, timedelta(seconds=30))
            batch = prefill_batch()
            collectives.begin(batch.shape.tokens)
            hidden = b.forward(batch)
            collectives.finish(torch.float32, b.device)
            if r == 0:
                out["logits"] = b.model.compute_logits(hidden)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out["logits"]


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_logits_match_one_device(tiny_dir: str, size: int) -> None:
    one = backend(tiny_dir)
    want = one.model.compute_logits(one.forward(prefill_batch()))
    torch.testing.assert_close(sharded_logits(tiny_dir, size), want, rtol=1e-4, atol=1e-4)


def test_a_rank_keeps_the_kv_head_its_query_heads_read() -> None:
    cfg = ModelConfig(
        vocab_size=8, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=8, num_kv_heads=2, head_dim=8
    )
    assert [list(kv_head_range(cfg, r, 2)) for r in range(2)] == [[0], [1]]
    assert [list(kv_head_range(cfg, r, 4)) for r in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_head_range(cfg, r, 8)) for r in range(8)] == [[0]] * 4 + [[1]] * 4


def test_sizes_the_heads_do_not_allow_are_refused_with_the_reason() -> None:
    default = ModelConfig(
        vocab_size=8, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9, num_kv_heads=3, head_dim=64
    )
    assert tp_refusal(default, 3) is None
    assert "does not divide the MLP's 1536 features" in tp_refusal(default, 9)  # heads would: 3 KV replicated
    assert "does not divide the model's 9 attention heads" in tp_refusal(default, 2)
    assert "(1, 3, 9)" in tp_refusal(default, 2)
    odd = ModelConfig(
        vocab_size=8, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=12, num_kv_heads=4, head_dim=8
    )
    assert "KV heads" in tp_refusal(odd, 6)  # 6 divides 12 query heads, but neither divides nor is a multiple of 4


def test_cuda_ranks_take_their_own_device_and_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: the CUDA choices are checked with fakes (rank r on cuda:r, the group over NCCL)."""
    from engine.backends import tp_collectives, tp_worker

    made: list[tuple] = []

    class FakeNCCL:
        class Options:
            _timeout = None

        def __init__(self, *args: object) -> None:
            made.append(args[:3])

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")  # make_group sets it: restored after the test
    assert isinstance(tp_collectives.make_group("store", 1, 2, torch.device("cuda", 1)), FakeNCCL)  # type: ignore[arg-type]
    assert made == [("store", 1, 2)]
    assert tp_worker.rank_kwargs({"device": "cuda"}, 1)["device"] == "cuda:1"
    assert tp_worker.rank_kwargs({"device": "cpu"}, 1)["device"] == "cpu"
