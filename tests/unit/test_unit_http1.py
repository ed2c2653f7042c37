"""kiln.http1 against real sockets: keep-alive, chunked streams, every way a server can fail."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
import time

import pytest
import uvloop

from kiln.http1 import BodyTooLarge, ConnectFailed, HttpClient, ProtocolFailure, ResponseTooLarge, Timeout
from kiln.tls import client_context


@contextlib.asynccontextmanager
async def server(handler):
    """A raw TCP server on loopback; `handler(reader, writer)` plays the HTTP server."""
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    listener = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        listener.close()


async def read_request(reader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    return head + await reader.readexactly(length)


async def silent_after_the_headers(reader, writer):
    """A server that answers 200 with a chunked body, then sends nothing more."""
    await read_request(reader)
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(5)


def answering(raw: bytes, *, then_wait: float = 0.0):
    """A server that reads the request, answers `raw` as it is, and keeps the connection
    open `then_wait` seconds before closing it."""
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(raw)
        await writer.drain()
        await asyncio.sleep(then_wait)

    return handler


async def silent(reader, writer):
    """A server that accepts, then neither reads nor answers."""
    await asyncio.sleep(5)


def run(coro):
    return asyncio.run(coro)


def client() -> HttpClient:
    return HttpClient(ssl_context=client_context)


def test_a_body_read_to_the_end_keeps_its_connection_for_the_next_request():
    async def handler(reader, writer):
        while True:
            request = await read_request(reader)
            body = request.split(b"\r\n\r\n", 1)[1]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    async def main():
        http = client()
        async with server(handler) as (url, connections):
            for payload in (b"one", b"two", b"three"):
                response = await http.request("POST", url + "/x", headers={}, body=payload)
                assert response.status == 200 and await response.read() == payload
            assert len(connections) == 1 and http.open_connections == 1
        await http.aclose()

    run(main())


def test_a_chunked_stream_arrives_piece_by_piece():
    release = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n")
        writer.write(b"7\r\ndata: a\r\n")
        await writer.drain()
        await release.wait()
        writer.write(b"7\r\ndata: b\r\n0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"{}")
            assert response.header("content-type") == "text/event-stream"
            pieces = response.chunks()
            assert await pieces.__anext__() == b"data: a"  # before the server sent the rest
            release.set()
            assert [piece async for piece in pieces] == [b"data: b"]
        await http.aclose()

    run(main())


def test_a_connection_cut_mid_body_is_a_protocol_failure_and_is_not_reused():
    handler = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"")
            with pytest.raises(ProtocolFailure):
                await response.read()
            assert http.open_connections == 0
        await http.aclose()

    run(main())


def test_silence_beyond_the_read_timeout_is_a_timeout():
    async def main():
        http = client()
        async with server(silent_after_the_headers) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"", read_timeout=0.2)
            with pytest.raises(Timeout):
                await response.read()
            assert http.open_connections == 0
        await http.aclose()

    run(main())


def timers_that_wake_early(by: float = 0.005) -> None:
    """Make the running loop's timers fire `by` seconds before they are due, as uvloop's may:
    it counts time in whole milliseconds, so a wait can end a little before `time.monotonic()`
    reaches its deadline."""
    loop = asyncio.get_running_loop()
    if isinstance(loop, asyncio.BaseEventLoop):  # its call_later goes through call_at
        due_at = loop.call_at
        loop.call_at = lambda when, callback, *args, **kwargs: due_at(when - by, callback, *args, **kwargs)
    else:  # uvloop's call_at goes through call_later
        due = loop.call_later
        loop.call_later = lambda delay, callback, *args, **kwargs: due(max(0.0, delay - by), callback, *args, **kwargs)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n",  # no last chunk
    b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\n{}",  # ten bytes short
], ids=["chunked", "content-length"])
@pytest.mark.parametrize("how", ["read", "chunks"])
def test_a_body_that_goes_silent_is_a_timeout_even_when_the_timer_wakes_early(answer, how):
    """A wait that ends a little before the read timeout is no end of the body: the client
    waits out the rest and then fails, never hands over the bytes so far as the whole body."""
    async def main():
        timers_that_wake_early()
        http = client()
        async with server(answering(answer, then_wait=2)) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"", read_timeout=0.2)
            with pytest.raises(Timeout):
                if how == "read":
                    await response.read()
                else:
                    [piece async for piece in response.chunks()]
            assert http.open_connections == 0
        await http.aclose()

    run(main())


@pytest.mark.parametrize("url", [
    "http://a..b.example.com/v1",          # an empty label: the resolver's IDNA step refuses it
    "http://" + "a" * 64 + ".example.com/v1",  # a label over 63 characters
    "http://ex\x00ample.com/v1",           # a NUL in the host
    "http://127.0.0.1:9/\u30e2\u30c7\u30eb",   # a path no request line can carry
])
def test_a_url_no_request_can_be_sent_to_is_a_failed_connection_not_a_crash(url):
    """The caller (failover, backend health) knows what to do with a connection that failed; a
    UnicodeError or ValueError from the resolver or the request line's encoding made a 500."""
    async def main():
        from kiln.http1 import Unaddressable
        from kiln.upstream import describe_transport_error

        http = client()
        with pytest.raises(ConnectFailed) as failed:  # as a failed connection: failover, health
            await http.request("POST", url, headers={}, body=b"", connect_timeout=2)
        assert isinstance(failed.value, Unaddressable)  # said as the catalog's, in the logs
        assert describe_transport_error(failed.value) == "backend URL cannot be called as written"
        await http.aclose()

    run(main())


