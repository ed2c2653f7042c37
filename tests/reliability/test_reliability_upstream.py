"""Upstream faults: each answered per contract §5/§7, with the slot released and the usage recorded."""

from __future__ import annotations

import json
import time

import pytest

from support import TELEMETRY, catalog_for_tests, data_events

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "x"}]

# fault → (model, extra body, expected status, expected usage status, what the client sees)
FAULTS = {
    "connection refused": ("all-down-model", {}, 502, "upstream_error", "plain"),
    "500": ("qwen3-32b", {"mock": {"status": 500}}, 502, "upstream_error", "plain"),
    "plain-text 500": ("qwen3-32b", {"mock": {"status": 500, "plain_text": True}}, 502, "upstream_error", "plain"),
    "400 passthrough": ("qwen3-32b", {"mock": {"status": 400, "message": "context too long"}}, 400, "upstream_rejected", "json"),
    "timeout before the first byte": ("hung-model", {"stream": True}, 502, "upstream_error", "plain"),
    "cut mid-stream": ("qwen3-32b", {"stream": True, "mock": {"cut_after": 4}}, 200, "stream_interrupted", "error-event"),
    "no backend": ("no-backend-model", {}, 503, "no_backend_available", "json"),
    "failover to a second backend": ("failover-model", {}, 200, "success", "json"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_answered_per_contract_and_settled(stack, fault):
    model, extra, status, usage_status, shape = FAULTS[fault]
    org_id, key = stack.org()
    response = stack.post(CHAT, {"model": model, "messages": MESSAGES, **extra}, key)
    assert response.status_code == status
    if shape == "plain":
        assert response.headers["content-type"].startswith("text/plain") and response.text.strip()
    elif shape == "error-event":
        chunks = data_events(response.text)
        assert chunks[-1]["error"]["code"] == "upstream_error" and "[DONE]" not in chunks
    elif status >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    (event,) = stack.events(org_id)
    assert event.gen_id == response.headers["X-Neocloud-Generation-Id"]
    assert event.status == usage_status
    assert stack.org_info(org_id).in_flight == 0


def test_a_slow_first_token_gets_keepalives_and_nothing_times_out_early(stack_factory):
    stack = stack_factory(keepalive_seconds=0.2)
    _, key = stack.org()
    # headers at once, first token after 1.5 s: far beyond a 0.5 s first-byte timeout, within the idle one
    document = catalog_for_tests(stack.mock.url)
    thinking = next(m for m in document["models"] if m["id"] == "qwen3-32b")
    stack.ssm.put_parameter(
        Name=stack.settings.catalog_parameter, Overwrite=True, Type="String", Tier="Advanced",
        Value=json.dumps({"models": [{**thinking, "timeouts": {"first_byte": 0.5, "idle": 5, "total": 30}}]}),
    )
    response = stack.post(CHAT, {"model": "qwen3-32b", "messages": MESSAGES, "stream": True, "mock": {"ttft_ms": 1500}}, key)
    assert response.status_code == 200
    assert response.text.count(": keepalive") >= 5
    assert data_events(response.text)[-1] == "[DONE]"


def test_backends_that_keep_failing_are_marked_unavailable_then_tried_again(stack_factory):
    stack = stack_factory(backend_failure_threshold=2, backend_cooldown_seconds=0.5)
    org_id, key = stack.org()
    body = {"model": "all-down-model", "messages": MESSAGES}
    assert [stack.post(CHAT, body, key).status_code for _ in range(2)] == [502, 502]
    # both backends failed twice in a row: out of service, answered at once without trying them
    marked = stack.post(CHAT, body, key)
    assert marked.status_code == 503 and marked.json()["error"]["code"] == "no_backend_available"
    assert "Retry-After" not in marked.headers
    time.sleep(0.6)
    assert stack.post(CHAT, body, key).status_code == 502  # after the cooldown: tried again
    statuses = [e.status for e in sorted(stack.events(org_id), key=lambda e: e.created_at)]
    assert statuses == ["upstream_error", "upstream_error", "no_backend_available", "upstream_error"]


def test_one_failing_backend_is_skipped_while_the_other_serves(stack_factory):
    stack = stack_factory(backend_failure_threshold=1, backend_cooldown_seconds=60)
    _, key = stack.org()
    mark = len(TELEMETRY.text())
    for _ in range(3):  # failover-model: a backend that refuses connections, then the mock
        response = stack.post(CHAT, {"model": "failover-model", "messages": MESSAGES}, key)
        assert response.status_code == 200
    assert stack.gateway.upstream.health.out_of_service() == ["dead"]
    # only the first request tried the dead backend; the others went straight to the live one
    failures = [json.loads(line)["UpstreamFailures"] for line in TELEMETRY.text()[mark:].splitlines()
                if '"UpstreamFailures"' in line]
    assert failures == [[1.0], [0.0], [0.0]]
