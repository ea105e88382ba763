"""Serve's request router for a generator deployment, over ``router.placement``.

Serve runs a request router in every process that holds a handle to the deployment (the
placement router that HAProxy asks, an ingress, another app), each with its own view of
where prefixes are cached; ``choose_replicas`` hands the candidates and the replicas' latest
reports (``record_routing_stats``) to ``PlacementPolicy`` and returns its ranking: the
cheapest first, the rest by cost as Serve's fallbacks when that one is full.
"""

from __future__ import annotations

from typing import Any

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve.request_router import ReplicaID, RequestRouter

from router.placement import PlacementPolicy, PlacementSettings, prompt_text


def _payload(pending_request: PendingRequest | None) -> Any:
    if pending_request is None or not pending_request.args:
        return None
    return pending_request.args[0]


def predicted_output(payload: Any) -> float | None:
    """The router's prediction where a call carries one, else the request's own bound."""
    for name in ("predicted_tokens", "max_tokens", "max_completion_tokens"):
        value = getattr(payload, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            return float(value)
    return None


class CarpoolRequestRouter(RequestRouter):
    """Cheapest replica by uncached prefill, queued work and output (``PlacementPolicy``)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.policy = PlacementPolicy(PlacementSettings(**kwargs))

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        self.policy.sync(
            {
                r.replica_id.to_full_id_str(): dict(r.routing_stats or {})
                for r in self.curr_replicas.values()
            }
        )
        payload = _payload(pending_request)
        placement = self.policy.choose(
            prompt_text(payload) if payload is not None else "",
            list(by_id),
            predicted_output(payload),
        )
        # The cheapest alone first; the rest, cheapest first, are Serve's fallbacks.
        ranked = sorted(by_id, key=lambda r: (r != placement.replica, placement.costs[r]))
        return [[by_id[ranked[0]]], [by_id[r] for r in ranked[1:]]][: min(2, len(ranked))]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget(replica_id.to_full_id_str())
