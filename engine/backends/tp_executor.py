"""Tensor parallelism on the torch backend: the driver, rank 0 of the group, behind the Backend protocol.

As vLLM's executor does, the driver holds the scheduler, the controller and the sampler, and sends each step's
batch to every other rank (engine/backends/tp_worker.py, one spawned process each); every rank then runs its
shard of the forward (engine/model/tensor_parallel.py), the all-reduces keep them in step, and only the driver
computes logits and samples. Each rank measures its own step with its own probe; RankProbes
(engine/backends/rank_probes.py) hands the engine every rank's sample and their tightest-rank combination.

Faults: an OOM on any rank fails the step on every rank (each finishes the step's all-reduces,
engine/backends/tp_collectives.py, and says whether it ran out) and the driver raises torch.OutOfMemoryError,
which the engine recovers as on one device: nothing advanced, the step's requests run again under backed-off
limits. A rank that dies (its pipe closes, its process exits while the driver waits for a collective, or a
collective fails or outlasts the group's timeout) raises RankDiedError, an EngineDeadError: the engine stops,
and the server answers 503.
"""

from __future__ import annotations

import multiprocessing as mp
import weakref
from contextlib import suppress
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from engine.backends.rank_probes import RankProbes
from engine.backends.torch_backend import TorchBackend
from engine.backends.tp_collectives import COLLECTIVE_TIMEOUT, make_group
from engine.backends.tp_worker import STORE_TIMEOUT, WorkerSpec, rank_backend, rank_kwargs, rank_sample, worker_main
from engine.backends.warm_up import run_warm_up
from engine.core.backend import ForwardingBackend
from engine.core.batch import EMPTY, ModelOutput, SchedulerOutput
from engine.core.kv.blocks import ResizePlan
from engine.core.llm_engine import EngineDeadError
from telemetry.record import RankSample

STOP_WAIT_S = 10.0  # how long a stopped worker may take to exit before it is killed


class RankDiedError(EngineDeadError):
    """A tensor-parallel rank is gone: the group cannot compute another step."""


