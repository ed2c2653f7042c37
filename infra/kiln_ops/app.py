"""Every function's routes in one app: what the local stack serves on one port."""

from __future__ import annotations

from typing import Any

__all__ = ["combined_app"]


def combined_app(gateway: Any = None, observer: Any = None):
    from importlib import import_module

    from kiln.endpoints import ENDPOINTS
    from kiln.web import create_app

    from .backends import STATE_PATH, state_endpoint

    # each function's own routes, as its app serves them
    routes = [route for endpoint in ENDPOINTS for route in import_module(f"kiln_functions.{endpoint.function}.app").routes]
    app = create_app(routes, gateway, observer)
    # the local stack only: its gateway's backend health, for `kiln admin backends`
    app.add_route(STATE_PATH, state_endpoint, methods=["GET"])  # not one of the functions' routes: no schema
    return app
