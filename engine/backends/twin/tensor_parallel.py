"""The twin at `--tensor-parallel-size 2`: two RTX 4090s on PCIe 4.0 x16 without NVLink, one rank each.

Each rank is a TwinBackend of its own, with its own device memory, allocator replay, sensors and probe, built
from a rank profile: the card's facts as they are, the model's memory as the torch backend shards it
(engine/model/tensor_parallel.py) and its step time from the kernel tables at the sharded shapes plus the
all-reduce ([tensor_parallel] in the profile says every hypothesis and its source; engine/backends/twin/
latency.py how they enter the step). Per rank:

- weights: half the layers' matrices; the embedding on both ranks; the LM head on rank 0 only, which alone
  computes logits and samples (rank 1 runs its steps without logits rows, so holds none);
- KV: half the KV heads, so half the bytes of a block; the same blocks on both ranks;
- outside the allocator: the CUDA context and NCCL's buffers.

A step takes as long as its slowest rank (they meet at every all-reduce); both clocks then stand at its end.
A step that runs out of memory on either rank fails on both, as the torch group's does.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from engine.backends.rank_probes import RankProbes
from engine.backends.twin.backend import TwinBackend
from engine.backends.twin.profile import Profile, load_profile
from engine.core.backend import BackendInfo, ForwardingBackend
from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.kv.blocks import ResizePlan
from telemetry.record import RankSample

MODELLED_SIZES = (2,)


def rank_profile(profile: Profile, rank: int, size: int) -> Profile:
    """`profile` as rank `rank` of `size` sees it: its shard's weights and KV bytes, NCCL beside the context,
    and [tensor_parallel] `size` set, which makes its latency model one rank's."""
    data = copy.deepcopy(profile.data)
    model, tp = data["model"], data["tensor_parallel"]
    if model["kv_heads"] % size or model["heads"] % size:
        raise ValueError(f"tensor parallel size {size} does not divide the model's heads")
    table = model["vocab"] * model["hidden"] * tp["activation_bytes"]  # the embedding, and the untied LM head
    layers = model["weight_bytes"] - 2 * table
    model["weight_bytes"] = layers // size + table + (table if rank == 0 else 0)
    model["kv_bytes_per_token"] //= size
    data["device"]["cuda_context_bytes"] += tp["nccl_bytes"]
    tp["size"], tp["rank"] = size, rank
    return Profile(f"{profile.name}-tp{size}-rank{rank}", data, profile.kernels)


class TwinGroup(ForwardingBackend):
    """Rank 0 for what the group shares (the model's name and context, the pool's size and block bytes); the step,
    the clock, the pool's resizes and the swaps on every rank."""

    def __init__(
        self,
        size: int,
        profile: str | Profile,
        num_blocks: int | None = None,
        block_size: int | None = None,
        max_model_len: int | None = None,
        sensors: str = "ideal",
    ) -> None:
        if size not in MODELLED_SIZES:
            raise ValueError(f"the twin models tensor parallelism over {MODELLED_SIZES} RTX 4090s; got {size}")
        base = profile if isinstance(profile, Profile) else load_profile(profile)
        self.ranks = [
            TwinBackend(rank_profile(base, r, size), num_blocks, block_size, False, max_model_len, sensors)
            for r in range(size)
        ]
        super().__init__(self.ranks[0])
        for worker in self.ranks[1:]:
            worker.samples = False
        self.size = size
        self._probe = RankProbes([b.probe for b in self.ranks], self.rank_samples)

    @property
    def probe(self) -> RankProbes:
        return self._probe

    def info(self) -> BackendInfo:
        """Rank 0's, its attention line naming the group."""
        info = self.ranks[0].info()
        return dataclasses.replace(info, attention=f"{info.attention}; tensor parallel over {self.size} ranks")

    def rank_samples(self) -> list[RankSample]:
        return [RankSample(r, b.probe.sample(), b.num_blocks, b.block_bytes) for r, b in enumerate(self.ranks)]

    def now(self) -> float:
        return self.ranks[0].now()

    def advance_to(self, t: float) -> None:
        for b in self.ranks:
            b.advance_to(t)

    def _meet(self) -> None:
        """Both clocks at the slowest rank's."""
        self.advance_to(max(b.now() for b in self.ranks))

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        """The step on every rank; rank 0's tokens. torch.OutOfMemoryError when any rank ran out."""
        outputs, oom = [], None
        for b in self.ranks:
            try:
                outputs.append(b.execute(batch))
            except torch.OutOfMemoryError as e:
                oom = oom or e
        self._meet()
        if oom is not None:
            raise oom
        return outputs[0]

    def resize_kv(self, plan: ResizePlan) -> float:
        """Every rank's pool to the plan; a rank that cannot grow leaves every rank's as it was."""
        done: list[TwinBackend] = []
        try:
            for b in self.ranks:
                b.resize_kv(plan)
                done.append(b)
        except torch.OutOfMemoryError:
            for b in done:
                b.resize_kv(ResizePlan(plan.old_num_blocks, plan.num_blocks))
            raise
        finally:
            start = self.now()
            self._meet()
        return self.now() - start

    def swap(self, out: list[tuple[str, list[int]]], into: list[tuple[str, list[int]]]) -> float:
        """Each rank copies its shard of the blocks over its own link, at once."""
        start = self.now()
        for b in self.ranks:
            b.swap(out, into)
        self._meet()
        return self.now() - start

    def recover_from_oom(self) -> None:
        for b in self.ranks:
            b.recover_from_oom()