def test_a_host_outside_ascii_is_not_resolved_by_idna_2003():
    """The resolver and TLS map a str host by IDNA 2003, which sends faß.example to fass.example
    (a browser, by UTS 46, to xn--fa-hia.example), the upstream key with it: such a host is no
    host the client calls; written in IDNA it is called as written."""
    async def main():
        http = client()
        with pytest.raises(ConnectFailed, match="outside ASCII"):
            await http.request("POST", "http://fa\u00df.example/v1", headers={}, body=b"", connect_timeout=2)
        await http.aclose()

    run(main())


def test_a_request_taken_on_a_kept_alive_connection_then_cut_is_no_connection_never_made():
    """A request sent again because its kept-alive connection closed without a word may have
    been taken by the server: if the new connection then cannot be made, the caller learns of
    the cut (a write that may have been applied), not of a connection that never carried it."""
    async def main():
        seen: list[bytes] = []
        server: asyncio.AbstractServer | None = None

        async def handle(reader, writer):
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                seen.append(head.split(b"\r\n", 1)[0])
                if len(seen) == 1:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()
                else:  # takes the second request, then goes away for good
                    server.close()
                    writer.transport.abort()
                    return

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        http = client()
        await (await http.request("POST", url, headers={}, body=b"{}", connect_timeout=2, read_timeout=2)).read()
        with pytest.raises(ProtocolFailure):
            await http.request("POST", url, headers={}, body=b"{}", connect_timeout=2, read_timeout=2)
        assert len(seen) == 2
        await http.aclose()

    run(main())


def test_refused_and_unanswered_connections():
    async def main():
        http = client()
        async with server(silent) as (url, _):
            port = int(url.rsplit(":", 1)[1])
        with pytest.raises(ConnectFailed):  # the server is gone: nothing listens there any more
            await http.request("POST", f"http://127.0.0.1:{port}", headers={}, body=b"", connect_timeout=2)
        async with server(silent) as (url, _):
            with pytest.raises(Timeout):
                await http.request("POST", url, headers={}, body=b"", read_timeout=0.2)
        assert http.open_connections == 0
        await http.aclose()

    run(main())


def test_on_sending_is_told_only_of_a_request_that_had_a_connection_to_go_on():
    """What the gateway bills a stream its client left: the prompt once a model server was
    sent it, not for a backend that refused the connection."""
    async def main():
        http, told = client(), []
        async with server(silent) as (url, _):
            port = int(url.rsplit(":", 1)[1])
        with pytest.raises(ConnectFailed):
            await http.request("POST", f"http://127.0.0.1:{port}", headers={}, body=b"", connect_timeout=2,
                               on_sending=lambda: told.append("refused"))
        async with server(answering(b"HTTP/1.1 204 No Content\r\n\r\n")) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"x", on_sending=lambda: told.append("sent"))
            await response.aclose()
        assert told == ["sent"]
        await http.aclose()

    run(main())


def test_a_tls_failure_is_a_failed_connection_and_a_close_before_answering_says_nothing_came():
    """What kiln.upstream counts as the backend's own failure (§5): a TLS handshake that fails
    (here, with a server that speaks no TLS) is a connection that failed; a connection the
    server closes before a byte of answer is a protocol failure with nothing received."""
    async def closes_at_once(reader, writer):
        await read_request(reader)

    async def speaks_no_tls(reader, writer):
        writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n")  # to a ClientHello; then closes

    async def main():
        http = client()
        async with server(speaks_no_tls) as (url, _):
            with pytest.raises(ConnectFailed):
                await http.request("POST", url.replace("http://", "https://"), headers={}, body=b"", connect_timeout=2)
        async with server(closes_at_once) as (url, _):
            with pytest.raises(ProtocolFailure) as closed:
                await http.request("POST", url, headers={}, body=b"x", read_timeout=2)
        assert closed.value.nothing_received
        await http.aclose()

    run(main())


