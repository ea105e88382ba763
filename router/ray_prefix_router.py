"""Ray Serve LLM's ``PrefixCacheAffinityRouter``, reading carpool's calls too.

For comparison runs only (``placement.policy: ray_prefix``): Ray's router as it ships (its
prefix tree actor and thresholds), so that only the routing differs from carpool's. Its own
text extraction knows OpenAI bodies (``prompt``, ``messages``); carpool's ``GenerationCall``
(other apps' handle calls) names its prompts ``prompts``.
"""

from __future__ import annotations

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
    PrefixCacheAffinityRouter,
)
from ray.serve._private.request_router.common import PendingRequest

from router.placement import prompt_text


class RayPrefixRouter(PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request: PendingRequest) -> str:
        try:
            return super()._extract_text_from_request(pending_request)
        except ValueError:
            return prompt_text(pending_request.args[0])
