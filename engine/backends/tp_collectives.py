"""One rank's collectives for a step, counted so that a rank whose forward failed still meets its peers.

Every rank of a step runs the same sequence of all-reduces (two a layer: engine/model/tensor_parallel.py).
A rank whose forward runs out of memory part way would leave the others blocked in the next all-reduce it
never joins. So after its forward, passed or failed, each rank `finish`es the step: it runs the all-reduces
its forward skipped, over zeros. The failed step's result is discarded on every rank: each worker tells the
driver whether its forward ran out (engine/backends/tp_worker.py), and the driver, which alone keeps state
between steps, recovers the step for all of them (engine/backends/tp_executor.py). No flag needs reducing.
"""

from __future__ import annotations

import random
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a backstop: a dead peer closes its sockets, which fails sooner


def make_group(store: dist.Store, rank: int, size: int, device: torch.device) -> dist.ProcessGroup:
    """The group's own process group (not torch.distributed's global one, so several engines can live in
    one process): gloo on the CPU, NCCL on CUDA."""
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, COLLECTIVE_TIMEOUT)


class StepCollectives:
    group: dist.ProcessGroup | None = None  # joined once every rank has loaded its shard
    per_step = 0  # all-reduces of one forward (`shape`)
    hidden = 0  # the width of what they reduce

    def __init__(self, oom_rate: float = 0.0) -> None:
        """oom_rate: a test hook that fails that share of this rank's forwards with an OOM before one of their
        all-reduces (a real OOM strikes between two of them just the same)."""
        self.calls = 0
        self._tokens = 0
        self._fail_at: int | None = None
        self._rate, self._rng = oom_rate, random.Random(0)
        self.injected = 0

    def shape(self, per_step: int, hidden: int) -> None:
        self.per_step, self.hidden = per_step, hidden

    def begin(self, tokens: int) -> None:
        """A step over `tokens` rows starts."""
        self.calls, self._tokens = 0, tokens
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
        self.group.allreduce([x]).wait()
        return x

    def finish(self, dtype: torch.dtype, device: torch.device) -> None:
        """Run the all-reduces this rank's forward skipped (none when it ran to the end)."""
        self._fail_at = None
        if self.calls < self.per_step:
            zeros = torch.zeros(self._tokens, self.hidden, dtype=dtype, device=device)
            while self.calls < self.per_step:
                self.reduce(zeros)
