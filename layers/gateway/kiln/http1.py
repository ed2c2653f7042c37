"""The gateway's HTTP/1.1 client: keep-alive pools, TLS, streamed bodies, timeouts.

Both of the gateway's outgoing conversations are plain HTTP/1.1 POSTs: to DynamoDB and
SSM (small JSON answers) and to model servers (JSON answers or SSE streams). This does
exactly that with one asyncio protocol per connection, parsing responses with httptools
(llhttp, which uvicorn already loads to serve the function). A general-purpose client
(httpx, with httpcore, h11 and anyio's socket layer) adds its imports to every cold start
and more CPU per call (docs/performance.md compares the two on one storage call).

A connection goes back to its pool only when its response was read to the end and the
server allows keep-alive; anything else (an error, a timeout, a cancellation, a body left
unread) closes it, so no pool ever holds a connection in an unknown state.

What a server sends is bounded: the status line and headers by `max_header_bytes` and
`max_headers` (checked before the bytes reach the parser, which would otherwise gather a
header of any size), a body read whole by `Response.read(max_bytes=…)`.
"""

from __future__ import annotations

import asyncio
import select
import ssl
import time
from collections import deque
from functools import lru_cache
from typing import AsyncIterator, Callable
from urllib.parse import SplitResult, urlsplit

import httptools

__all__ = [
    "BodyTooLarge", "ConnectFailed", "ConnectTimeout", "HttpClient", "HttpError", "ProtocolFailure", "Response",
    "ResponseTooLarge", "Timeout", "Unaddressable", "canonical_host", "sooner",
]

# unread bytes beyond which a connection stops reading from its socket (as asyncio's streams do)
RECEIVE_BOUND = 128 * 1024
# Defaults for any server; the model servers' come from the catalog (kiln.catalog.Limits).
MAX_HEADER_BYTES = 64 * 1024
MAX_HEADERS = 256


class HttpError(Exception):
    """The exchange failed at the transport level; the subclasses say how."""


class ConnectFailed(HttpError):
    """No connection: refused, unreachable, TLS handshake failed."""


class Unaddressable(ConnectFailed):
    """No connection can be made as the URL is written: no resolver takes its host, or no
    request line carries its path (a catalog's mistake, never the network's)."""


class Timeout(HttpError):
    """Nothing arrived (or could be sent) in time."""


class ConnectTimeout(Timeout):
    """The connection (TCP, TLS) was not established in time."""


class ProtocolFailure(HttpError):
    """The connection closed mid-response, or the response was not HTTP/1.1."""

    def __init__(self, message: str, *, nothing_received: bool = False) -> None:
        super().__init__(message)
        # the server closed before answering anything: on a reused connection, safe to retry
        self.nothing_received = nothing_received


class ResponseTooLarge(ProtocolFailure):
    """The status line and headers went beyond their bound (bytes or count)."""


class BodyTooLarge(HttpError):
    """A body read whole went beyond its bound."""


class _Origin:
    __slots__ = ("scheme", "host", "port")

    def __init__(self, scheme: str, host: str, port: int) -> None:
        self.scheme = scheme
        self.host = host
        self.port = port

    @property
    def key(self) -> tuple[str, str, int]:
        return self.scheme, self.host, self.port


