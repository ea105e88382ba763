"""Ray Serve LLM's ``PrefixCacheAffinityRouter``, reading carpool's calls too.

For comparison runs only (``placement.policy: ray_prefix``): Ray's router as it ships (its
prefix tree actor and thresholds), so that only the routing differs from carpool's. Its own
text extraction knows OpenAI bodies (``prompt``, ``messages``); carpool's ``GenerationCall``
(other apps' handle calls) names its prompts ``prompts``.

Ray's router learns where a prompt went in ``on_request_routed``, which Serve calls after a
handle call reserves its replica. HAProxy's placement router asks without a reservation
(``choose_replica(_reserve=False)``, pipelines/placement.py), takes the first replica of the
first list and never calls it back, so the tree stayed empty and every request went to the
first replica. Here the chosen replica is recorded when it is chosen, as Ray would record it.
"""

from __future__ import annotations

import time
from typing import Any

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica

from router.placement import prompt_text


class RayPrefixRouter(PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        try:
            return super()._extract_text_from_request(pending_request)
        except ValueError:
            return prompt_text(pending_request.args[0])

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> Any:
        ranked = await super().choose_replicas(candidate_replicas, pending_request)
        if pending_request is not None and pending_request.args and ranked and ranked[0]:
            text = self._extract_text_from_request(pending_request)
            if text:
                # One caller's calls to an actor run in order: the next request's match
                # sees this insert.
                self._tree_actor.insert.remote(
                    text, ranked[0][0].replica_id.to_full_id_str(), time.time()
                )
        return ranked
