"""Token sampling: greedy, temperature, top-k, top-p, min_p, min_tokens' EOS masking, presence/frequency/repetition
penalties, vLLM's logits controls (engine/core/logits_controls.py), logprobs and prompt logprobs.

A seeded request's draw for the token at position p depends only on (seed, p): its uniform comes from
splitmix64 of both, and which path draws it depends only on its own parameters. With batch-invariant logits,
a seeded request then samples the same tokens alone or batched, and again after a preemption recomputes it.

The draw stays on the logits' device: only the per-row parameters and uniforms go up (one small tensor),
and one `.tolist()` brings the step's chosen ids back. Each random row takes the cheapest exact path its
own parameters allow, so no row's options change another row's draw:
- top_k set: the top k by `topk` (no sort of the vocabulary), top_p measured against the full softmax;
- top_p only: a stable sort of the row's head, the best tokens up to more than top_p's mass, the one exact way to
  find the smallest prefix holding top_p;
- neither: inversion of the unsorted CDF.
A batch whose random rows all take the last path, with no min_p, is drawn by one call of the plain draw on the
raw logits, temperature and greedy rows included: a one-stream step's commonest case, where each extra tensor
operation costs more than the draw itself.
A seed means the same uniform on every device; a token can still differ between devices where their
logits or float sums round differently.

Penalties, logits controls and logprobs touch only the rows that ask for them: a batch without them pays a list
scan.
"""

from __future__ import annotations

import random
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence

import torch

from engine.core.batch import ModelOutput, ScheduledItem
from engine.core.logits_controls import NEG_INF, add_logit_bias, apply_min_p, ban_bad_words, disallowed_mask
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import TokenLogprob

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
    tokens are in the prompt or the output. The sampler adds each token it samples for the request (`add`),
    so a step costs O(vocab) per penalized row however long the output is."""

    def __init__(self, prompt_ids: Sequence[int], vocab: int, device: torch.device) -> None:
        self.output = torch.zeros(vocab, dtype=torch.float32, device=device)
        self.seen = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.seen[torch.tensor([i for i in prompt_ids if 0 <= i < vocab], dtype=torch.long, device=device)] = True
        self.num_counted = 0

    def add(self, token: int) -> None:
        self.output[token] += 1.0
        self.seen[token] = True
        self.num_counted += 1


def apply_penalties(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams, TokenCounts]]) -> None:
    """In place, on the penalized rows (row index, its parameters, its request's counts), in vLLM's order: the
    repetition penalty on every token of the prompt and the output (divides a positive logit, multiplies a
    negative one), then OpenAI's frequency (per occurrence) and presence (once) penalties over the output."""
    if not rows:
        return
    counts = torch.stack([c.output for _, _, c in rows])
    seen = torch.stack([c.seen for _, _, c in rows])
    index = [i for i, _, _ in rows]

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for _, p, _ in rows], device=logits.device)[:, None]

    x, rep = logits[index], column("repetition_penalty")
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    logits[index] = x - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)


def token_logprobs(
    logprobs: torch.Tensor, tokens: list[int], ks: list[int], ranked: bool = False
) -> list[TokenLogprob]:
    """logprobs: log-softmax rows [R, V]; tokens[r]: the token row r chose; ks[r]: how many top entries.
    `ranked`: each chosen token's rank in its row too (1 is the best; a tie counts against it, as vLLM ranks)."""
    index = torch.tensor(tokens, device=logprobs.device)[:, None]
    chosen_t = logprobs.gather(1, index)
    chosen = chosen_t.squeeze(1).tolist()
    ranks = (logprobs >= chosen_t).sum(dim=-1).tolist() if ranked else [None] * len(tokens)
    top_values, top_ids = logprobs.topk(max(ks), dim=-1)
    values, ids = top_values.tolist(), top_ids.tolist()
    return [
        TokenLogprob(c, list(zip(ids[r][:k], values[r][:k], strict=True)), rank)
        for r, (c, k, rank) in enumerate(zip(chosen, ks, ranks, strict=True))
    ]


PROMPT_LOGITS_ROWS = 256  # prompt logprobs: a prompt's rows go through the vocabulary this many at a time