class _Connection(asyncio.Protocol):
    """One connection, as its transport reports it: what the server sent that was not read yet,
    whether it ended, and whether writing must wait for the kernel to take what was written.

    A read takes everything received so far. Each wait for more is a future of its own, woken
    by the transport's callbacks; a timeout sets it (no timer scope around the waiting task).
    One timer serves the waits that follow each other: armed by a wait, it is kept when data
    ends the wait, and when it fires it ends the wait then under way if that wait's time is up,
    or is armed again for it (a stream's reads, each bounded by a later instant than the one
    before, arm one timer, not one each).
    Reading from the socket pauses while more than `RECEIVE_BOUND` bytes wait unread, as
    asyncio's stream reader pauses, so a server that sends faster than its answer is taken
    holds no more than that in memory."""

    def __init__(self, origin: _Origin) -> None:
        self.origin = origin
        # made by the loop it serves (its protocol factory): each wait is a future of that loop,
        # each timer its handle (asked for each time, the loop is looked up anew: under Python 3.11, with a system call)
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.received = bytearray()
        self.ended = False  # the server closed its side, or the connection was lost
        self.lost = False  # connection_lost came
        self.failure: BaseException | None = None  # how it was lost, when by an error
        self._waiter: asyncio.Future | None = None
        self._deadline: float | None = None  # when the wait under way ends (the loop's time); None: no bound
        self._timer: asyncio.TimerHandle | None = None  # armed for `_timer_at`, or None
        self._timer_at = 0.0
        self._writable: asyncio.Future | None = None  # set while the transport's buffer is full
        self._reading_paused = False
        self.idle_since = time.monotonic()
        self.reused = False
        # the socket's, for what the kernel holds that the transport has not handed on: bytes, its
        # end or an error (a transport with no socket to ask is not asked)
        self._socket_poll: select.poll | None = None

    # -- the transport's callbacks --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.fileno() >= 0:  # asked at each checkout (usable)
            self._socket_poll = select.poll()
            self._socket_poll.register(sock.fileno(), select.POLLIN)

    def data_received(self, data: bytes) -> None:
        self.received += data
        if len(self.received) > RECEIVE_BOUND and not self._reading_paused:
            self._reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # nothing more is written after the server's end: close

    def connection_lost(self, exc: BaseException | None) -> None:
        self.ended = self.lost = True
        self.failure = exc
        self._wake()
        self._stop_timer()
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = self._loop.create_future()

    def resume_writing(self) -> None:
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- what the client does with it ----------------------------------------------------

    def usable(self, expiry: float) -> bool:
        return (
            not self.ended
            and not self.transport.is_closing()  # type: ignore[union-attr]
            # bytes the server sent while the connection was idle answer no request: read by
            # the next one they would be its answer; those the loop has not handed on yet (it
            # was busy when they came) wait in the kernel, which is asked too
            and not self.received
            and time.monotonic() - self.idle_since < expiry
            and not (self._socket_poll is not None and self._socket_poll.poll(0))
        )

    def unread(self) -> bytearray:
        """What the server sent that was not read yet (the buffer itself, not a copy)."""
        return self.received

    async def read(self, timeout: float | None) -> bytes:
        """Everything the server sent that was not read yet, waiting for some at most `timeout`
        seconds (None: no bound; TimeoutError past it): b"" once it has closed and all was read.
        A connection lost by an error raises that error, whatever it had received, as asyncio's
        stream reader does."""
        while True:
            if self.failure is not None:
                raise self.failure
            received = self.received
            if received:
                data = bytes(received)
                received.clear()
                if self._reading_paused:
                    self._reading_paused = False
                    self.transport.resume_reading()  # type: ignore[union-attr]
                return data
            if self.ended:
                return b""
            loop = self._loop
            waiter = self._waiter = loop.create_future()
            if timeout is None:
                await waiter
                continue
            deadline = self._deadline = loop.time() + max(0.0, timeout)
            # a timer armed for a later instant is armed again for this one, unless it is later by
            # less than a step of the loop's clock (uvloop's: whole milliseconds; the same instant
            # read twice may come out one apart)
            if self._timer is None or self._timer_at > deadline + _CLOCK_STEP:
                self._arm_timer(deadline)
            try:
                await waiter
            finally:
                self._deadline = None

    def _timer_fired(self) -> None:
        """The timer armed for `_timer_at` fired: the wait under way ends if it was armed for it
        (or a sooner instant), else it is armed again for that wait's own. A timer may fire a
        little early (uvloop counts whole milliseconds): the callers wait out the rest."""
        at, self._timer = self._timer_at, None
        deadline, waiter = self._deadline, self._waiter
        if deadline is None or waiter is None or waiter.done():
            return  # no bounded wait under way: the next one arms its own
        if deadline > at:  # armed by a wait before this one, which ended sooner
            self._arm_timer(deadline)
        else:
            waiter.set_exception(TimeoutError())

    def _arm_timer(self, at: float) -> None:
        """The timer armed for `at` (the loop's time), in place of any armed before."""
        self._stop_timer()
        self._timer, self._timer_at = self._loop.call_at(at, self._timer_fired), at

    def _stop_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()

    def write(self, data: bytes) -> None:
        self.transport.write(data)  # type: ignore[union-attr]

    async def drain(self, timeout: float | None) -> None:
        """Wait until the kernel has taken what was written (TimeoutError past `timeout`);
        ConnectionResetError when the connection is lost, as asyncio's stream writer says it."""
        if self.failure is not None:
            raise self.failure
        if self.lost:
            raise ConnectionResetError("Connection lost")
        writable = self._writable
        if writable is not None:
            async with asyncio.timeout(timeout):
                await writable
        elif self.transport.is_closing():  # type: ignore[union-attr]
            await asyncio.sleep(0)  # let connection_lost come, as asyncio's writer does
        else:
            return
        if self.lost:
            raise ConnectionResetError("Connection lost")

    def close(self) -> None:
        if not self.transport.is_closing():  # type: ignore[union-attr]
            self.transport.close()  # type: ignore[union-attr]


