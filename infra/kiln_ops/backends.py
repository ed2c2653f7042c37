"""`kiln admin backends`: each model's backends in the catalog, and what a gateway thinks of them.

Backend health lives in each gateway process (a Lambda execution environment, or `kiln
dev`): there is no one state to read. So this shows the catalog's backends (enabled or not)
and, where a gateway can be asked (`--gateway URL`, by default `kiln dev`'s own, read from
KILN_BASE_URL), that gateway's view: in service, out of service (for how long, and why) or
probing. A deployed stack's view is the `BackendInService` metric (1 or 0 per model and
backend, sent by each environment at every change) and its `backend_state` log lines.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

__all__ = ["STATE_PATH", "add_backends_parser", "state_endpoint"]

# Served by the local stack only (kiln_ops.app): the deployed functions have no such route.
STATE_PATH = "/_kiln/backends"
COLUMNS = ("model", "backend", "url", "enabled", "state", "out_for_seconds", "reason")


def add_backends_parser(groups: Any, formatted: argparse.ArgumentParser) -> None:
    backends = groups.add_parser(
        "backends", parents=[formatted],
        help="each model's backends (catalog) and, for the local stack, whether its gateway has them in service",
    )
    backends.add_argument("--gateway", help="a local gateway's base URL (default: kiln dev's, from KILN_BASE_URL)")
    backends.set_defaults(run=_backends)


def _backends(ctx: Any, args: argparse.Namespace, out: Any) -> None:

    from .admin import AdminError, _stored_catalog, _stored_catalog_parsed
    from .output import render

    raw = _stored_catalog(ctx)
    if raw is None:
        raise AdminError(f"no catalog parameter {ctx.settings.catalog_parameter}")
    catalog = _stored_catalog_parsed(ctx, raw)
    gateway = args.gateway or (None if getattr(args, "stack", None) else os.environ.get("KILN_BASE_URL"))
    states, note = _gateway_states(gateway)
    rows = []
    for model in catalog:
        for backend in model.backends:
            row = {"model": model.id, "backend": backend.name, "url": backend.url, "enabled": backend.enabled}
            seen = states.get((backend.name, backend.url)) if states is not None else None
            if not backend.enabled:
                row["state"] = "disabled"
            elif states is not None:
                row["state"] = seen["state"] if seen else "in_service"
                if seen:
                    row["out_for_seconds"], row["reason"] = seen.get("out_for_seconds"), seen.get("reason")
            rows.append(row)
    render(rows, COLUMNS, args.format, out)
    if note and args.format == "table":
        out(note)


def _gateway_states(base_url: str | None) -> tuple[dict | None, str]:
    if not base_url:
        return None, ("state: per gateway process; a deployed stack reports it as the BackendInService metric "
                      "and backend_state log lines")
    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        answer = httpx.get(root + STATE_PATH, timeout=5)
        answer.raise_for_status()
        rows = answer.json()["backends"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return None, f"state: the gateway at {root} could not be asked ({type(exc).__name__})"
    return {(row["backend"], row["url"]): row for row in rows}, f"state: as the gateway at {root} sees it"


async def state_endpoint(request: Any) -> Any:
    """The local stack's report of its gateway's backend health (the kiln.health snapshot)."""
    from starlette.responses import JSONResponse

    gateway = request.app.state._state.get("gateway")
    return JSONResponse({"backends": gateway.upstream.health.snapshot() if gateway is not None else []})
