"""``model: "auto"`` from another app: the generate app's router, which its ingress hosts.

The router has no deployment of its own (``router.deployment.HostedRouter`` runs inside the
replica taking the generate app's HTTP), so the OpenAI app and rag reach it through that
replica's ``route_*`` methods, behind a handle-shaped ``RouterHandle``.
"""

from typing import Any

from ray import serve

# The name other apps (rag's generator_deployment) use for `auto`: the router, which lives in
# the generate app's ingress (its route_* methods), not in a deployment of its own.
ROUTER_DEPLOYMENT = "router"
# A generator handle's methods, as the ingress hosting the router names them.
ROUTER_METHODS = {
    "generate": "route_generate",
    "stream": "route_stream",
    "describe": "route_describe",
}


class RouterHandle:
    """The generate app's router, reached from another app through the app's ingress.

    The ingress replica hosts the router (``router.deployment.HostedRouter``) and exposes it
    as ``route_generate`` / ``route_stream`` / ``route_describe``; this maps the calls a
    handler makes on a generator's handle (``generate``, ``stream``, ``describe``) onto them,
    so ``auto`` is one more name for a handle, as ``small`` and ``large`` are. The app's
    handle is looked up at first use: apps deploy in any order.
    """

    def __init__(self, app: str, ingress: Any = None) -> None:
        self.app = app
        self._ingress = ingress

    def _resolved(self) -> Any:
        if self._ingress is None:
            self._ingress = serve.get_app_handle(self.app)
        return self._ingress

    def options(self, **kwargs: Any) -> "RouterHandle":
        return RouterHandle(self.app, self._resolved().options(**kwargs))

    def __getattr__(self, name: str) -> Any:
        if name not in ROUTER_METHODS:
            raise AttributeError(name)
        return getattr(self._resolved(), ROUTER_METHODS[name])


def router_handle(app: str) -> RouterHandle:
    """``auto`` of the running generate app ``app`` (its ingress hosts the router)."""
    return RouterHandle(app)
