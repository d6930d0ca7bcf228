"""The engine step loop: schedule under the policy's limits, run the backend under a memory probe, feed the
measured record back, and finish requests."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from controller.policy import Policy, PoolResize
from engine.core.backend import Backend
from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.decode_burst import burst_sequences, run_burst
from engine.core.kv.blocks import BlockAllocator, ResizePlan
from engine.core.kv.prefix_cache import PrefixCache
from engine.core.outputs import EngineOutput
from engine.core.sampling_params import ParamError, SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.stats import EngineStats, FinishedRequest
from telemetry.phases import PhaseTimer
from telemetry.record import StepRecord


def default_max_tokens(prompt_len: int, max_model_len: int, pool_tokens: int) -> int:
    """max_tokens=None, for the offline API and the server alike: up to the context, but never more than
    the whole KV pool holds (a small pool, the twin's, would otherwise reject every such request). At least
    1, so a prompt too long for either is rejected by the check that says why."""
    return max(1, min(max_model_len, pool_tokens) - prompt_len)


class RequestError(ValueError):
    """A request the engine can never serve; the API answers 400 with `param`."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine stopped (`healthy` False): a baseline's worker died on an OOM, as the seed engine's did."""


class _PromptLogprobsPrefixCache(PrefixCache):
    """vLLM's rule for prompt logprobs: a request that asks for them reads nothing from the prefix cache, since
    a prompt token's logprobs need its row's logits, which a cache hit never computes. Its blocks are still
    cached for the requests after it."""

    def match(self, seq: Sequence) -> list[int]:
        return [] if seq.params.prompt_logprobs is not None else super().match(seq)


class LLMEngine:
    def __init__(self, backend: Backend, policy: Policy, enable_prefix_caching: bool = True) -> None:
        """A baseline policy (engine/baselines/) brings its engine's rules: `policy.scheduler_class` packs the
        steps and `policy.on_oom()` may stop the engine on an OOM instead of recovering."""
        self.backend = backend
        self.policy = policy
        self.allocator = BlockAllocator(backend.num_blocks, backend.block_size)
        self.prefix_cache = _PromptLogprobsPrefixCache(self.allocator) if enable_prefix_caching else None
        scheduler_class: type[Scheduler] = policy.scheduler_class or Scheduler
        self.scheduler = scheduler_class(self.allocator, policy, self.prefix_cache, can_swap=backend.can_swap)
        self.stop_reason: str | None = None  # why the policy stopped the engine on an OOM (OomDecision)
        self.healthy = True
        self._steps = 0
        self.ooms = 0
        self.ooms_recovered = 0
        self.step_listeners: list[Callable[[StepRecord, SchedulerOutput], None]] = []
        self.finish_listeners: list[Callable[[FinishedRequest], None]] = []
        self._phases = PhaseTimer()
        self._sampler_seconds = 0.0  # the backend's sampler_seconds at the last step
        self._last_batch: SchedulerOutput | None = None  # the last step's, while nothing since changed the schedule

    @property
    def requests(self) -> dict[str, Sequence]:
        """Every unfinished request, by id: the scheduler's registry, the one place a request is listed."""
        return self.scheduler.requests

    @property
    def max_model_len(self) -> int:
        return self.backend.max_model_len

    @property
    def step_id(self) -> int:
        """Steps run so far: the last step record's id."""
        return self._steps

    def now(self) -> float:
        """The backend's clock: wall time, or the twin's virtual time."""
        return self.backend.now()

    def advance_to(self, t: float) -> None:
        """Let the idle device wait until `t` on its clock (an open-loop load's next arrival)."""
        self.backend.advance_to(t)

    def stats(self) -> EngineStats:
        """The engine's counters and gauges now; read on the thread that steps it."""
        sched, alloc, cache = self.scheduler, self.allocator, self.prefix_cache
        return EngineStats(
            healthy=self.healthy,
            steps=self._steps,
            ooms=self.ooms,
            ooms_recovered=self.ooms_recovered,
            preemptions=sched.num_preemptions,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            kv_blocks_used=alloc.num_used,
            kv_blocks_free=alloc.num_free,
            kv_blocks_total=alloc.num_blocks,
            block_size=alloc.block_size,
            max_model_len=self.max_model_len,
            prefix_cache_queries=cache.queries if cache else 0,
            prefix_cache_hits=cache.hits if cache else 0,
        )

    def phase_totals(self) -> dict[str, float]:
        """The steps' seconds by phase since the start (telemetry/phases.py); safe to call from any thread."""
        return self._phases.totals()

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        output_ids: list[int] | tuple[int, ...] = (),
    ) -> Sequence:
        """`output_ids`: what the request already produced on a replica that died (its stream is resumed here).
        They are prefilled with the prompt, as after a preemption by recompute, and sampling goes on at their
        positions: a seeded request draws what it would have drawn there, a greedy one picks what it would have."""
        if not self.healthy:
            raise EngineDeadError("engine is unhealthy after an unrecovered OOM")
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}")
        seq = Sequence(
            request_id,
            tuple(prompt_ids),
            params,
            max_tokens=self._check(prompt_ids, params, len(output_ids)),
            arrival_time=self.backend.now() if arrival_time is None else arrival_time,
            output_ids=list(output_ids),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else [],  # the first token has none
        )
        self.scheduler.add(seq)
        self._last_batch = None  # the next step packs it: no decode burst before
        return seq

    def _check(self, prompt_ids: list[int], params: SamplingParams, produced: int = 0) -> int:
        """Validate at arrival and resolve max_tokens. Like vLLM, a request whose prompt plus max_tokens
        exceeds the context is rejected (400) rather than silently truncated; max_tokens=None resolves by
        `default_max_tokens`, the one rule the offline API and the server share."""
        try:
            params.validate(self.backend.vocab_size)
        except ParamError as e:
            raise RequestError(str(e), e.param) from e
        n, ctx = len(prompt_ids), self.max_model_len
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        if n >= ctx:
            raise RequestError(
                f"This model's maximum context length is {ctx} tokens. However, your prompt has {n} tokens.",
                "prompt",
                "context_length_exceeded",
            )
        alloc = self.allocator
        # what a request may hold of the pool: a scheduler that reserves slots beyond a request's tokens
        # could never admit one that fills the pool without them
        pool_tokens = alloc.num_blocks * alloc.block_size - self.scheduler.reserve_slack
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = default_max_tokens(n, ctx, pool_tokens)
        if n + max_tokens > ctx:
            raise RequestError(
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion).",
                "max_tokens",
                "context_length_exceeded",
            )
        if params.min_tokens > max_tokens:  # only when max_tokens is None: validate() checked the rest
            raise RequestError(
                f"min_tokens ({params.min_tokens}) exceeds the {max_tokens} tokens the context leaves", "min_tokens"
            )
        if produced >= max_tokens:
            raise RequestError(f"resumed with {produced} tokens of the {max_tokens} it may make", "resume")
        if n + max_tokens > pool_tokens:
            raise RequestError(
                f"prompt plus max_tokens ({n + max_tokens} tokens) exceeds the whole KV cache ({pool_tokens} tokens)",
                "max_tokens",
            )
        if reason := self.policy.reject_reason(n, max_tokens):
            raise RequestError(reason, "prompt", "too_long_for_memory")
        return max_tokens

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request from outside the step: the client went away ("abort"), or the front end found a
        stop string in its text ("stop"). Its KV blocks are free for the next step."""
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self._finish(seq, reason)
            self._last_batch = None

    def resize_kv_pool(self, target: int) -> ResizePlan | None:
        """Resize the KV pool to `target` blocks between steps; returns the plan carried out, or None when
        the size stays. Never below the blocks in use (in-use blocks above the new size are moved, see
        engine/core/kv/blocks.py) nor below the largest admitted request's prompt + max_tokens, so every request
        can still finish. Raises torch.OutOfMemoryError, nothing changed, when the backend cannot."""
        alloc = self.allocator
        plan = alloc.plan_resize(max(target, self._longest_request_blocks()))
        if plan.num_blocks == alloc.num_blocks:
            return None
        self.backend.resize_kv(plan)
        alloc.apply(plan)
        if plan.moves:
            for seq in self.scheduler.running:
                seq.block_table = [plan.moves.get(b, b) for b in seq.block_table]
        return plan

    def _longest_request_blocks(self) -> int:
        """The blocks the largest admitted request's prompt + max_tokens need: the pool never goes below."""
        return max((self.allocator.blocks_for(s.prompt_len + s.max_tokens) for s in self.requests.values()), default=1)

    def _follow_pool_target(self) -> None:
        """Resize the pool where the policy asks (only a policy that sizes the pool ever does), before the
        step is packed: a shrink for memory another process took lands before the step that would OOM.

        A shrink gives back free blocks first. Only when the policy says the pool must reach a size below
        the blocks in use (memory is short by more than the free blocks and the prefill reserve hold) are
        running sequences preempted by recompute, newest first, until their blocks fit it: the last resort,
        since the alternative is steps that OOM."""
        target = self.policy.kv_pool_target(self.backend.probe.sample())
        old = self.allocator.num_blocks
        if target is None or target.num_blocks == old:
            return
        preempted = 0
        must = target.must_reach
        if must is not None and must < self.allocator.num_used:
            preempted = len(self.scheduler.preempt_newest(max(must, self._longest_request_blocks())))
        try:
            self.resize_kv_pool(target.num_blocks)
        except torch.OutOfMemoryError as e:
            self.backend.recover_from_oom()
            self.policy.observe_pool(PoolResize(target, old, old, str(e), preempted))
            return
        self.policy.observe_pool(PoolResize(target, old, self.allocator.num_blocks, preempted=preempted))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """Run one engine step; returns an output for each request that got a token or finished in it. A
        backend that can never run another step (a tensor-parallel rank died, in the step or in a pool resize)
        raises EngineDeadError, and the engine is unhealthy from then on."""
        try:
            return self._step()
        except EngineDeadError:
            self.healthy = False
            raise

    def decode_burst(self, until: float = float("inf")) -> int:
        """Repeat the last step's decodes without the scheduler while nothing can change the schedule, each step
        the backend's own (Backend.decode_step) and starting before `until`; returns the steps run, 0 when the next
        step must be `step()`'s. For load generators in virtual time: a burst records no step, feeds the policy
        nothing and finishes no request (engine/core/decode_burst.py says why that is exact)."""
        batch = self._last_batch
        if batch is None or not self.healthy or self.step_listeners or not self.policy.feedback_free:
            return 0
        seqs = burst_sequences(batch, self.scheduler)
        done = 0 if seqs is None else run_burst(seqs, self.scheduler, self.backend, until)
        self._steps += done
        return done

    def _step(self) -> list[EngineOutput]:
        phases, self._last_batch = self._phases, None
        with phases.span("schedule"):  # KV swaps included: they move blocks for the step being packed
            self._follow_pool_target()
            batch = self.scheduler.schedule()
            if batch.swap_out or batch.swap_in:  # before the step and outside it: an OOM there must not skip them
                self.backend.swap(batch.swap_out, batch.swap_in)
        if not batch.items:
            return []
        self.backend.prepare(batch)
        start = self.backend.now()
        oom = False
        wall = time.perf_counter()
        try:
            with self.backend.probe.step(batch.shape):
                result = self.backend.execute(batch)
        except torch.OutOfMemoryError:
            oom = True
            self.ooms += 1
            self.backend.recover_from_oom()
        now = self.backend.now()
        self._time_execute(time.perf_counter() - wall)
        with phases.span("detokenize_stream"):
            outputs = self._advance(batch, result, now) if not oom else self._on_oom()
        with phases.span("telemetry"):
            record = self._record(batch, start, now - start, oom)  # KV and queue counts as the step leaves them
        with phases.span("controller"):
            self.policy.observe(record, batch.cuts)
        with phases.span("telemetry"):
            for listener in self.step_listeners:
                listener(record, batch)
        self._last_batch = batch
        return outputs

    def _time_execute(self, seconds: float) -> None:
        """Split the backend's execute into forward and sampler by the sampler seconds it reports."""
        total = self.backend.sampler_seconds
        sampler, self._sampler_seconds = total - self._sampler_seconds, total
        self._phases.add("sampler", sampler)
        self._phases.add("forward", seconds - sampler)

    def _advance(self, batch: SchedulerOutput, result: ModelOutput, now: float) -> list[EngineOutput]:
        logprobs_of = iter(result.logprobs)
        outputs = []
        for seq, item in self.scheduler.update(batch, result):
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            if result.prompt_logprobs and (scored := result.prompt_logprobs.get(item.request_id)):
                seq.record_prompt_logprobs(item.start + 1, scored)
            if item.sample:
                logprob = next(logprobs_of, None)  # the model output's, for this sampled item
                if logprob is not None:
                    seq.output_logprobs.append(logprob)
                seq.token_times.append(now)
                if seq.first_token_time is None:
                    seq.first_token_time = now
                # a grammar that can take no more token ends the request, whatever the length and EOS rules say
                reason = "stop" if item.request_id in result.structured_done else self._stop_reason(seq)
                if reason is not None:
                    self._finish(seq, reason)
                logprobs = [logprob] if logprob is not None else []
                out = EngineOutput(seq.request_id, [seq.output_ids[-1]], logprobs, reason)
                if seq.params.prompt_logprobs is not None and len(seq.output_ids) == 1:  # with the first token
                    out = replace(out, prompt_logprobs=list(seq.prompt_logprobs), prompt_token_ids=seq.prompt_ids)
                outputs.append(out)
        return outputs

    def _on_oom(self) -> list[EngineOutput]:
        """Nothing advanced, so by default the step's work simply runs again under the backed-off limits. A
        policy may stop the engine instead (a baseline's worker dies): every request fails, new ones are
        refused."""
        decision = self.policy.on_oom()
        if decision.stop is None:
            self.ooms_recovered += 1
            return []
        self.healthy = False
        self.stop_reason = decision.stop
        failed = [*self.scheduler.running, *self.scheduler.waiting]
        for seq in failed:
            self.abort(seq.request_id, "error")
        return [EngineOutput(seq.request_id, [], finish_reason="error") for seq in failed]

    def _stop_reason(self, seq: Sequence) -> str | None:
        """vLLM's engine-core stop checks, on tokens only and in its order: nothing under min_tokens (at most
        max_tokens, checked at arrival); EOS unless ignored; a stop token id; then the length cap. Stop
        strings are text: the front end's output processor finds them (engine/frontend/)."""
        params, token, n_out = seq.params, seq.output_ids[-1], len(seq.output_ids)
        if n_out < params.min_tokens:
            return None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.backend.eos_token_ids):
            return "stop"
        if n_out >= seq.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self.policy.observe_finished(len(seq.output_ids), seq.max_tokens, reason)
        if self.finish_listeners:
            record = FinishedRequest.of(seq)
            for listener in self.finish_listeners:
                listener(record)

    def _record(self, batch: SchedulerOutput, start: float, duration: float, oom: bool) -> StepRecord:
        self._steps += 1
        sched = self.scheduler
        return StepRecord(
            step_id=self._steps,
            time=start,
            duration=duration,
            shape=batch.shape,
            memory=self.backend.probe.sample(),
            kv_blocks_used=self.allocator.num_used,
            kv_blocks_free=self.allocator.num_free,
            kv_blocks_owed=sched.blocks_owed(),
            kv_blocks_total=self.allocator.num_blocks,
            oom=oom,
            preempted=len(batch.preempted),
            prefix_cache_queries=batch.prefix_queries,
            prefix_cache_hits=batch.prefix_hits,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            limits=self.policy.limits().as_dict(),
            ranks=self.backend.rank_samples(),
        )
