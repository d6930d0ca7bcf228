"""A tensor-parallel rank other than the driver: a process that runs its shard of every step it is sent.

The driver (engine/backends/tp_executor.py) schedules, samples and runs the controller; a worker only computes.
It says ("loaded", ...) once its shard is built and ("ready", ...) once it has joined the group, which the ranks
join together, all loaded: the group's timeout (tp_collectives) bounds its rendezvous on gloo too, and is
sized for a collective, not for a model's load. Then it takes commands on a pipe, in order, and answers each:
- ("execute", items, tokens): its shard's forward under its own memory probe, then the step's `finish`
  (engine/backends/tp_collectives.py); answers ("done", its RankSample, whether its forward ran out of memory);
- ("resize", plan): its KV shard to the plan's size; answers ("done", its RankSample, whether it ran out);
- ("stop",): exits. So does a closed pipe: a driver that died leaves no worker behind.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from engine.backends.torch_backend import TorchBackend, resolve_device
from engine.backends.tp_collectives import COLLECTIVE_TIMEOUT, StepCollectives, make_group
from engine.core.batch import ScheduledItem, SchedulerOutput
from engine.model.tensor_parallel import RankShard
from telemetry.record import RankSample

STORE_TIMEOUT = timedelta(seconds=120)  # every rank loads the model before the group meets


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    size: int
    store_port: int
    backend_kwargs: dict[str, Any]  # TorchBackend's keyword arguments (the model as a spec, not an object)
    oom_rate: float = 0.0  # test hook: this rank's forwards that fail with an OOM (StepCollectives)
    timeout: timedelta = COLLECTIVE_TIMEOUT  # the group's, on every collective (make_group)


def rank_backend(
    rank: int, size: int, kwargs: dict[str, Any], oom_rate: float, timeout: timedelta
) -> tuple[TorchBackend, StepCollectives]:
    """Rank `rank`'s backend and the collectives its model all-reduces through; the group is joined later
    (`StepCollectives.group`), once every rank has loaded."""
    collectives = StepCollectives(oom_rate, timeout)
    backend = TorchBackend(**kwargs, shard=RankShard(rank, size, collectives.reduce))
    if backend.device.type == "cuda":
        torch.cuda.set_device(backend.device)  # NCCL's communicator runs on the process's current device
    else:
        # The ranks share the host's cores: a share each, or their OpenMP threads spin against each other (every
        # step waits in an all-reduce for the slowest rank, whose cores the others' waiting threads hold).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    collectives.shape(2 * backend.config.num_layers, backend.config.hidden_size)
    return backend, collectives


def rank_sample(rank: int, backend: TorchBackend) -> RankSample:
    return RankSample(rank, backend.probe.sample(), backend.num_blocks, backend.block_bytes)


def join_group(store_port: int, rank: int, size: int, device: torch.device, timeout: timedelta) -> dist.ProcessGroup:
    """A worker's place in the group, through the driver's store."""
    store = dist.TCPStore("127.0.0.1", store_port, size, is_master=False, timeout=STORE_TIMEOUT)
    return make_group(store, rank, size, device, timeout)


def worker_main(spec: WorkerSpec, conn: Connection) -> None:
    """The spawned process: build the shard, say loaded, join the group, say ready, then serve commands."""
    try:
        backend, collectives = rank_backend(spec.rank, spec.size, spec.backend_kwargs, spec.oom_rate, spec.timeout)
        conn.send(("loaded", rank_sample(spec.rank, backend), False))
        collectives.group = join_group(spec.store_port, spec.rank, spec.size, backend.device, spec.timeout)
    except Exception as e:  # noqa: BLE001 - the driver reports it and stops the group
        conn.send(("error", f"rank {spec.rank}: {type(e).__name__}: {e}"))
        return
    conn.send(("ready", rank_sample(spec.rank, backend), False))
    try:
        serve(spec.rank, backend, collectives, conn)
    except (EOFError, BrokenPipeError):
        return  # the driver is gone


def serve(rank: int, backend: TorchBackend, collectives: StepCollectives, conn: Connection) -> None:
    while True:
        command, *args = conn.recv()
        if command == "stop":
            return
        failed = False
        if command == "execute":
            failed = run_step(backend, collectives, *args)
        else:  # "resize"
            try:
                backend.resize_kv(args[0])
            except torch.OutOfMemoryError:
                failed = True
        conn.send(("done", rank_sample(rank, backend), failed))


def run_step(backend: TorchBackend, collectives: StepCollectives, items: list[ScheduledItem], tokens: int) -> bool:
    """This rank's shard of one step, measured by its own probe; True when its forward ran out of memory.
    Either way the step's collectives are finished with the other ranks."""
    batch = SchedulerOutput()
    for item in items:
        batch.add(item)
    collectives.begin(tokens)
    failed = False
    try:
        with backend.probe.step(batch.shape):
            backend.forward(batch)
    except torch.OutOfMemoryError:
        failed = True
    collectives.finish(backend.model.dtype, backend.device)
    return failed


def rank_kwargs(kwargs: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank `rank`'s backend arguments: on CUDA its own device, cuda:<rank> (of those CUDA_VISIBLE_DEVICES
    shows this process), as vLLM's workers take theirs."""
    if resolve_device(kwargs.get("device")).type == "cuda":
        return {**kwargs, "device": f"cuda:{rank}"}
    return kwargs