# what the event loop's clock may be off by, read twice for the same instant (uvloop's counts whole milliseconds)
_CLOCK_STEP = 0.001


class _Message:
    """httptools' callbacks for one response."""

    __slots__ = ("status", "headers", "headers_complete", "complete", "pending", "keep_alive", "parser", "max_headers",
                 "interim", "relaxed", "coded", "max_header_bytes", "fed", "body_bytes", "pieces")

    def __init__(
        self,
        status: int = 0,
        headers: list[tuple[bytes, bytes]] | None = None,
        headers_complete: bool = False,
        complete: bool = False,
        pending: deque | None = None,
    ) -> None:
        self.status = status
        self.headers = headers if headers is not None else []
        self.headers_complete = headers_complete
        self.complete = complete
        self.pending = pending if pending is not None else deque()
        self.keep_alive = False
        self.parser: object = None
        self.max_headers = MAX_HEADERS
        self.interim = False  # parsing a 1xx answer, which the final one follows
        self.relaxed = False  # the parser goes on past a 1xx that would close the connection
        self.coded = False  # a Transfer-Encoding header came (checked once the headers are in)
        self.max_header_bytes = MAX_HEADER_BYTES
        self.fed = 0  # bytes fed to the parser…
        self.body_bytes = 0  # …of which the body's (the rest frames it: `_fed` bounds it)
        self.pieces = 0  # the body's pieces: at least one a chunk

    def on_message_begin(self) -> None:
        if self.complete:  # the server goes on past its answer: it says more than it was asked
            self.keep_alive = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.complete or self.headers_complete:
            # a message after the answer (see on_headers_complete), or a chunked body's trailer:
            # neither is a header of the answer (h11 keeps trailers apart, this client drops them)
            return
        if len(self.headers) <= self.max_headers:  # one more than allowed is kept: the caller sees it and refuses
            name = name.lower()
            if name == b"transfer-encoding":
                self.coded = True
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.complete:
            # The server went on past its answer (a stray 1xx after it, say): that answer
            # stands as it was, and a connection that says more than it was asked is not reused.
            self.keep_alive = False
            return
        status = self.parser.get_status_code()
        if status < 100:  # no HTTP status (RFC 9110 §15), though the parser reads three digits
            raise ProtocolFailure(f"malformed response: status {status:03d}")
        if 100 <= status < 200 and status != 101:
            # An interim answer (100 Continue, 103 Early Hints…) is not the answer: its
            # headers are dropped and the parser goes on to the final one, which follows on
            # the same connection (RFC 9110 §15.2). Its bytes count in the headers' bound.
            self.interim = True
            self.headers.clear()
            self.coded = False
            # an HTTP/1.0 server's 1xx (HTTP/1.0 has none, some send one) reads as a message
            # that closes the connection: the final answer after it is read all the same
            self.parser.set_dangerous_leniencies(lenient_keep_alive=True)
            self.relaxed = True
            return
        if self.relaxed:  # for interim answers only: the final one is read as strictly as ever
            self.parser.set_dangerous_leniencies(lenient_keep_alive=False)
            self.relaxed = False
        self.status = status  # the final answer's, whatever the parser reads after it
        self.headers_complete = True
        # asked now: once the message is complete the parser has reset its flags. An HTTP/1.0
        # answer's connection is closed after it, its keep-alive asked for or not, as h11 does
        # (one framed as chunked is faulty framing besides: RFC 9112 §6.1)
        self.keep_alive = self.parser.should_keep_alive() and self.parser.get_http_version() != "1.0"

    def on_body(self, body: bytes) -> None:
        if not self.complete:
            self.body_bytes += len(body)
            self.pieces += 1  # each chunk's data comes in one piece at least (its size is not 0)
            self.pending.append(bytes(body))

    def on_message_complete(self) -> None:
        if self.interim:  # the end of a 1xx, not of the answer
            self.interim = False
            return
        self.complete = True


