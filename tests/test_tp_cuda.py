"""Tensor parallelism over NCCL, on as many GPUs as ranks: TP=2 gives TP=1's greedy tokens, and a rank that dies
ends the engine with RankDiedError, not a hang. NCCL needs one GPU a rank, so on a one-GPU machine these are not
run (bench/device_check.sh names them NOT RUN with the reason); the same behaviour over gloo runs on the CPU in
tests/test_tensor_parallel.py. Engine-level, without the server: a lent machine's image has no fastapi."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from engine.backends.tp_executor import RankDiedError
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sampling_params import SamplingParams
from engine.factory import build_engine
from tests.fixtures_llama import build_tiny_llama

RANKS = 2
PROMPTS = [[5 + i, 17, 33 + i, 40, 9] * (i + 1) for i in range(4)]
DEAD_RANK_S = 120  # the collective timeout with room: a hang would outlast the test's own timeout
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        torch.cuda.device_count() < RANKS,
        reason=f"NCCL needs one GPU a rank: {RANKS} ranks, {torch.cuda.device_count()} GPU(s) here",
    ),
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_tp_cuda")).hf_dir


def engine_at(model: Path, size: int) -> LLMEngine:
    return build_engine(EngineConfig(model=str(model), dtype="float32", device="cuda", tensor_parallel_size=size))


def generate(engine: LLMEngine) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.timeout(300)
def test_tp2_over_nccl_gives_tp1s_tokens(tiny_dir: Path) -> None:
    reference = generate(engine_at(tiny_dir, 1))
    engine = engine_at(tiny_dir, RANKS)
    try:
        assert generate(engine) == reference
    finally:
        engine.backend.close()


@pytest.mark.timeout(300)
def test_a_dead_rank_over_nccl_raises_instead_of_hanging(tiny_dir: Path) -> None:
    engine = engine_at(tiny_dir, RANKS)
    try:
        generate(engine)
        engine.backend._procs[0].kill()
        engine.add_request("after", PROMPTS[0], SamplingParams(max_tokens=8))
        start = time.monotonic()
        with pytest.raises(RankDiedError):
            while engine.has_unfinished():
                engine.step()
        assert time.monotonic() - start < DEAD_RANK_S
    finally:
        engine.backend.close()