def test_a_kept_alive_connection_the_server_closed_is_replaced_transparently():
    async def one_answer_per_connection(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")  # keep-alive offered…
        await writer.drain()
        # …then the connection is closed by the handler's return, as an idle timeout would

    async def main():
        http = client()
        async with server(one_answer_per_connection) as (url, connections):
            for _ in range(3):
                response = await http.request("POST", url, headers={}, body=b"")
                assert await response.read() == b"ok"
                await asyncio.sleep(0.05)
            assert len(connections) == 3
        await http.aclose()

    run(main())


def test_an_abandoned_or_cancelled_stream_closes_its_connection():
    async def endless(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(0.01)

    async def main():
        http = client()
        async with server(endless) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"")
            async for _ in response.chunks():
                break  # the consumer walks away…
            await response.aclose()  # …and is done with it: the half-read connection is closed
            assert http.open_connections == 0

            response = await http.request("POST", url, headers={}, body=b"")
            reader = asyncio.ensure_future(response.read())
            await asyncio.sleep(0.05)
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
            assert http.open_connections == 0
        await http.aclose()

    run(main())


def test_a_connection_close_answer_is_not_pooled_and_a_close_delimited_body_is_whole():
    handler = answering(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"")
            assert await response.read() == b"until the end"
            assert http.open_connections == 0
        await http.aclose()

    run(main())


# -- bounds on what a server sends ---------------------------------------------------------


def endless_header(name=b"X-Filler"):
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n" + name + b": ")
        for _ in range(10 * 1024):  # 10 MB of one header value, if the client kept reading
            writer.write(b"a" * 1024)
            await writer.drain()

    return handler


def test_response_headers_over_their_byte_bound_are_refused_having_read_little_more():
    async def main():
        http = client()
        async with server(endless_header()) as (url, _):
            with pytest.raises(ResponseTooLarge):
                await http.request("POST", url, headers={}, body=b"", max_header_bytes=16 * 1024)
            assert http.open_connections == 0
        await http.aclose()

    run(main())


def test_too_many_response_headers_are_refused():
    handler = answering(b"HTTP/1.1 200 OK\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(300)) + b"Content-Length: 0\r\n\r\n",
                        then_wait=1)

    async def main():
        http = client()
        async with server(handler) as (url, _):
            with pytest.raises(ResponseTooLarge):
                await http.request("POST", url, headers={}, body=b"", max_headers=100)
            response = await http.request("POST", url, headers={}, body=b"", max_headers=400)
            assert response.status == 200 and len(response.headers) == 301
        await http.aclose()

    run(main())


def test_headers_just_under_the_bound_with_the_body_in_the_same_read_are_whole():
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-Pad: " + b"p" * 900 + b"\r\n\r\n"

    handler = answering(head + b"hello", then_wait=1)

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"", max_header_bytes=len(head))
            assert await response.read() == b"hello"
        await http.aclose()

    run(main())


