"""kiln_ops.serve: the local server bounds how long a request may take to arrive, and answers
what it cannot parse in the contract's error shape (`kiln dev` and the tests' stacks use it)."""

from __future__ import annotations

import json
import select
import socket
import time

import pytest

from kiln_ops.serve import MAX_HEAD_BYTES, ServerThread


async def echo(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def server():
    running = ServerThread(echo, header_timeout=0.3, body_timeout=0.3).start()
    yield running
    running.stop()


def exchange(server, *parts: bytes, pause: float = 0.0) -> bytes:
    """Send the parts (pausing between them), then read until the server closes."""
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        for part in parts:
            raw.sendall(part)
            time.sleep(pause)
        received = b""
        while chunk := raw.recv(65536):
            received += chunk
        return received


def json_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert b"content-type: application/json" in head.lower()
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return status, error


def test_headers_that_do_not_arrive_in_time_get_408_in_the_contract_shape(server):
    # a slow client: one header line, then nothing
    status, error = json_error(exchange(server, b"POST / HTTP/1.1\r\nHost: x\r\n"))
    assert status == 408 and error["code"] == "request_timeout"


def test_a_body_that_does_not_arrive_in_time_gets_408(server):
    status, error = json_error(exchange(server, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"))
    assert status == 408 and "body" in error["message"]


def test_a_connection_that_never_sends_anything_is_closed(server):
    assert exchange(server) == b""


@pytest.mark.parametrize("request_bytes", [
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",  # framing
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",  # a bad chunk size
    b"HELLO\r\n\r\n",  # not HTTP at all
    b"POST / HTTP/1.1\r\nBad Header\r\n\r\n",
    # a body in a transfer coding the server does not decode (RFC 9112 §6.1), read as plain it
    # would be a different body from the one a proxy in front decoded
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
])
def test_malformed_requests_get_a_json_400(server, request_bytes):
    status, error = json_error(exchange(server, request_bytes))
    assert status == 400 and error["code"] == "invalid_http_request"


@pytest.mark.parametrize("pieces", [[b"X-A: " + b"a" * 100_000 + b"\r\n\r\n"],
                                    [b"X-A: " + b"a" * 60_000, b"b" * 60_000, b"c" * 60_000 + b"\r\n\r\n"]],
                         ids=["in-one-read", "over-three-reads"])
def test_a_request_head_past_its_bound_is_a_json_400_however_it_comes(server, pieces):
    """A head that begins and ends in one read, or over reads that begin and end it, is the
    parser's to count: the reads alone missed both."""
    answer = exchange(server, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + pieces[0], *pieces[1:],
                      pause=0.1)
    status, error = json_error(answer)
    assert status == 400 and error["code"] == "invalid_http_request"


@pytest.mark.parametrize("shape", ["many headers", "one endless header"])
def test_a_request_head_past_its_bound_is_a_json_400_before_it_ends(server, shape):
    """httptools keeps a head however long it grows: a client streaming header lines (or one
    endless value) took 91 MB of the server's memory before the header timeout's 408."""
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        raw.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
        line = b"X-Pad: " + b"a" * 8000 + b"\r\n" if shape == "many headers" else b"a" * 8000
        if shape != "many headers":
            raw.sendall(b"X-Pad: ")
        received = b""
        for _ in range(200):  # 1.6 MB, far past the bound, if the server lets it in
            raw.sendall(line)
            if select.select([raw], [], [], 0.002)[0]:
                break  # the server answered: sending on would only reset the connection
        while chunk := raw.recv(65536):
            received += chunk
    status, error = json_error(received)
    assert status == 400 and error["code"] == "invalid_http_request"


def test_a_pipelined_request_behind_a_long_body_is_served(server):
    """The read that ends one request's long body and begins the next one's head: the body's
    bytes are not the head's (they were counted as such, and the first answer lost to a 400)."""
    first = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"a" * 100000
    answer = exchange(server, first + b"POST / HTTP/1.1\r\nHost: x\r\n",
                      b"Content-Length: 2\r\nConnection: close\r\n\r\nok", pause=0.2)
    assert answer.count(b"HTTP/1.1 200") == 2 and answer.endswith(b"ok")


def test_a_head_within_its_bound_is_served(server):
    head = b"".join(b"X-Pad-%d: " % index + b"a" * 1000 + b"\r\n" for index in range(MAX_HEAD_BYTES // 1100))
    answer = exchange(server, b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + head
                      + b"Content-Length: 2\r\n\r\nok")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")


def test_a_kept_alive_connection_may_wait_between_requests_longer_than_the_header_timeout(server):
    request = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok"
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        for _ in range(2):
            raw.sendall(request)
            answer = raw.recv(65536)
            assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"ok")
            time.sleep(0.5)  # idle between requests: uvicorn's keep-alive timeout applies, not ours


def test_a_chunked_body_in_no_other_coding_is_read(server):
    answer = exchange(server, b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\nConnection: close\r\n\r\n"
                              b"2\r\n{}\r\n0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\n{}")


async def stream(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for piece in (b"data: 1\n\n", b"data: 2\n\n"):
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


@pytest.fixture(scope="module")
def streaming_server():
    running = ServerThread(stream).start()
    yield running
    running.stop()


def test_a_stream_to_an_http_1_0_client_ends_where_the_connection_closes(streaming_server, caplog):
    """HTTP/1.0 has no chunked coding (RFC 9112 section 6.1): the stream is sent as it comes and
    ended by closing the connection, so the client reads the events and nothing else, and the
    app's last piece ends its answer without an error."""
    import logging

    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        answer = exchange(streaming_server, b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower() and b"connection: close" in head.lower()
    assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR], caplog.text


def test_a_stream_to_an_http_1_1_client_is_still_chunked(streaming_server):
    answer = exchange(streaming_server, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower() and body.endswith(b"0\r\n\r\n")
