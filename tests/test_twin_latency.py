"""The twin's latency model: the kernel tables are read as measured, the fitted overheads are what the fit
procedure gives, the single-stream table is matched within 5 %, and the bench's decode fast path changes
nothing but wall time."""

from __future__ import annotations

import pytest

from bench.loadgen import TraceRequest, run_closed_loop, run_trace
from bench.report import metrics
from engine.backends.twin.backend import TwinBackend
from engine.backends.twin.latency import US, LatencyModel, StepWork, fit_overheads
from engine.backends.twin.profile import PROFILE_DIR, load_profile
from engine.baselines.seed import FixedPolicy, SeedStaticPolicy
from engine.core.llm_engine import LLMEngine

PROFILE = load_profile()
SINGLE_STREAM = PROFILE.section("calibration")["single_stream"]


@pytest.fixture(scope="module")
def model() -> LatencyModel:
    return LatencyModel(PROFILE)


def test_kernel_tables_ship_with_the_repo_and_stay_small():
    d = PROFILE_DIR / PROFILE.section("kernels")["dir"]
    files = {p.name for p in d.iterdir()}
    assert {"dense.csv", "attention.csv", "per_sequence.csv", "LICENSE-LLMServingSim"} <= files
    assert sum(p.stat().st_size for p in d.iterdir()) < 1_000_000


def test_tables_are_read_exactly_at_grid_points(model):
    k = PROFILE.kernels
    kern = PROFILE.section("kernels")
    for tokens in (1, 16, 256, 2048):
        layer = sum(m * k.dense[op][tokens] for op, m in kern["layer_ops"].items())
        once = sum(m * k.dense[op][tokens] for op, m in kern["model_ops"].items())
        assert model.dense(tokens) == pytest.approx((32 * layer + once) * US, rel=1e-12)
    assert model.rows("lm_head", 64) == pytest.approx(k.per_sequence["lm_head"][64] * US)
    # decode-only, prefill-only and mixed attention, x 32 layers
    assert model.attention(StepWork(decode_seqs=8, decode_context=8 * 1024)) == pytest.approx(
        32 * k.attention[(0, 0, 8, 1024)] * US
    )
    assert model.attention(StepWork(((512, 2048),))) == pytest.approx(32 * k.attention[(512, 2048, 0, 0)] * US)
    mixed = StepWork(((256, 1024),), decode_seqs=16, decode_context=16 * 4096)
    assert model.attention(mixed) == pytest.approx(32 * k.attention[(256, 1024, 16, 4096)] * US)


def test_extrapolation_is_physical(model):
    # Past the dense table (2048 tokens) GEMMs are compute-bound: time doubles with tokens.
    assert model.dense(4096) == pytest.approx(2 * model.dense(2048))
    # lm_head over 4096 prompt rows: 4096 x 4096 x 128256 x 2 FLOP at ~165 TFLOPS is ~26 ms.
    assert 0.024 < model.rows("lm_head", 4096) < 0.029
    # A 4096-token chunk is two 2048 chunks, the second over the first's KV.
    a = PROFILE.kernels.attention
    want = (a[(2048, 0, 0, 0)] + a[(2048, 2048, 0, 0)]) * 32 * US
    assert model.attention(StepWork(((4096, 0),))) == pytest.approx(want)
    # Monotone in every direction a scheduler can push.
    assert model.step_time(StepWork(((300, 0),), logits_rows=300, sampled=1)) < model.step_time(
        StepWork(((600, 0),), logits_rows=600, sampled=1)
    )
    d = [model.decode_step_time(n, n * 3000, n, n) for n in (1, 8, 64, 256, 300)]
    assert d == sorted(d)


def test_stored_overheads_are_the_fit():
    pytest.importorskip("scipy")
    fit = fit_overheads(PROFILE)
    over = PROFILE.section("overhead")
    assert fit["step_ms"] == pytest.approx(over["step_ms"], abs=1e-3)
    assert fit["prefill_knots_tokens"] == over["prefill_knots_tokens"]
    assert fit["prefill_knots_ms"] == pytest.approx(over["prefill_knots_ms"], abs=1e-2)
    assert fit["per_max_token_us"] == pytest.approx(over["per_max_token_us"], abs=1e-3)
    assert fit["max_rel_ttft_error"] < 0.05


def single_stream(inp: int, out: int, n: int = 3) -> dict:
    engine = LLMEngine(TwinBackend(num_blocks=64, sensors="ideal"), SeedStaticPolicy())  # the facts' own
    return metrics(run_closed_loop(engine, 1, n, inp, out))


@pytest.mark.parametrize("row", SINGLE_STREAM, ids=lambda r: f"{r['input']}x{r['output']}")
def test_single_stream_matches_calibration_within_5_percent(row):
    # At concurrency 1 every request is identical, so 3 requests give the same means as the seed's 20.
    m = single_stream(row["input"], row["output"])
    assert m["completed"] == 3 and m["failed"] == 0
    assert m["mean_ttft_ms"] == pytest.approx(row["ttft_mean_ms"], rel=0.05)
    assert m["mean_tpot_ms"] == pytest.approx(row["tpot_mean_ms"], rel=0.05)
    assert m["output_throughput"] == pytest.approx(row["out_tps"], rel=0.05)
    assert m["total_token_throughput"] == pytest.approx(row["total_tps"], rel=0.05)


def _token_times(fast: bool, policy_factory, driver) -> list[tuple[str, list[float], list[int]]]:
    run_fn, block_size, num_blocks, _ = driver
    engine = LLMEngine(TwinBackend(num_blocks=num_blocks, block_size=block_size), policy_factory())
    run = run_fn(engine, fast)
    assert run.sequences and engine.scheduler.num_preemptions >= driver[3]
    return sorted((s.request_id, s.token_times, s.output_ids) for s in run.sequences)


TRACE = [TraceRequest(100 + 37 * i % 900, 40 + 13 * i % 300, 0.05 * i) for i in range(40)]


@pytest.mark.parametrize(
    "policy_factory,driver",
    [
        (SeedStaticPolicy, (lambda e, f: run_closed_loop(e, 16, 40, 256, 300, fast=f), 256, 64, 0)),
        (SeedStaticPolicy, (lambda e, f: run_closed_loop(e, 4, 10, 4096, 200, fast=f), 256, 64, 0)),
        # vLLM-like: block 16, chunked prefill, mixed steps, preemption by recompute, open-loop arrivals
        (
            lambda: FixedPolicy(
                max_num_seqs=32, max_batched_tokens=512, kv_reserve_ratio=0.0, allow_mixed=True, prefill_first=False
            ),
            (lambda e, f: run_trace(e, TRACE, fast=f), 16, 128, 1),
        ),
    ],
)
def test_decode_fast_path_is_exact(policy_factory, driver):
    assert _token_times(True, policy_factory, driver) == _token_times(False, policy_factory, driver)


def test_realtime_paces_steps_in_wall_time():
    import time

    engine = LLMEngine(TwinBackend(num_blocks=64, realtime=True), SeedStaticPolicy())
    from engine.core.sampling_params import SamplingParams

    engine.add_request("r", [5] * 32, SamplingParams(max_tokens=3, ignore_eos=True))
    t = time.monotonic()
    while engine.has_unfinished():
        engine.step()
    # prefill (~30 ms) + 2 decodes (~17.6 ms each)
    assert time.monotonic() - t >= 0.06
