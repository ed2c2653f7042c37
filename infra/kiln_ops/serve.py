"""Serving ASGI apps with uvicorn: in the foreground (the CLI) or in a thread (tests).

uvicorn waits for a request's headers and body as long as the client likes (a client that
sends one byte a minute holds a connection for ever) and answers a malformed request with a
plain-text 400. The protocol here bounds both waits (`header_timeout`, `body_timeout`: 408
in the contract's JSON error shape, or a plain close when nothing was received) and answers
what httptools cannot parse (bad framing, oversized or invalid headers) or HTTP/1.1 forbids (no
Host, two) with a JSON 400. It declines an upgrade offer (h2c, WebSocket: the request answered as
HTTP/1.1), keeps trailer fields out of the headers, and bounds a pipelined request's wait only
from when the answer before it ends, never writing into that answer.
What it cannot do: a request whose method or URL uvicorn's own code refuses after parsing
(a non-ASCII path) still gets uvicorn's answer, and a client that stops reading a response
is bounded only by the app's own write timeouts. The deployed functions run uvicorn behind
the Lambda Web Adapter on loopback (functions/run.sh): API Gateway and the Function URL read
the whole request before the function is invoked, so no slow client reaches it there.
"""

from __future__ import annotations

import errno
import json
import re
import socket
import sys
import threading
import time
from typing import Any, Callable

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["HEADER_TIMEOUT", "BODY_TIMEOUT", "MAX_HEAD_BYTES", "BoundedHttpProtocol", "ServerThread", "free_port",
           "inherited_socket", "listen_as", "listening_socket", "read_body", "serve", "served_url"]

# A client's whole request head must arrive within this, and its body within the next.
HEADER_TIMEOUT = 10.0
BODY_TIMEOUT = 30.0
# The most a request's line and headers may take (API Gateway takes 10 KiB of headers)
MAX_HEAD_BYTES = 64 * 1024
# Headers the Lambda Web Adapter sets in AWS (the invocation's ids): locally no one does, and a
# client's own are not taken for them
_AWS_SET = frozenset((b"x-amzn-request-context", b"x-amzn-lambda-context"))
# RFC 3986's host (an IP literal, or a name of unreserved, sub-delims and %-escapes) and port
_HOST = re.compile(rb"(\[[0-9A-Za-z:.%~_-]*\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(:[0-9]*)?")


async def read_body(receive: Any) -> bytes:
    """An ASGI request's whole body (what came before a disconnect, if the client left)."""
    parts = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(parts)


