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


# -- found by a hostile client, on raw sockets ---------------------------------------------------

async def slow_or_echo(scope, receive, send):
    """/slow: a stream that takes longer than the body timeout; anything else: echo."""
    import asyncio

    if scope["type"] != "http":
        return
    if scope["path"] != "/slow":
        return await echo(scope, receive, send)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for piece in range(6):
        await send({"type": "http.response.body", "body": b"data: %d\n\n" % piece, "more_body": True})
        await asyncio.sleep(0.15)
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


async def headers_seen(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = json.dumps([[name.decode(), value.decode()] for name, value in scope["headers"]]).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def slow_server():
    running = ServerThread(slow_or_echo, header_timeout=0.3, body_timeout=0.3).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def headers_server():
    running = ServerThread(headers_seen).start()
    yield running
    running.stop()


def answers(received: bytes) -> list[tuple[int, bytes]]:
    """The answers on one connection, in order: (status, body as sent, chunked or not)."""
    found = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        status = int(head.split(b" ")[1])
        fields = dict(line.split(b": ", 1) for line in head.lower().split(b"\r\n")[1:])
        if b"content-length" in fields:
            size = int(fields[b"content-length"])
            body, received = rest[:size], rest[size:]
        else:  # chunked: up to the last chunk
            body, _, received = rest.partition(b"\r\n0\r\n\r\n")
        found.append((status, body))
    return found


def test_a_request_pipelined_behind_a_long_stream_is_answered_after_it_and_never_inside_it(slow_server):
    """The second request waits, unread, while the first's stream runs: its body timer ran
    from its head, and a 408 was written into the middle of the first request's stream."""
    stream_request = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
    second_head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n"
    received = exchange(slow_server, stream_request + second_head, b"ok", pause=0.2)
    assert b"408" not in received
    (first_status, first_body), (second_status, second_body) = answers(received)
    assert first_status == 200 and first_body.endswith(b"data: [DONE]\n\n")
    assert (second_status, second_body) == (200, b"ok")


def test_a_request_pipelined_behind_a_stream_still_has_its_body_bounded_once_it_is_read(slow_server):
    stream_request = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
    second = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"
    (first_status, first_body), (second_status, _) = answers(exchange(slow_server, stream_request + second))
    assert first_status == 200 and first_body.endswith(b"data: [DONE]\n\n")
    assert second_status == 408


@pytest.mark.parametrize("upgrade", [b"Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n",
                                     b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                                     b"Sec-WebSocket-Version: 13\r\n"],
                         ids=["h2c", "websocket"])
@pytest.mark.parametrize("split", [False, True], ids=["one-write", "body-apart"])
def test_an_upgrade_offered_with_a_request_is_ignored_and_its_body_read(server, upgrade, split):
    """curl --http2 and Java's HttpClient offer h2c on http: URLs (RFC 9110 §7.8 lets a server
    ignore the offer). The parser took the offer for a switch: the body was dropped (400 "the
    body is empty"), and, sent apart, answered again as a second, malformed request."""
    head = b"POST / HTTP/1.1\r\nHost: x\r\n" + upgrade + b"Content-Length: 7\r\n\r\n"
    parts = (head, b'{"a":1}') if split else (head + b'{"a":1}',)
    with socket.create_connection((server.host, server.port), timeout=5) as raw:
        for part in parts:
            raw.sendall(part)
            time.sleep(0.05)
        first = raw.recv(65536)
        assert answers(first) == [(200, b'{"a":1}')]
        # and the connection goes on as HTTP/1.1
        raw.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        rest = b""
        while chunk := raw.recv(65536):
            rest += chunk
    assert answers(rest) == [(200, b"ok")]


def test_an_upgrade_offered_with_a_chunked_body_and_a_request_behind_it(server):
    head = b"POST / HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nTransfer-Encoding: chunked\r\n\r\n"
    following = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
    received = exchange(server, head + b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n" + following)
    assert answers(received) == [(200, b"abcde"), (200, b"ok")]


def test_trailer_fields_are_not_taken_for_headers(headers_server):
    """RFC 9110 §6.5.1: a trailer is not merged into the header section. A key sent only in
    a chunked body's trailer authenticated the request, depending on how TCP split it."""
    received = exchange(headers_server, b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                                        b"Connection: close\r\n\r\n2\r\n{}\r\n0\r\nAuthorization: Bearer sk-x\r\n\r\n")
    ((status, body),) = answers(received)
    assert status == 200 and "authorization" not in [name for name, _ in json.loads(body)]


def test_the_ids_the_functions_get_from_aws_are_not_taken_from_a_client(headers_server):
    """In AWS the Web Adapter sets x-amzn-request-context and x-amzn-lambda-context; locally
    no one does, and a client's own made the request log's lambda_request_id and api_request_id."""
    received = exchange(headers_server, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                        b"X-Amzn-Request-Context: {\"requestId\":\"forged\"}\r\n"
                                        b"x-amzn-lambda-context: {\"request_id\":\"forged\"}\r\nX-Other: kept\r\n\r\n")
    ((status, body),) = answers(received)
    names = [name for name, _ in json.loads(body)]
    assert status == 200 and "x-other" in names and not [name for name in names if name.startswith("x-amzn-")]


@pytest.mark.parametrize("request_bytes", [
    b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n",  # no Host (RFC 9112 §3.2)
    b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: a b/c@d:99\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.0\r\nHost: x\r\nHost: y\r\n\r\n",
    # HTTP/1.0 has no chunked coding (RFC 9112 §6.1): framing a 1.0 request by it is faulty
    b"POST / HTTP/1.0\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
])
def test_requests_whose_host_or_framing_http_1_1_forbids_get_a_json_400(server, request_bytes):
    status, error = json_error(exchange(server, request_bytes))
    assert status == 400 and error["code"] == "invalid_http_request"


@pytest.mark.parametrize("request_bytes", [
    b"GET / HTTP/1.0\r\n\r\n",  # HTTP/1.0 needs no Host
    b"GET / HTTP/1.1\r\nHost: \r\nConnection: close\r\n\r\n",  # empty: allowed (RFC 9112 §3.2)
    b"GET / HTTP/1.1\r\nHost: [::1]:8000\r\nConnection: close\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: api.example-1.com.\r\nConnection: close\r\n\r\n",
])
def test_requests_with_a_host_http_allows_are_served(server, request_bytes):
    assert exchange(server, request_bytes).startswith(b"HTTP/1.1 200")


# found in review: what waits unread behind an answer, and upgrade offers among pipelined requests

async def slow_unread(scope, receive, send):
    """/slow: a buffered-like answer that takes 0.9 s and never calls receive(); else echo."""
    import asyncio

    if scope["type"] != "http":
        return
    if scope["path"] != "/slow":
        return await echo(scope, receive, send)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for piece in range(3):
        await asyncio.sleep(0.3)
        await send({"type": "http.response.body", "body": b"s%d;" % piece, "more_body": True})
    await send({"type": "http.response.body", "body": b"end"})


@pytest.fixture(scope="module")
def unread_server():
    running = ServerThread(slow_unread, header_timeout=0.3, body_timeout=0.3).start()
    yield running
    running.stop()


UPGRADE = b"Connection: upgrade\r\nUpgrade: h2c\r\n"
SLOW = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_head_begun_behind_a_queued_request_has_its_time_from_when_it_is_read(unread_server):
    """The connection is not read while a queued request waits: the rest of a third head
    cannot come in, and its header timer closed the connection, the complete second unanswered."""
    received = exchange(unread_server, SLOW + b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\naPOST /b HTTP/1.1\r\nHo",
                        b"st: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\nb", pause=0.2)
    assert [status for status, _ in answers(received)] == [200, 200, 200]
    assert answers(received)[1:] == [(200, b"a"), (200, b"b")]


def test_a_queued_upgrade_offer_has_its_body_read_when_its_turn_comes(unread_server):
    received = exchange(unread_server, SLOW + b"POST /u HTTP/1.1\r\nHost: x\r\n" + UPGRADE + b"Content-Length: 5\r\n\r\n",
                        b"hello", b"POST /after HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                        pause=0.2)
    assert answers(received)[1:] == [(200, b"hello"), (200, b"ok")]


def test_many_upgrade_offers_in_one_read_are_each_answered(server):
    """Each declined offer's rest was fed on recursively: some 500 in one read overflowed the stack."""
    offer = b"GET / HTTP/1.1\r\nHost: x\r\n" + UPGRADE + b"\r\n"
    received = exchange(server, offer * 600 + b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nConnection: close\r\n\r\nlast")
    found = answers(received)
    assert len(found) == 601 and found[-1] == (200, b"last")


def test_after_a_declined_offer_a_request_that_closes_the_connection_is_answered_and_nothing_after_it(unread_server):
    """uvicorn's parser lets bytes follow a request that closes the connection; the one made for
    a declined offer did not: a 400 was written into the answer still going out."""
    received = exchange(unread_server, b"GET /slow HTTP/1.1\r\nHost: x\r\n" + UPGRADE + b"\r\n",
                        b"GET /c HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\nGET /d HTTP/1.1\r\nHost: x\r\n\r\n",
                        pause=0.35)
    assert b"400" not in received
    (first_status, first_body), second = answers(received)
    assert first_status == 200 and first_body.endswith(b"3\r\nend") and second == (200, b"")


@pytest.mark.parametrize("broken", [
    b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n",  # no Host
    b"GET / HTTP/1.1\r\nHost: x\r\nX-A: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n",
    b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",  # its body
], ids=["length", "coding", "host", "head", "chunk"])
def test_a_malformed_request_pipelined_behind_one_still_answered_gets_its_400_after_that_answer(slow_server, broken):
    """HTTP/1.1 answers pipelined requests in order: the 400 of a malformed request was written
    at once, the connection closed, in the middle of the answer to the request before it (still
    running, and billed), so the client took the 400 for that request's answer."""
    received = exchange(slow_server, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + broken)
    (first_status, first_body), (second_status, second_body) = answers(received)
    assert first_status == 200 and first_body.endswith(b"data: [DONE]\n\n")
    assert second_status == 400 and json.loads(second_body)["error"]["code"] == "invalid_http_request"


@pytest.mark.parametrize("queued", [1, 2])
def test_requests_queued_between_the_one_answered_and_a_malformed_one_are_each_answered(slow_server, queued):
    """A valid request queued behind the one answered, a malformed one behind it: the 400 was
    taken for the queued request's answer, the queued request dropped unanswered."""
    good = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi"
    received = exchange(slow_server, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + good * queued
                        + b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n")
    assert [(status, body if status == 200 else b"") for status, body in answers(received)][1:] == [
        (200, b"hi")] * queued + [(400, b"")]


def test_a_malformed_request_waits_for_answers_longer_than_the_header_timeout_and_is_still_refused():
    """Waiting behind answers that outlast the head's timeout, the malformed request's head
    timer closed the connection after them, the 400 never sent: no read timer runs for it."""
    import asyncio

    async def slow_answer(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await asyncio.sleep(0.6)
        await send({"type": "http.response.body", "body": b"ok"})

    running = ServerThread(slow_answer, header_timeout=0.3, body_timeout=0.3).start()
    try:
        good = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        received = exchange(running, good * 3 + b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert [status for status, _ in answers(received)] == [200, 200, 200, 400]
    finally:
        running.stop()


def test_a_client_that_leaves_with_requests_queued_is_seen_gone_by_the_one_answered():
    """A client that pipelined a request behind one still answered, then left: only the queued
    request was told, so the one answered waited on as if its client were there (a stream's
    slot held until its model server answered), and its first write then failed on the closed
    connection. It is told the client is gone, as a client that pipelined nothing is."""
    import asyncio

    told = []

    async def waits_for_its_client(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/wait":
            started = time.monotonic()
            while (await receive())["type"] != "http.disconnect":
                pass
            told.append(time.monotonic() - started)
            await asyncio.sleep(0.1)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"late"})
            told.append("sent")
            return
        await echo(scope, receive, send)

    running = ServerThread(waits_for_its_client).start()
    try:
        with socket.create_connection((running.host, running.port), timeout=5) as raw:
            raw.sendall(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
            time.sleep(0.3)
        deadline = time.monotonic() + 3
        while len(told) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(told) == 2 and told[0] < 1.0, told
    finally:
        running.stop()


def test_a_server_thread_holds_its_port_from_when_it_is_made():
    """A ServerThread took a port found free and let go, and bound it only when its thread ran:
    a parallel worker's server could take it first, and the tests then spoke to that one."""
    import errno

    running = ServerThread(echo)
    try:
        with socket.socket() as rival, pytest.raises(OSError) as taken:
            rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            rival.bind(("127.0.0.1", running.port))
        assert taken.value.errno == errno.EADDRINUSE
        running.start()
        answer = exchange(running, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nConnection: close\r\n\r\nx")
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\nx")
    finally:
        running.stop()
    with socket.socket() as after:  # stopped: the port is free again
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", running.port))


def test_a_server_thread_never_started_frees_its_port_when_stopped():
    unused = ServerThread(echo)
    unused.stop()
    with socket.socket() as after:
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", unused.port))
