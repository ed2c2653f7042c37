"""kiln.responses.RelayResponse: the ASGI messages a relayed stream makes."""

from __future__ import annotations

import asyncio

from kiln.responses import LastPiece, RelayResponse


async def _client_stays() -> dict:
    await asyncio.sleep(30)
    return {"type": "http.disconnect"}


async def _ignore(message: dict) -> None:
    pass


def _messages(pieces: list[bytes]) -> list[dict]:
    sent: list[dict] = []

    async def body():
        for piece in pieces:
            yield piece

    async def send(message):
        sent.append(message)

    asyncio.run(RelayResponse(body(), "gen-1")({"type": "http"}, _client_stays, send))
    return sent


def test_the_last_piece_goes_out_with_the_end_of_the_body():
    sent = _messages([b"data: a\n\n", LastPiece(b"data: [DONE]\n\n")])
    bodies = [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]
    assert bodies == [(b"data: a\n\n", True), (b"data: [DONE]\n\n", False)]
    assert all(type(body) is bytes for body, _ in bodies)


def test_a_body_without_a_marked_end_is_ended_by_an_empty_message():
    sent = _messages([b"data: a\n\n"])
    bodies = [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]
    assert bodies == [(b"data: a\n\n", True), (b"", False)]


def _relay(body, *, receive, send=None, on_close=None) -> None:
    async def main():
        await RelayResponse(body, "gen-1", on_close=on_close)({"type": "http"}, receive, send or _ignore)
        await asyncio.sleep(0)  # the listener's cancel is delivered
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        assert others == [], "the disconnect listener outlived its response"

    asyncio.run(main())


def test_a_client_leaving_while_the_upstream_is_silent_cancels_the_body_and_its_settle_still_finishes():
    import anyio

    seen: list[str] = []

    async def body():
        try:
            yield b"data: a\n\n"
            await asyncio.sleep(30)  # the upstream says nothing
            yield b"never"
        except asyncio.CancelledError:
            with anyio.CancelScope(shield=True):  # as the relay settles
                await asyncio.sleep(0.05)
                seen.append("settled")
            raise

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    async def closed():
        seen.append("on_close")

    _relay(body(), receive=receive, on_close=closed)
    assert seen == ["settled", "on_close"]


def test_requests_messages_before_the_disconnect_do_not_end_the_stream():
    messages = iter([{"type": "http.request", "body": b"", "more_body": False}] * 3)
    sent: list[bytes] = []

    async def body():
        await asyncio.sleep(0.05)
        yield LastPiece(b"data: [DONE]\n\n")

    async def receive():
        try:
            return next(messages)
        except StopIteration:
            await asyncio.sleep(10)
            return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    _relay(body(), receive=receive, send=send)
    assert sent == [b"data: [DONE]\n\n"]


def _two_events(seen: list[str]):
    """A body of two events that notes when it is closed."""
    async def body():
        try:
            yield b"data: a\n\n"
            yield b"data: b\n\n"
        finally:
            seen.append("closed")

    return body()


def test_a_failed_write_closes_the_body_and_runs_on_close():
    seen: list[str] = []

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("connection reset")

    async def closed():
        seen.append("on_close")

    _relay(_two_events(seen), receive=_client_stays, send=send, on_close=closed)
    assert seen == ["closed", "on_close"]


def test_the_server_cancelling_the_request_still_closes_the_body():
    seen: list[str] = []

    async def body():
        try:
            yield b"data: a\n\n"
            await asyncio.sleep(30)
        finally:
            seen.append("closed")

    async def main():
        task = asyncio.get_running_loop().create_task(RelayResponse(body(), "gen-1")({"type": "http"}, _client_stays, _ignore))
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            seen.append("cancelled")

    asyncio.run(main())
    assert seen == ["closed", "cancelled"]


def test_after_a_client_leaves_the_request_goes_on_uncancelled():
    """The stream is cut, not the request: what follows the response in the request's task (its
    telemetry) runs, awaits included, whether the client left mid-stream or as the stream ended."""
    seen: list[str] = []

    async def body(finish_at_once: bool):
        yield b"data: a\n\n"
        if not finish_at_once:
            await asyncio.sleep(30)
        yield LastPiece(b"data: [DONE]\n\n")

    async def main(finish_at_once: bool) -> None:
        async def receive():
            await asyncio.sleep(0 if finish_at_once else 0.05)
            return {"type": "http.disconnect"}

        await RelayResponse(body(finish_at_once), "gen-1")({"type": "http"}, receive, _ignore)
        await asyncio.sleep(0.01)
        seen.append("went on")

    for finish_at_once in (False, True):
        asyncio.run(main(finish_at_once))
    assert seen == ["went on", "went on"]


def test_a_client_that_stops_reading_is_cut_at_the_deadline():
    import time

    seen: list[str] = []

    async def send(message):
        if message["type"] == "http.response.body":
            await asyncio.sleep(30)  # the client reads nothing: the write waits

    async def main():
        started = time.monotonic()
        await RelayResponse(_two_events(seen), "gen-1", deadline=time.monotonic() + 0.1)({"type": "http"}, _client_stays,
                                                                                        send)
        seen.append(f"over in {time.monotonic() - started < 1}")

    asyncio.run(main())
    assert seen == ["closed", "over in True"]


def test_the_deadline_waits_for_a_body_at_work_and_cuts_only_a_write_the_client_holds():
    """The deadline is for a client that reads too slowly: a body still at work when it passes
    (its settle, slow on storage, at the end of a stream that ran to the model's total time)
    goes on, and its last piece goes out; the connection was once cut in the middle of it,
    the response never ended. A write the client then holds past the deadline is still cut."""
    import time

    async def settles_slowly():
        yield b"data: a\n\n"
        await asyncio.sleep(0.3)  # past the deadline: the settle, waiting on storage
        yield LastPiece(b"data: [DONE]\n\n")

    sent: list[dict] = []

    async def reads(message):
        sent.append(message)

    asyncio.run(RelayResponse(settles_slowly(), "gen-1", deadline=time.monotonic() + 0.1)(
        {"type": "http"}, _client_stays, reads))
    bodies = [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]
    assert bodies == [(b"data: a\n\n", True), (b"data: [DONE]\n\n", False)]

    seen: list[str] = []

    async def last_piece_held():
        try:
            yield b"data: a\n\n"
            await asyncio.sleep(0.3)
            yield LastPiece(b"data: [DONE]\n\n")
        finally:
            seen.append("closed")

    async def holds_the_last(message):
        if message["type"] == "http.response.body" and not message["more_body"]:
            await asyncio.sleep(30)  # the client reads nothing more: the write waits

    async def main():
        started = time.monotonic()
        await RelayResponse(last_piece_held(), "gen-1", deadline=time.monotonic() + 0.1)(
            {"type": "http"}, _client_stays, holds_the_last)
        seen.append(f"over in {time.monotonic() - started < 2}")

    asyncio.run(main())
    assert seen == ["closed", "over in True"]
