"""Step latency of the twin: measured kernel tables plus engine-overhead terms fitted to the seed's
single-stream benchmark.

Why this shape: the kernel tables (vLLM 0.19 on this exact card and model) give the GPU time of every
op by batch shape; what they cannot give is the serving engine's own cost (CPU scheduling, launch gaps,
its less tuned prefill path). Those are a few fitted terms, each pinned by a row of the calibration table
(docs/twin.md). Everything is precomputed or a handful of bisects, so a step costs microseconds.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import NamedTuple

from engine.backends.twin.memo import LRUMemo
from engine.backends.twin.profile import Profile

US = 1e-6


def interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extended linearly past both ends by the end segments."""
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


def _bracket(axis: Sequence[int], x: float) -> tuple[int, int, float]:
    """Neighbouring grid indices and the weight of the upper one; below the grid clamps to its first point
    (kernel time is flat there: launch-bound), above it extrapolates along the last segment."""
    if x <= axis[0]:
        return 0, 0, 0.0
    i = min(bisect_right(axis, x) - 1, len(axis) - 2)
    return i, i + 1, (x - axis[i]) / (axis[i + 1] - axis[i])


def _bilinear(ax: Sequence[int], ay: Sequence[int], table: list[list[float]], x: float, y: float) -> float:
    i0, i1, wx = _bracket(ax, x)
    j0, j1, wy = _bracket(ay, y)
    r0, r1 = table[i0], table[i1]
    return (1 - wx) * ((1 - wy) * r0[j0] + wy * r0[j1]) + wx * ((1 - wy) * r1[j0] + wy * r1[j1])


class StepWork(NamedTuple):
    """What one step computes, in the units the latency model needs (built by the backend per step)."""

    prefills: tuple[tuple[int, int], ...] = ()  # (chunk tokens, tokens already in KV before the chunk)
    decode_seqs: int = 0
    decode_context: int = 0  # sum of the decodes' KV lengths (each including its new token)
    logits_rows: int = 0  # rows through lm_head (the seed: every prefill token plus every decode)
    sampled: int = 0  # rows through the sampler
    new_max_tokens: int = 0  # sum of max_tokens over requests whose first chunk runs this step

    @property
    def prefill_tokens(self) -> int:
        return sum(c for c, _ in self.prefills)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs


