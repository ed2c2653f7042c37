"""kiln.responses.RelayResponse: the ASGI messages a relayed stream makes."""

from __future__ import annotations

import asyncio

from kiln.responses import LastPiece, RelayResponse


def _messages(pieces: list[bytes]) -> list[dict]:
    sent: list[dict] = []

    async def body():
        for piece in pieces:
            yield piece

    async def receive():
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    asyncio.run(RelayResponse(body(), "gen-1")({"type": "http"}, receive, send))
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