def score_prompts(
    items: Sequence[ScheduledItem], hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, list[TokenLogprob]]:
    """vLLM's prompt logprobs, by request id: for each of an item's `prompt_logprob_positions` (their hidden
    states in `hidden`, in item order), the log-softmax of its logits at the prompt token that follows, that
    token's rank and the request's top k. In slices of PROMPT_LOGITS_ROWS rows, so a long prompt never holds its
    whole [tokens, vocab] logits at once."""
    scored: dict[str, list[TokenLogprob]] = {}
    at = 0
    for item in items:
        positions = item.prompt_logprob_positions
        for a in range(0, len(positions), PROMPT_LOGITS_ROWS):
            span = positions[a : a + PROMPT_LOGITS_ROWS]
            logprobs = torch.log_softmax(compute_logits(hidden[at + a : at + a + len(span)]), dim=-1)
            targets = [item.prompt_ids[p + 1] for p in span]
            k = item.params.prompt_logprobs or 0
            scored.setdefault(item.request_id, []).extend(token_logprobs(logprobs, targets, [k] * len(span), True))
        at += len(positions)
    return scored


TOP_K, TOP_P, PLAIN = 0, 1, 2  # a random row's path, by its own parameters
UNIFORM_BITS = 24  # exactly representable in float32, and below 1


def seeded_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, position)."""
    return (seed_for(seed, position) >> (63 - UNIFORM_BITS)) / (1 << UNIFORM_BITS)


def _path(params: SamplingParams) -> int:
    if params.top_k > 0:
        return TOP_K
    return TOP_P if params.top_p < 1 else PLAIN


def invert_cdf(probs: torch.Tensor, drop: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Per row, the index where the CDF of `probs` (with `drop` zeroed) first exceeds u times its total.
    The target is kept strictly below the total, so the index always has mass, even when u * total rounds
    up to it."""
    kept = probs if drop is None else probs.masked_fill(drop, 0.0)
    cdf = kept.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def draw_top_k(x: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor, u: torch.Tensor, top: int) -> torch.Tensor:
    """Rows with top_k: the `top` (>= every row's k) largest logits by topk (sorted, best first), each row
    cut to its k, top-p over the full softmax's probabilities of those (one O(vocab) pass, no sort).
    Exact ties at a row's k-th place may be broken differently than a full stable sort would."""
    ids = x.topk(min(top, x.shape[1]), dim=-1).indices
    probs = torch.softmax(x, dim=-1).gather(1, ids)
    ranks = torch.arange(ids.shape[1], device=x.device)[None, :]
    drop = (probs.cumsum(dim=-1) - probs > ps[:, None]) | (ranks >= ks[:, None])
    return ids.gather(1, invert_cdf(probs, drop, u)[:, None]).squeeze(1)


TOP_P_HEAD = 64  # the best tokens a top-p row first sorts; 16x as many until they hold more than top_p
TOP_P_MARGIN = 1e-4  # relative: the head's sum and the prefix sums of a sort round differently


