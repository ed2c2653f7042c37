"""Contract §5: what the client gets when the model server fails; failover; nothing leaks."""

from __future__ import annotations

import json

import pytest

from support import data_events

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello!"}]


def chat(model: str = "qwen3-32b", **fields):
    return {"model": model, "messages": MESSAGES, **fields}


def assert_settled(stack, org_id: str, status: str, http_status: int) -> None:
    (event,) = stack.events(org_id)
    assert (event.status, event.http_status) == (status, http_status)
    assert stack.org_info(org_id).in_flight == 0


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_400_is_passed_on_in_the_openai_shape_without_retry(stack, org, stream):
    org_id, key = org
    body = chat(stream=stream, mock={"status": 400, "message": "This model's maximum context length is 40960 tokens."})
    response = stack.post(CHAT, body, key)
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "This model's maximum context length is 40960 tokens.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }
    assert response.headers["X-Neocloud-Generation-Id"]
    assert stack.mock.stats["requests"] == 1
    assert_settled(stack, org_id, "upstream_rejected", 400)
    assert stack.events(org_id)[0].upstream == "local"  # §4: the upstream used, the one that refused


@pytest.mark.parametrize("status", [404, 409, 422, 429])
def test_other_upstream_4xx_keep_their_status(stack, org, status):
    org_id, key = org
    response = stack.post(CHAT, chat(mock={"status": status, "message": "nope"}), key)
    assert response.status_code == status
    error = response.json()["error"]
    assert error["message"] == "nope" and set(error) == {"message", "type", "param", "code"}
    assert_settled(stack, org_id, "upstream_rejected", status)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("message", ['{"error":' + "[" * 5000, "[" * 5000, '{"error":{"message":' + "{" * 3000],
                         ids=["nested error", "nested array", "nested message"])
def test_an_upstream_4xx_nested_past_any_parser_is_still_passed_on(stack, org, stream, message):
    """A body nested thousands deep is no error shape: its text is the message, never a 500."""
    org_id, key = org
    response = stack.post(CHAT, chat(stream=stream, mock={"status": 400, "plain_text": True, "message": message}), key)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] == message[:2000]
    assert_settled(stack, org_id, "upstream_rejected", 400)


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_4xx_with_a_long_message_keeps_its_shape_and_its_code(stack, org, stream):
    """A validation error may quote a long input before its code: the body was cut at 64 KiB
    and so was no JSON, the client got `{"error": {"message": "mmm…` as the message, code null."""
    org_id, key = org
    raw = json.dumps({"error": {"message": "m" * 1_000_000, "type": "BadRequestError", "code": "too_long"}})
    response = stack.post(CHAT, chat(stream=stream, mock={"status": 400, "plain_text": True, "message": raw}), key)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["message"], error["code"]) == ("m" * 2000, "too_long")
    assert_settled(stack, org_id, "upstream_rejected", 400)


# found by a hostile model server: its codes were the gateway's word on the caller's key and org

