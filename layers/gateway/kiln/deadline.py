"""The deadline of a request that calls no model: models, generations, self-service and keys.

Such a request is a few storage calls, and a key's change a dozen one after the other: on a
storage answering slowly, it can outlast its function's 29 s timeout and API Gateway's, and
then the client gets their answer, not the contract's, and the operator a function error. At
its deadline it is cut short and answered 503 `storage_unavailable`, saying whether something
may have been written. A change cut short is one whose later calls failed, which key
management is written for (docs/design.md), and no worse than one Lambda ends.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from .errors import RequestTimeout, StorageUnavailable

__all__ = ["LAMBDA_MARGIN_SECONDS", "bounded", "deadline_of"]

Handler = Callable[[Request], Awaitable[Response]]

# what is kept of an invocation's time for the answer to reach API Gateway (and a log line)
LAMBDA_MARGIN_SECONDS = 3.0
_WRITES = frozenset({"POST", "PATCH", "PUT", "DELETE"})
_WITH_BODY = frozenset({"POST", "PATCH", "PUT"})


def deadline_of(scope: dict[str, Any], configured: float) -> float:
    """Seconds the request may take: `configured`, or less where Lambda says less is left of
    the invocation (Mangum hands its context over in the scope)."""
    remaining = getattr(scope.get("aws.context"), "get_remaining_time_in_millis", None)
    if remaining is None:
        return configured
    try:
        left = float(remaining()) / 1000 - LAMBDA_MARGIN_SECONDS
    except (TypeError, ValueError):  # not Lambda's context: the configured deadline holds
        return configured
    return min(configured, max(left, 0.001))


def bounded(handler: Handler) -> Handler:
    """`handler`, answered 503 once its request's deadline passes (KILN_ANSWER_DEADLINE_SECONDS);
    408 `request_timeout` instead when it is cut while waiting for the request's body (a client
    that sends it slowly: nothing was written)."""

    async def handle(request: Request) -> Response:
        seconds = deadline_of(request.scope, request.app.state.gateway.settings.answer_deadline_seconds)
        arrived = _Arrival(request)
        timer = asyncio.timeout(seconds)
        try:
            async with timer:
                return await handler(arrived.request)
        except TimeoutError:
            if not timer.expired():  # a timeout of the work's own, not the deadline
                raise
            if arrived.waiting:
                raise RequestTimeout("The request's body did not arrive in time.") from None
            raise StorageUnavailable(_late(request, seconds)) from None

    handle.__name__ = handle.__qualname__ = getattr(handler, "__name__", "handle")
    return handle


class _Arrival:
    """The request, telling whether it is waiting for its body to arrive (cut there, the client
    was too slow; anywhere else, storage was). On Lambda the body is handed over whole."""

    def __init__(self, request: Request) -> None:
        self.waiting = False
        if request.method not in _WITH_BODY:
            self.request = request
            return
        receive = request.receive

        async def received() -> Any:
            self.waiting = True
            message = await receive()  # cut here by the deadline, it says so still
            self.waiting = False
            return message

        self.request = Request(request.scope, received)


def _late(request: Request, seconds: float) -> str:
    said = f"Storage did not answer in time: the request was cut short at the gateway's deadline ({seconds:g} s). "
    if request.method not in _WRITES:
        return said + "Nothing was changed; try again."
    if request.method == "POST":
        return said + ("A key may have been made, and its secret is lost with this answer: list the keys "
                       "(GET /v1/keys) and revoke one you did not get before you make another.")
    return said + (f"The change may have been made: read the key (GET {request.url.path}) before you make it "
                   "again.")
