"""Token sampling: greedy, temperature, top-k, top-p, min_tokens' EOS masking, presence/frequency/repetition
penalties and logprobs.

A seeded request's draw for the token at position p depends only on (seed, p): each row gets its own
generator seeded from both. With batch-invariant logits, a seeded request then samples the same tokens
alone or batched, and again after a preemption recomputes it. Every random row goes through the same
sort-and-invert path whatever its parameters, so one row's options never change another row's draw.

Penalties and logprobs touch only the rows that ask for them: a batch without them pays a list scan.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprob

if TYPE_CHECKING:
    from engine.sequence import Sequence as Request

_MASK64 = (1 << 64) - 1


def seed_for(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): Python's hash() of a tuple is not promised stable across builds."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds are at most 2**63 - 1 signed, keep it non-negative


def mask_tokens(logits: torch.Tensor, rows: Iterable[tuple[int, Iterable[int]]]) -> None:
    """Set logits[row, ids] to -inf in place, e.g. EOS and stop ids while a request is under min_tokens."""
    for row, ids in rows:
        ids = [i for i in ids if 0 <= i < logits.shape[1]]
        if ids:
            logits[row, ids] = float("-inf")


class TokenCounts:
    """One request's penalty state, on the logits' device: how often each token is in the output, and which
    tokens are in the prompt or the output. `update` adds only the tokens sampled since it last ran, so a
    step costs O(vocab) per penalized row however long the output is."""

    def __init__(self, prompt_ids: list[int], vocab: int, device: torch.device) -> None:
        self.output = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[torch.tensor([i for i in prompt_ids if 0 <= i < vocab], dtype=torch.long, device=device)] = True
        self.num_counted = 0

    def update(self, output_ids: list[int]) -> None:
        new = output_ids[self.num_counted :]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.output.device)
            self.output.index_put_((ids,), torch.ones(len(new), device=ids.device), accumulate=True)
            self.seen[ids] = True
            self.num_counted = len(output_ids)


def apply_penalties(logits: torch.Tensor, seqs: Sequence[Request]) -> None:
    """In place, on the penalized rows, in vLLM's order: the repetition penalty on every token of the prompt
    and the output (divides a positive logit, multiplies a negative one), then OpenAI's frequency (per
    occurrence) and presence (once) penalties over the output."""
    rows = [i for i, s in enumerate(seqs) if s.params.penalized]
    if not rows:
        return
    for i in rows:
        seq = seqs[i]
        if seq.token_counts is None:
            seq.token_counts = TokenCounts(seq.prompt_ids, logits.shape[1], logits.device)
        seq.token_counts.update(seq.output_ids)
    counts = torch.stack([seqs[i].token_counts.output for i in rows])
    seen = torch.stack([seqs[i].token_counts.seen for i in rows])

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(seqs[i].params, name) for i in rows], device=logits.device)[:, None]

    x, rep = logits[rows], column("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    logits[rows] = x - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], ks: list[int]) -> list[TokenLogprob]:
    """logprobs: log-softmax rows [R, V]; tokens[r]: the token row r chose; ks[r]: how many top entries."""
    index = torch.tensor(tokens, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, index).squeeze(1).tolist()
    top_values, top_ids = logprobs.topk(max(ks), dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(c, list(zip(ids[r][:k], values[r][:k], strict=True)))
        for r, (c, k) in enumerate(zip(chosen, ks, strict=True))
    ]


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        self._generator = torch.Generator()  # for unseeded requests
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def _uniform(self, params: SamplingParams, position: int) -> float:
        if params.seed is None:
            return float(torch.rand((), generator=self._generator))
        g = torch.Generator().manual_seed(seed_for(params.seed, position))
        return float(torch.rand((), generator=g))

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
        """logits: float32 [S, V]; positions[i]: where row i's sampled token will sit in its sequence."""
        out = logits.argmax(dim=-1).tolist()
        rand = [i for i, p in enumerate(params) if not p.greedy and p.top_k != 1]
        if not rand:
            return out
        x = logits[rand].cpu()  # the draw is made on CPU, so a seed means the same thing on every device
        temps = torch.tensor([params[i].temperature for i in rand], dtype=torch.float32)
        probs, order = torch.softmax(x / temps[:, None], dim=-1).sort(dim=-1, descending=True, stable=True)
        vocab = probs.shape[1]
        ks = torch.tensor([params[i].top_k if params[i].top_k > 0 else vocab for i in rand])
        ps = torch.tensor([params[i].top_p for i in rand], dtype=torch.float32)
        # top-p keeps the smallest prefix whose mass reaches top_p (a token is dropped when the mass before it
        # already does); the first token always stays.
        drop = (probs.cumsum(dim=-1) - probs > ps[:, None]) | (torch.arange(vocab)[None, :] >= ks[:, None])
        kept = probs.masked_fill(drop, 0.0)
        cdf = kept.cumsum(dim=-1)
        u = torch.tensor([self._uniform(params[i], positions[i]) for i in rand], dtype=torch.float32)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)
        # u * total can round up to total; the last token with mass (kept ones are a prefix) is the bound
        pick = torch.minimum(pick, (kept > 0).sum(dim=-1, keepdim=True) - 1)
        for row, token in zip(rand, order.gather(1, pick).squeeze(1).tolist(), strict=True):
            out[row] = token
        return out

    def sample_sequences(
        self, logits: torch.Tensor, seqs: Sequence[Request], eos_token_ids: set[int]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """One step's sampling for `seqs` (row i of `logits` is seqs[i]'s next token): raw logprobs where asked
        for, EOS and stop ids masked under min_tokens, penalties, then the draw. Returns the tokens and, per
        row, its TokenLogprob (None where not asked for)."""
        wanted = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        raw = torch.log_softmax(logits[wanted], dim=-1) if wanted else None
        under_min = [(i, s) for i, s in enumerate(seqs) if len(s.output_ids) < s.params.min_tokens]
        mask_tokens(logits, [(i, banned_under_min_tokens(s, eos_token_ids)) for i, s in under_min])
        apply_penalties(logits, seqs)
        tokens = self.sample(logits, [s.params for s in seqs], [s.num_tokens for s in seqs])
        logprobs: list[TokenLogprob | None] = [None] * len(seqs)
        if raw is not None:
            chosen = token_logprobs(raw, [tokens[i] for i in wanted], [seqs[i].params.logprobs for i in wanted])
            for i, entry in zip(wanted, chosen, strict=True):
                logprobs[i] = entry
        return tokens, logprobs


def banned_under_min_tokens(seq: Request, eos_token_ids: set[int]) -> set[int]:
    """Tokens that would end `seq` before min_tokens: its stop ids, and EOS unless EOS is ignored."""
    banned = set(seq.params.stop_token_ids)
    if not seq.params.ignore_eos:
        banned |= eos_token_ids
    return banned