@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_its_bound_is_refused_without_being_held(declared):
    async def handler(reader, writer):
        await read_request(reader)
        size = 100 * 1024 * 1024
        if declared:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            for _ in range(size // 65536):
                writer.write(b"a" * 65536)
                await writer.drain()
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(size // 65536):
                writer.write(b"10000\r\n" + b"a" * 65536 + b"\r\n")
                await writer.drain()

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"")
            with pytest.raises(BodyTooLarge):
                await response.read(max_bytes=1024 * 1024)
            assert http.open_connections == 0
        await http.aclose()

    run(main())


def test_next_piece_returns_on_quiet_without_losing_what_comes_after():
    """A keep-alive wake interrupts only the wait: the bytes that come next (the rest of a
    chunk cut across two reads included) arrive in order, and the connection stays reusable."""
    release = asyncio.Event()

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\ndata")
        await writer.drain()
        await release.wait()
        writer.write(b": a\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"7\r\ndata: b\r\n7\r\ndata: c\r\n0\r\n\r\n")
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()

    async def main():
        http = client()
        async with server(handler) as (url, connections):
            response = await http.request("POST", url, headers={}, body=b"{}", read_timeout=5)
            quiet = [await response.next_piece(time.monotonic() + 0.05) for _ in range(3)]
            assert quiet == [b"data", None, None]  # what had come, then nothing
            release.set()
            assert await response.next_piece(time.monotonic() + 5) == b": a"
            # pieces that came in one read are handed over as one
            assert await response.next_piece(time.monotonic() + 5) == b"data: bdata: c"
            assert await response.next_piece(time.monotonic() + 5) == b""
            again = await http.request("GET", url, headers={}, body=b"")
            assert await again.read() == b"ok" and len(connections) == 1
        await http.aclose()

    run(main())


def test_next_piece_counts_the_read_timeout_from_when_the_silence_began():
    async def main():
        http = client()
        async with server(silent_after_the_headers) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"", read_timeout=0.3)
            started, wakes = time.monotonic(), 0
            with pytest.raises(Timeout):
                while True:  # each wake well within the read timeout: silence still ends it
                    assert await response.next_piece(time.monotonic() + 0.1) is None
                    wakes += 1
            assert 2 <= wakes <= 3 and time.monotonic() - started < 1.0
            assert http.open_connections == 0  # a timed-out body is never reused
        await http.aclose()

    run(main())


def pieces_after(*delays: float, then_wait: float = 5.0):
    """A server that answers 200 with a chunked body and sends a piece after each delay, then
    nothing more for `then_wait` seconds."""
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        for number, delay in enumerate(delays):
            await asyncio.sleep(delay)
            piece = b"piece %d" % number
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        await asyncio.sleep(then_wait)
    return handler


def timers_armed() -> list[float]:
    """The delays of the timers the client (kiln.http1) arms on the running loop from now on."""
    loop, armed = asyncio.get_running_loop(), []
    if isinstance(loop, asyncio.BaseEventLoop):  # its call_later goes through call_at
        due_at = loop.call_at

        def call_at(when, callback, *args, **kwargs):
            if getattr(callback, "__module__", None) == "kiln.http1":
                armed.append(when - loop.time())
            return due_at(when, callback, *args, **kwargs)

        loop.call_at = call_at
    else:  # uvloop's call_at goes through call_later
        due = loop.call_later

        def call_later(delay, callback, *args, **kwargs):
            if getattr(callback, "__module__", None) == "kiln.http1":
                armed.append(delay)
            return due(delay, callback, *args, **kwargs)

        loop.call_later = call_later
    return armed


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("until", ["later each time", "the same instant"])
def test_a_streams_reads_each_bounded_later_than_the_last_arm_one_timer_between_them(until, loop):
    """Each wait of a stream ends at the keep-alive or the read timeout, each later than the
    last or at the same instant (a keep-alive not yet reset): the timer armed by the first
    serves them all (per-read timers were a stream's largest cost after its own checks), and
    every piece still comes as it is sent."""
    async def main():
        http = client()
        async with server(pieces_after(*[0.01] * 20)) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"", read_timeout=5)
            armed, fixed = timers_armed(), time.monotonic() + 2
            pieces = [await response.next_piece(fixed if until == "the same instant" else time.monotonic() + 2)
                      for _ in range(20)]
            assert pieces == [b"piece %d" % number for number in range(20)]
            assert len(armed) == 1
            await response.aclose()
        await http.aclose()

    uvloop.run(main()) if loop == "uvloop" else run(main())


def test_a_wait_bounded_sooner_than_the_one_before_ends_at_its_own_instant():
    async def main():
        http = client()
        async with server(pieces_after(0.02)) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"", read_timeout=30)
            assert await response.next_piece(time.monotonic() + 20) == b"piece 0"  # its timer: 20 s away
            started = time.monotonic()
            assert await response.next_piece(started + 0.1) is None  # silent: over at 0.1 s, not 20
            assert 0.09 <= time.monotonic() - started < 1.0
            await response.aclose()
        await http.aclose()

    run(main())


@pytest.mark.parametrize("early", [0.0, 0.005], ids=["on time", "timers waking early"])
def test_a_wait_bounded_later_than_the_one_before_is_not_ended_at_the_sooner_instant(early):
    """The timer armed for the first wait fires during the second, whose own instant is later:
    it is armed again, and the piece sent in between is handed over (not a silence, not a
    timeout); a silence after it still ends at the second wait's instant."""
    async def main():
        if early:
            timers_that_wake_early(early)
        http = client()
        async with server(pieces_after(0.02, 0.4)) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"", read_timeout=0.6)
            assert await response.next_piece(time.monotonic() + 0.2) == b"piece 0"  # its timer: 0.2 s away
            assert await response.next_piece(time.monotonic() + 2) == b"piece 1"  # sent 0.4 s later
            started = time.monotonic()
            with pytest.raises(Timeout):  # then silent: the read timeout (0.6 s) ends it
                await response.next_piece(started + 2)
            assert 0.55 <= time.monotonic() - started < 1.5
        await http.aclose()

    run(main())


def test_next_piece_cancelled_midway_closes_the_connection():
    async def main():
        http = client()
        async with server(silent_after_the_headers) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"")
            waiting = asyncio.ensure_future(response.next_piece())
            await asyncio.sleep(0.05)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert http.open_connections == 0
        await http.aclose()

    run(main())


