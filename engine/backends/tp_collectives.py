"""One rank's collectives for a step, counted so that a rank whose forward failed still meets its peers.

Every rank of a step runs the same sequence of all-reduces (two a layer: engine/model/tensor_parallel.py).
A rank whose forward runs out of memory part way would leave the others blocked in the next all-reduce it
never joins. So after its forward, passed or failed, each rank `finish`es the step: it runs the all-reduces
its forward skipped, over zeros. The failed step's result is discarded on every rank: each worker tells the
driver whether its forward ran out (engine/backends/tp_worker.py), and the driver, which alone keeps state
between steps, recovers the step for all of them (engine/backends/tp_executor.py). No flag needs reducing.

A peer that dies or hangs must fail the step, not block it. On gloo `work.wait()` blocks the host and fails
when a peer's sockets close or the group's timeout passes. On NCCL it only makes the current stream wait: the
all-reduce spins on the GPU for a peer that never comes, and the host, free to run on, blocks in the first
read of the step's result (a CUDA synchronize no timeout reaches), or sooner, once a dead peer's stalled stream
fills CUDA's launch queue. So every rank also waits on the host (`_settle`), polling for completion against
the group's timeout and, on the driver, for a worker process that has exited. It waits for each all-reduce
when it issues the next one, and for the step's last at once: the host stays within one all-reduce of the
stream (it still queues the kernels up to the next one, half a layer, which keeps the GPU fed), and nothing of
the step is read back before every all-reduce of it has completed.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

# How long one all-reduce may wait for its peers before the group is lost. A live peer is late by its lag
# behind the slowest rank of a step: a long prefill chunk (seconds on a large model), a first CUDA step (cuBLAS
# and attention kernels loading), a rank descheduled on a busy host. A minute is over ten times the longest of
# those, and short enough that a client gets its 503 before it gives up waiting. It only bounds a rank that
# hangs while alive: one that exits is found at once (gloo: its sockets close; NCCL: the driver watches the
# processes). TensorParallelBackend(collective_timeout=...) overrides it for a group.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
# The host's polls of an all-reduce it waits for: a first pause of 20 us (a decode step's all-reduce is done
# in tens of microseconds), doubled up to 200 us, which is then the most a completed step waits to be seen.
FIRST_PAUSE_S, LAST_PAUSE_S = 20e-6, 200e-6


class GroupLost(RuntimeError):
    """An all-reduce that will not complete: a peer exited, or the group's timeout passed."""


def make_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta = COLLECTIVE_TIMEOUT
) -> dist.ProcessGroup:
    """The group's own process group (not torch.distributed's global one, so several engines can live in
    one process): gloo on the CPU, NCCL on CUDA, each with `timeout` on every collective.

    NCCL's watchdog acts on a collective that times out or fails as TORCH_NCCL_ASYNC_ERROR_HANDLING says, read
    when the group is made. Its default (3) takes the whole process down: the server, which should live on to
    answer 503. 2 (CleanUpOnly) aborts the communicator instead, which ends the kernel spinning for a dead
    peer, so the device is usable again and the host's wait sees the collective fail. The ranks' only NCCL
    group is this one, so the process-wide variable is theirs to set."""
    if device.type == "cuda":
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _nobody_lost() -> str | None:
    return None


class StepCollectives:
    group: dist.ProcessGroup | None = None  # joined once every rank has loaded its shard
    per_step = 0  # all-reduces of one forward (`shape`)
    hidden = 0  # the width of what they reduce

    def __init__(self, oom_rate: float = 0.0, timeout: timedelta = COLLECTIVE_TIMEOUT) -> None:
        """oom_rate: a test hook that fails that share of this rank's forwards with an OOM before one of their
        all-reduces (a real OOM strikes between two of them just the same). timeout: the group's (make_group),
        which the host's wait for an all-reduce keeps to as well."""
        self.timeout = timeout
        # Why a peer will never join another all-reduce (None while they all can): the driver names a worker
        # process that exited, so that its death ends the step at once rather than at the timeout.
        self.lost: Callable[[], str | None] = _nobody_lost
        self._behind: dist.Work | None = None  # the last all-reduce issued, not yet seen complete on the host
        self.calls = 0
        self._tokens = 0
        self._fail_at: int | None = None
        self._rate, self._rng = oom_rate, random.Random(0)
        self.injected = 0

    def shape(self, per_step: int, hidden: int) -> None:
        self.per_step, self.hidden = per_step, hidden

    def begin(self, tokens: int) -> None:
        """A step over `tokens` rows starts."""
        self.calls, self._tokens, self._behind = 0, tokens, None
        if self._rate and self._rng.random() < self._rate:
            self._fail_at = self._rng.randrange(self.per_step)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The all-reduce (sum) of a row-parallel output, in place. Counted before it runs: an OOM the
        probe raises once it has returned is an all-reduce that did happen."""
        if self.calls == self._fail_at:
            self._fail_at = None
            self.injected += 1
            raise torch.OutOfMemoryError(f"injected OOM #{self.injected} before all-reduce {self.calls}")
        self.calls += 1
        work = self.group.allreduce([x])
        work.wait()  # gloo: the host waits; NCCL: only the current stream does
        behind, self._behind = self._behind, work
        if behind is not None:
            self._settle(behind)
        if self.calls == self.per_step:
            self._behind = None
            self._settle(work)
        return x

    def _settle(self, work: dist.Work) -> None:
        """Wait on the host until `work` has completed. Raises GroupLost when a peer is `lost` or the timeout
        passes first, and the collective's own error where it failed (on NCCL also one the watchdog aborted
        on NCCL's clock, which started when the collective was issued)."""
        deadline = time.monotonic() + self.timeout.total_seconds()
        pause = FIRST_PAUSE_S
        while not work.is_completed():
            if (why := self.lost()) is not None:
                raise GroupLost(why)
            if time.monotonic() > deadline:
                raise GroupLost(f"an all-reduce did not complete in {self.timeout.total_seconds():g} s")
            time.sleep(pause)
            pause = min(2 * pause, LAST_PAUSE_S)
        work.wait()  # raises what the collective failed with

    def finish(self, dtype: torch.dtype, device: torch.device) -> None:
        """Run the all-reduces this rank's forward skipped (none when it ran to the end)."""
        self._fail_at = None
        if self.calls < self.per_step:
            zeros = torch.zeros(self._tokens, self.hidden, dtype=dtype, device=device)
            while self.calls < self.per_step:
                self.reduce(zeros)
