from collections import Counter

import pytest
import torch
from torch import Generator

from engine.core.batch import ScheduledItem
from engine.core.sampler import (
    Sampler,
    TokenCounts,
    apply_penalties,
    argmax_rows,
    draw_top_p,
    invert_cdf,
    mask_tokens,
    seed_for,
)
from engine.core.sampling_params import ParamError, SamplingParams
from engine.core.sequence import Sequence as Request

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


def full_sort_top_p(x: torch.Tensor, ps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """top-p as the definition reads: the whole row stably sorted."""
    probs, order = torch.softmax(x, dim=-1).sort(dim=-1, descending=True, stable=True)
    drop = probs.cumsum(dim=-1) - probs > ps[:, None]
    return order.gather(1, invert_cdf(probs, drop, u)[:, None]).squeeze(1)


@pytest.mark.parametrize("scale", [0.3, 3.0, 8.0])
def test_top_p_sorts_only_the_head_and_draws_what_the_full_sort_draws(scale: float, monkeypatch) -> None:
    """A vocabulary of 49,152 with peaked and flat rows, ties, and top_p from tiny to 1: the same token as
    the full stable sort for every uniform, while a peaked row sorts far fewer than the vocabulary."""
    g = torch.Generator().manual_seed(int(scale * 10))
    x = (torch.randn(6, 49152, generator=g) * scale).round(decimals=1)  # rounded: many exact ties
    ps = torch.tensor([1e-6, 0.2, 0.5, 0.9, 0.95, 1.0])
    sorted_sizes = []
    real_sort = torch.Tensor.sort
    monkeypatch.setattr(torch.Tensor, "sort", lambda t, **kw: sorted_sizes.append(t.shape[-1]) or real_sort(t, **kw))
    for _ in range(20):
        u = torch.rand(6, generator=g)
        assert torch.equal(draw_top_p(x, ps, u), full_sort_top_p(x, ps, u))
    if scale == 8.0:  # peaked rows: the head holds top_p long before the vocabulary ends (top_p 1: it never does)
        assert max(sorted_sizes[: len(ps) - 1]) < 49152 // 16


def test_top_k_and_top_p_limit_support() -> None:
    x = torch.tensor([[3.0, 2.9, 2.8, 2.7, 2.6] + [2.5] * (V - 5)])
    s = Sampler(seed=0)
    top_k = {s.sample(x, [SamplingParams(top_k=3)], [i])[0] for i in range(300)}
    assert top_k == {0, 1, 2}
    probs = torch.softmax(x[0], -1)
    keep = int((probs.cumsum(0) - probs <= 0.2).sum())  # smallest prefix reaching 0.2
    top_p = {s.sample(x, [SamplingParams(top_p=0.2)], [i])[0] for i in range(300)}
    assert top_p == set(range(keep))


def test_top_k_with_top_p_draws_the_filtered_softmax() -> None:
    """The top-k path (topk, no sort) with top_p draws each token of the support in proportion to its
    probability: top-p measured against the full softmax, then renormalized over what both filters keep."""
    x = torch.tensor([[2.0, 1.8, 1.0, 0.5, 0.4] + [-1.0] * (V - 5)])
    p = torch.softmax(x[0], -1)
    before = p.cumsum(0) - p
    support = [t for t in range(4) if before[t] <= 0.75]  # top_k=4 and top_p=0.75
    params = [SamplingParams(temperature=1.0, top_k=4, top_p=0.75, seed=s) for s in range(3000)]
    counts = Counter(Sampler().sample(x.expand(len(params), V), params, [0] * len(params)))
    assert set(counts) == set(support)
    kept = p[support] / p[support].sum()
    for token, share in zip(support, kept.tolist(), strict=True):
        assert abs(counts[token] / len(params) - share) < 0.03


def test_inversion_never_lands_on_a_token_without_mass() -> None:
    """u * total can round up to the total: the pick must still be a token with mass, in vocabulary
    order (the plain path) as in sorted order."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    top = torch.full((2,), 1 - 2**-24)
    assert invert_cdf(probs, None, top).tolist() == [3, 1]
    assert invert_cdf(probs, None, torch.zeros(2)).tolist() == [1, 0]


def test_random_rows_never_go_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draw stays on the logits' device: no row is copied out with .cpu() (the old sampler drew every
    random row on the CPU)."""

    def refuse(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("a tensor was moved to the CPU")

    monkeypatch.setattr(torch.Tensor, "cpu", refuse)
    x = logits(8)
    mixes = [
        SamplingParams(temperature=0.9, top_k=5),
        SamplingParams(top_p=0.5),
        SamplingParams(),
        SamplingParams(temperature=0),
    ]
    assert len(Sampler(seed=0).sample(x, mixes * 2, list(range(8)))) == 8


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


def penalized_reference(x: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's penalties for one row, token by token."""
    x = x.clone()
    counts = Counter(output)
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def item(prompt: list[int], params: SamplingParams, output: list[int] = (), rid: str = "r") -> ScheduledItem:
    """The step item that samples the token after `prompt` + `output`."""
    seq = Request(rid, list(prompt), params, max_tokens=1000)
    seq.output_ids.extend(output)
    return ScheduledItem.of(seq, 0, seq.num_tokens, True)


def counts(prompt: list[int], output: list[int]) -> TokenCounts:
    c = TokenCounts(prompt, V, torch.device("cpu"))
    for t in output:
        c.add(t)
    return c


PENALIZED = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=0.5),
    SamplingParams(presence_penalty=-1.5, frequency_penalty=2.0),
    SamplingParams(presence_penalty=1.0, frequency_penalty=-0.3, repetition_penalty=1.2),
]


def test_penalties_match_the_reference_and_leave_other_rows_alone() -> None:
    rng = Generator().manual_seed(3)
    x = logits(len(PENALIZED) + 1, seed=4)
    prompts = [torch.randint(0, V, (9,), generator=rng).tolist() for _ in PENALIZED]
    outputs = [torch.randint(0, V, (15,), generator=rng).tolist() for _ in PENALIZED]
    y = x.clone()
    rows = [(i, p, counts(pr, out)) for i, (pr, p, out) in enumerate(zip(prompts, PENALIZED, outputs, strict=True))]
    apply_penalties(y, rows)
    for i, (pr, p, out) in enumerate(zip(prompts, PENALIZED, outputs, strict=True)):
        torch.testing.assert_close(y[i], penalized_reference(x[i], pr, out, p))
    assert torch.equal(y[-1], x[-1])


def test_penalty_counts_follow_the_sampled_tokens_until_the_request_is_dropped() -> None:
    """The sampler adds each token it samples for a request to that request's counts (kept by request id):
    step after step the penalized logits equal the reference over the whole output so far. Dropped (the
    request finished), a request id starts again from its prompt."""
    p = SamplingParams(presence_penalty=0.7, frequency_penalty=0.9, repetition_penalty=1.3, seed=5)
    sampler, prompt, output = Sampler(), [3, 3, 8], []
    for step in range(40):
        x = logits(1, seed=step)
        y = x.clone()
        output += sampler.sample_items(y, [item(prompt, p, output)], set()).sampled
        torch.testing.assert_close(y[0], penalized_reference(x[0], prompt, output[:-1], p))
    sampler.drop(["r"])
    x = logits(1, seed=99)
    y = x.clone()
    sampler.sample_items(y, [item(prompt, p, output)], set())
    torch.testing.assert_close(y[0], penalized_reference(x[0], prompt, [], p))


def test_greedy_follows_the_penalized_logits() -> None:
    x = torch.zeros(1, V)
    x[0, 7], x[0, 8] = 5.0, 4.0
    assert Sampler().sample_items(
        x.clone(), [item([7], SamplingParams(temperature=0, repetition_penalty=2.0))], set()
    ).sampled == [8]
    sampler, p = Sampler(), SamplingParams(temperature=0, presence_penalty=2.0)
    assert sampler.sample_items(x.clone(), [item([1], p)], set()).sampled == [7]
    assert sampler.sample_items(x.clone(), [item([1], p, [7])], set()).sampled == [8]  # 7 is in its output now


def test_logprobs_are_raw_and_the_top_k_is_best_first() -> None:
    """The chosen token's logprob and the top k come from the model's log-softmax: temperature, penalties and
    min_tokens masking do not change them. Rows that did not ask get None."""
    x = logits(3, seed=6)
    raw = torch.log_softmax(x, dim=-1)
    items = [
        item([1, 2], SamplingParams(temperature=0.3, seed=1, repetition_penalty=1.5, logprobs=5), [3], rid="a"),
        item([1], SamplingParams(temperature=0), rid="b"),
        item([4], SamplingParams(temperature=0, logprobs=0, min_tokens=2), rid="c"),
    ]
    top_token = int(x[2].argmax())
    out = Sampler().sample_items(x.clone(), items, eos_token_ids={top_token})
    tokens, logprobs = out.sampled, out.logprobs
    assert logprobs[1] is None and tokens[2] != top_token  # EOS masked under min_tokens
    for i in (0, 2):
        assert logprobs[i].logprob == pytest.approx(raw[i, tokens[i]].item(), abs=1e-6)
    assert logprobs[2].top == []
    top = logprobs[0].top
    assert [t for t, _ in top] == raw[0].topk(5).indices.tolist()
    assert [v for _, v in top] == pytest.approx(raw[0].topk(5).values.tolist(), abs=1e-6)
    assert Sampler().sample_items(x.clone(), items[1:2], set()).logprobs == []  # none asked


@pytest.mark.parametrize(
    "field,value",
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("logprobs", 21),
        ("logprobs", -1),
        ("temperature", float("nan")),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, value: float) -> None:
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value}).validate()
    assert e.value.param == field