@pytest.mark.parametrize("after, complete", [(b"0\r\n\r\nXYZ nonsense\r\n", True), (b"zz\r\nnot a chunk", False)])
def test_next_piece_hands_over_what_came_before_malformed_bytes(after, complete):
    """Bytes that are not HTTP, in the same read as the end of a body (or mid-body), do not take
    away what came before them: it is handed over, then the body ends (or fails), and the
    connection is never reused."""
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"7\r\ndata: a\r\n" + after)
        await writer.drain()
        await asyncio.sleep(1)

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"", read_timeout=2)
            assert await response.next_piece(time.monotonic() + 2) == b"data: a"
            if complete:
                assert await response.next_piece(time.monotonic() + 2) == b""
            else:
                with pytest.raises(ProtocolFailure):
                    await response.next_piece(time.monotonic() + 2)
            assert http.open_connections == 0 and http.idle_connections == 0
        await http.aclose()

    run(main())


def test_a_whole_body_followed_by_bytes_that_are_not_http_is_read_whole_and_not_reused():
    handler = answering(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokXYZ nonsense\r\n", then_wait=1)

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"", read_timeout=2)
            assert await response.read() == b"ok"
            assert http.open_connections == 0 and http.idle_connections == 0
        await http.aclose()

    run(main())


async def interim_then_final(writer, interim: bytes, final: bytes, together: bool) -> None:
    """Send an interim answer and the final one: in one write, or apart with a pause between."""
    if together:
        writer.write(interim + final)
    else:
        writer.write(interim)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(final)
    await writer.drain()


@pytest.mark.parametrize("together", [False, True], ids=["apart", "in one write"])
@pytest.mark.parametrize("interim", [
    b"HTTP/1.1 100 Continue\r\n\r\n",
    b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 102 Processing\r\n\r\n",
], ids=["100", "103", "100 then 102"])
def test_interim_answers_are_skipped_and_each_request_gets_its_own_final_answer(interim, together):
    """A 1xx is not the answer (RFC 9110 §15.2): the final one follows on the same connection.
    Taken for the answer, its request would end early and the next request on the kept-alive
    connection would read the answer meant for this one."""
    async def handler(reader, writer):
        while True:
            body = (await read_request(reader)).split(b"\r\n\r\n", 1)[1]
            final = b"HTTP/1.1 200 OK\r\nX-Final: yes\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            await interim_then_final(writer, interim, final, together)

    async def main():
        http = client()
        async with server(handler) as (url, connections):
            answers = []
            for body in (b"first", b"second", b"third"):
                response = await http.request("POST", url, headers={}, body=body, read_timeout=2)
                answers.append((response.status, response.header("x-final"), response.header("link"),
                                await response.read()))
            assert answers == [(200, "yes", None, b"first"), (200, "yes", None, b"second"), (200, "yes", None, b"third")]
            assert len(connections) == 1  # kept alive throughout
        await http.aclose()

    run(main())


def test_interim_answers_without_end_are_bounded_like_headers():
    """A server that sends 1xx after 1xx never answers: the headers' byte bound stops it."""
    async def handler(reader, writer):
        await read_request(reader)
        for _ in range(5000):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()

    async def main():
        http = client()
        async with server(handler) as (url, _):
            with pytest.raises(ResponseTooLarge):
                await http.request("POST", url, headers={}, body=b"x", read_timeout=2, max_header_bytes=4096)
        await http.aclose()

    run(main())


@pytest.mark.parametrize("then", [b"", b"\x81\x05hello"], ids=["nothing after", "another protocol's bytes"])
def test_a_switch_of_protocols_is_an_answer_of_its_own_and_its_connection_is_never_reused(then):
    """101 (an upgrade) is no answer to a POST: it comes back as the status it is (the caller
    fails over on it as on any status it does not expect), never an exception of the parser's,
    and what follows it is not HTTP: the connection is closed."""
    raw = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n" + then

    async def main():
        http = client()
        async with server(answering(raw, then_wait=1)) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"x", read_timeout=2)
            assert response.status == 101
            with contextlib.suppress(ProtocolFailure):
                await response.read()
        assert http.idle_connections == 0 and http.open_connections == 0
        await http.aclose()

    run(main())


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nX-Final: yes\r\nContent-Length: 2\r\n\r\nr0",
    b"HTTP/1.1 204 No Content\r\nX-Final: yes\r\n\r\n",
])
def test_a_1xx_after_the_answer_leaves_the_answer_whole_and_the_connection_unused(answer):
    raw = answer + b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"

    async def main():
        http = client()
        async with server(answering(raw, then_wait=1)) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"x", read_timeout=2)
            assert (response.status, response.header("x-final"), response.header("link")) == (
                int(answer[9:12]), "yes", None)
            assert await response.read() == (b"r0" if answer.startswith(b"HTTP/1.1 200") else b"")
        assert http.idle_connections == 0  # it said more than it was asked: not reused
        await http.aclose()

    run(main())


