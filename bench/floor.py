"""The floor: what a request's exchanges cost a Python process on this machine with no gateway in it.

An ASGI app, served by uvicorn with functions/run.sh's flags (uvloop, httptools), that answers
POST /v1/chat/completions by making the exchanges a gateway makes and nothing else:

- `FLOOR_STORAGE_CALLS` storage exchanges (Kiln makes two on every request: admission before the
  upstream, settle after its answer and before the client's last byte; here the first goes before
  the upstream and the others after it), each a DynamoDB GetItem of `FLOOR_STORAGE_BODY` sent to `FLOOR_STORAGE`
  with headers of the size a signed request has (no signing: the stand-in does not check);
- one upstream exchange: the client's body, as it came, to `FLOOR_UPSTREAM`; its answer relayed to
  the client as it arrives (each body piece of a stream as one ASGI message).

No validation, no routing, no JSON, no authentication, no logging: keep-alive connections on
asyncio streams, each request written in one write, each answer parsed by httptools. Its CPU per
request is what the exchanges themselves take (system calls, loopback, the event loop, the
server's parsing), the part of a gateway's CPU that no work on its own code can remove. With
`FLOOR_STORAGE_CALLS=0` it is the floor of a proxy that makes one exchange, Portkey's job.

Run it as `python -m uvicorn … bench.floor:app` (the bench does: `Stack.start_floor`).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from typing import Any
from urllib.parse import urlsplit

import httptools

__all__ = ["app", "floor_app", "storage_request", "upstream_request"]

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

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.pieces.append(bytes(body))

    def on_message_complete(self) -> None:
        self.complete = True


class _Origin:
    """Keep-alive connections to one host:port, each used by one exchange at a time."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.authority, self.path = parts.netloc, parts.path or "/"
        self.idle: deque[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = deque()

    async def exchange(self, request: bytes, piece: Any = None) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """Write `request` in one write and read its answer. With `piece`, each body piece is passed
        on through `await piece(status, headers, data)` as it arrives instead of being kept."""
        reader, writer = self.idle.popleft() if self.idle else await asyncio.open_connection(self.host, self.port)
        answer = _Answer()
        parser = httptools.HttpResponseParser(answer)
        kept: list[bytes] = []
        try:
            writer.write(request)
            while not answer.complete:
                data = await reader.read(65536)
                if not data:
                    raise ConnectionError("the server closed the connection mid-answer")
                parser.feed_data(data)
                if answer.pieces:
                    if piece is None:
                        kept += answer.pieces
                    else:
                        for data in answer.pieces:
                            await piece(parser.get_status_code(), answer.headers, data)
                    answer.pieces.clear()
        except BaseException:
            writer.close()
            raise
        if parser.should_keep_alive():
            self.idle.append((reader, writer))
        else:
            writer.close()
        return parser.get_status_code(), answer.headers, b"".join(kept)


def floor_app(upstream_url: str, *, storage_url: str = "", storage_calls: int = 0, storage_body: bytes = b"{}") -> Any:
    """The floor's ASGI app: POST anything but /healthz makes `storage_calls` storage exchanges with
    `storage_url` and one with `upstream_url` (the full URL of its chat/completions), as above."""
    upstream = _Origin(upstream_url)
    storage = _Origin(storage_url) if storage_calls else None

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/healthz":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        # as a gateway does: one storage exchange before the upstream (admission), the others after
        # its answer and before the client's last byte (the settle)
        if storage is not None:
            await storage.exchange(storage_request(storage.authority, storage_body))
        started = False
        kept: list[bytes] = []

        async def relay(status: int, headers: list[tuple[bytes, bytes]], data: bytes) -> None:
            # a stream's pieces go on as they come; a buffered answer's are kept for one message
            nonlocal started
            if not started:
                if not any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers):
                    kept.append(data)
                    return
                await send({"type": "http.response.start", "status": status,
                            "headers": [(k, v) for k, v in headers if k == b"content-type"]})
                started = True
            await send({"type": "http.response.body", "body": data, "more_body": True})

        status, headers, _ = await upstream.exchange(upstream_request(upstream.authority, upstream.path, b"".join(chunks)),
                                                     piece=relay)
        if storage is not None:
            for _ in range(storage_calls - 1):
                await storage.exchange(storage_request(storage.authority, storage_body))
        if started:
            await send({"type": "http.response.body", "body": b""})
            return
        answer = b"".join(kept)
        await send({"type": "http.response.start", "status": status,
                    "headers": [*((k, v) for k, v in headers if k == b"content-type"),
                                (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    return app


_from_env: list[Any] = []


async def app(scope: dict, receive: Any, send: Any) -> None:
    """floor_app configured by FLOOR_UPSTREAM, FLOOR_STORAGE, FLOOR_STORAGE_CALLS, FLOOR_STORAGE_BODY."""
    if not _from_env:
        _from_env.append(floor_app(os.environ["FLOOR_UPSTREAM"], storage_url=os.environ.get("FLOOR_STORAGE", ""),
                                   storage_calls=int(os.environ.get("FLOOR_STORAGE_CALLS", "0")),
                                   storage_body=os.environ.get("FLOOR_STORAGE_BODY", "{}").encode()))
    await _from_env[0](scope, receive, send)
