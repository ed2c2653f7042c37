"""HTTP responses: errors in the contract's shape, JSON, and the SSE relay response."""

from __future__ import annotations

import asyncio
import time
from typing import AsyncGenerator, Awaitable, Callable, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from .departure import disconnected
from .errors import GatewayError

__all__ = ["GENERATION_HEADER", "LastPiece", "RelayResponse", "error_response", "json_response"]

GENERATION_HEADER = "X-Neocloud-Generation-Id"
# past a stream's deadline, how often it looks again for a write its client holds
_RECHECK_SECONDS = 0.25


def _generation_headers(gen_id: str | None) -> dict[str, str]:
    return {GENERATION_HEADER: gen_id} if gen_id else {}


def error_response(error: GatewayError, gen_id: str | None = None) -> Response:
    headers = {**error.headers, **_generation_headers(gen_id)}
    return Response(error.body(), status_code=error.status, headers=headers, media_type=error.media_type)


def json_response(body: bytes, gen_id: str | None = None, status: int = 200) -> Response:
    return Response(body, status_code=status, headers=_generation_headers(gen_id), media_type="application/json")


class LastPiece(bytes):
    """The stream's last bytes, which a body generator may mark as such: they go out with the
    end of the body, in one write, instead of the end in a write of its own."""


class RelayResponse(Response):
    """An SSE response whose body generator is always closed, and told when the client leaves.

    While it streams, it also listens for `http.disconnect`: a client that goes away while
    the upstream is silent is noticed at once (the stream is cancelled, so the generator can
    close the upstream request and settle). A failed write closes the generator the same way.
    `on_close` runs last, whatever happened: a generator that never started (the client
    left before the first byte) never ran its own clean-up, and this is its owner's chance.
    A `deadline` ends the stream the same way when the client reads too slowly to finish by then
    (a write it holds is cut; a body still at work, its settle slow, is not),
    and so does `interrupt()`, for its owner: a generator waiting for its source is cancelled
    there (it may then end the stream as it likes); one waiting for the client's reading is
    closed, as for a client that left.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        body: AsyncGenerator[bytes, None],
        gen_id: str,
        headers: Mapping[str, str] | None = None,
        on_close: Callable[[], Awaitable[None]] | None = None,
        deadline: float | None = None,
    ):
        self.body_iterator = body
        self.on_close = on_close
        self.deadline = deadline  # time.monotonic() by which the stream is over, whatever the client reads
        self._end: Callable[[], None] | None = None  # ends the stream while it is sent
        self._timer: asyncio.TimerHandle | None = None  # the deadline's
        self.status_code = 200
        self.background = None
        self.init_headers(
            {
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **_generation_headers(gen_id),
                **(headers or {}),
            }
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The stream runs in a task of its own, which a second task, listening for the client's
        # leaving, cancels when it does (as does the deadline: a client that stops reading holds
        # every write, and past the deadline the stream is cut as if the client had left). A
        # task cancelled once is told once: the body's clean-up (its settle) runs undisturbed,
        # and a stream that ended meanwhile is not cancelled at all. The request's own task
        # only waits for it; a cancellation of that task (a server that stops) reaches the
        # stream through the wait, as it would reach the stream itself.
        loop = asyncio.get_running_loop()
        streamer = loop.create_task(self._send_body(send))
        cut = False

        def end() -> None:
            nonlocal cut
            if not streamer.done():
                cut = True
                streamer.cancel()

        async def listen() -> None:
            # a server that cannot be listened to: never; a failed write still ends the stream
            await disconnected(receive)
            end()

        listener = loop.create_task(listen())
        if self.deadline is not None:
            self._timer = loop.call_later(max(0.0, self.deadline - time.monotonic()), self._overdue, streamer, end)
        self._end = end
        try:
            await streamer
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if not (cut and streamer.cancelled()) or (current is not None and current.cancelling()):
                raise  # not the stream's own end: the request itself was cancelled
        finally:
            self._end = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            listener.cancel()
            await self.body_iterator.aclose()
            if self.on_close is not None:
                await self.on_close()

    def _overdue(self, streamer: asyncio.Task, end: Callable[[], None]) -> None:
        """Past the deadline, only a write the client holds is cut: a body still at work (its
        settle, slow on storage: the generator runs, awaiting inside) goes on, and its last
        piece goes out."""
        if streamer.done():
            return
        if getattr(self.body_iterator, "ag_running", False):
            self._timer = asyncio.get_running_loop().call_later(_RECHECK_SECONDS, self._overdue, streamer, end)
        else:
            end()

    def interrupt(self) -> None:
        """End the stream now, if it is being sent (see the class's docstring)."""
        if self._end is not None:
            self._end()

    async def _send_body(self, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                ended = isinstance(chunk, LastPiece)
                await send({"type": "http.response.body", "body": bytes(chunk), "more_body": not ended})
                if ended:
                    return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:
            pass  # the client went away mid-write; the generator is closed by the caller