class Response:
    """A response whose status and headers have arrived; the body is read on demand."""

    def __init__(
        self, client: "HttpClient | None", connection: "_Connection | None", parser: object, message: _Message,
        read_timeout: float | None, spoiled: "ProtocolFailure | None" = None,
    ) -> None:
        self._client = client
        self._connection = connection
        self._parser = parser
        self._message = message
        self._read_timeout = read_timeout
        self.status = message.status
        self.headers = message.headers
        self._closed = False
        self._silent_since: float | None = None  # when the current wait for the body began
        self._spoiled = spoiled  # malformed bytes came after the pieces still to take (`_fed`)

    @classmethod
    def complete(cls, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> "Response":
        """A response already in hand (tests, injected faults)."""
        message = _Message(status, headers or [], True, True, deque([body] if body else []))
        return cls(None, None, None, message, None)

    def header(self, name: str) -> str | None:
        wanted = name.lower().encode()
        for key, value in self.headers:
            if key == wanted:
                return value.decode("latin-1")
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives (`next_piece`: each wait bounded by the read timeout)."""
        try:
            while piece := await self.next_piece():
                yield piece
        except BaseException:  # a body left unread midway is never reused
            self._discard()
            raise

    async def next_piece(self, until: float | None = None) -> bytes | None:
        """What of the body has arrived and was not taken yet, in one piece (the chunks that came
        in one read are joined), b"" once all of it has: a stream read one read at a time, with
        no task or generator around each wait.

        None when nothing came by `until` (a `time.monotonic()` instant): nothing is lost, the
        next call goes on waiting. Silence is still bounded by the read timeout, counted from
        when it began whatever `until` was, and raises Timeout as `chunks` does; any failure,
        or a cancellation, closes the connection."""
        message = self._message
        if message.pending:
            return _taken(message.pending)
        if message.complete:
            self._release()
            return b""
        connection = self._connection
        assert connection is not None
        try:
            if self._spoiled is not None:
                raise self._spoiled
            if self._silent_since is None:
                self._silent_since = time.monotonic()
            while True:
                limit = None if self._read_timeout is None else self._silent_since + self._read_timeout
                wake = until if limit is None else limit if until is None or limit <= until else until  # sooner()
                try:
                    data = await connection.read(None if wake is None else wake - time.monotonic())
                except TimeoutError:
                    now = time.monotonic()
                    if limit is not None and now >= limit:
                        raise Timeout("the server sent nothing in time") from None
                    if until is not None and now >= until:
                        return None
                    # the timer woke before either instant (uvloop counts whole milliseconds):
                    # the rest is waited out, never taken for the caller's quiet or the body's end
                    continue
                except OSError as exc:
                    raise ProtocolFailure(f"connection lost: {exc}") from exc
                self._silent_since = None
                if not data:
                    if message.headers_complete and _delimited_by_close(message.headers):
                        message.complete = True
                    else:
                        raise ProtocolFailure("the server closed the connection before the response was complete")
                else:
                    self._spoiled = _fed(self._parser, message, data)
                if message.pending:
                    return _taken(message.pending)
                if message.complete:
                    self._release()
                    return b""
                if self._spoiled is not None:
                    raise self._spoiled
                self._silent_since = time.monotonic()
        except BaseException:
            self._discard()
            raise

    async def read(self, limit: int | None = None, *, max_bytes: int | None = None) -> bytes:
        """The whole body. `limit`: keep that much, drop the rest with the connection (error
        bodies). `max_bytes`: a longer body is refused (BodyTooLarge), at its declared length
        already if it has one, and never held in memory beyond the bound."""
        if max_bytes is not None:
            declared = self.header("content-length")
            if declared is not None and declared.isascii() and declared.strip().isdigit() and int(declared) > max_bytes:
                self._discard()
                raise BodyTooLarge(f"the body is {int(declared)} bytes, more than {max_bytes}")
        parts, size = [], 0
        while part := await self.next_piece():  # any failure there closes the connection
            parts.append(part)
            size += len(part)
            if limit is not None and size >= limit:
                self._discard()
                break
            if max_bytes is not None and size > max_bytes:
                self._discard()
                raise BodyTooLarge(f"the body is more than {max_bytes} bytes")
        return b"".join(parts)[:limit] if limit is not None else b"".join(parts)

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        # the whole message is in: its callbacks need no parser, and the two let go of each other
        self._message.parser = None
        if self._connection is not None and self._client is not None:
            self._client._release(self._connection, self._message.complete and self._message.keep_alive)

    def _discard(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._connection is not None and self._client is not None:
            self._client._drop(self._connection)

    async def aclose(self) -> None:
        """Done with it: a body read to the end keeps its connection, anything else closes it."""
        if self._message.complete and not self._message.pending:
            self._release()
        else:
            self._discard()


class HttpClient:
    def __init__(
        self,
        *,
        ssl_context: Callable[[], ssl.SSLContext],
        keepalive_expiry: float = 30.0,
        max_idle_per_origin: int = 64,
    ) -> None:
        self._ssl_context = ssl_context
        self._expiry = keepalive_expiry
        self._max_idle = max_idle_per_origin
        self._idle: dict[tuple[str, str, int], deque[_Connection]] = {}
        self._open: set[_Connection] = set()

    @property
    def open_connections(self) -> int:
        """Connections in use or idle in the pool (closed ones are forgotten at once)."""
        return len(self._open)

    @property
    def idle_connections(self) -> int:
        """Connections back in the pool, ready for another request."""
        return sum(len(pool) for pool in self._idle.values())

    async def request(
        self,
        method: str,
        url: str,
        *,
        headers: dict[str, str],
        body: bytes,
        connect_timeout: float | None = None,
        read_timeout: float | None = None,
        max_header_bytes: int = MAX_HEADER_BYTES,
        max_headers: int = MAX_HEADERS,
        head_timeout: float | None | str = "read_timeout",
        on_sending: Callable[[], None] | None = None,
        resend_unanswered: bool = True,
    ) -> Response:
        """Send the request and wait for the status line and headers (not the body).

        Each wait for the headers is bounded by `head_timeout` (by default the read timeout;
        None when the caller bounds the whole wait itself), each read of the body by
        `read_timeout`. `on_sending` is called as the request is written, once a connection
        to the server is there (not for one that could not be made). A request whose kept-alive
        connection closes without a word is sent once more on a new one, unless
        `resend_unanswered` is false: the server may have taken it, and a request that must not
        be applied twice (a DynamoDB ADD) is then the caller's to judge."""
        head_wait = read_timeout if head_timeout == "read_timeout" else head_timeout
        try:
            origin, target, host = _addressed(url)
            lines = [f"{name}: {value}\r\n" for name, value in headers.items() if name.lower() not in _FRAMING]
            if len(lines) != len(headers):  # a Host or a Content-Length was given: the first Host is sent
                host = next((value for name, value in headers.items() if name.lower() == "host"), None) or host
            block = "".join(lines)
            # a line break or a NUL in a name or a value (a key read from a file with its newline)
            # would end the line where the server reads another header, or another request: refused,
            # as h11 refuses it (counted over the whole block: one line end a header, no more)
            if (block.count("\r") != len(lines) or block.count("\n") != len(lines) or "\0" in block
                    or not host.isprintable()):
                raise ValueError("a header name or value holds a line break or a NUL")
            wire = (f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n{block}"
                    "\r\n").encode("latin-1") + body
        except ValueError as exc:  # UnicodeError too: a URL or header no request line can carry
            raise Unaddressable(f"no request can be sent to {url[:200]!r}: {exc}") from None
        unanswered: ProtocolFailure | None = None
        for attempt in range(2):
            try:
                connection = await self._connection(origin, connect_timeout)
            except HttpError:
                if unanswered is not None:
                    # the request went out on the kept-alive connection and may have been
                    # taken: that, not the new connection's failure, is what the caller learns
                    raise unanswered from None
                raise
            if on_sending is not None:
                on_sending()
            try:
                return await self._exchange(connection, wire, read_timeout, head_wait, max_header_bytes, max_headers)
            except ProtocolFailure as exc:
                self._drop(connection)
                # a kept-alive connection the server had already closed: once more on a new one
                if attempt == 0 and connection.reused and exc.nothing_received and resend_unanswered:
                    unanswered = exc
                    continue
                raise
            except BaseException:
                self._drop(connection)
                raise
        raise AssertionError("unreachable")

    async def _exchange(
        self, connection: _Connection, wire: bytes, read_timeout: float | None, head_timeout: float | None,
        max_header_bytes: int, max_headers: int,
    ) -> Response:
        message = _Message()
        message.max_headers = max_headers
        message.max_header_bytes = max_header_bytes
        parser = httptools.HttpResponseParser(message)
        message.parser = parser
        try:
            connection.write(wire)
            # the kernel did not take it all: wait, bounded (nearly every request has nothing to
            # wait for; a connection already lost still raises)
            await connection.drain(read_timeout)
        except TimeoutError:
            early = self._early_answer(connection, parser, message, read_timeout, max_header_bytes, max_headers)
            if early is None:
                raise Timeout("the request could not be sent in time") from None
            return early
        except OSError as exc:
            early = self._early_answer(connection, parser, message, read_timeout, max_header_bytes, max_headers)
            if early is None:
                raise ProtocolFailure(f"connection lost while sending: {exc}", nothing_received=True) from exc
            return early
        head = 0  # bytes of the status line and headers fed so far
        spoiled: ProtocolFailure | None = None
        start: bytes | None = b""  # the answer's first bytes, until they show its protocol (then None)
        while not message.headers_complete:
            data = await _read(connection, head_timeout, "no response in time", nothing_received=not head)
            if not data:
                raise ProtocolFailure("the server closed the connection without answering", nothing_received=not head)
            if start is not None:
                start = None if not start and data.startswith(_PROTOCOL) else _protocol_shown(start, data)
            # never more than the bound reaches the parser before the headers are complete
            piece = data[: max_header_bytes - head] if head + len(data) > max_header_bytes else data
            head += len(piece)
            spoiled = _fed(parser, message, piece)
            if len(message.headers) > max_headers:
                raise ResponseTooLarge(f"more than {max_headers} response headers")
            if not message.headers_complete:
                if head >= max_header_bytes:
                    raise ResponseTooLarge(f"response headers over {max_header_bytes} bytes")
            elif len(piece) < len(data) and spoiled is None:
                spoiled = _fed(parser, message, data[len(piece):])  # the body's start, read with the headers' end
        if message.coded:
            _check_framing(message.headers)
        return Response(self, connection, parser, message, read_timeout, spoiled)

    def _early_answer(self, connection: _Connection, parser: object, message: _Message, read_timeout: float | None,
                      max_header_bytes: int, max_headers: int) -> Response | None:
        """The answer a server sent before it read the whole request (a 413 to a body too
        large, then a reset or no more reading), if its head is already here: that is the
        response, as httpx takes it, on a connection never used again. None otherwise."""
        buffered = bytes(connection.unread())
        head = buffered[:max_header_bytes]
        if not head.lstrip(b"\r\n").startswith(_PROTOCOL):
            return None
        spoiled = _fed(parser, message, head)
        if not message.headers_complete or len(message.headers) > max_headers:
            return None
        if message.coded:
            _check_framing(message.headers)
        if spoiled is None and len(head) < len(buffered):
            spoiled = _fed(parser, message, buffered[len(head):])
        message.keep_alive = False
        if not message.complete:
            # the rest of its body can only come from a connection that failed: it is not read
            spoiled = spoiled or ProtocolFailure("connection lost after an answer sent before the request was read")
        return Response(self, connection, parser, message, read_timeout, spoiled)

    async def _connection(self, origin: _Origin, connect_timeout: float | None) -> _Connection:
        idle = self._idle.get(origin.key)
        while idle:
            connection = idle.pop()
            if connection.usable(self._expiry):
                connection.reused = True
                return connection
            self._drop(connection)
        try:
            async with asyncio.timeout(connect_timeout):
                loop = asyncio.get_running_loop()
                if origin.scheme == "https":
                    _, connection = await loop.create_connection(
                        lambda: _Connection(origin), origin.host, origin.port, ssl=self._ssl_context(),
                        server_hostname=origin.host,
                    )
                else:
                    _, connection = await loop.create_connection(lambda: _Connection(origin), origin.host, origin.port)
        except TimeoutError:
            raise ConnectTimeout(f"could not connect to {origin.host}:{origin.port} in time") from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(f"could not connect to {origin.host}:{origin.port}: {exc}") from exc
        except ValueError as exc:
            # UnicodeError among them: a host no resolver takes (an empty or 64-character
            # label, a NUL), as unreachable as one that refuses
            raise Unaddressable(f"no resolver takes the host {origin.host[:100]!r}: {exc}") from exc
        self._open.add(connection)
        return connection

    def _release(self, connection: _Connection, keep: bool) -> None:
        idle = self._idle.setdefault(connection.origin.key, deque())
        if keep and len(idle) < self._max_idle and not connection.transport.is_closing():
            connection.idle_since = time.monotonic()
            idle.append(connection)
        else:
            self._drop(connection)

    def _drop(self, connection: _Connection) -> None:
        connection.close()
        self._open.discard(connection)

    async def aclose(self) -> None:
        for connection in list(self._open):
            connection.close()
        self._open.clear()
        self._idle.clear()


@lru_cache(maxsize=256)
def _addressed(url: str) -> tuple[_Origin, str, str]:
    """Where a URL's request goes, its request target and its Host, worked out once per URL
    (a gateway calls the same few URLs over and over). ValueError for one no request can be
    sent to as written."""
    if not url.isprintable():  # urlsplit drops tabs and line breaks: the URL would be another one
        raise ValueError("a URL with control characters")
    parts = urlsplit(url)
    origin = _Origin(parts.scheme, parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80))
    if not origin.host.isascii():
        # the resolver and TLS would map it by IDNA 2003, which sends some names to another
        # host than the one meant (a browser maps by UTS 46): written in IDNA (xn--…), it is
        # called as written
        raise ValueError("a host outside ASCII: write it in IDNA (xn--…)")
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if not (target.isascii() and target.isprintable()) or " " in target:
        # a server would read a blank as the request line's end, and bytes outside ASCII as
        # whatever it decodes them as: percent-encoded, it is one target to every reader
        raise ValueError("a path or query with blanks, control characters or non-ASCII: percent-encode it")
    return origin, target, canonical_host(parts)