class LatencyModel:
    def __init__(self, profile: Profile) -> None:
        k = profile.kernels
        model, kern, over = profile.section("model"), profile.section("kernels"), profile.section("overhead")
        self.layers = int(model["layers"])
        # Dense ops: one decoder layer's ops (times their count per layer) x layers, plus the model-level
        # ops once, tabulated per token count up to the table's end; past it, GEMMs are compute-bound
        # (the table's largest already run at a steady rate per token), so time scales with tokens.
        layer_ops: dict[str, float] = kern["layer_ops"]
        model_ops: dict[str, float] = kern["model_ops"]
        grid = sorted(next(iter(k.dense.values())))
        self._dense_max = grid[-1]
        table = [0.0] * (self._dense_max + 1)
        self._tensor_parallel(profile)
        for op, mult in [*((o, m * self.layers) for o, m in layer_ops.items()), *model_ops.items()]:
            ys = [k.dense[op][t] for t in grid]
            mult *= self._shares.get(op, 1.0)
            for t in range(1, self._dense_max + 1):
                table[t] += mult * interp(grid, ys, t) * US
        self._dense = table
        # lm_head / sampler by rows; lm_head past the table is a compute-bound GEMM (linear in rows),
        # the sampler follows its last measured slope.
        self._rows: dict[str, list[float]] = {}
        for op, tab in k.per_sequence.items():
            xs = sorted(tab)
            ys = [tab[r] * US for r in xs]
            self._rows[op] = [0.0] + [interp(xs, ys, n) if n >= xs[0] else ys[0] for n in range(1, xs[-1] + 1)]
        # Attention grids (per layer, microseconds).
        attn = k.attention
        self._chunks = sorted({c for c, _, _, _ in attn if c > 0})
        self._kvp = sorted({p for c, p, _, _ in attn if c > 0})
        self._ndec_mixed = sorted({n for c, _, n, _ in attn if c > 0 and n > 0})
        self._ndec = sorted({n for c, _, n, _ in attn if c == 0})
        self._kvd = sorted({d for _, _, n, d in attn if n > 0})
        self._pre = [[attn[(c, p, 0, 0)] for p in self._kvp] for c in self._chunks]
        self._dec = [[attn[(0, 0, n, d)] for d in self._kvd] for n in self._ndec]
        self._mix = [
            [[[attn[(c, p, n, d)] for d in self._kvd] for n in self._ndec_mixed] for p in self._kvp]
            for c in self._chunks
        ]
        self._floor = attn[(self._chunks[0], 0, 0, 0)]  # one launch of the prefill kernel
        # Fitted engine overheads (see the profile for the fact that fixed each).
        self.step_s = float(over["step_ms"]) * 1e-3
        self._pre_x = [float(x) for x in over["prefill_knots_tokens"]]
        self._pre_y = [float(y) * 1e-3 for y in over["prefill_knots_ms"]]
        self.per_max_token_s = float(over["per_max_token_us"]) * US
        # per decode batch shape; bounded because a server may see every batch size up to its cap
        # CUDA graphs (profile [engine] cuda_graph_sizes): a decode-only step replays the smallest captured
        # graph that holds its batch, so its dense layers run at that padded size.
        self._graph_sizes = sorted(int(n) for n in profile.section("engine").get("cuda_graph_sizes", ()))
        self._dec_const: LRUMemo[tuple[int, int, int], tuple] = LRUMemo(4096)

    def _tensor_parallel(self, profile: Profile) -> None:
        """One rank's share of the work under tensor parallelism (a rank profile's [tensor_parallel] `size`,
        engine/backends/twin/tensor_parallel.py): hypotheses, documented in the profile. The sharded dense ops
        and attention run on 1/size of the weights and heads; a GEMM with half its output (or input) features
        moves half the weight bytes and does half the FLOPs, so it takes half the time in both regimes (the
        launch floor, tens of microseconds beside Llama-8B's ~50 us GEMMs, is not kept). Each step adds two
        ring all-reduces a layer of [tokens, hidden] activations over the link. One rank: nothing changes."""
        tp = profile.data.get("tensor_parallel", {})
        size = int(tp.get("size", 1))
        self._shares = {op: 1.0 / size for op in tp.get("sharded_ops", ())} if size > 1 else {}
        self._attn_share = 1.0 / size
        self._allreduces = 2 * self.layers if size > 1 else 0
        if self._allreduces:
            row = int(profile.section("model")["hidden"]) * int(tp["activation_bytes"])
            self._allreduce_s = float(tp["allreduce_latency_s"])
            self._allreduce_row_s = 2 * (size - 1) / size * row / float(tp["allreduce_bus_bytes_per_s"])

    def allreduce(self, tokens: int) -> float:
        """The step's all-reduces over `tokens` rows: latency plus the ring's bytes at the bus bandwidth."""
        if not self._allreduces:
            return 0.0
        return self._allreduces * (self._allreduce_s + tokens * self._allreduce_row_s)

    # -- kernels ---------------------------------------------------------------------------------
    def dense(self, tokens: int) -> float:
        if tokens <= self._dense_max:
            return self._dense[tokens]
        return self._dense[self._dense_max] * tokens / self._dense_max

    def graph_batch(self, n: int) -> int:
        """The batch a decode-only step of `n` sequences runs at: the smallest CUDA graph that holds it, or
        `n` itself (eager) past the largest graph or without graphs."""
        i = bisect_right(self._graph_sizes, n - 1)
        return self._graph_sizes[i] if i < len(self._graph_sizes) else n

    def rows(self, op: str, n: int) -> float:
        tab = self._rows[op]
        top = len(tab) - 1
        if n <= top:
            return tab[max(n, 0)]
        if op == "lm_head":
            return tab[top] * n / top
        return tab[top] + (tab[top] - tab[top - 1]) * (n - top)

    def _prefill_attn(self, chunk: int, kv: int) -> float:
        """One prefill chunk alone (us per layer). Chunks past the grid run as grid-sized pieces over a
        growing context: causal attention of a long chunk is exactly that sum of blocks."""
        top = self._chunks[-1]
        total = 0.0
        while chunk > top:
            total += _bilinear(self._chunks, self._kvp, self._pre, top, kv)
            chunk, kv = chunk - top, kv + top
        return total + _bilinear(self._chunks, self._kvp, self._pre, chunk, kv)

    def _decode_attn(self, n: int, kv: float) -> float:
        return _bilinear(self._ndec, self._kvd, self._dec, n, kv)

    def _mixed_attn(self, chunk: int, kvp: int, n: int, kvd: float) -> float:
        """One prefill chunk beside n decodes: vLLM runs them in one varlen kernel, in which a decode costs
        about what a prefill row over the same context does -- far more than the decode kernel."""
        top_n = self._ndec_mixed[-1]
        extra = 0.0
        if n > top_n:  # more decodes than the mixed grid: add the decode-only increment
            extra = self._decode_attn(n, kvd) - self._decode_attn(top_n, kvd)
            n = top_n
        ic = _bracket(self._chunks, chunk)
        ip = _bracket(self._kvp, kvp)
        i_n = _bracket(self._ndec_mixed, n)
        idd = _bracket(self._kvd, kvd)
        total = 0.0
        for a, wa in ((ic[0], 1 - ic[2]), (ic[1], ic[2])):
            for b, wb in ((ip[0], 1 - ip[2]), (ip[1], ip[2])):
                for c, wc in ((i_n[0], 1 - i_n[2]), (i_n[1], i_n[2])):
                    w = wa * wb * wc
                    if w:
                        row = self._mix[a][b][c]
                        total += w * ((1 - idd[2]) * row[idd[0]] + idd[2] * row[idd[1]])
        return total + extra

    def attention(self, work: StepWork) -> float:
        """All layers' attention for the step, in seconds. Several prefills share one kernel launch, so
        each one past the first adds its time minus the launch floor."""
        pre = sorted(work.prefills, reverse=True)
        n = work.decode_seqs
        kvd = work.decode_context / n if n else 0.0
        if not pre:
            us = self._decode_attn(n, kvd) if n else 0.0
        else:
            rest = sum(self._prefill_attn(c, p) - self._floor for c, p in pre[1:])
            chunk, kvp = pre[0]
            if n:
                top = self._chunks[-1]
                while chunk > top:  # the primary chunk's excess runs as prefill-only pieces
                    rest += self._prefill_attn(top, kvp) - self._floor
                    chunk, kvp = chunk - top, kvp + top
                us = self._mixed_attn(chunk, kvp, n, kvd) + rest
            else:
                us = self._prefill_attn(chunk, kvp) + rest
        return us * US * self.layers * self._attn_share

    # -- the step --------------------------------------------------------------------------------
    def kernel_time(self, work: StepWork) -> float:
        return (
            self.dense(work.tokens)
            + self.allreduce(work.tokens)
            + self.attention(work)
            + self.rows("lm_head", work.logits_rows)
            + self.rows("sampler", work.sampled)
        )

    def overhead(self, work: StepWork) -> float:
        t = self.step_s + self.per_max_token_s * work.new_max_tokens
        if work.prefills:
            t += max(0.0, interp(self._pre_x, self._pre_y, work.prefill_tokens))
        return t

    def step_time(self, work: StepWork) -> float:
        if not work.prefills:
            return self.decode_step_time(work.decode_seqs, work.decode_context, work.logits_rows, work.sampled)
        return self.kernel_time(work) + self.overhead(work)

    def decode_step_time(self, n: int, context: int, rows: int, sampled: int) -> float:
        """A decode-only step (the common case, kept cheap): same terms as step_time, with everything that
        depends only on the batch size cached."""
        const = self._dec_const.get((n, rows, sampled))
        if const is None:
            batch = self.graph_batch(n)
            dense = self.dense(batch) + self.allreduce(batch)
            const = (dense, _bracket(self._ndec, n), self.rows("lm_head", rows), self.rows("sampler", sampled))
            self._dec_const.put((n, rows, sampled), const)
        dense, (i0, i1, wx), lm, sm = const
        j0, j1, wy = _bracket(self._kvd, context / n)
        r0, r1 = self._dec[i0], self._dec[i1]
        attn = (1 - wx) * ((1 - wy) * r0[j0] + wy * r0[j1]) + wx * ((1 - wy) * r1[j0] + wy * r1[j1])
        return dense + attn * US * self.layers * self._attn_share + lm + sm + self.step_s


