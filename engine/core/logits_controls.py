"""vLLM's per-request logits controls beside the penalties: an allow-list of token ids, bad words, OpenAI's
logit bias and min_p. The sampler calls these only for the rows whose requests set them, each on its own row,
so a row's logits never depend on what else is in the batch.

vLLM's order, which this keeps: allowed tokens, bad words, min_tokens, logit bias and the penalties on the
logits (every masked token at -inf, so the order among masks and bias does not matter); min_p after the
temperature, before top-k and top-p. Logprobs stay the raw model's (taken before any of these), as vLLM's
default `raw_logprobs` are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEG_INF = float("-inf")


def disallowed_mask(allowed: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
    """True for every token not in `allowed`: built once per request, reused every step."""
    mask = torch.ones(vocab, dtype=torch.bool, device=device)
    mask[torch.tensor(list(allowed), dtype=torch.long, device=device)] = False
    return mask


def ban_bad_words(row: torch.Tensor, words: Sequence[Sequence[int]], output: Sequence[int]) -> None:
    """vLLM's bad words on one row, in place: a word's last token is banned where the output so far ends with
    the word's other tokens (a one-token word is always banned). Only the output counts, not the prompt."""
    for word in words:
        prefix = len(word) - 1
        if prefix > len(output):
            continue
        if prefix == 0 or list(output[len(output) - prefix :]) == list(word[:prefix]):
            row[word[-1]] = NEG_INF


def add_logit_bias(logits: torch.Tensor, rows: Sequence[tuple[int, dict[int, float]]]) -> None:
    """OpenAI's logit bias, in place: each row's bias added to its tokens' logits (one indexed add)."""
    index = [(row, token, bias) for row, biases in rows for token, bias in biases.items()]
    if not index:
        return
    rows_t, tokens_t, values = zip(*index, strict=True)
    device = logits.device
    at = (torch.tensor(rows_t, device=device), torch.tensor(tokens_t, device=device))
    logits.index_put_(at, torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def apply_min_p(x: torch.Tensor, min_ps: Sequence[float]) -> torch.Tensor:
    """vLLM's min_p on tempered logits (one row per value): a token whose probability is below min_p times the
    top token's gets no mass. Compared as logits, p_j / p_max = exp(x_j - x_max), so no softmax is needed; a
    row with min_p 0 compares against -inf and keeps everything."""
    mins = torch.tensor(list(min_ps), dtype=x.dtype, device=x.device)[:, None]
    threshold = x.max(dim=-1, keepdim=True).values + torch.log(mins)
    return x.masked_fill(x < threshold, NEG_INF)
