"""vLLM's sampling, detokenization and prompt options through the real server (the default model), driven by
the official openai client (vLLM's own fields through `extra_body`, as vLLM's docs send them): logit_bias,
allowed_token_ids, bad_words and min_p, alone and in a batch; skip_special_tokens;
truncate_prompt_tokens; return_tokens_as_token_ids; beam search."""

from __future__ import annotations

import asyncio

import httpx
import pytest

CAPITAL = "The capital of France is"


def first_token(tokenizer, text: str) -> int:  # noqa: ANN001
    return tokenizer.encode(text)[0]


def test_logit_bias_and_allowed_tokens_hold_alone_and_in_a_batch(server, tokenizer) -> None:  # noqa: ANN001
    """Each request, with penalties and a seed, gives the same tokens alone and among concurrent requests of
    other options; a -100 bias bans the token greedy decoding picks (" Paris"), +100 forces a token, an
    allow-list keeps every token inside it."""
    paris = first_token(tokenizer, " Paris")
    allowed = [first_token(tokenizer, w) for w in (" the", " a", " city", ".")]
    base = {"model": "default", "prompt": CAPITAL, "max_tokens": 8, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True, "frequency_penalty": 0.5, "repetition_penalty": 1.2}  # fmt: skip
    cases = [
        {**base, "temperature": 0, "logit_bias": {str(paris): -100}},
        {**base, "temperature": 0.8, "seed": 3, "logit_bias": {"13": 100}},
        {**base, "temperature": 1.0, "seed": 5, "allowed_token_ids": allowed},
        {**base, "temperature": 0.7, "seed": 9, "min_p": 0.2, "logit_bias": {str(paris): 5}},
    ]
    unrelated = [{**base, "temperature": 1.0, "seed": s, "prompt": f"Story {s}:"} for s in range(4)]

    async def run(bodies: list[dict]) -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            answers = await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))
        return [[int(t[9:]) for t in a.json()["choices"][0]["logprobs"]["tokens"]] for a in answers]

    alone = [asyncio.run(run([body]))[0] for body in cases]
    batched = asyncio.run(run([*unrelated[:2], *cases, *unrelated[2:]]))[2:6]
    assert batched == alone
    assert paris not in alone[0] and alone[1] == [13] * 8 and set(alone[2]) <= set(allowed)
    greedy = asyncio.run(run([{**base, "temperature": 0}]))[0]
    assert greedy[0] == paris  # what the -100 bias took away


def test_bad_words_are_never_completed(client, tokenizer) -> None:  # noqa: ANN001
    """vLLM's bad_words: a word's last token never follows the rest of it, with or without a leading space."""
    kw = {"model": "default", "prompt": CAPITAL, "max_tokens": 12, "temperature": 0}
    plain = client.completions.create(**kw).choices[0].text
    assert " Paris" in plain
    banned = client.completions.create(**kw, extra_body={"bad_words": ["Paris"], "ignore_eos": True}).choices[0].text
    assert "Paris" not in banned and banned != plain


def test_skip_special_tokens_writes_them_when_false(client) -> None:  # noqa: ANN001
    """The chat model ends its turn with <|im_end|> (EOS: not written); with a stop token of its own turn
    start, skip_special_tokens false writes it in the text, true (the default) leaves it out."""
    kw = {"model": "default", "prompt": "<|im_start|>user\nHi<|im_end|>\n", "max_tokens": 3, "temperature": 0}
    body = {"ignore_eos": True, "logit_bias": {"1": 100}}  # <|im_start|>, forced
    written = client.completions.create(**kw, extra_body={**body, "skip_special_tokens": False}).choices[0].text
    skipped = client.completions.create(**kw, extra_body=body).choices[0].text
    assert written == "<|im_start|>" * 3 and skipped == ""


def test_truncate_prompt_tokens_keeps_the_last_k(client, tokenizer) -> None:  # noqa: ANN001
    """vLLM's truncate_prompt_tokens: the answer is the one for the prompt's last k tokens (the first k with
    truncation_side right); echo shows the kept tokens; k past what the context leaves is a 400."""
    long = "one two three four five six seven eight nine ten. " + CAPITAL
    ids = tokenizer.encode(long)
    kw = {"model": "default", "max_tokens": 4, "temperature": 0}
    cut = client.completions.create(prompt=long, **kw, extra_body={"truncate_prompt_tokens": 6, "echo": True})
    last = client.completions.create(prompt=ids[-6:], **kw)
    assert cut.usage.prompt_tokens == 6
    assert cut.choices[0].text == tokenizer.decode(ids[-6:]) + last.choices[0].text
    first = {"truncate_prompt_tokens": 3, "truncation_side": "right", "echo": True}
    right = client.completions.create(prompt=long, **kw, extra_body=first)
    assert right.choices[0].text.startswith("one two three") and right.usage.prompt_tokens == 3
    with pytest.raises(Exception) as e:  # noqa: PT011 - the openai client's BadRequestError
        client.completions.create(prompt=CAPITAL, **kw, extra_body={"truncate_prompt_tokens": 10**6})
    assert "truncate_prompt_tokens" in str(e.value)


def test_return_tokens_as_token_ids_in_both_shapes(client, tokenizer) -> None:  # noqa: ANN001
    kw = {"model": "default", "max_tokens": 3, "temperature": 0, "extra_body": {"return_tokens_as_token_ids": True}}
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "Hi"}], logprobs=True, top_logprobs=2, **kw
    )
    content = chat.choices[0].logprobs.content
    assert all(e.token.startswith("token_id:") and bytes(e.bytes) == e.token.encode() for e in content)
    assert tokenizer.decode([int(e.token[9:]) for e in content]) == chat.choices[0].message.content
    assert all(t.token.startswith("token_id:") for e in content for t in e.top_logprobs)
    legacy = client.completions.create(prompt=CAPITAL, logprobs=1, **kw).choices[0].logprobs
    assert all(t.startswith("token_id:") for t in legacy.tokens)


def test_beam_search_returns_n_beams_best_first(client, tokenizer) -> None:  # noqa: ANN001
    """vLLM's beam search: n beams, each the best continuation found; the first scores best by vLLM's
    length-normalized cumulative logprob; a greedy answer is never a better-scoring beam's equal or more."""
    kw = {"model": "default", "prompt": CAPITAL, "max_tokens": 6, "temperature": 0}
    beams = client.completions.create(n=3, logprobs=1, **kw, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in beams.choices] == [0, 1, 2] and beams.usage.completion_tokens == 18
    texts = [c.text for c in beams.choices]
    assert len(set(texts)) == 3

    def score(c) -> float:  # noqa: ANN001
        return sum(c.logprobs.token_logprobs) / (len(tokenizer.encode(CAPITAL)) + len(c.logprobs.tokens))

    scores = [score(c) for c in beams.choices]
    assert scores == sorted(scores, reverse=True)
    greedy = client.completions.create(logprobs=1, **kw, extra_body={"ignore_eos": True}).choices[0]
    assert score(greedy) <= scores[0] + 1e-6
    with pytest.raises(Exception) as e:  # noqa: PT011 - the openai client's BadRequestError
        client.completions.create(stream=True, **kw, extra_body={"use_beam_search": True})
    assert "beam search" in str(e.value)
