"""The floor: what a request's exchanges cost a Python process on this machine with no gateway in it.

An ASGI app, served by functions/run.sh as a function is (uvicorn, uvloop, httptools), that answers
POST /v1/chat/completions by making the exchanges a gateway makes and nothing else:

- `FLOOR_STORAGE_CALLS` storage exchanges with `FLOOR_STORAGE`. Kiln makes two on every request:
  admission before the upstream, the settle after its answer and before the client's last bytes;
  here too, the first goes before the upstream and the others after it. Each is a DynamoDB GetItem
  of `FLOOR_STORAGE_BODY` (about 100 bytes, where Kiln's transactions are about a kilobyte) with
  headers of the size a signed request has (not signed: the stand-in does not check);
- one upstream exchange: the client's body, as it came, to `FLOOR_UPSTREAM`; a buffered answer
  sent whole with its length, a stream relayed one piece per read, its last read held until the
  storage calls after it are done (as Kiln holds its tail until the settle). A path under
  `GAPS_PREFIX` goes to `FLOOR_GAP_UPSTREAM` instead: the mock's spaced tokens, one read each, as
  the bench's spaced-token model is served to Kiln and Portkey.

No validation, no routing, no JSON, no authentication, no signing, no logging: keep-alive
connections on asyncio streams, each request in one write, each answer parsed by httptools. Its
CPU per request is what the exchanges take made plainly on the stack the functions run on (system
calls, loopback, the event loop, the server's parsing): not a proof that nothing could do them
for less, but the part of a gateway's CPU that work on its own logic does not remove. With
`FLOOR_STORAGE_CALLS=0` it is the floor of a proxy that makes one exchange, Portkey's job.

`Stack.start_floor` serves it through functions/run.sh itself, as a function is served, with
bench/floor_root as the task root (its app.py builds the app from the FLOOR_* variables).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

import httptools

from kiln_ops.serve import read_body

__all__ = ["GAPS_PREFIX", "floor_app", "from_env", "storage_request", "upstream_request"]

# the floor's path to the spaced-token upstream: {url}/gaps/v1/chat/completions
GAPS_PREFIX = "/gaps/"

_SIGNED_LIKE = (
    # what a SigV4-signed call carries beyond its body, of the same sizes (values are not checked)
    b"x-amz-date: 20261201T000000Z\r\n"
    b"x-amz-content-sha256: " + b"0" * 64 + b"\r\n"
    b"authorization: AWS4-HMAC-SHA256 Credential=AKIAXXXXXXXXXXXXXXXX/20261201/us-east-1/dynamodb/aws4_request, "
    b"SignedHeaders=content-type;host;x-amz-content-sha256;x-amz-date;x-amz-target, Signature=" + b"0" * 64 + b"\r\n"
)


def storage_request(host: str, body: bytes) -> bytes:
    """One DynamoDB GetItem, whole, as one write."""
    return (b"POST / HTTP/1.1\r\nhost: " + host.encode() + b"\r\ncontent-type: application/x-amz-json-1.0\r\n"
            b"x-amz-target: DynamoDB_20120810.GetItem\r\n" + _SIGNED_LIKE
            + b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


def upstream_request(host: str, path: str, body: bytes) -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nhost: " + host.encode() + b"\r\ncontent-type: application/json\r\n"
            b"accept: text/event-stream, application/json\r\ncontent-length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


class _Answer:
    """httptools' callbacks for one response: headers, then body pieces as they come."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.pieces: list[bytes] = []
        self.complete = False
        self.keep_alive = False
        self.parser: Any = None

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        # asked now: once the message is complete the parser has reset its flags
        self.keep_alive = self.parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.pieces.append(bytes(body))

    def on_message_complete(self) -> None:
        self.complete = True


Relay = Callable[[int, list[tuple[bytes, bytes]], bytes], Awaitable[None]]


