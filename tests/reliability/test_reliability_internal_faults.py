"""A fault inside the gateway itself, after admission (contract §4, "settled on every path").

Whatever fails in the gateway's own code, the request settles exactly once (`gateway_error`),
its slot comes back, and the client gets an answer in the contract's shape with the generation
id (a 500 `internal_error`, or a stream's §5 error event). A request the gateway failed before
any answer is billed nothing (its client is told to try again, and an SDK's retries would pay
for the same failure each time); a stream is billed what it relayed.
"""

from __future__ import annotations

import json
import time

import pytest

from kiln import exchange
from kiln.apis.base import ChatStyleApi
from kiln.apis.responses import ResponsesApi
from kiln.sse import SseRelay
from support import sse_events, wait_for_events

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


def fails_on_call(original, count: int, times: int | None = None):
    """`original`, failing from its `count`-th call on (`times` calls, or all)."""
    calls = []

    def patched(*args, **kwargs):
        calls.append(1)
        if len(calls) >= count and (times is None or len(calls) < count + times):
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


@pytest.mark.parametrize("fault", ["writing the answer", "pricing"])
@pytest.mark.parametrize("path", [CHAT, RESPONSES])
def test_a_buffered_request_the_gateway_fails_is_a_500_settled_once_and_billed_nothing(
        stack, ledger, monkeypatch, path, fault):
    """The model server answered in full; the gateway failed writing the cost into its answer,
    or pricing it. The client gets 500 `internal_error` with the
    generation id; the request settles as `gateway_error`. A failure in the pricing itself once
    failed the crash's own settle: no event, a 500 with no generation id, and the lease renewed
    on for the model's whole total time, the org's slot taken."""
    if fault == "writing the answer":
        monkeypatch.setattr(ChatStyleApi if path == CHAT else ResponsesApi, "with_usage", fails)
    else:
        monkeypatch.setattr(exchange, "cost_of", fails)
    response = ledger.saw(stack.post(path, BODIES[path], ledger.key))
    monkeypatch.undo()
    assert response.status_code == 500, response.text
    assert response.json()["error"]["code"] == "internal_error"
    assert response.headers["X-Neocloud-Generation-Id"]
    (event,) = ledger.check()
    assert (event.status, event.http_status, event.cost) == ("gateway_error", 500, 0), event


def test_a_stream_the_gateway_cannot_price_still_ends_and_settles(stack, ledger, monkeypatch):
    """The stream ran whole; pricing it failed: it ends with the error event, settled once as
    `gateway_error`, its slot back."""
    monkeypatch.setattr(exchange, "cost_of", fails)
    response = ledger.saw(stack.post(CHAT, {**BODIES[CHAT], "stream": True}, ledger.key))
    monkeypatch.undo()
    assert response.status_code == 200
    assert ends_with_the_error_event(CHAT, response.text), response.text[-300:]
    (event,) = ledger.check()
    assert (event.status, event.cost) == ("gateway_error", 0)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_a_usage_event_that_cannot_be_made_whole_is_made_with_what_the_request_is_billed(
        stack, ledger, monkeypatch, stream):
    """Making the usage event failed (once): the request was once marked settled first, so no
    event was written and its slot was held, renewed, for the model's whole total time. It is
    made again with what the request is billed, and the client gets its answer."""
    monkeypatch.setattr(exchange, "UsageEvent", fails_on_call(exchange.UsageEvent, 1, times=1))
    response = ledger.saw(stack.post(CHAT, {**BODIES[CHAT], "stream": stream}, ledger.key))
    monkeypatch.undo()
    assert response.status_code == 200
    (event,) = ledger.check()
    assert event.status == "success" and event.cost > 0 and event.completion_tokens == 12, event
    assert "could not be made whole" in event.error


def test_a_request_whose_usage_event_cannot_be_made_at_all_leaves_its_lease_to_be_reclaimed(
        stack_factory, monkeypatch):
    """Nothing can record it: its lease is no longer renewed, so it expires and the next
    admission reclaims it (`abandoned`), as a dead gateway's; the org's one slot comes back
    within the lease's time, never held for the model's whole total time."""
    stack = stack_factory(lease_ttl_seconds=2.0, lease_renew_seconds=0.5)
    org_id, key = stack.org(concurrency=1)
    monkeypatch.setattr(exchange, "UsageEvent", fails)
    assert stack.post(CHAT, BODIES[CHAT], key).status_code == 500
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while (answered := stack.post(CHAT, BODIES[CHAT], key)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert answered.status_code == 200, answered.text
    assert sorted(event.status for event in wait_for_events(stack, org_id, 2)) == ["abandoned", "success"]
    assert stack.org_info(org_id).in_flight == 0


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
