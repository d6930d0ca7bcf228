from collections import Counter

import pytest
import torch

from engine.sampler import Sampler, mask_tokens, seed_for
from engine.sampling_params import SamplingParams

V = 64


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    x = logits(5)
    assert Sampler().sample(x, [SamplingParams(temperature=0)] * 5, [0] * 5) == x.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.8, top_k=1, seed=3), SamplingParams(temperature=1.5, top_p=1e-6, seed=3)],
    ids=["top_k=1", "top_p tiny"],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    x = logits(16)
    assert Sampler().sample(x, [params] * 16, list(range(16))) == x.argmax(-1).tolist()


def test_seeded_draw_depends_only_on_seed_and_position() -> None:
    """The same row alone, batched with unrelated rows (other seeds, unseeded, greedy, top-k/p) and at a
    different row index draws the same token; another step with a fresh sampler too."""
    x = logits(1, seed=1)
    p = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler().sample(x, [p], [pos])[0] for pos in range(50)]
    others = [
        SamplingParams(temperature=0.7, top_k=5, seed=9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.3, top_p=0.5),
    ]
    sampler = Sampler()
    for pos in range(50):
        batch = torch.cat([logits(2, seed=pos), x, logits(2, seed=pos + 100)])
        params = [others[0], others[1], p, others[2], others[3]]
        assert sampler.sample(batch, params, [7, pos + 3, pos, 1, pos])[2] == alone[pos]
    assert len(set(alone)) > 5, "draws should differ between positions"


def test_seed_for_is_stable_and_spread() -> None:
    assert seed_for(0, 0) == seed_for(0, 0)
    assert len({seed_for(s, p) for s in range(20) for p in range(20)}) == 400
    assert all(0 <= seed_for(s, p) < 2**63 for s in (0, 2**64 - 1, -5) for p in (0, 10**9))


def test_distribution_matches_softmax() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)])
    p = torch.softmax(x[0], -1)
    n = 4000
    counts = Counter(Sampler().sample(x, [SamplingParams(seed=s)], [0])[0] for s in range(n))
    for token in range(4):
        assert abs(counts[token] / n - p[token].item()) < 0.03
    assert set(counts) <= {0, 1, 2, 3}


def test_top_k_and_top_p_limit_support() -> None:
    x = torch.tensor([[3.0, 2.9, 2.8, 2.7, 2.6] + [2.5] * (V - 5)])
    s = Sampler(seed=0)
    top_k = {s.sample(x, [SamplingParams(top_k=3)], [i])[0] for i in range(300)}
    assert top_k == {0, 1, 2}
    probs = torch.softmax(x[0], -1)
    keep = int((probs.cumsum(0) - probs <= 0.2).sum())  # smallest prefix reaching 0.2
    top_p = {s.sample(x, [SamplingParams(top_p=0.2)], [i])[0] for i in range(300)}
    assert top_p == set(range(keep))


def test_unseeded_uses_global_generator() -> None:
    x = torch.zeros(1, V)
    draws = [Sampler(seed=5).sample(x, [SamplingParams()], [0])[0] for _ in range(3)]
    assert len(set(draws)) == 1  # same sampler seed -> same stream
    s = Sampler(seed=5)
    assert len({s.sample(x, [SamplingParams()], [0])[0] for _ in range(50)}) > 10


def test_masked_tokens_are_never_sampled() -> None:
    x = torch.zeros(2, V)
    x[:, 7] = 50.0  # would always win
    mask_tokens(x, [(0, {7, 9, V + 5})])
    s = Sampler(seed=0)
    assert s.sample(x, [SamplingParams(temperature=0)] * 2, [0, 0]) == [0, 7]
    assert all(s.sample(x[:1], [SamplingParams()], [i])[0] not in (7, 9) for i in range(100))