@pytest.mark.cuda
def test_seeded_draws_on_cuda_are_the_cpus() -> None:
    """A seed means the same uniform on every device: on the same logits, CUDA draws what the CPU draws
    (a flip needs a uniform within float rounding of a CDF step, about 1e-7 per draw)."""
    x = logits(64, seed=9)
    mixes = [SamplingParams(temperature=0.9, top_k=8, seed=s) for s in range(32)]
    mixes += [SamplingParams(temperature=1.2, top_p=0.8, seed=s) for s in range(16)]
    mixes += [SamplingParams(temperature=0.7, seed=s) for s in range(16)]
    positions = list(range(64))
    assert Sampler().sample(x.cuda(), mixes, positions) == Sampler().sample(x, mixes, positions)


def test_the_cpu_argmax_is_torchs_with_ties_and_nans() -> None:
    """Greedy rows take numpy's argmax on the CPU: the first largest index, a NaN the largest, as torch's."""
    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    x[:, 3] = x.max(dim=-1).values  # a tie with a later column
    x[1, 10], x[1, 20] = float("nan"), float("nan")
    x[2, :] = float("-inf")
    assert argmax_rows(x) == x.argmax(dim=-1).tolist()
    assert argmax_rows(x[::2]) == x[::2].argmax(dim=-1).tolist()  # strided rows
