"""The ASGI app every function serves: its routes, the gateway's services, errors in one shape.

Its handlers each take a Starlette Request and answer with a Starlette Response; the app
routes, observes and answers errors itself (`App`), with nothing for a framework to do per
call. FastAPI describes the same routes for `/openapi.json`, and is imported only when that
is first asked for: its import is most of a bare FastAPI app's cold start.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Awaitable, Callable, Sequence

from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import Response

from . import schemas
from .deadline import bounded
from .endpoints import Endpoint
from .errors import GatewayError, InternalError, InvalidEvent, MethodNotAllowed, UnknownUrl
from .gateway import Gateway
from .handlers import KEY_HEADERS, complete, list_models, retrieve_generation, retrieve_model
from .observability import ObservabilityMiddleware, Observer, loggable_path, record_of
from .responses import error_response
from .selfservice import HANDLERS as SELF_SERVICE

__all__ = ["App", "RouteSpec", "create_app", "lambda_handler", "routes_of"]

HEALTH_PATH = "/healthz"  # the Web Adapter's readiness check (AWS_LWA_READINESS_CHECK_PATH in template.yaml)
OPENAPI_PATH = "/openapi.json"

log = logging.getLogger("kiln.web")

Handler = Callable[[Request], Awaitable[Response]]


class RouteSpec:
    """One route of a function's app, with its OpenAPI description; `admits`: a model
    endpoint's (its requests are admitted, metered and settled)."""

    __slots__ = ("path", "endpoint", "methods", "name", "summary", "openapi_extra", "responses", "admits")

    def __init__(
        self,
        path: str,
        endpoint: Handler,
        methods: tuple[str, ...],
        name: str,
        summary: str,
        openapi_extra: dict[str, Any] | None = None,
        responses: dict[int | str, dict[str, Any]] | None = None,
        *,
        admits: bool = False,
    ) -> None:
        self.path = path
        self.endpoint = endpoint
        self.methods = methods
        self.name = name
        self.summary = summary
        self.openapi_extra = openapi_extra or {}
        self.responses = responses or {}
        self.admits = admits


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
        return [RouteSpec(route.path, bounded(READERS[route.name]), (route.method,), route.name, route.summary,
                          schemas.SELF_SERVICE.get(route.name), schemas.ERROR_RESPONSES) for route in endpoint.routes]

    async def handle(request: Request) -> Response:
        return await complete(request, api)

    responses = {**schemas.ERROR_RESPONSES, 502: {"description": "no backend answered (plain text)"}}
    return [RouteSpec(route.path, handle, (route.method,), route.name, route.summary, api.openapi_body(), responses,
                      admits=True) for route in endpoint.routes]


def create_app(
    routes: Sequence[RouteSpec],
    gateway: Gateway | Callable[[], Gateway] | None = None,
    observer: Observer | None = None,
) -> "App":
    """An app serving `routes`. The gateway is made on first use (or given, for tests); one made
    here knows whether the app admits requests (its role writes orgs and usage, kiln.gateway)."""
    served = [(HEALTH_PATH, _healthz, ("GET",))]
    served += [(route.path, route.endpoint, route.methods) for route in routes]
    served.append((OPENAPI_PATH, _openapi(routes), ("GET", "HEAD")))  # as FastAPI serves it
    if isinstance(gateway, Gateway):
        return App(served, observer=observer, gateway=gateway)
    admits = any(route.admits for route in routes)
    return App(served, observer=observer, factory=gateway or (lambda: Gateway.from_env(admits=admits)))


