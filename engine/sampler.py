"""Token sampling: greedy, temperature, top-k, top-p, and min_tokens' EOS masking.

A seeded request's draw for the token at position p depends only on (seed, p): each row gets its own
generator seeded from both. With batch-invariant logits, a seeded request then samples the same tokens
alone or batched, and again after a preemption recomputes it. Every random row goes through the same
sort-and-invert path whatever its parameters, so one row's options never change another row's draw.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from engine.sampling_params import SamplingParams

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
