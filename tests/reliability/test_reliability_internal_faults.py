"""A fault inside the gateway itself, after admission (contract §4, "settled on every path").

Whatever fails in the gateway's own code, the request settles exactly once (`gateway_error`),
its slot comes back, the client gets an answer in the contract's shape with the generation id
(a 500 `internal_error`, or a stream's §5 error event), and what the model server was sent is
billed: a request is never billed zero because the gateway failed.
"""

from __future__ import annotations

import json

import pytest

from kiln.apis.base import ChatStyleApi
from kiln.apis.responses import ResponsesApi
from kiln.sse import SseRelay
from support import sse_events

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
MODEL = "qwen3-32b"
BODIES = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "one two three four five six seven"}]},
    RESPONSES: {"model": MODEL, "input": "one two three four five six seven"},
}


class Fault(Exception):
    """A bug of the gateway's, as a test makes one."""


def fails(*args, **kwargs):
    raise Fault("a bug")


def fails_on_call(original, count: int):
    """`original`, failing from its `count`-th call on."""
    calls = []

    def patched(*args, **kwargs):
        calls.append(1)
        if len(calls) >= count:
            raise Fault("a bug")
        return original(*args, **kwargs)

    return patched


def ends_with_the_error_event(path: str, text: str) -> bool:
    *_, last = sse_events(text)
    fields = dict(line.split(": ", 1) for line in last.split("\n"))
    payload = json.loads(fields["data"])
    if path == RESPONSES:
        return fields.get("event") == "error" and payload["code"] == "upstream_error"
    return payload["error"]["code"] == "upstream_error"


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_a_buffered_answer_the_gateway_fails_to_write_is_a_500_settled_once_and_billed_its_prompt(
        stack, ledger, monkeypatch, path):
    """The model server answered in full; writing the cost into its answer failed. The client
    gets 500 `internal_error` with the generation id; the request settles as `gateway_error`,
    billed the prompt the model server was sent (as a request ended before its answer is),
    never zero."""
    monkeypatch.setattr(ChatStyleApi if path == CHAT else ResponsesApi, "with_usage", fails)
    response = ledger.saw(stack.post(path, BODIES[path], ledger.key))
    assert response.status_code == 500, response.text
    assert response.json()["error"]["code"] == "internal_error"
    assert response.headers["X-Neocloud-Generation-Id"]
    (event,) = ledger.check()
    assert (event.status, event.http_status) == ("gateway_error", 500)
    assert event.prompt_tokens > 0 and event.cost > 0, event


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_a_stream_the_gateway_fails_to_relay_ends_with_the_error_event_and_is_billed_what_it_relayed(
        stack, ledger, monkeypatch, path):
    """The relay fails on the stream's third piece: the client has what came before, then the
    §5 error event; the request settles as `gateway_error`, billed its prompt and what it relayed."""
    monkeypatch.setattr(SseRelay, "feed", fails_on_call(SseRelay.feed, 3))
    body = {**BODIES[path], "stream": True, "mock": {"token_delay_ms": 20}}
    response = ledger.saw(stack.post(path, body, ledger.key))
    assert response.status_code == 200
    assert ends_with_the_error_event(path, response.text), response.text[-300:]
    (event,) = ledger.check()
    assert event.status == "gateway_error"
    assert event.prompt_tokens > 0 and event.cost > 0, event


@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_a_stream_whose_last_event_the_gateway_fails_to_write_keeps_its_usage(stack, ledger, monkeypatch, path):
    """The whole stream was relayed; writing its last event failed: it ends with the error
    event, and its usage, as the model server reported it, is billed."""
    monkeypatch.setattr(ChatStyleApi if path == CHAT else ResponsesApi, "stream_tail", fails)
    response = ledger.saw(stack.post(path, {**BODIES[path], "stream": True}, ledger.key))
    assert response.status_code == 200
    assert ends_with_the_error_event(path, response.text), response.text[-300:]
    (event,) = ledger.check()
    assert (event.status, event.usage_source) == ("gateway_error", "upstream")
    assert event.completion_tokens > 0 and event.cost > 0, event
