"""The headroom-aware Ray Serve request router: `headroom_policy.rank` over the replicas' published stats.

Configured on the engine deployment (`request_router_config`), it runs wherever a handle to that deployment
lives, i.e. in the ingress. Requests are routed in FIFO order (Ray's FIFOMixin); each rank this router returns
holds one replica, so Ray takes them in the order given and only skips one whose queue is full.
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from engine.serving.ray_serve.forwarding import ForwardedRequest
from engine.serving.ray_serve.headroom_policy import Affinity, Headroom, Ledger, Prompt, rank
from engine.serving.ray_serve.prompt_size import PromptSize


def _size(request: PendingRequest | None) -> PromptSize:
    """What the ingress forwards carries its prompt's size; anything else routed here (none today) has none."""
    arg = request.args[0] if request is not None and request.args else None
    return arg.prompt if isinstance(arg, ForwardedRequest) else PromptSize(0)


class HeadroomRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._ledger = Ledger()
        self._affinity = Affinity()
        self._rng = random.Random()

    def _prompt(self, request: PendingRequest | None) -> Prompt:
        size = _size(request)
        return self._affinity.prompt(size.tokens, size.prefix, size.prefix_tokens)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        views = {
            rid: Headroom.of(r.routing_stats, self._ledger.routed_since(rid, r.routing_stats.get("published_at")))
            for rid, r in by_id.items()
        }
        return [[by_id[rid]] for rid in rank(views, self._prompt(pending_request), self._rng)]

    async def _choose_replica_for_request(self, pending_request: PendingRequest, *, is_retry: bool = False) -> Any:
        """Ray's choice (FIFO: it may serve an older request with the replica chosen for this one), entered in
        the ledger and the prefix homes with the prompt of the request it serves. Ray reports a routed request
        to `on_request_routed` only when replicas may reject, so they hook in here."""
        replica = await super()._choose_replica_for_request(pending_request, is_retry=is_retry)
        rid = replica.replica_id
        self._ledger.add(rid, self._prompt(pending_request).to_prefill(rid))
        self._affinity.routed(_size(pending_request).prefix, rid)
        return replica

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ledger.forget(replica_id)
        self._affinity.forget(replica_id)