class App:
    """The ASGI app of a function: its routes, the gateway's services, one telemetry record per
    request (kiln.observability), errors in the contract's shape.

    Each request goes from the server to its handler in one call: a route is found by its path
    (a dict for the fixed ones, a pattern for the few with a parameter), and the handler's
    answer, or the error it raised, is sent from here. A request's task resumes through every
    frame between the server and the awaiting code each time an answer it waits for arrives
    (three or four times a request), so those frames are kept few."""

    def __init__(self, routes: Sequence[tuple[str, Handler, Sequence[str]]], *, observer: Observer | None = None,
                 gateway: Gateway | None = None, factory: Callable[[], Gateway] | None = None) -> None:
        self.state = State()
        if gateway is not None:
            self.state.gateway = gateway
        self._owns_gateway = gateway is None
        self._factory = factory
        # outermost: it sees every response, the errors' included
        self._observed = ObservabilityMiddleware(self._dispatch, observer=observer,
                                                 quiet_paths=frozenset({HEALTH_PATH}))
        self._fixed: dict[str, dict[str, Handler]] = {}
        self._patterned: list[tuple[re.Pattern[str], dict[str, Handler]]] = []
        for path, endpoint, methods in routes:
            self.add_route(path, endpoint, methods=methods)

    def add_route(self, path: str, endpoint: Handler, methods: Sequence[str]) -> None:
        """Serve `path` (API Gateway's syntax: `{name}` is one segment, `{name+}` any of them)
        with `endpoint` for these methods, exactly (a GET route answers no HEAD)."""
        by_method = dict.fromkeys(methods, endpoint)
        if "{" not in path:
            self._fixed.setdefault(path, {}).update(by_method)
            return
        pattern = _route_pattern(path)
        for known, handlers in self._patterned:
            if known.pattern == pattern.pattern:
                handlers.update(by_method)
                return
        self._patterned.append((pattern, by_method))

    def _route(self, path: str) -> tuple[dict[str, Handler] | None, dict[str, str]]:
        handlers = self._fixed.get(path)
        if handlers is not None:
            return handlers, {}
        for pattern, handlers in self._patterned:
            found = pattern.fullmatch(path)
            if found is not None:
                return handlers, found.groupdict()
        return None, {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind == "http":
            scope["app"] = self
            await self._observed(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "websocket":  # nothing here speaks WebSocket
            await send({"type": "websocket.close", "code": 1000})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                made = self.state._state.get("gateway")
                if made is not None and self._owns_gateway:  # ours to close
                    await made.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _dispatch(self, scope: dict, receive: Any, send: Any) -> None:
        """The route's handler and its response, or the error's in the contract's shape (what
        goes wrong once a response is being sent ends it as the server ends a broken one)."""
        path = scope["path"]
        root = scope.get("root_path")
        if root and path.startswith(root):  # as Starlette routes a path mounted under a root path
            path = path[len(root):]
        handlers, scope["path_params"] = self._route(path)
        request = Request(scope, receive)
        try:
            if self._factory is not None and self.state._state.get("gateway") is None:
                self.state.gateway = self._factory()  # on the first request: a Lambda init must not touch the network
            if handlers is None:
                raise UnknownUrl(f"Unknown request URL: {request.method} {request.url.path}.")
            handler = handlers.get(scope["method"])
            if handler is None:
                raise MethodNotAllowed(f"Method {request.method} is not allowed on {request.url.path}.", handlers)
            response = await handler(request)
        except GatewayError as error:
            response = _answer(request, error)
        except Exception as exc:
            log.error("unexpected error on %s %s", request.method, loggable_path(request.url.path), exc_info=exc)
            response = _answer(request, InternalError("The gateway failed to process the request."))
        await response(scope, receive, send)


def _route_pattern(path: str) -> re.Pattern[str]:
    """A path with parameters as a pattern: `{name}` one segment, `{name+}` one or more (no
    empty value, none that starts or ends with a slash, as API Gateway matches it)."""
    pattern, last = "", 0
    for parameter in _PARAMETER.finditer(path):
        name, greedy = parameter.groups()
        pattern += re.escape(path[last:parameter.start()]) + f"(?P<{name}>{_GREEDY_VALUE if greedy else '[^/]+'})"
        last = parameter.end()
    return re.compile(pattern + re.escape(path[last:]))


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
            openapi_path(route.path),
            route.endpoint,
            methods=list(route.methods),
            name=route.name,
            summary=route.summary,
            openapi_extra=route.openapi_extra or None,
            responses=route.responses or None,
            response_class=Response,
        )
    return JSONResponse(described.openapi()).body


def openapi_path(path: str) -> str:
    """A route's path as the OpenAPI document names it: a parameter is a parameter, greedy or not."""
    return _GREEDY.sub(r"{\1}", path)


_GREEDY = re.compile(r"\{(\w+)\+\}")
_PARAMETER = re.compile(r"\{(\w+)(\+?)\}")  # a route's parameter, greedy or not
_GREEDY_VALUE = r"[^/](?:.*[^/])?"


async def _healthz(request: Request) -> Response:
    """The Web Adapter's readiness check: the process serves; no I/O."""
    return Response(b'{"status":"ok"}', media_type="application/json")


def _answer(request: Request, error: GatewayError) -> Response:
    record_of(request).error_code = error.code
    return error_response(error)


def lambda_handler(app: App) -> Callable[[dict, Any], dict]:
    """The buffered Lambda entry point (API Gateway REST / Function URL events) via Mangum."""
    adapter: list[Any] = []

    def handler(event: dict, context: Any) -> dict:
        if not adapter:
            from mangum import Mangum
            from mangum.protocols import HTTPCycle

            adapter.extend((Mangum(app, lifespan="off"), HTTPCycle))
        mangum, cycle = adapter
        # Mangum's own steps, the event's reading apart: what fails there is the event's fault
        # (answered 400); what fails after it, the app's answer turned into Lambda's, is the
        # gateway's, and raised as a function error, as Mangum would
        try:
            request = mangum.infer(_one_name_per_header(event), context)
            scope, body = request.scope, request.body
        except Exception as exc:
            return _unusable_event(event, exc)
        return request(cycle(scope, body)(app))

    return handler


def _one_name_per_header(event: Any) -> Any:
    """The event with each header that names a key under one name. A REST event keeps names as
    the client wrote them, and Mangum, lowering them, keeps only the last of `Authorization`
    and `authorization`: two keys, one served. Merged, they are two values of one header, which
    is no key at all (`credential`), as the local server and a Function URL have them. Other
    headers are left as they are (two ports merged would be no port). ValueError for a key's
    header of no header's type beside another of its names: the event is no request."""
    if not isinstance(event, dict):
        return event
    merged = None
    for field, kind in (("headers", str), ("multiValueHeaders", list)):
        headers = event.get(field)
        if not isinstance(headers, dict):
            continue
        names = [name for name in headers if isinstance(name, str) and name.lower() in KEY_HEADERS]
        if len(names) == len({name.lower() for name in names}):
            continue  # each named once: nearly every event, passed on as it is
        if not all(isinstance(headers[name], kind) for name in names):
            raise ValueError(f"a key's header in {field} is not a {kind.__name__}")
        rest = {name: value for name, value in headers.items() if name not in names}
        for name in names:
            value = headers[name]
            joined = rest.get(name.lower())
            rest[name.lower()] = value if joined is None else (joined + value if kind is list else f"{joined}, {value}")
        merged = merged if merged is not None else dict(event)
        merged[field] = rest
    return merged if merged is not None else event


def _unusable_event(event: Any, exc: Exception) -> dict:
    """The answer to an invoke no HTTP request makes, in the contract's shape: an answer, not a
    function error (which would page whoever watches the errors alarm). The log names what was
    wrong and the event's top-level fields, never its values (headers hold keys)."""
    fields = sorted(str(name) for name in event) if isinstance(event, dict) else type(event).__name__
    log.warning("unusable Lambda event (%s); its fields: %s", type(exc).__name__, fields)
    error = InvalidEvent("This function serves HTTP requests from API Gateway (REST) and Function URLs; "
                         "the event it was invoked with is not one it can serve.")
    return {"statusCode": error.status, "headers": {"content-type": error.media_type}, "multiValueHeaders": {},
            "body": error.body().decode(), "isBase64Encoded": False}

