"""vLLM's logits controls in the sampler (engine/core/logits_controls.py): logit_bias, allowed_token_ids, bad
words and min_p, on every draw path (greedy, top-k, top-p, the plain draw and the CPU kernel's plain draw),
with penalties, and the same tokens alone as batched with unrelated rows. And vLLM's prompt logprobs from a
prompt's rows (`score_prompts`)."""

from __future__ import annotations

import pytest
import torch

from engine.core.batch import ScheduledItem
from engine.core.logits_controls import apply_min_p
from engine.core.sampler import Sampler, draw_plain, score_prompts
from engine.core.sampling_params import ParamError, SamplingParams
from engine.core.sequence import Sequence as Request
from engine.model import cpu_kernels

V = 64


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def item(prompt: list[int], params: SamplingParams, output: list[int] = (), rid: str = "r") -> ScheduledItem:
    seq = Request(rid, list(prompt), params, max_tokens=1000)
    seq.output_ids.extend(output)
    return ScheduledItem.of(seq, 0, seq.num_tokens, True)


def plain_draws() -> list:
    """The plain path's draws: torch's, and the C++ kernel's where it builds."""
    draws = [draw_plain]
    if cpu_kernels.unusable_reason(torch.device("cpu"), torch.float32) is None:
        draws.append(cpu_kernels.draw_plain)
    return draws


PATHS = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.0),
]
PENALTIES = {"presence_penalty": 1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3}


@pytest.mark.parametrize("plain", plain_draws())
@pytest.mark.parametrize("base", PATHS, ids=["greedy", "top_k", "top_p", "plain"])
def test_a_banned_token_never_and_a_forced_one_always_comes(base: SamplingParams, plain) -> None:  # noqa: ANN001
    """logit_bias -100 on the row's best tokens bans them; +100 on one token makes it the only one with mass;
    an allow-list keeps the draw inside it. With penalties on, over 60 steps of one request."""
    x = logits(1, seed=11)
    best = x[0].topk(3).indices.tolist()
    for kind, params, check in [
        ("ban", {"logit_bias": dict.fromkeys(best, -100.0)}, lambda t: t not in best),
        ("force", {"logit_bias": {5: 100.0}}, lambda t: t == 5),
        ("allow", {"allowed_token_ids": [3, 9, 40]}, lambda t: t in (3, 9, 40)),
    ]:
        p = SamplingParams(**{**base.__dict__, **params, **PENALTIES, "seed": 7})
        sampler, output = Sampler(plain=plain), []
        for step in range(60):
            output += sampler.sample_items(logits(1, seed=step % 3 + 10), [item([1, 2], p, output)], set()).sampled
        assert all(check(t) for t in output), (kind, output)


@pytest.mark.parametrize("plain", plain_draws())
def test_controls_draw_the_same_tokens_alone_and_batched(plain) -> None:  # noqa: ANN001
    """A seeded row with bias, allow-list, bad words, min_p and penalties draws what it draws alone when batched
    between unrelated rows (other paths, other controls, none), step after step."""
    mine = SamplingParams(temperature=0.9, seed=3, min_p=0.05, logit_bias={4: 3.0, 6: -2.0},
                          allowed_token_ids=list(range(0, V, 2)), bad_words_token_ids=[[8], [10, 12]],
                          **PENALTIES)  # fmt: skip
    others = [
        SamplingParams(temperature=0.7, top_k=5, seed=9, logit_bias={1: 50.0}),
        SamplingParams(temperature=1.1, min_p=0.2),
        SamplingParams(temperature=0, allowed_token_ids=[1, 2, 3]),
        SamplingParams(temperature=1.2, top_p=0.5, bad_words_token_ids=[[2]]),
    ]
    alone_sampler, batch_sampler = Sampler(plain=plain), Sampler(plain=plain)
    alone, batched = [], []
    for step in range(40):
        x = logits(1, seed=100 + step)
        alone += alone_sampler.sample_items(x.clone(), [item([5], mine, alone, "m")], set()).sampled
        rows = torch.cat([logits(2, seed=step), x, logits(2, seed=step + 50)])
        items = [item([5], p, [], f"o{i}") for i, p in enumerate(others)]
        items.insert(2, item([5], mine, batched, "m"))
        batched.append(batch_sampler.sample_items(rows, items, set()).sampled[2])
    assert alone == batched
    assert all(t % 2 == 0 and t != 8 for t in alone)
    assert len(set(alone)) > 3


@pytest.mark.parametrize("plain", plain_draws())
def test_the_one_call_path_draws_what_the_general_path_draws(plain) -> None:  # noqa: ANN001
    """Greedy rows and rows with a temperature alone take one plain draw on the raw logits; beside a top-k
    row the same rows go through the general path (gather, division, table): the same tokens, step by step."""
    rows = [SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=0), SamplingParams(temperature=1.4)]
    one_call, general = Sampler(seed=2, plain=plain), Sampler(seed=2, plain=plain)
    top_k = SamplingParams(temperature=1.0, top_k=3, seed=1)
    for step in range(40):
        x = logits(3, seed=200 + step)
        assert (
            one_call.sample(x, rows, [step] * 3)
            == general.sample(torch.cat([x, logits(1)]), [*rows, top_k], [step] * 4)[:3]
        )