def test_a_request_the_server_does_not_read_is_a_timeout_and_its_connection_is_dropped():
    """Sending is bounded too: a body the kernel cannot take (a server that reads nothing) times out."""
    async def main():
        http = client()
        async with server(silent) as (url, _):
            started = time.monotonic()
            with pytest.raises(Timeout, match="could not be sent in time"):
                await http.request("POST", url, headers={}, body=b"x" * (64 << 20), read_timeout=0.3)
            assert time.monotonic() - started < 3
            assert http.open_connections == 0
        await http.aclose()

    run(main())


def test_a_request_on_a_connection_the_server_reset_fails_as_nothing_received():
    """A kept-alive connection the server reset (RST, not FIN) before the next request: that
    request goes again on a new connection, whether the send or the read sees the reset first."""

    served = []

    async def answers_then_resets(reader, writer):
        await read_request(reader)
        served.append(1)
        if len(served) == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(0.1)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nsecond")
        await writer.drain()

    async def main():
        http = client()
        async with server(answers_then_resets) as (url, _):
            assert await two_requests_apart(http, url, 0.3) == (b"ok", b"second")  # the reset came between
        await http.aclose()

    run(main())


@pytest.mark.parametrize("together", [False, True], ids=["apart", "in one write"])
def test_an_interim_answer_of_an_http_1_0_server_is_skipped_too(together):
    """HTTP/1.0 defines no 1xx, but a server may still send one before its final answer;
    h11 (httpx) skips it as any interim answer, and so does this client. The connection of
    an HTTP/1.0 answer is not kept alive."""
    async def handler(reader, writer):
        await read_request(reader)
        await interim_then_final(writer, b"HTTP/1.0 100 Continue\r\n\r\n",
                                 b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", together)
        writer.close()

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"x", read_timeout=2)
            assert (response.status, await response.read()) == (200, b"ok")
            assert http.idle_connections == 0
        await http.aclose()

    run(main())


async def two_requests_apart(http, url: str, pause: float) -> tuple[bytes, bytes]:
    """The bodies of two requests (bodies `first`, `second`) made `pause` seconds apart."""
    first = await http.request("POST", url, headers={}, body=b"first", read_timeout=2)
    first_body = await first.read()
    await asyncio.sleep(pause)
    second = await http.request("POST", url, headers={}, body=b"second", read_timeout=2)
    return first_body, await second.read()


