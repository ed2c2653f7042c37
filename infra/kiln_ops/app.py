"""Every function's routes in one app: what the local stack serves on one port."""

from __future__ import annotations

from typing import Any

__all__ = ["combined_app"]


def combined_app(gateway: Any = None, observer: Any = None):
    from kiln.web import create_app
    from kiln_functions.chat_completions.app import routes as chat_routes
    from kiln_functions.completions.app import routes as completion_routes
    from kiln_functions.generations.app import routes as generation_routes
    from kiln_functions.models.app import routes as model_routes

    from .backends import STATE_PATH, state_endpoint

    routes = [*chat_routes, *completion_routes, *model_routes, *generation_routes]
    app = create_app(routes, gateway, observer)
    # the local stack only: its gateway's backend health, for `kiln admin backends`
    app.add_route(STATE_PATH, state_endpoint, methods=["GET"], include_in_schema=False)
    return app
