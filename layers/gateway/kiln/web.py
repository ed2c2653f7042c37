"""The ASGI app every function serves: its routes, the gateway's services, errors in one shape.

A Starlette app: its handlers each take the Request and answer, with nothing for a framework
to solve per call. FastAPI describes the same routes for `/openapi.json`, and is imported only
when that is first asked for: its import is most of a bare FastAPI app's cold start.
"""

from __future__ import annotations

import logging
import re
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from . import schemas
from .endpoints import Endpoint
from .errors import GatewayError, InternalError, MethodNotAllowed, UnknownUrl
from .gateway import Gateway
from .handlers import complete, list_models, retrieve_generation, retrieve_model
from .observability import ObservabilityMiddleware, Observer, record_of
from .responses import error_response
from .selfservice import HANDLERS as SELF_SERVICE

__all__ = ["RouteSpec", "create_app", "lambda_handler", "routes_of"]

HEALTH_PATH = "/healthz"  # the Web Adapter's readiness check (AWS_LWA_READINESS_CHECK_PATH in template.yaml)
OPENAPI_PATH = "/openapi.json"

log = logging.getLogger("kiln.web")

Handler = Callable[[Request], Awaitable[Response]]


class RouteSpec:
    """One route of a function's app, with its OpenAPI description."""

    __slots__ = ("path", "endpoint", "methods", "name", "summary", "openapi_extra", "responses")

    def __init__(
        self,
        path: str,
        endpoint: Handler,
        methods: tuple[str, ...],
        name: str,
        summary: str,
        openapi_extra: dict[str, Any] | None = None,
        responses: dict[int | str, dict[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self.endpoint = endpoint
        self.methods = methods
        self.name = name
        self.summary = summary
        self.openapi_extra = openapi_extra or {}
        self.responses = responses or {}


# the read endpoints' handlers, by route name (kiln.endpoints)
READERS: dict[str, Handler] = {
    "models.list": list_models,
    "models.retrieve": retrieve_model,
    "generations.retrieve": retrieve_generation,
    **SELF_SERVICE,  # credits, key, usage and keys (contract §10)
}


def routes_of(endpoint: Endpoint) -> list[RouteSpec]:
    """The routes of one endpoint of the registry, bound to their handlers."""
    api = endpoint.api
    if api is None:
        return [RouteSpec(route.path, READERS[route.name], (route.method,), route.name, route.summary,
                          schemas.SELF_SERVICE.get(route.name), schemas.ERROR_RESPONSES) for route in endpoint.routes]

    async def handle(request: Request) -> Response:
        return await complete(request, api)

    responses = {**schemas.ERROR_RESPONSES, 502: {"description": "no backend answered (plain text)"}}
    return [RouteSpec(route.path, handle, (route.method,), route.name, route.summary, api.openapi_body(), responses)
            for route in endpoint.routes]


def create_app(
    routes: Sequence[RouteSpec],
    gateway: Gateway | Callable[[], Gateway] | None = None,
    observer: Observer | None = None,
) -> Starlette:
    """An app serving `routes`. The gateway is made on first use (or given, for tests)."""
    factory = gateway if callable(gateway) and not isinstance(gateway, Gateway) else None

    @asynccontextmanager
    async def lifespan(app: Starlette):
        yield
        made = app.state._state.get("gateway")
        if made is not None and not isinstance(gateway, Gateway):  # ours to close
            await made.aclose()

    served = [_served(HEALTH_PATH, _healthz, ("GET",), "healthz")]
    served += [_served(route.path, route.endpoint, route.methods, route.name) for route in routes]
    served.append(_served(OPENAPI_PATH, _openapi(routes), ("GET", "HEAD"), "openapi"))  # as FastAPI serves it
    # outermost: it sees every response, the error handlers' included
    middleware = [Middleware(ObservabilityMiddleware, observer=observer, quiet_paths=frozenset({HEALTH_PATH}))]
    if not isinstance(gateway, Gateway):
        middleware.append(Middleware(_LazyGateway, factory=factory or Gateway.from_env))
    app = Starlette(
        routes=served,
        middleware=middleware,
        exception_handlers={
            GatewayError: _gateway_error,
            StarletteHTTPException: _http_error,
            Exception: _unexpected_error,
        },
        lifespan=lifespan,
    )
    app.router.redirect_slashes = False  # a trailing slash is an unknown URL, not a 307 to a Host-built Location
    if isinstance(gateway, Gateway):
        app.state.gateway = gateway
    return app


def _openapi(routes: Sequence[RouteSpec]) -> Handler:
    """GET /openapi.json: the routes as FastAPI describes them (made once, on first use)."""
    routes = list(routes)
    document: list[bytes] = []

    async def openapi(request: Request) -> Response:
        if not document:
            document.append(_described(routes))
        return Response(document[0], media_type="application/json")

    return openapi


def _described(routes: Sequence[RouteSpec]) -> bytes:
    from fastapi import FastAPI
    from starlette.responses import JSONResponse

    described = FastAPI(title="Kiln gateway", version="1", docs_url=None, redoc_url=None, openapi_url=None)
    for route in routes:
        described.add_api_route(
            starlette_path(route.path),
            route.endpoint,
            methods=list(route.methods),
            name=route.name,
            summary=route.summary,
            openapi_extra=route.openapi_extra or None,
            responses=route.responses or None,
            response_class=Response,
        )
    return JSONResponse(described.openapi()).body


def starlette_path(path: str) -> str:
    """A route's path as Starlette reads it: API Gateway's greedy `{name+}` (slashes and all,
    but neither empty nor ending in a slash, as API Gateway matches it) is `{name:greedy}`."""
    return _GREEDY.sub(r"{\1:greedy}", path)


class _Greedy(Convertor):
    regex = r"[^/](?:.*[^/])?"  # no empty value, none that starts or ends with a slash

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("greedy", _Greedy())


def openapi_path(path: str) -> str:
    """A route's path as the OpenAPI document names it: a parameter is a parameter, greedy or not."""
    return _GREEDY.sub(r"{\1}", path)


_GREEDY = re.compile(r"\{(\w+)\+\}")


def _served(path: str, endpoint: Handler, methods: Sequence[str], name: str) -> Route:
    """The route that serves a path: Starlette's own, without what FastAPI adds to each call
    (solving dependencies: these handlers have none, each takes the Request and answers)."""
    route = Route(starlette_path(path), endpoint, methods=list(methods), name=name)
    route.methods = set(methods)  # exactly these: for a GET route Starlette would answer HEAD too
    return route


class _LazyGateway:
    """Builds the gateway on the first request (a Lambda init must not touch the network)."""

    def __init__(self, app, factory: Callable[[], Gateway]) -> None:
        self.app = app
        self.factory = factory

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            state = scope["app"].state
            if state._state.get("gateway") is None:
                state.gateway = self.factory()
        await self.app(scope, receive, send)


async def _healthz(request: Request) -> Response:
    """The Web Adapter's readiness check: the process serves; no I/O."""
    return Response(b'{"status":"ok"}', media_type="application/json")


def _answer(request: Request, error: GatewayError) -> Response:
    record_of(request).error_code = error.code
    return error_response(error)


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return _answer(request, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 405:
        return _answer(request, MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}."))
    if exc.status_code == 404:
        return _answer(request, UnknownUrl(f"Unknown request URL: {request.method} {request.url.path}."))
    return _answer(request, InternalError(str(exc.detail)))


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return _answer(request, InternalError("The gateway failed to process the request."))


def lambda_handler(app: Starlette) -> Callable[[dict, Any], dict]:
    """The buffered Lambda entry point (API Gateway REST / Function URL events) via Mangum."""
    adapter: list[Any] = []

    def handler(event: dict, context: Any) -> dict:
        if not adapter:
            from mangum import Mangum

            adapter.append(Mangum(app, lifespan="off"))
        return adapter[0](event, context)

    return handler