def canonical_host(parts: SplitResult) -> str:
    """The Host of a URL: lower case, no user info, the port only when not the scheme's own."""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"  # IPv6
    if parts.port is not None and parts.port != {"http": 80, "https": 443}.get(parts.scheme):
        host = f"{host}:{parts.port}"
    return host


async def _read(connection: _Connection, timeout: float | None, timeout_message: str, *,
                nothing_received: bool = False) -> bytes:
    """What the server sent next (b"" once it closed), waiting at most `timeout`."""
    try:
        return await connection.read(timeout)
    except TimeoutError:
        raise Timeout(timeout_message) from None
    except OSError as exc:
        raise ProtocolFailure(f"connection lost: {exc}", nothing_received=nothing_received) from exc


def sooner(a: float | None, b: float | None) -> float | None:
    """The earlier of two instants, either of which may be none."""
    return b if a is None else a if b is None else min(a, b)


def _taken(pending: deque) -> bytes:
    """Every piece waiting, as one."""
    if len(pending) == 1:
        return pending.popleft()
    joined = b"".join(pending)
    pending.clear()
    return joined


def _fed(parser: object, message: _Message, data: bytes) -> ProtocolFailure | None:
    """Feed `data`; malformed bytes after some of the body (the end of a body followed by bytes
    that are not HTTP, or a body broken midway) are returned, not raised: what came before them
    is handed over first, the connection is never reused, and an unfinished body then fails.
    Malformed bytes before any of the body raise at once."""
    try:
        _feed(parser, data)
        message.fed += len(data)
        # what frames a chunked body (the head, chunk sizes and their extensions, trailers) is
        # bounded as the head is: a trailer or a chunk size line that never ends was held, or kept
        # the read timeout from ever firing, however long (h11 stops such a buffer at 16 KiB). A
        # body of a known length has no framing the parser would hold.
        if message.coded:
            framing = message.fed - message.body_bytes
            bound = 2 * message.max_header_bytes + CHUNK_FRAMING_BYTES * message.pieces
            if framing > bound:
                raise ResponseTooLarge(f"the response's framing (its head, chunk sizes and extensions, trailers) is "
                                       f"over {bound} bytes: {CHUNK_FRAMING_BYTES} a chunk, and twice the headers' bound")
    except ProtocolFailure as exc:
        if not (message.headers_complete and (message.complete or message.pending)):
            raise
        message.keep_alive = False
        return exc
    return None


