"""A dead or hung tensor-parallel rank ends the step in RankDiedError (the server's 503), on NCCL as on gloo.

No GPU here, so NCCL is played by a fake whose all-reduce behaves as NCCL's does for a peer that never joins:
`wait()` returns at once (it only orders the stream) and the collective never completes, and the first host
read of the step's result blocks until it does (a CUDA synchronize). Before the fix the driver ran on into that
read and hung; pytest-timeout turns such a hang into a failure. The gloo tests run real processes."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from engine.backends.tp_collectives import COLLECTIVE_TIMEOUT, GroupLost, StepCollectives, make_group
from engine.backends.tp_executor import RankDiedError, TensorParallelBackend
from engine.core.batch import ScheduledItem, SchedulerOutput
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Sequence
from tests.fixtures_llama import build_tiny_llama


class NcclLikeWork:
    """An NCCL all-reduce: `wait()` returns at once, done or not; it completes after `polls` host polls (None:
    never, its peer is gone)."""

    def __init__(self, polls: int | None) -> None:
        self.polls = polls

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls = max(0, self.polls - 1)
        return self.done

    @property
    def done(self) -> bool:
        return self.polls == 0


class NcclLikeGroup:
    """Issues NcclLikeWork that completes after `polls`; `on_first` runs as the first is issued (a peer that
    dies mid-step)."""

    def __init__(self, on_first: Callable[[], None] | None = None, polls: int | None = None) -> None:
        self.works: list[NcclLikeWork] = []
        self.on_first, self.polls = on_first, polls

    def allreduce(self, tensors: list[torch.Tensor]) -> NcclLikeWork:
        if self.on_first is not None:
            self.on_first()
            self.on_first = None
        self.works.append(NcclLikeWork(self.polls))
        return self.works[-1]

    def synchronize(self) -> None:
        """The host's read of a result: blocks until every all-reduce issued has completed, as CUDA's does."""
        while not all(w.is_completed() for w in self.works):
            time.sleep(0.01)


def collectives(timeout: timedelta, group: NcclLikeGroup, per_step: int = 4) -> StepCollectives:
    c = StepCollectives(timeout=timeout)
    c.shape(per_step, 8)
    c.group = group  # type: ignore[assignment]
    return c


def run_step(c: StepCollectives) -> None:
    """A forward's all-reduces, then the read of its result."""
    c.begin(3)
    x = torch.zeros(3, 8)
    for _ in range(c.per_step):
        c.reduce(x)
    c.group.synchronize()  # type: ignore[union-attr]


@pytest.mark.timeout(20)
def test_an_nccl_all_reduce_whose_peer_exited_fails_at_once() -> None:
    c = collectives(COLLECTIVE_TIMEOUT, NcclLikeGroup())
    c.lost = lambda: "rank 1 exited (code -9)"
    start = time.monotonic()
    with pytest.raises(GroupLost, match="rank 1 exited"):
        run_step(c)
    assert time.monotonic() - start < 2  # at once, not at the minute's timeout


@pytest.mark.timeout(20)
def test_an_nccl_all_reduce_whose_peer_hangs_fails_at_the_timeout() -> None:
    c = collectives(timedelta(seconds=0.5), NcclLikeGroup())
    start = time.monotonic()
    with pytest.raises(GroupLost, match="did not complete in 0.5 s"):
        run_step(c)
    assert 0.5 <= time.monotonic() - start < 5


@pytest.mark.timeout(20)
def test_the_host_stays_within_one_all_reduce_of_the_stream() -> None:
    """Healthy all-reduces pass. The host sees each complete as it issues the next (so it never runs more than
    one layer ahead of a stalled stream) but not sooner (so it still queues a layer ahead of the GPU), and the
    step's last before the result can be read."""
    group = NcclLikeGroup(polls=3)
    c = collectives(COLLECTIVE_TIMEOUT, group, per_step=6)
    c.begin(3)
    for k in range(c.per_step):
        c.reduce(torch.zeros(3, 8))
        assert [w.done for w in group.works] == [True] * k + [k == c.per_step - 1]