def _error_response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
                      separators=(",", ":")).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with read timeouts and the contract's error shape."""

    header_timeout = HEADER_TIMEOUT
    body_timeout = BODY_TIMEOUT

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer: Any = None
        self._received = False
        self._head_open, self._head_bytes = False, 0
        self._answering: Any = None  # the request whose app runs (others wait behind it, unread)
        self._refused = False  # a malformed request's 400 waits for the answers before it
        self._resuming = False  # reading the body of a request whose upgrade offer was declined
        self._arm(self.header_timeout, "headers")

    def _arm(self, seconds: float, what: str) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(seconds, self._read_timed_out, what)

    def _disarm(self) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
            self._read_timer = None

    # httptools keeps a request's head however long it grows: it is bounded here by what the
    # parser hands over (the URL, each header when it is whole), and by the whole of each read
    # that begins and ends inside the head (a header that never ends grows there unseen); the
    # read a head begins in may end another request's body, so only the parser's count is its.

    def data_received(self, data: bytes) -> None:
        if self._refused:  # nothing after a malformed request is read
            return
        self._received = True
        inside = self._head_open  # a head begun in an earlier read, not finished
        counted = self._head_bytes
        self._feed(data)
        if inside and self._head_open and not self.transport.is_closing():
            self._head_bytes = counted + max(len(data), self._head_bytes - counted)
            if self._head_bytes > MAX_HEAD_BYTES:
                self.send_400_response("request head too large")

    def _feed(self, data: bytes) -> None:
        while data and not self.transport.is_closing():
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
                return
            except httptools.HttpParserError:
                self.send_400_response("Invalid HTTP request received.")
                return
            except httptools.HttpParserUpgrade as offer:
                data = self._decline_upgrade(data[offer.args[0]:])

    def _decline_upgrade(self, rest: bytes) -> bytes:
        """A request that offers an upgrade (h2c, which curl --http2 and Java's HttpClient offer
        on http: URLs; a WebSocket) is answered as HTTP/1.1, as RFC 9110 §7.8 allows. The
        parser took the offer for a switch: it ended the request at its head and stopped. The
        request's body, and what follows it, are read by a new parser, told the body's framing:
        what to feed it is returned."""
        cycle = self.cycle
        self.parser = httptools.HttpRequestParser(self)
        # as uvicorn's own parser: a request after one that closes the connection is not an error
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        framing = _body_framing(self.headers)
        if framing and cycle is not None and not cycle.response_complete:
            cycle.more_body = True  # its body is still to come
            self._resuming = True
            if not self._queued(cycle):  # a queued request's body's time starts when it is read
                self._arm(self.body_timeout, "body")
            rest = b"POST / HTTP/1.1\r\n" + framing + b"\r\n\r\n" + rest
        return rest

    def _queued(self, cycle: Any) -> bool:
        """Whether the request waits, unread, behind one still answered."""
        return any(waiting is cycle for waiting, _ in self.pipeline)

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > MAX_HEAD_BYTES:
            raise ValueError("request head too large")  # the parser's error: answered as a 400

    def on_url(self, url: bytes) -> None:
        if self._resuming:
            return
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._resuming:
            return
        self._count_head(len(name) + len(value) + 4)
        if not self._head_open:
            return  # a trailer field: never merged into the headers (RFC 9110 §6.5.1)
        if name.lower() in _AWS_SET:
            return
        super().on_header(name, value)

    def on_message_begin(self) -> None:
        if self._resuming:
            return
        self._head_open, self._head_bytes = True, 0
        super().on_message_begin()
        if self._read_timer is None and not self.pipeline:  # a kept-alive connection's next request
            # (behind a queued request the connection is not read: the head's time starts when it is)
            self._arm(self.header_timeout, "headers")

    def on_headers_complete(self) -> None:
        if self._resuming:
            return
        _check_framing(self.headers, self.parser.get_http_version())
        self._head_open = False
        super().on_headers_complete()
        if self._queued(self.cycle):
            # queued behind a request still answered, unread: its body's time starts with it
            self._disarm()
        else:
            self._arm(self.body_timeout, "body")
        if self.scope.get("http_version") == "1.0" and self.cycle is not None:
            _close_delimited(self.cycle)

    def on_message_complete(self) -> None:
        self._resuming = False
        super().on_message_complete()
        self._disarm()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        self._answering = cycle
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # reads the connection again, and starts a queued request
        if self._refused:  # nothing after the malformed request is read: no read timer for it
            if not self.transport.is_closing() and self._unanswered() is None:
                self._refuse()  # the answers before the malformed request are out: its 400 now
            return
        if self._read_timer is not None or self.transport.is_closing():
            return
        # what was waiting, unread, behind the answer now ends: a head's or a body's time starts
        cycle = self.cycle
        if self._head_open:
            self._arm(self.header_timeout, "headers")
        elif cycle is not None and cycle.more_body and not cycle.response_complete:
            self._arm(self.body_timeout, "body")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        # uvicorn tells the request it parsed last; the one answered, if a request was pipelined
        # behind it, is told too: its client is gone as well
        answering = self._unanswered()
        if answering is not None and answering is not self.cycle:
            answering.disconnected = True
            answering.message_event.set()
        super().connection_lost(exc)

    def _unanswered(self) -> Any:
        """The request whose app runs and has not answered whole yet, if any."""
        answering = self._answering
        return answering if answering is not None and not answering.response_complete else None

    def _read_timed_out(self, what: str) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        answering = self._unanswered()
        late = self.cycle if what == "body" else None  # the request whose body is late (a head: none yet)
        if answering is not None and late is not answering:
            # a later request's head or body is late while an earlier one is answered (pipelined):
            # that answer goes on whole, and the connection closes after it, the late one unread
            answering.keep_alive = False
            return
        if answering is None and what == "headers" and not self._received:
            self.transport.close()  # an idle connection that never sent a byte
            return
        if answering is None or not answering.response_started:
            self.transport.write(_error_response(
                408, "Request Timeout", f"The request's {what} did not arrive in time.", "request_timeout"))
        if answering is not None:
            answering.disconnected = True  # the app sees the client gone, and its answer goes nowhere
            answering.message_event.set()
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        answering = self._unanswered()
        # the malformed bytes are a later request's (a head begun, or a queued request's body) while
        # an earlier one is answered: HTTP/1.1 answers in order, so the 400 waits for the answers
        # before it (a queued request whose body is malformed is answered by the 400 alone)
        later = self._head_open or self.cycle is not answering
        if answering is not None and later:
            if not self._head_open and self.cycle is not None and self._queued(self.cycle):
                # its own body is malformed: the 400 is its answer, in its place
                self.pipeline.remove(next(entry for entry in self.pipeline if entry[0] is self.cycle))
            self._refused = True
            self.flow.pause_reading()
            return
        self._refuse()

    def _refuse(self) -> None:
        self._refused = True
        self.transport.write(_error_response(
            400, "Bad Request", "The request is not valid HTTP/1.1 (framing or headers).", "invalid_http_request"))
        self.transport.close()