def test_an_idle_connection_the_server_sent_more_on_is_not_reused():
    """Bytes a server sends on a connection while it is idle answer no request (a late
    duplicate, a hostile server): read by the next request, they would be its answer, and
    the next request may be another org's. Such a connection is dropped at checkout."""
    async def handler(reader, writer):
        while True:
            body = (await read_request(reader)).split(b"\r\n\r\n", 1)[1]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nSTALE")
            await writer.drain()

    async def main():
        http = client()
        async with server(handler) as (url, connections):
            # the stray answer arrives while the connection is idle
            assert await two_requests_apart(http, url, 0.2) == (b"first", b"second")
            assert len(connections) == 2
        await http.aclose()

    run(main())


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_connection_whose_stray_answer_the_loop_has_not_taken_yet_is_not_reused(loop):
    """As above, but the stray answer came while the event loop was busy (another request's
    JSON, a large body): it waits in the kernel, not yet handed to the connection, when the
    next request takes it from the pool. It was that request's answer; the next request may be
    another org's. The socket itself is asked at checkout, as httpcore asks it."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    accepted = []

    def answer(body: bytes, then: bytes = b"") -> None:
        """Accept a connection, answer its request (body `body`) with that body, then `then`."""
        connection, _ = listener.accept()
        accepted.append(connection)
        with connection:
            head = b""
            while body not in head:
                head += connection.recv(65536)
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.02)
            connection.sendall(then)
            time.sleep(0.5)

    def serve():
        answer(b"first", then=b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nSTRAY!")
        answer(b"second")  # the next request, on a connection of its own

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    async def main():
        http = client()
        url = f"http://127.0.0.1:{port}"
        first = await http.request("POST", url, headers={}, body=b"first", read_timeout=2)
        assert await first.read() == b"first"
        time.sleep(0.1)  # the loop busy: the stray answer reaches the socket, not the connection
        second = await http.request("POST", url, headers={}, body=b"second", read_timeout=2)
        body = await second.read()
        await http.aclose()
        return body

    try:
        assert (run(main()) if loop == "asyncio" else uvloop.run(main())) == b"second"
        assert len(accepted) == 2
    finally:
        thread.join(timeout=5)
        listener.close()


@pytest.mark.parametrize("ending", ["reset", "silence"])
def test_an_answer_sent_before_the_request_was_read_is_the_answer(ending):
    """A server may answer before it reads the body (413 to a body too large, 401) and then
    reset the connection, or stop reading: that answer is the response, as httpx reads it,
    not a failure of the connection (which would count against a healthy backend)."""
    async def handler(reader, writer):
        await reader.readuntil(b"\r\n\r\n")  # the head only: the body is never read
        writer.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 9\r\nConnection: close\r\n\r\ntoo large")
        await writer.drain()
        if ending == "reset":
            await asyncio.sleep(0.1)
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
            return
        await asyncio.sleep(3)

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"x" * (32 * 1024 * 1024), read_timeout=1)
            assert (response.status, await response.read()) == (413, b"too large")
            assert http.idle_connections == 0
        await http.aclose()

    run(main())


GZIP_THEN_CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
CHUNKED_TWICE = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
                 b"2\r\n{}\r\n0\r\n\r\n")
CHUNKED_THEN_GZIP = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
# the parser reads `chunked` and a tab as no coding: the body would be handed over with its chunk sizes
CHUNKED_AND_A_TAB = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\t\r\n\r\n2\r\n{}\r\n0\r\n\r\n"


@pytest.mark.parametrize("raw", [GZIP_THEN_CHUNKED, CHUNKED_TWICE, CHUNKED_THEN_GZIP, CHUNKED_AND_A_TAB],
                         ids=["gzip-then-chunked", "chunked-twice", "chunked-then-gzip", "chunked-and-a-tab"])
def test_a_transfer_coding_other_than_chunked_once_is_refused_and_not_reused(raw):
    """The client decodes no transfer coding but chunked (it asks for identity): a gzipped body
    would be handed over still gzipped, and a coding applied twice (RFC 9112 §6.1) read as once.
    h11 refuses both; so does this client, and the connection is never used again."""
    async def main():
        http = client()
        async with server(answering(raw, then_wait=1)) as (url, _):
            with pytest.raises(ProtocolFailure, match="transfer coding"):
                response = await http.request("POST", url, headers={}, body=b"{}", read_timeout=2)
                await response.read()
            assert http.idle_connections == 0
        await http.aclose()

    run(main())


@pytest.mark.parametrize("version", [b"RTSP/1.0", b"ICE/1.0"])
def test_a_status_line_that_is_not_http_is_refused(version):
    """The parser reads RTSP and ICE status lines too: an RTSP server's `200 OK` is no answer."""
    async def main():
        http = client()
        async with server(answering(version + b" 200 OK\r\nContent-Length: 2\r\n\r\n{}", then_wait=1)) as (url, _):
            with pytest.raises(ProtocolFailure, match="not HTTP"):
                await http.request("POST", url, headers={}, body=b"{}", read_timeout=2)
            assert http.idle_connections == 0
        await http.aclose()

    run(main())


@pytest.mark.parametrize("status", [b"000", b"099", b"042"])
def test_a_status_below_100_is_refused(status):
    """No HTTP status is below 100 (RFC 9110 §15), and h11 refuses one: it was taken for a
    final answer, its connection pooled, and counted as a backend that works."""
    async def main():
        http = client()
        async with server(answering(b"HTTP/1.1 " + status + b" OK\r\nContent-Length: 2\r\n\r\n{}", then_wait=1)) \
                as (url, _):
            with pytest.raises(ProtocolFailure, match="status"):
                await http.request("POST", url, headers={}, body=b"{}", read_timeout=2)
            assert http.idle_connections == 0
        await http.aclose()

    run(main())


@pytest.mark.parametrize("lead", [b"", b"\r\n", b"\r\n\r\n"], ids=["none", "an-empty-line", "two"])
def test_a_status_line_trickled_a_byte_at_a_time_is_still_read(lead):
    """The protocol is told from the answer's first bytes, whatever pieces they come in, past
    the empty lines a server may send first (the parser skips them, RFC 9112 §2.2)."""
    async def handler(reader, writer):
        await read_request(reader)
        for byte in lead + b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}":
            writer.write(bytes([byte]))
            await writer.drain()
            await asyncio.sleep(0.001)
        await asyncio.sleep(1)

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"{}", read_timeout=2)
            assert (response.status, await response.read()) == (200, b"{}")
        await http.aclose()

    run(main())


def test_a_server_sending_faster_than_its_answer_is_read_is_held_to_a_bounded_buffer():
    """While the body is not taken, the connection stops reading from its socket past a bound
    (as asyncio's streams do): what waits in memory is bounded, and nothing is lost."""
    from kiln.http1 import RECEIVE_BOUND

    size = 16 * 1024 * 1024

    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"{}")
            await asyncio.sleep(0.5)  # the server goes on sending; nothing is read
            waiting = len(response._connection.unread())  # noqa: SLF001 - what the connection holds
            assert 0 < waiting <= RECEIVE_BOUND + 256 * 1024
            assert len(await response.read()) == size
        await http.aclose()

    run(main())