def test_the_nccl_group_has_the_timeout_and_keeps_the_server_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """The group is made with the timeout, under TORCH_NCCL_ASYNC_ERROR_HANDLING=2: the watchdog then aborts a
    collective that timed out rather than taking the process (the server) down, its default."""
    env = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    made: list[dict[str, Any]] = []

    class FakeNCCL:
        class Options:
            _timeout = timedelta(minutes=10)  # NCCL's own default

        def __init__(self, store: dist.Store, rank: int, size: int, options: FakeNCCL.Options) -> None:
            made.append({"rank": rank, "size": size, "timeout": options._timeout, "env": os.environ.get(env)})

    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    monkeypatch.setenv(env, "3")  # the default: restored after the test
    make_group(dist.HashStore(), 1, 2, torch.device("cuda", 1), timedelta(seconds=42))
    make_group(dist.HashStore(), 1, 2, torch.device("cuda", 1))
    assert made == [
        {"rank": 1, "size": 2, "timeout": timedelta(seconds=42), "env": "2"},
        {"rank": 1, "size": 2, "timeout": COLLECTIVE_TIMEOUT, "env": "2"},
    ]


def test_the_gloo_group_has_the_timeout() -> None:
    group = make_group(dist.HashStore(), 0, 1, torch.device("cpu"), timedelta(seconds=7))
    assert group.options._timeout == timedelta(seconds=7)


# The driver, rank 0, with a real worker process (rank 1) on the tiny Llama.


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny_dead_rank")).hf_dir


@pytest.fixture
def tp2(tiny_dir: Path) -> Iterator[Callable[..., TensorParallelBackend]]:
    made: list[TensorParallelBackend] = []

    def make(**kwargs: Any) -> TensorParallelBackend:
        backend_kwargs = {"model": str(tiny_dir), "dtype": "float32", "num_blocks": 8, "model_cache": False}
        made.append(TensorParallelBackend(2, backend_kwargs, **kwargs))
        return made[-1]

    yield make
    for backend in made:
        for proc in backend._procs:  # a frozen worker would hold close() up for its whole grace
            proc.kill()
        backend.close()


def prefill_batch() -> SchedulerOutput:
    batch = SchedulerOutput()
    for i, prompt in enumerate(([5, 17, 33, 40, 9], [6, 17, 34, 40, 9, 11])):
        seq = Sequence(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=1), 1)
        seq.block_table = [2 * i, 2 * i + 1]
        batch.add(ScheduledItem.of(seq, 0, seq.num_tokens, True))
    return batch


def signal_worker(backend: TensorParallelBackend, sig: signal.Signals) -> Callable[[], None]:
    return lambda: os.kill(backend._procs[0].pid, sig)


def execute_until_died(backend: TensorParallelBackend) -> float:
    """The step, which must raise RankDiedError; the seconds it took."""
    start = time.monotonic()
    with pytest.raises(RankDiedError, match="tensor parallel group lost"):
        backend.execute(prefill_batch())
    assert backend.dead is not None
    with pytest.raises(RankDiedError):  # the group is finished: every later step raises at once
        backend.execute(prefill_batch())
    return time.monotonic() - start


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault", ["killed", "frozen"])
def test_the_driver_on_nccl_raises_rank_died_instead_of_hanging(
    tp2: Callable[..., TensorParallelBackend], fault: str
) -> None:
    """The driver's group is the NCCL stand-in; as it issues the step's first all-reduce the worker is killed,
    or frozen (alive, but hung). The driver's read of the step's result, the sampler's, blocks until the
    all-reduces complete."""
    backend = tp2(collective_timeout=timedelta(seconds=1))
    group = NcclLikeGroup(signal_worker(backend, signal.SIGKILL if fault == "killed" else signal.SIGSTOP))
    backend._collectives.group = group  # type: ignore[assignment]
    sample = backend.inner.sampler.sample_items

    def read_after_the_stream(*args: Any) -> Any:
        group.synchronize()
        return sample(*args)

    backend.inner.sampler.sample_items = read_after_the_stream  # type: ignore[method-assign]
    seconds = execute_until_died(backend)
    assert ("exited" in backend.dead) == (fault == "killed")
    assert seconds < (1 if fault == "killed" else 1 + 3)  # a dead peer at once; a frozen one at the timeout


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_the_driver_on_gloo_raises_rank_died_within_the_timeout(
    tp2: Callable[..., TensorParallelBackend], sig: signal.Signals
) -> None:
    """Real gloo: the worker is killed, or frozen, mid-step (as the driver issues the step's first all-reduce)."""
    backend = tp2(collective_timeout=timedelta(seconds=2))
    real = backend._collectives.group
    act: list[Callable[[], None]] = [signal_worker(backend, sig)]

    class Interrupting:
        def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work:
            while act:
                act.pop()()
            return real.allreduce(tensors)

    backend._collectives.group = Interrupting()  # type: ignore[assignment]
    assert execute_until_died(backend) < 2 + 3