def _check_framing(headers: list[tuple[bytes, bytes]], version: str) -> None:
    """What HTTP/1.1 asks a server to refuse (raised: the parser's error, answered as a 400):
    a body in a transfer coding not decoded here (it would be read as another body than the one
    sent), a transfer coding in HTTP/1.0, which has none (RFC 9112 §6.1), and an HTTP/1.1
    request without one valid Host, or any with two (§3.2)."""
    codings = [coding.strip().lower() for name, value in headers if name == b"transfer-encoding"
               for coding in value.split(b",")]
    if codings and (codings != [b"chunked"] or version == "1.0"):
        raise ValueError("a transfer coding other than chunked, or any in HTTP/1.0")
    hosts = [value for name, value in headers if name == b"host"]
    if len(hosts) > 1 or (version == "1.1" and not hosts) or (hosts and not _HOST.fullmatch(hosts[0])):
        raise ValueError("no Host, two, or one that is no host")


def _body_framing(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    """A request's body framing, as a header line (none: it has no body)."""
    if any(name == b"transfer-encoding" for name, _ in headers):
        return b"transfer-encoding: chunked"  # the only coding _check_framing lets through
    lengths = [value for name, value in headers if name == b"content-length"]
    return b"content-length: " + lengths[0] if lengths and lengths[0].strip(b"0") else None


def _close_delimited(cycle: Any) -> None:
    """An answer to an HTTP/1.0 request without a Content-Length of its own (a stream) ends
    where the connection closes: uvicorn would send it chunked, which HTTP/1.0 has not (RFC 9112
    section 6.1), and its client would read the chunk sizes as the body."""
    send = cycle.send
    delimited = False

    async def close_delimited_send(message: dict) -> None:
        nonlocal delimited
        if message["type"] == "http.response.start":
            framed = any(name.lower() in (b"content-length", b"transfer-encoding")
                         for name, _ in message.get("headers", []))
            if not framed and cycle.scope["method"] != "HEAD" and message["status"] not in (204, 304):
                delimited = True
                cycle.chunked_encoding = False  # the body as it comes; keep-alive is off for 1.0
                cycle.expected_content_length = sys.maxsize  # uvicorn counts each piece off it
        elif delimited and not message.get("more_body", False):
            cycle.expected_content_length = len(message.get("body", b""))  # its last piece: done
        await send(message)

    cycle.send = close_delimited_send


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for what cannot take a bound socket (a URL that must lead nowhere):
    another process may take it before it is used, so a server is given `listening_socket`."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening, as uvicorn binds one (SO_REUSEADDR); port 0 is
    one the system picks (`getsockname()` says which). Bound here and held until served on, so no
    other process takes the port in between, as one could a port found free and let go. OSError
    (EADDRINUSE when the port is taken) or socket.gaierror when the host does not resolve."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)  # uvicorn's backlog
    except BaseException:
        sock.close()
        raise
    return sock


def inherited_socket(fd: int) -> socket.socket:
    """The listening socket a parent handed this process as file descriptor `fd` (`kiln dev` does
    so for its children); ValueError if it is not one."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ValueError(f"file descriptor {fd} is no socket ({exc.strerror or exc})") from None
    if (sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM
            or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
        sock.detach()
        raise ValueError(f"file descriptor {fd} is no listening TCP socket")
    sock.set_inheritable(False)  # handed to this process, not to any it starts
    return sock


def listen_as(who: str, host: str, port: int, fd: int | None = None) -> socket.socket:
    """The socket `who` (a command) serves on: the one inherited as `fd`, else one bound to
    host:port; SystemExit with what is wrong and what to do."""
    if fd is not None:
        try:
            return inherited_socket(fd)
        except ValueError as exc:
            raise SystemExit(f"{who}: --fd: {exc}") from None
    try:
        return listening_socket(host, port)
    except socket.gaierror as exc:
        raise SystemExit(f"{who}: {host}:{port} does not resolve ({exc}): pass a --host this machine has") from None
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise SystemExit(f"{who}: {host}:{port} is already in use: stop what holds it or pass --port with a "
                             f"free port (0: any)") from None
        raise SystemExit(f"{who}: {host}:{port} cannot be listened on ({exc.strerror or exc}): "
                         f"pass another --host or --port") from None


def served_url(sock: socket.socket) -> str:
    """http://host:port of a listening socket, as a client calls it (an IPv6 host in brackets)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _config(app: Any, host: str, port: int, **options: Any) -> uvicorn.Config:
    protocol = type("Protocol", (BoundedHttpProtocol,), {
        "header_timeout": options.pop("header_timeout", HEADER_TIMEOUT),
        "body_timeout": options.pop("body_timeout", BODY_TIMEOUT),
    })
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=options.pop("log_level", "warning"),
        access_log=False,
        timeout_keep_alive=75,
        http=protocol,
        ws="none",  # no WebSocket: an Upgrade offer is declined, the request answered as HTTP/1.1
        **options,
    )


class _AnnouncingServer(uvicorn.Server):
    """Calls `on_ready` once the socket is listening, not before."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_ready is not None:
            self._on_ready()


def serve(app: Any, sock: socket.socket, on_ready: Callable[[], None] | None = None, **options: Any) -> None:
    """Serve `app` on a listening socket (`listening_socket`, `inherited_socket`) until stopped."""
    host, port = sock.getsockname()[:2]
    _AnnouncingServer(_config(app, host, port, **options), on_ready).run(sockets=[sock])


class ServerThread:
    """uvicorn on a loopback port in a daemon thread; `url` once started."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        self.host = host
        self._socket = listening_socket(host, port)  # port 0: held from here, taken by no one else
        self.port = self._socket.getsockname()[1]
        self.server = uvicorn.Server(_config(app, self.host, self.port, **options))
        self.server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                        name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 15.0) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._socket.close()  # its port freed even where the server never served on it