class _Origin:
    """Keep-alive connections to one host:port, each used by one exchange at a time."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.authority, self.path = parts.netloc, parts.path or "/"
        self.idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = deque()
        self.opened = 0  # connections opened, over the origin's life

    async def exchange(self, request: bytes, relay: Relay | None = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Write `request` in one write and read its answer: status, headers and the body. With
        `relay`, the body of each read but the last goes on through `await relay(status, headers,
        piece)` as it arrives, one piece per read (as Kiln relays a stream), and only the last read's
        is returned: the tail a gateway holds until its settle is done."""
        while True:
            reused = bool(self.idle)
            if reused:
                reader, writer = self.idle.popleft()
            else:
                reader, writer = await asyncio.open_connection(self.host, self.port)
                self.opened += 1
            answer = _Answer()
            parser = answer.parser = httptools.HttpResponseParser(answer)
            kept: list[bytes] = []
            received = False
            try:
                writer.write(request)
                while not answer.complete:
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("the server closed the connection mid-answer")
                    received = True
                    parser.feed_data(data)
                    if not answer.pieces:
                        continue
                    if relay is None or answer.complete:
                        kept += answer.pieces
                    else:
                        await relay(parser.get_status_code(), answer.headers, b"".join(answer.pieces))
                    answer.pieces.clear()
            except ConnectionError:
                writer.close()
                if reused and not received:
                    continue  # a kept-alive connection the server had closed: again, on the next one
                raise
            except BaseException:
                writer.close()
                raise
            if answer.keep_alive:
                self.idle.append((reader, writer))
            else:
                writer.close()
            return parser.get_status_code(), answer.headers, b"".join(kept)


async def _storage_call(storage: _Origin, wire: bytes) -> None:
    status, _, answer = await storage.exchange(wire)
    if status != 200:
        raise RuntimeError(f"the storage answered {status}: {answer[:200]!r}")


def _streamed(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def floor_app(upstream_url: str, *, storage_url: str = "", storage_calls: int = 0, storage_body: bytes = b"{}",
              gap_upstream_url: str = "") -> Any:
    """The floor's ASGI app: POST anything but /healthz makes `storage_calls` storage exchanges with
    `storage_url` and one with `upstream_url` (the full URL of its chat/completions), as above; a
    path under GAPS_PREFIX with `gap_upstream_url` (404 without one)."""
    direct = _Origin(upstream_url)
    gaps = _Origin(gap_upstream_url) if gap_upstream_url else None
    storage = _Origin(storage_url) if storage_calls else None
    storage_wire = storage_request(storage.authority, storage_body) if storage is not None else b""

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/healthz":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        upstream = gaps if scope["path"].startswith(GAPS_PREFIX) else direct
        if upstream is None:
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        request_body = await read_body(receive)
        # as a gateway does: one storage exchange before the upstream (admission), the others after
        # its answer and before the client's last bytes (the settle)
        if storage is not None:
            await _storage_call(storage, storage_wire)
        streamed: bool | None = None  # known at the answer's first piece
        started = False
        kept: list[bytes] = []

        async def relay(status: int, headers: list[tuple[bytes, bytes]], piece: bytes) -> None:
            # a stream's pieces go on as they come; a buffered answer's are kept for one message
            nonlocal streamed, started
            if streamed is None:
                streamed = _streamed(headers)
            if not streamed:
                kept.append(piece)
                return
            if not started:
                await send({"type": "http.response.start", "status": status,
                            "headers": [(k, v) for k, v in headers if k == b"content-type"]})
                started = True
            await send({"type": "http.response.body", "body": piece, "more_body": True})

        status, headers, tail = await upstream.exchange(
            upstream_request(upstream.authority, upstream.path, request_body), relay=relay)
        if storage is not None:
            for _ in range(storage_calls - 1):
                await _storage_call(storage, storage_wire)
        if started:
            await send({"type": "http.response.body", "body": tail})  # the tail, with the end of the stream
            return
        answer = b"".join(kept) + tail
        start_headers = [(k, v) for k, v in headers if k == b"content-type"]
        if not (_streamed(headers) if streamed is None else streamed):
            start_headers.append((b"content-length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": start_headers})
        await send({"type": "http.response.body", "body": answer})

    return app


def from_env() -> Any:
    """floor_app configured by FLOOR_UPSTREAM, FLOOR_STORAGE, FLOOR_STORAGE_CALLS, FLOOR_STORAGE_BODY,
    FLOOR_GAP_UPSTREAM."""
    return floor_app(os.environ["FLOOR_UPSTREAM"], storage_url=os.environ.get("FLOOR_STORAGE", ""),
                     storage_calls=int(os.environ.get("FLOOR_STORAGE_CALLS", "0")),
                     storage_body=os.environ.get("FLOOR_STORAGE_BODY", "{}").encode(),
                     gap_upstream_url=os.environ.get("FLOOR_GAP_UPSTREAM", ""))
