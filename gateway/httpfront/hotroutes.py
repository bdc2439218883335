"""The two completion routes, dispatched before Starlette's middleware and router.

Every client request is a ``POST /v1/chat/completions`` or ``/v1/completions``: they go straight
to their endpoint (the same ``Endpoint`` objects the Starlette routes hold, so the behaviour is
the same), skipping the error middleware, the exception middleware and the route matching that
the endpoint does not need (it answers every error itself). A deep await chain is not free: each
time the request's task resumes (every message from the node) it passes through every frame of
it. Anything else, including these paths with another method, is Starlette's.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send


class HotRoutes:
    """``routes`` (exact path -> endpoint) for POST, then ``app`` for the rest."""

    def __init__(self, app: Starlette, routes: Mapping[str, ASGIApp]) -> None:
        self.app = app
        self.routes = dict(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.routes.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self.app  # what Starlette sets: handlers reach the service through it
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)