def sorted_head(probs: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The start of one row's stable descending sort (ties by index), (probabilities, ids), long enough to
    hold every token top-p `p` can keep: every token at least as likely as the k-th best, for the first k
    whose tokens hold more than p; the whole row where none does. A token past such a head has more than p
    before it, so top-p drops it, and the head is the same prefix the full sort starts with."""
    k = TOP_P_HEAD
    while k < probs.shape[0]:
        ids = (probs >= probs.topk(k, sorted=False).values.min()).nonzero().squeeze(1)  # index order
        head = probs[ids]
        if float(head.sum()) > p * (1 + TOP_P_MARGIN):
            values, order = head.sort(descending=True, stable=True)
            return values, ids[order]
        k *= 16
    return probs.sort(descending=True, stable=True)


def draw_top_p(x: torch.Tensor, ps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows with top_p only: top-p keeps the smallest prefix of the stably sorted softmax whose mass
    reaches top_p (a token is dropped when the mass before it already does); the first token stays. Each
    row sorts only its head (`sorted_head`): a full sort of a vocabulary costs milliseconds on a CPU."""
    picks = []
    for row, p, v in zip(torch.softmax(x, dim=-1), ps, u, strict=True):
        probs, ids = sorted_head(row, float(p))
        drop = probs.cumsum(dim=-1) - probs > p
        picks.append(ids[invert_cdf(probs[None], drop[None], v[None])])
    return torch.cat(picks)


def draw_plain(x: torch.Tensor, temperatures: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Rows with neither filter: the softmax of x over its row's temperature, its CDF in vocabulary order, no
    sort; the argmax where the temperature is 0."""
    greedy = temperatures == 0
    drawn = invert_cdf(torch.softmax(x / torch.where(greedy, 1.0, temperatures)[:, None], dim=-1), None, u)
    return torch.where(greedy, x.argmax(dim=-1), drawn)


PlainDraw = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, temperatures, uniforms)


def draw_by_path(
    x: torch.Tensor,
    ks: torch.Tensor,
    ps: torch.Tensor,
    us: torch.Tensor,
    params: Sequence[SamplingParams],
    plain: PlainDraw = draw_plain,
) -> torch.Tensor:
    """Token ids for rows already ordered by path (`_path` of params[r]), each path on its own slice.
    `plain` draws the rows with neither filter (on the CPU, engine/model/cpu_kernels.py's kernel)."""
    paths = [_path(p) for p in params]
    picks = []
    for path in (TOP_K, TOP_P, PLAIN):
        a, b = bisect_left(paths, path), bisect_right(paths, path)
        if a == b:
            continue
        if path == TOP_K:
            picks.append(draw_top_k(x[a:b], ks[a:b], ps[a:b], us[a:b], max(p.top_k for p in params[a:b])))
        elif path == TOP_P:
            picks.append(draw_top_p(x[a:b], ps[a:b], us[a:b]))
        else:
            picks.append(plain(x[a:b], torch.ones_like(us[a:b]), us[a:b]))  # x is already over the temperature
    return torch.cat(picks)


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's first largest index, as torch's argmax gives it. On the CPU numpy's: torch's reduction over one
    row of a vocabulary takes about 20x as long, a few percent of a one-stream decode step."""
    if logits.device.type == "cpu":
        return logits.numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


class Sampler:
    def __init__(self, seed: int | None = None, plain: PlainDraw = draw_plain) -> None:
        self._plain = plain
        self._counts: dict[str, TokenCounts] = {}  # penalized requests' counts, by request id
        self._outputs: dict[str, list[int]] = {}  # bad-words requests' output so far, by request id
        self._disallowed: dict[str, torch.Tensor] = {}  # allow-list requests' masks, by request id
        self._random = random.Random(seed)  # for unseeded requests

    def _uniforms(self, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[float]:
        """One uniform per row: seeded rows from (seed, position), the others from this sampler's stream."""
        return [
            self._random.getrandbits(UNIFORM_BITS) / (1 << UNIFORM_BITS)
            if p.seed is None
            else seeded_uniform(p.seed, pos)
            for p, pos in zip(params, positions, strict=True)
        ]

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> list[int]:
        """logits: float32 [S, V]; positions[i]: where row i's sampled token will sit in its sequence."""
        rand = [i for i, p in enumerate(params) if not p.greedy and p.top_k != 1]
        if not rand:
            return argmax_rows(logits)
        if all(_path(params[i]) == PLAIN and not params[i].min_p for i in rand):
            return self._sample_whole_rows(logits, params, positions, rand)
        # random rows grouped by path on the host (stable: row order within a path), so each path takes a
        # contiguous slice and nothing waits on the device to learn a group's size
        rand.sort(key=lambda i: _path(params[i]))
        # the argmax, the row gather and the temperature each pass over [rows, vocab]: only where needed
        greedy = sorted(set(range(len(params))) - set(rand))
        out = torch.zeros(len(params), dtype=torch.long, device=logits.device)
        if greedy:
            out[greedy] = logits[greedy].argmax(dim=-1)
        chosen = [params[i] for i in rand]
        uniforms = self._uniforms(chosen, [positions[i] for i in rand])
        columns = [(i, p.temperature, p.top_k, p.top_p, u) for i, p, u in zip(rand, chosen, uniforms, strict=True)]
        table = torch.tensor(columns, dtype=torch.float64).to(logits.device)  # the one upload
        rows = table[:, 0].long()
        x = logits if rand == list(range(len(params))) else logits.index_select(0, rows)
        if any(p.temperature != 1 for p in chosen):  # x / 1 is x: skipping it changes no bit
            x = x / table[:, 1:2].float()
        if any(p.min_p for p in chosen):  # after the temperature, before top-k/top-p, as vLLM filters
            x = apply_min_p(x, [p.min_p for p in chosen])
        picks = draw_by_path(x, table[:, 2].long(), table[:, 3].float(), table[:, 4].float(), chosen, self._plain)
        return out.index_copy_(0, rows, picks).tolist()

    def _sample_whole_rows(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int], rand: list[int]
    ) -> list[int]:
        """Greedy rows and random rows with the temperature alone: the plain draw on the raw logits, two columns
        uploaded, no gather, division or table; the same tokens as the general path."""
        temperatures, uniforms = [0.0] * len(params), [0.0] * len(params)
        drawn = self._uniforms([params[i] for i in rand], [positions[i] for i in rand])
        for i, u in zip(rand, drawn, strict=True):
            temperatures[i], uniforms[i] = params[i].temperature, u
        columns = torch.tensor([temperatures, uniforms], dtype=torch.float32).to(logits.device)
        return self._plain(logits, columns[0], columns[1]).tolist()

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests' penalty counts."""
        for rid in request_ids:
            self._counts.pop(rid, None)
            self._outputs.pop(rid, None)
            self._disallowed.pop(rid, None)

    def sample_items(
        self, logits: torch.Tensor, items: Sequence[ScheduledItem], eos_token_ids: set[int]
    ) -> ModelOutput:
        """One step's sampling for `items` (row i of `logits` is items[i]'s next token): raw logprobs where
        asked for, EOS and stop ids masked under min_tokens, the logits controls, penalties, then the draw.
        Returns the tokens and, per row, its TokenLogprob (None where not asked for)."""
        params = [it.params for it in items]
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = torch.log_softmax(logits[wanted], dim=-1) if wanted else None
        under_min = [i for i, it in enumerate(items) if it.num_output < it.params.min_tokens]
        mask_tokens(logits, [(i, banned_under_min_tokens(params[i], eos_token_ids)) for i in under_min])
        constrained = [i for i, p in enumerate(params) if p.constrained]
        if constrained:
            self._constrain(logits, [(i, items[i]) for i in constrained])
        penalized = [(i, it.params, self._counts_of(it, logits)) for i, it in enumerate(items) if it.params.penalized]
        apply_penalties(logits, penalized)
        tokens = self.sample(logits, params, [it.start + it.num_tokens for it in items])
        for i, _, counts in penalized:
            counts.add(tokens[i])
        for i in constrained:
            if params[i].bad_words_token_ids:
                self._outputs[items[i].request_id].append(tokens[i])
        logprobs: list[TokenLogprob | None] = [None] * len(items)
        if raw is not None:
            chosen = token_logprobs(raw, [tokens[i] for i in wanted], [params[i].logprobs for i in wanted])
            for i, entry in zip(wanted, chosen, strict=True):
                logprobs[i] = entry
        return ModelOutput(tokens, logprobs if wanted else [])

    def _constrain(self, logits: torch.Tensor, rows: Sequence[tuple[int, ScheduledItem]]) -> None:
        """The allow-lists, bad words and logit biases of `rows` (row index, item), in place."""
        for row, item in rows:
            p = item.params
            if p.allowed_token_ids is not None:
                mask = self._disallowed.get(item.request_id)
                if mask is None:
                    mask = disallowed_mask(p.allowed_token_ids, logits.shape[1], logits.device)
                    self._disallowed[item.request_id] = mask
                logits[row].masked_fill_(mask, NEG_INF)
            if p.bad_words_token_ids:
                ban_bad_words(logits[row], p.bad_words_token_ids, self._output_of(item))
        add_logit_bias(logits, [(row, item.params.logit_bias) for row, item in rows if item.params.logit_bias])

    def _output_of(self, item: ScheduledItem) -> list[int]:
        """The request's output as this sampler drew it. Longer than the request's output: a new request under
        a finished one's id (see `_counts_of`): it starts over."""
        output = self._outputs.get(item.request_id)
        if output is None or len(output) > item.num_output:
            output = self._outputs[item.request_id] = []
        return output

    def _counts_of(self, item: ScheduledItem, logits: torch.Tensor) -> TokenCounts:
        counts = self._counts.get(item.request_id)
        # More counted than the request has output: a new request under the id of a finished one whose end
        # this sampler has not heard of yet (another engine on the same backend): it starts over.
        if counts is None or counts.num_counted > item.num_output:
            counts = self._counts[item.request_id] = TokenCounts(item.prompt_ids, logits.shape[1], logits.device)
        return counts


def banned_under_min_tokens(params: SamplingParams, eos_token_ids: set[int]) -> set[int]:
    """Tokens that would end a request before min_tokens: its stop ids, and EOS unless EOS is ignored."""
    banned = set(params.stop_token_ids)
    if not params.ignore_eos:
        banned |= eos_token_ids
    return banned