class TensorParallelBackend(ForwardingBackend):
    """The driver's backend (`inner`) for everything the group shares: the tokenizer, the pool's block size, the
    sampler's seconds, ...; the step, the pool's resizes and the warm-up on every rank. No swap: a rank's host
    copy would need every rank's blocks."""

    can_swap = False
    inner: TorchBackend

    def __init__(
        self,
        size: int,
        backend_kwargs: dict[str, Any],
        oom_rank: int | None = None,
        oom_rate: float = 0.0,
        collective_timeout: timedelta = COLLECTIVE_TIMEOUT,
    ):
        """`size` ranks of TorchBackend(**backend_kwargs), the model given as a spec each rank loads. oom_rank and
        oom_rate: a test hook that fails that share of one rank's forwards with an OOM (StepCollectives).
        collective_timeout: how long a collective may wait for a peer that hangs (tp_collectives)."""
        self.size = size
        rate = {r: oom_rate if r == oom_rank else 0.0 for r in range(size)}
        self._threads = torch.get_num_threads()  # the driver takes its share of the cores; close() restores
        # the driver's shard first: a size the model cannot take is refused before any process starts
        inner, self._collectives = rank_backend(0, size, rank_kwargs(backend_kwargs, 0), rate[0], collective_timeout)
        super().__init__(inner)
        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=STORE_TIMEOUT, wait_for_workers=False)
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self.dead: str | None = None
        self._ranks = [rank_sample(0, self.inner)] * size  # the workers' come with their first answers
        self._stopper = weakref.finalize(self, _stop, self._conns, self._procs)
        for rank in range(1, size):
            # every rank holds the driver's pool: the same blocks, of the same size
            kwargs = {**rank_kwargs(backend_kwargs, rank), "num_blocks": self.inner.num_blocks}
            kwargs["block_size"] = self.inner.block_size
            self._start(WorkerSpec(rank, size, store.port, kwargs, rate[rank], collective_timeout))
        self._collectives.lost = self._exited
        try:
            self._gather()  # every worker loaded: the group's rendezvous is then a matter of milliseconds
            self._collectives.group = make_group(store, 0, size, self.inner.device, collective_timeout)
            self._gather()
        except BaseException:
            self.close()
            raise
        self._probe = RankProbes([self.inner.probe], self.rank_samples)

    @property
    def probe(self) -> RankProbes:
        return self._probe

    def _start(self, spec: WorkerSpec) -> None:
        context = mp.get_context("spawn")  # a fork would copy the driver's threads and OpenMP state
        ours, theirs = context.Pipe()
        proc = context.Process(target=worker_main, args=(spec, theirs), daemon=True, name=f"headroom-tp{spec.rank}")
        proc.start()
        theirs.close()
        self._conns.append(ours)
        self._procs.append(proc)

    def rank_samples(self) -> list[RankSample]:
        """Every rank's sample, by rank: the driver's read now, the workers' from their last answers."""
        self._ranks[0] = rank_sample(0, self.inner)
        return list(self._ranks)

    @torch.inference_mode()
    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """The step on every rank: the batch to the workers, the driver's own shard and the sampling, then the
        step's collectives finished everywhere. Raises torch.OutOfMemoryError when any rank ran out."""
        items = [it._replace(prompt_ids=()) for it in batch.items]  # the workers never read the prompt
        tokens = sum(it.num_tokens for it in items)
        self._send(("execute", items, tokens))
        collectives, failed, result = self._collectives, False, EMPTY
        collectives.begin(tokens)
        try:
            result = self.inner.execute(batch)
        except torch.OutOfMemoryError:
            failed = True
        except RuntimeError as e:  # a collective whose peer is gone
            raise self._died(f"a collective failed: {e}") from e
        try:
            collectives.finish(self.inner.model.dtype, self.inner.device)
        except RuntimeError as e:
            raise self._died(f"a collective failed: {e}") from e
        failed_ranks = [0] if failed else []
        failed_ranks += [rank for rank, (_, _, oom) in enumerate(self._gather(), 1) if oom]
        if failed_ranks:
            raise torch.OutOfMemoryError(f"tensor parallel: rank(s) {failed_ranks} ran out of memory in the step")
        return result

    def resize_kv(self, plan: ResizePlan) -> float:
        """Every rank's KV shard to the plan's size; returns the driver's seconds. Where a rank cannot grow, the
        ranks that did are shrunk back (a shrink never needs more memory than it frees), so that every rank
        holds the same blocks, and torch.OutOfMemoryError is raised with the pool as it was, as on one device."""
        self._send(("resize", plan))
        seconds, failed = 0.0, False
        try:
            seconds = self.inner.resize_kv(plan)
        except torch.OutOfMemoryError:
            failed = True
        replies = self._gather()
        if not failed and not any(oom for _, _, oom in replies):
            self._ranks[0] = rank_sample(0, self.inner)
            return seconds
        back = ResizePlan(plan.old_num_blocks, plan.num_blocks)
        if not failed:
            self.inner.resize_kv(back)
        grown = [rank for rank, (_, _, oom) in enumerate(replies, 1) if not oom]
        self._send(("resize", back), grown)
        self._gather(grown)
        raise torch.OutOfMemoryError("tensor parallel: a rank could not grow its KV shard")

    def warm_up(self) -> float:
        """Through this backend's execute, so that every rank warms up."""
        return run_warm_up(self)

    def close(self) -> None:
        """Stop the workers (at most STOP_WAIT_S each, then killed), and give the process its threads back."""
        self._stopper()
        torch.set_num_threads(self._threads)

    def _send(self, message: tuple[Any, ...], ranks: list[int] | None = None) -> None:
        """To every worker, or to `ranks`."""
        if self.dead is not None:
            raise RankDiedError(self.dead)
        for rank in range(1, self.size) if ranks is None else ranks:
            try:
                self._conns[rank - 1].send(message)
            except (BrokenPipeError, ConnectionError, EOFError) as e:
                raise self._died(f"rank {rank} is gone ({type(e).__name__})") from e

    def _gather(self, ranks: list[int] | None = None) -> list[tuple[str, RankSample, bool]]:
        """Each worker's answer (or those of `ranks`), in rank order; their samples become the ranks' last ones."""
        replies = []
        for rank in range(1, self.size) if ranks is None else ranks:
            try:
                reply = self._conns[rank - 1].recv()
            except (EOFError, ConnectionError) as e:
                raise self._died(f"rank {rank} is gone ({type(e).__name__})") from e
            if reply[0] == "error":
                raise self._died(reply[1])
            replies.append(reply)
            self._ranks[rank] = reply[1]
        return replies

    def _exited(self) -> str | None:
        """A worker whose process has exited, which no collective will ever hear from again."""
        for rank, proc in enumerate(self._procs, 1):
            if not proc.is_alive():
                return f"rank {rank} exited (code {proc.exitcode})"
        return None

    def _died(self, why: str) -> RankDiedError:
        """The group is finished: the workers are killed and every later call raises at once. Killed, not
        asked to stop: a worker of a lost group may be stuck in a collective for its whole timeout, and the
        caller's 503 would wait STOP_WAIT_S on each."""
        self.dead = f"tensor parallel group lost: {why}"
        for proc in self._procs:
            proc.kill()
        self.close()
        return RankDiedError(self.dead)


def _stop(conns: list[Connection], procs: list[Any]) -> None:
    for conn in conns:
        with suppress(BrokenPipeError, ConnectionError, EOFError, OSError):
            conn.send(("stop",))
    for proc in procs:
        proc.join(STOP_WAIT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
