"""A model-free backend that still goes through the paged KV: like a model's, the value it writes into a
token's slot depends on the token and on the slot before it (read back through the block table), and the next
token is derived from what it reads back, so aliasing, a lost block or a block reused under another prefix
changes the output."""

from __future__ import annotations

from engine.core.backend import BackendDefaults, BackendInfo
from engine.core.batch import ModelOutput, SchedulerOutput
from engine.core.kv.blocks import ResizePlan
from telemetry.probes.null import NullProbe


class FakeBackend(BackendDefaults):
    model_name = "fake"
    tokenizer = None
    vocab_size = 1000  # its tokens are 1..997

    def __init__(
        self, num_blocks: int = 64, block_size: int = 4, max_model_len: int = 512, eos: int = 0, can_swap: bool = False
    ) -> None:
        self.num_blocks, self.block_size, self.max_model_len = num_blocks, block_size, max_model_len
        self.can_swap = can_swap
        self.swapped_blocks = 0
        self.eos_token_ids = {eos}
        self.slots = [-1] * (num_blocks * block_size)
        self.probe = NullProbe()
        self.steps: list[SchedulerOutput] = []
        self.host: dict[str, list[list[int]]] = {}  # swapped-out requests' slots, by request id
        self.dropped: list[str] = []  # requests the scheduler said finished

    @property
    def block_bytes(self) -> int:
        return 8 * self.block_size  # a slot holds one int

    def execute(self, batch: SchedulerOutput) -> ModelOutput:
        self.steps.append(batch)
        self.dropped += batch.finished
        out = []
        for item in batch.items:
            table, bs = item.block_table, self.block_size
            kv = self.slots[table[(item.start - 1) // bs] * bs + (item.start - 1) % bs] if item.start else 0
            for pos, token in enumerate(item.token_ids, item.start):
                kv = (kv * 31 + token) % 1_000_003
                self.slots[table[pos // bs] * bs + pos % bs] = kv
            if item.sample:
                end = item.start + item.num_tokens
                kv = [self.slots[table[p // bs] * bs + p % bs] for p in range(end)]
                out.append(1 + (sum(t * (i + 7) for i, t in enumerate(kv)) % 997))
        return ModelOutput(out)

    def resize_kv(self, plan: ResizePlan) -> float:
        bs = self.block_size
        for old, new in plan.moves.items():
            self.slots[new * bs : (new + 1) * bs] = self.slots[old * bs : (old + 1) * bs]
        keep = min(plan.num_blocks, self.num_blocks) * bs
        self.slots = self.slots[:keep] + [-1] * (plan.num_blocks * bs - keep)
        self.num_blocks = plan.num_blocks
        return 0.0

    def swap(self, out: list, into: list) -> float:
        """The slots of each `out` request's blocks to a host list, then each `into` host list back into new
        blocks; the old slots are scribbled over, so a swap-in that reads the wrong copy changes output."""
        bs = self.block_size
        for rid, blocks in out:
            self.host[rid] = [self.slots[b * bs : (b + 1) * bs] for b in blocks]
            for b in blocks:
                self.slots[b * bs : (b + 1) * bs] = [-7] * bs
            self.swapped_blocks += len(blocks)
        for rid, blocks in into:
            for b, saved in zip(blocks, self.host.pop(rid), strict=True):
                self.slots[b * bs : (b + 1) * bs] = saved
        return 0.0

    def recover_from_oom(self) -> None:
        return None

    def info(self) -> BackendInfo:
        return BackendInfo("none", "none", "fake", "a list of slots")