@pytest.mark.parametrize("status, code", [(401, "invalid_api_key"), (402, "insufficient_credits"),
                                          (429, "rate_limit_exceeded"), (403, "organization_disabled"),
                                          (400, "maintenance"), (404, "generation_not_found")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_model_servers_code_is_never_one_the_gateway_says_of_the_key_org_or_itself(stack, org, stream, status, code):
    """A client branches on `error.code` (§5: codes are stable API): a model server's (or a
    misconfigured backend's) `invalid_api_key` told a client with a good key that its key was
    bad, a `insufficient_credits` that its org was out of credits. The status and the message
    are the server's (§5); such a code is none, and the usage event keeps it as the server's."""
    org_id, key = org
    raw = json.dumps({"error": {"message": "from the model server", "type": "x", "code": code}})
    response = stack.post(CHAT, chat(stream=stream, mock={"status": status, "plain_text": True, "message": raw}), key)
    assert response.status_code == status, response.text
    assert response.json()["error"] == {"message": "from the model server", "type": "invalid_request_error",
                                        "param": None, "code": None}
    assert_settled(stack, org_id, "upstream_rejected", status)
    assert stack.events(org_id)[0].error == f"upstream HTTP {status} {code}"


@pytest.mark.parametrize("code", ["context_length_exceeded", "invalid_value", "invalid_type"])
def test_a_model_servers_code_of_the_request_is_passed_on(stack, org, code):
    org_id, key = org
    raw = json.dumps({"error": {"message": "no", "param": "max_tokens", "code": code}})
    response = stack.post(CHAT, chat(mock={"status": 400, "plain_text": True, "message": raw}), key)
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (code, "max_tokens")


def _repeating_the_request(levels: int) -> str:
    """A 422 as a validation layer writes it, quoting an input nested `levels` deep."""
    quoted: object = "x"
    for _ in range(levels):
        quoted = [quoted]
    return json.dumps({"error": {"message": "bad schema", "type": "BadRequestError", "param": "tools",
                                 "code": "bad_schema", "input": quoted}})


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("raw", ["\ufeff" + json.dumps({"error": {"message": "bad schema", "param": "tools",
                                                                   "code": "bad_schema"}}),
                                 _repeating_the_request(199)], ids=["byte order mark", "quoting the request"])
def test_an_upstream_4xx_is_read_as_its_answers_are(stack, org, stream, raw):
    """An error body is read as a 200 answer is: opened by a byte order mark, or quoting a
    request at the clients' nesting bound (a few levels deeper than the request itself). Read
    more strictly, the client got the whole body as the message and no `code` to branch on."""
    org_id, key = org
    response = stack.post(CHAT, chat(stream=stream, mock={"status": 400, "plain_text": True, "message": raw}), key)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["message"], error["param"], error["code"]) == ("bad schema", "tools", "bad_schema")
    assert_settled(stack, org_id, "upstream_rejected", 400)
    assert stack.events(org_id)[0].error == "upstream HTTP 400 bad_schema"


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_4xx_whose_message_no_utf8_can_carry_is_passed_on_as_its_text(stack, org, stream):
    """A lone surrogate escape in the error's message can be written in no UTF-8 body: the
    message is the upstream's text as it came, and the answer keeps its status and its id."""
    org_id, key = org
    raw = '{"error":{"message":"bad token \\ud800 here","code":"bad"}}'
    response = stack.post(CHAT, chat(stream=stream, mock={"status": 400, "plain_text": True, "message": raw}), key)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"] == raw
    assert response.headers["X-Neocloud-Generation-Id"]
    assert_settled(stack, org_id, "upstream_rejected", 400)


@pytest.mark.parametrize("fault", [{"status": 500}, {"status": 503}, {"status": 500, "plain_text": True}])
@pytest.mark.parametrize("stream", [False, True])
def test_upstream_5xx_with_no_other_backend_is_502_plain_text(stack, org, fault, stream):
    org_id, key = org
    response = stack.post(CHAT, chat(stream=stream, mock=fault), key)
    assert response.status_code == 502
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text.strip() and "{" not in response.text
    assert response.headers["X-Neocloud-Generation-Id"]
    assert_settled(stack, org_id, "upstream_error", 502)


def test_connection_refused_on_every_backend_is_502(stack, org):
    org_id, key = org
    response = stack.post(CHAT, chat("all-down-model"), key)
    assert response.status_code == 502
    assert response.headers["content-type"].startswith("text/plain")
    (event,) = stack.events(org_id)
    assert "dead: connection failed" in event.error and "sick: HTTP 500" in event.error


@pytest.mark.parametrize("model", ["failover-model", "failover-5xx-model", "hung-then-ok-model"])
@pytest.mark.parametrize("stream", [False, True])
def test_failover_to_the_next_backend_before_the_first_byte(stack, org, model, stream):
    if model == "hung-then-ok-model" and not stream:
        pytest.skip("a buffered answer has no first byte before it is whole: see the test below")
    org_id, key = org
    response = stack.post(CHAT, chat(model, stream=stream), key)
    assert response.status_code == 200
    if stream:
        assert data_events(response.text)[-1] == "[DONE]"
    (event,) = stack.events(org_id)
    assert (event.status, event.upstream) == ("success", "b")


def test_a_hung_backend_holds_a_buffered_request_only_for_the_models_total_time_failover_included(stack, org):
    # hung-then-ok-model: total 1 s; the hung backend would answer after 3 s. A buffered answer
    # comes whole, so its wait is bounded by the total, which the whole request shares: the
    # next backend gets what is left (nothing), not a fresh total of its own.
    org_id, key = org
    response = stack.post(CHAT, chat("hung-then-ok-model"), key)
    assert response.status_code == 502
    (event,) = stack.events(org_id)
    assert event.status == "upstream_error" and event.error.startswith("hung: timed out")
    assert stack.org_info(org_id).in_flight == 0


def test_timeout_before_the_first_byte_with_no_other_backend_is_502(stack, org):
    org_id, key = org
    response = stack.post(CHAT, chat("hung-model", stream=True), key)
    assert response.status_code == 502
    assert_settled(stack, org_id, "upstream_error", 502)


@pytest.mark.parametrize("model", ["no-backend-model", "disabled-backend-model"])
def test_no_backend_is_503_no_backend_available_without_retry_after(stack, org, model):
    org_id, key = org
    response = stack.post(CHAT, chat(model), key)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "no_backend_available"
    assert "Retry-After" not in response.headers
    assert response.headers["X-Neocloud-Generation-Id"]
    assert_settled(stack, org_id, "no_backend_available", 503)


@pytest.mark.parametrize("fault", [{"cut_after": 3}, {"no_done": True}])
def test_failure_after_the_stream_started_is_one_error_event_and_no_done(stack, org, fault):
    org_id, key = org
    response = stack.post(CHAT, chat(stream=True, stream_options={"include_usage": True}, mock=fault), key)
    assert response.status_code == 200
    chunks = data_events(response.text)
    assert "[DONE]" not in chunks
    assert chunks[-1] == {
        "error": {
            "message": "The model backend failed while streaming the response.",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
    }
    assert sum(1 for c in chunks if "error" in c) == 1
    (event,) = stack.events(org_id)
    assert event.status == "stream_interrupted"
    assert stack.org_info(org_id).in_flight == 0
    if "cut_after" in fault:
        # the role chunk and two tokens were relayed: the two tokens are billed
        assert event.completion_tokens == 2 and event.cost > 0


def test_an_upstream_silent_for_longer_than_its_idle_timeout_is_cut(stack, org):
    org_id, key = org
    response = stack.post(CHAT, chat("idle-model", stream=True, mock={"token_delay_ms": 1000}), key)
    assert response.status_code == 200
    assert data_events(response.text)[-1]["error"]["code"] == "upstream_error"
    assert stack.events(org_id)[0].status == "stream_interrupted"


def test_a_buffered_body_cut_half_way_is_502(stack, org):
    org_id, key = org
    response = stack.post(CHAT, chat(mock={"cut_after": 1}), key)
    assert response.status_code == 502
    assert_settled(stack, org_id, "upstream_error", 502)