@pytest.mark.parametrize(("given", "host"), [
    ({"x-a": "1"}, None),
    ({"Host": "example.test", "Content-Length": "999", "x-a": "1"}, b"example.test"),
    ({"x-a": "1", "HOST": "first.test", "host": "second.test"}, b"first.test"),
    ({"host": "", "x-a": "1"}, None),
])
def test_the_request_carries_its_own_length_and_the_first_host_given(given, host):
    """Host and Content-Length are the client's to write: the body's true length, the first
    Host given (none, or an empty one: the URL's), every other header as given, once."""
    seen = []

    async def handler(reader, writer):
        seen.append(await read_request(reader))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    async def main():
        http = client()
        async with server(handler) as (url, _):
            response = await http.request("POST", url + "/x", headers=given, body=b"12345")
            assert response.status == 200 and await response.read() == b""
            (request,) = seen
            lines = request.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
            names = [line.split(b":", 1)[0].lower() for line in lines]
            assert names.count(b"host") == 1 and names.count(b"content-length") == 1 and names.count(b"x-a") == 1
            assert b"content-length: 5" in [line.lower() for line in lines]
            expected = host or url.split("//", 1)[1].encode()
            assert f"host: {expected.decode()}".encode() in [line.lower() for line in lines]
        await http.aclose()

    run(main())


# -- what h11 refuses, refused here too (a review against h11 and httpx) ---------------------------


@pytest.mark.parametrize("headers", [
    {"authorization": "Bearer k\r\nX-Injected: 1"},  # a value that ends a line and starts another
    {"authorization": "Bearer k\n"},  # a key read from a file, its newline kept
    {"x-amz-security-token": "tok\r"},
    {"x-note": "a\x00b"},
    {"x-a: b\r\nx-c": "d"},  # a name that is a line and a half
])
def test_a_header_that_would_change_the_request_on_the_wire_is_refused_not_sent(headers):
    """httpx refuses a header name or value holding a line break or a NUL; this client wrote
    it as given: a second request in the first's headers, or a body the server reads as the
    start of the next request on the pooled connection."""
    received = []

    async def handler(reader, writer):
        received.append(await reader.read(65536))

    async def main():
        http = client()
        async with server(handler) as (url, _):
            with pytest.raises(ConnectFailed, match="header"):
                await http.request("POST", url + "/v1/x", headers=headers, body=b"{}")
            await asyncio.sleep(0.05)
        await http.aclose()
        assert received == []  # nothing was sent, not even a connection's worth

    run(main())


@pytest.mark.parametrize("path", ["/v1/chat completions", "/v1/caf\u00e9", "/v1/x\ty"])
def test_a_path_no_request_line_carries_as_written_is_refused(path):
    async def main():
        http = client()
        async with server(lambda reader, writer: asyncio.sleep(0)) as (url, _):
            with pytest.raises(ConnectFailed):
                await http.request("POST", url + path, headers={}, body=b"{}")
        await http.aclose()

    run(main())


def test_trailers_are_bounded_and_never_taken_for_headers():
    """A trailer of 200 MiB was held whole (h11 stops at 16 KiB); a trailer's fields were merged
    into the response's headers, where one could add an `x-amzn-errortype` the AWS client reads."""
    def endless(head: bytes):
        async def handler(reader, writer):  # `head`, then 4 MiB of a line that never ends
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + head)
            for _ in range(64):
                writer.write(b"a" * 65536)
                await writer.drain()

        return handler

    adds = answering(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
                     b"X-Amzn-ErrorType: Injected\r\n\r\n")

    async def main():
        http = client()
        for flooding in (endless(b"2\r\n{}\r\n0\r\nX-T: "), endless(b"2;x=")):  # a trailer, a chunk extension
            async with server(flooding) as (url, _):
                response = await http.request("POST", url, headers={}, body=b"{}")
                with pytest.raises(ResponseTooLarge):
                    await response.read(max_bytes=1024)
        async with server(adds) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"{}")
            assert await response.read() == b"{}"
            assert response.header("x-amzn-errortype") is None
        await http.aclose()

    run(main())


@pytest.mark.parametrize("answer", [
    # HTTP/1.0 with chunked framing: RFC 9112 §6.1, the client closes the connection after it
    b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    # any HTTP/1.0 answer, its keep-alive asked for or not: h11 reuses none
    b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}",
    # bytes after the body's end, in the same read: a connection that says more than it was asked
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}H",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}HTTP/1.1 200 OK\r\n",
])
def test_an_answer_whose_connection_cannot_be_trusted_again_is_not_reused(answer):
    async def main():
        http = client()
        async with server(answering(answer, then_wait=1)) as (url, _):
            response = await http.request("POST", url, headers={}, body=b"{}")
            assert await response.read() == b"{}" and http.idle_connections == 0
        await http.aclose()

    run(main())