# -- fitting (offline; the results live in the profile) ---------------------------------------------
def single_stream_work(inp: int, out: int, logits_all_prompt_tokens: bool = True) -> tuple[StepWork, list[StepWork]]:
    """The steps of one request running alone: its prefill and its out-1 decodes."""
    prefill = StepWork(((inp, 0),), logits_rows=inp if logits_all_prompt_tokens else 1, sampled=1, new_max_tokens=out)
    decodes = [StepWork(decode_seqs=1, decode_context=inp + j + 1, logits_rows=1, sampled=1) for j in range(out - 1)]
    return prefill, decodes


def fit_overheads(profile: Profile) -> dict[str, object]:
    """Refit the [overhead] constants from the single-stream table (scipy, offline). TPOT fixes the per-step
    constant (mean residual over the 9 rows); mean TTFT fixes the prefill knots at the three prompt
    lengths and the max_tokens slope, by minimising the largest relative TTFT error (a small LP)."""
    from scipy.optimize import linprog

    model = LatencyModel(profile)
    rows = profile.section("calibration")["single_stream"]
    all_logits = bool(profile.section("engine")["logits_all_prompt_tokens"])
    resid, cases = [], []
    for r in rows:
        prefill, decodes = single_stream_work(r["input"], r["output"], all_logits)
        kern_dec = sum(model.kernel_time(w) for w in decodes) / len(decodes)
        resid.append(r["tpot_mean_ms"] * 1e-3 - kern_dec)
        cases.append((r["input"], r["output"], r["ttft_mean_ms"] * 1e-3, model.kernel_time(prefill)))
    step = sum(resid) / len(resid)
    knots = sorted({c[0] for c in cases})
    # variables: one prefill overhead per knot, the per-max-token slope, the max relative error e
    nv = len(knots) + 2
    a_ub, b_ub = [], []
    for inp, out, ttft, kern in cases:
        row = [0.0] * nv
        row[knots.index(inp)] = 1.0
        row[-2] = out
        base = kern + step
        a_ub.append([v / ttft for v in row[:-1]] + [-1.0])
        b_ub.append(1.0 - base / ttft)
        a_ub.append([-v / ttft for v in row[:-1]] + [-1.0])
        b_ub.append(base / ttft - 1.0)
    bounds = [(0, None)] * (nv - 1) + [(0, None)]
    res = linprog([0.0] * (nv - 1) + [1.0], A_ub=a_ub, b_ub=b_ub, bounds=bounds)
    if not res.success:
        raise RuntimeError(f"overhead fit failed: {res.message}")
    x = res.x
    return {
        "step_ms": round(step * 1e3, 4),
        "prefill_knots_tokens": [0, *knots],
        "prefill_knots_ms": [0.0, *(round(v * 1e3, 3) for v in x[: len(knots)])],
        "per_max_token_us": round(x[-2] * 1e6, 4),
        "max_rel_ttft_error": round(float(x[-1]), 4),
    }
