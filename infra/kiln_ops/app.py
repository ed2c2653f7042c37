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

    routes = [*chat_routes, *completion_routes, *model_routes, *generation_routes]
    return create_app(routes, gateway, observer)