def test_a_one_token_bad_word_is_always_banned_and_the_prompt_does_not_count() -> None:
    x = torch.zeros(1, V)
    x[0, 20], x[0, 21] = 10.0, 9.0
    greedy = Sampler().sample_items
    p = SamplingParams(temperature=0, bad_words_token_ids=[[7, 20]])
    assert greedy(x.clone(), [item([7], p)], set()).sampled == [20]  # 7 is in the prompt, not the output
    one = SamplingParams(temperature=0, bad_words_token_ids=[[20], [21]])
    assert greedy(x.clone(), [item([1], one)], set()).sampled not in ([20], [21])


def test_bad_words_ban_the_last_token_only_after_the_rest_of_the_word() -> None:
    """vLLM's bad words over the output the sampler drew, step after step: after it drew 7, token 20 is banned;
    dropped (the request finished), a new request under the id has no output."""
    x = torch.zeros(1, V)
    x[0, 7] = 10.0
    y = torch.zeros(1, V)
    y[0, 20], y[0, 21] = 10.0, 9.0
    p = SamplingParams(temperature=0, bad_words_token_ids=[[7, 20]])
    sampler, output = Sampler(), []
    output += sampler.sample_items(x.clone(), [item([1], p, output)], set()).sampled
    output += sampler.sample_items(y.clone(), [item([1], p, output)], set()).sampled
    assert output == [7, 21]
    sampler.drop(["r"])  # a new request under the id starts with no output
    assert sampler.sample_items(y.clone(), [item([1], p)], set()).sampled == [20]


def test_min_p_keeps_the_tokens_at_least_min_p_of_the_best() -> None:
    """vLLM's min_p on the tempered probabilities: a token below min_p times the best one's has no mass, the
    rest keep their relative probabilities; min_p 0 keeps everything."""
    x = logits(3, seed=5)
    y = apply_min_p(x, [0.1, 0.0, 1.0])
    probs = torch.softmax(x, dim=-1)
    kept = probs >= 0.1 * probs.max(dim=-1, keepdim=True).values
    assert torch.equal(torch.isfinite(y[0]), kept[0]) and 1 < int(kept[0].sum()) < V
    assert torch.equal(y[1], x[1])
    assert torch.isfinite(y[2]).sum() == 1 and int(y[2].argmax()) == int(x[2].argmax())


@pytest.mark.parametrize("plain", plain_draws())
@pytest.mark.parametrize("base", PATHS[1:], ids=["top_k", "top_p", "plain"])
def test_min_p_draws_only_kept_tokens_after_the_temperature(base: SamplingParams, plain) -> None:  # noqa: ANN001
    x = logits(1, seed=8)
    p = SamplingParams(**{**base.__dict__, "min_p": 0.3, "temperature": 2.0})
    probs = torch.softmax(x[0] / 2.0, dim=-1)
    kept = set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist())
    sampler = Sampler(seed=1, plain=plain)
    drawn = {sampler.sample(x, [p], [i])[0] for i in range(300)}
    assert drawn <= kept and len(drawn) > 1
    cold = {sampler.sample(x, [SamplingParams(**{**p.__dict__, "temperature": 0.5})], [i])[0] for i in range(300)}
    assert len(cold) < len(drawn)  # min_p measures the tempered distribution


@pytest.mark.parametrize(
    "field,value",
    [
        ("min_p", 1.5),
        ("prompt_logprobs", 21),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [V]),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {1: float("nan")}),
        ("bad_words", ["x"]),  # not tokenized
    ],
)
def test_bad_controls_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ParamError) as e:
        SamplingParams(**{field: value}).validate(vocab_size=V)
    assert e.value.param == field


def test_prompt_scores_are_the_log_softmax_at_the_next_prompt_token() -> None:
    """score_prompts: for each asked position, the next prompt token's logprob, its rank (1: best) and the top k,
    in slices; an item that does not ask gets nothing."""
    head = torch.randn(8, V, generator=torch.Generator().manual_seed(2))
    prompt = [3, 9, 1, 4, 4, 7]
    asking = item(prompt, SamplingParams(prompt_logprobs=2), rid="a")
    quiet = item([5, 6], SamplingParams(), rid="b")
    hidden = torch.randn(len(prompt) - 1, 8, generator=torch.Generator().manual_seed(3))
    scored = score_prompts([quiet, asking], hidden, lambda h: h @ head)
    assert list(scored) == ["a"]
    raw = torch.log_softmax(hidden @ head, dim=-1)
    for p, entry in enumerate(scored["a"]):
        target = prompt[p + 1]
        assert entry.logprob == pytest.approx(raw[p, target].item(), abs=1e-6)
        assert entry.rank == int((raw[p] >= raw[p, target]).sum())
        assert [t for t, _ in entry.top] == raw[p].topk(2).indices.tolist()