def _feed(parser: object, data: bytes) -> None:
    try:
        parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        # 101 Switching Protocols (or an upgrade): no HTTP answer to a POST will follow
        raise ProtocolFailure("the server switched protocols instead of answering") from None
    except httptools.HttpParserError as exc:
        if isinstance(exc.__context__, ProtocolFailure):  # a callback's own (_Message), said as it is
            raise exc.__context__ from None
        raise ProtocolFailure(f"malformed response: {exc}") from exc


_PROTOCOL = b"HTTP/"
# what a chunk's size line and the line end after its data may take (a size in hex and its CRLFs;
# extensions, which no model server or AWS sends, are held to the rest)
CHUNK_FRAMING_BYTES = 64
# the headers the client writes itself, whatever it is given
_FRAMING = frozenset({"host", "content-length"})


def _protocol_shown(start: bytes, data: bytes) -> bytes | None:
    """The answer's first bytes so far, `data` added, or None once they show HTTP's protocol;
    ProtocolFailure if they show another (the parser reads RTSP and ICE status lines too).
    Empty lines before the status line are skipped (RFC 9112 §2.2), as the parser does."""
    start = (start + data[:64]).lstrip(b"\r\n")[: len(_PROTOCOL)]
    if not _PROTOCOL.startswith(start):
        raise ProtocolFailure("the answer is not HTTP: its status line does not start with HTTP/")
    return None if len(start) == len(_PROTOCOL) else start


def _check_framing(headers: list[tuple[bytes, bytes]]) -> None:
    """Of an answer with a Transfer-Encoding header: a transfer coding other than chunked once is refused (as h11 does): the client decodes
    none but chunked (it asks for identity), so such a body would be handed over still coded."""
    codings = [value for name, value in headers if name == b"transfer-encoding"]
    # blanks around a coding are spaces only: the parser reads `chunked` and a tab as no coding
    if len(codings) > 1 or [part.strip(b" ").lower() for part in codings[0].split(b",")] != [b"chunked"]:
        shown = b", ".join(codings).decode("latin-1")[:100]
        raise ProtocolFailure(f"a transfer coding this client does not decode: {shown!r} (only chunked is)")


def _delimited_by_close(headers: list[tuple[bytes, bytes]]) -> bool:
    """A body with neither a length nor chunked encoding ends when the server closes."""
    names = {name for name, _ in headers}
    chunked = any(name == b"transfer-encoding" and b"chunked" in value.lower() for name, value in headers)
    return b"content-length" not in names and not chunked
