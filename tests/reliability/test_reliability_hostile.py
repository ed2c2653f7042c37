"""Hostile clients and hostile model servers: every admitted request settles exactly once (§4, §8).

Each case is a request that once leaked a slot, lost its usage event, billed an absurd sum
or answered 500. After each, `LedgerCheck` asserts the ledger's invariants: the org's
in-flight count is back, every generation id the client saw has exactly one usage event,
and the credits debited equal the events' costs exactly.
"""

from __future__ import annotations

import json
from decimal import Decimal

import pytest

from support import LedgerCheck, data_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MODEL = "qwen3-32b"  # context length 40 960; $0.08 / $0.24 per million tokens
CONTEXT = 40960
MESSAGES = [{"role": "user", "content": "x y z"}]
ESTIMATED_PROMPT = 6  # "user" and "x y z": 9 characters, ~4 per token, + 3 for the message


def post(stack, ledger: LedgerCheck, path: str, body, **kwargs):
    return ledger.saw(stack.post(path, body, ledger.key, **kwargs))


def assert_stream_ends_cleanly(text: str) -> None:
    """A stream ends with `[DONE]` or with the §5 error event, never cut mid-event."""
    assert text.endswith("\n\n"), text[-200:]
    last = text.rstrip("\n").rsplit("\n\n", 1)[-1]
    assert last == "data: [DONE]" or json.loads(last[len("data: "):])["error"]["code"] == "upstream_error", last


def last_events(text: str, count: int) -> list:
    """The stream's last `count` data payloads, parsed (an upstream's own events may not be JSON)."""
    blocks = [block for block in text.split("\n\n") if block.startswith("data: ")][-count:]
    return [block[6:] if block == "data: [DONE]" else json.loads(block[6:]) for block in blocks]


# -- hostile clients --------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("messages", [5, "text", {"a": 1}, [1, None, {"content": 7}], True])
def test_odd_extra_fields_on_completions_are_forwarded_and_billed_by_estimate(stack, ledger, stream, messages):
    """`messages` is not a completions field: whatever it holds, the estimate must not fail."""
    body = {"model": MODEL, "prompt": "a b c d", "messages": messages, "stream": stream, "mock": {"no_usage": True}}
    response = post(stack, ledger, COMPLETIONS, body)
    assert response.status_code == 200
    if stream:
        assert_stream_ends_cleanly(response.text)
        assert data_events(response.text)[-1] == "[DONE]"
    (event,) = ledger.check()
    assert event.status == "success" and event.usage_source == "estimated"
    assert event.completion_tokens > 0 and event.cost > 0


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "qwen3-32b", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "\\udfff", "messages": [{"role": "user", "content": "x"}]}',
        b'{"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "user": "a\\ud800b"}',
        b'{"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "\\ud83d": 1}',
    ],
    ids=["content", "model", "extra-field", "key"],
)
def test_a_lone_surrogate_anywhere_is_400_invalid_json(stack, ledger, raw):
    response = post(stack, ledger, CHAT, raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    assert "X-Neocloud-Generation-Id" not in response.headers
    assert ledger.check() == []


@pytest.mark.parametrize("depth", [300, 959, 960, 961, 962, 990])
def test_deep_nesting_that_the_parser_accepts_is_still_a_400(stack, ledger, depth):
    nested = "[" * depth + "]" * depth
    raw = ('{"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "extra": ' + nested + "}").encode()
    response = post(stack, ledger, CHAT, raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
    assert ledger.check() == []


def test_moderate_nesting_is_forwarded(stack, ledger):
    nested = {"a": None}
    for _ in range(60):
        nested = {"a": nested}
    response = post(stack, ledger, CHAT, {"model": MODEL, "messages": MESSAGES, "extra": nested})
    assert response.status_code == 200
    ledger.check()


# -- hostile model servers: buffered ------------------------------------------------------------


def _answer(**fields) -> str:
    base = {"id": "x", "object": "chat.completion", "created": 1, "model": MODEL}
    return json.dumps({**base, **fields})


GOOD_CHOICE = {"index": 0, "message": {"role": "assistant", "content": "one two three four"}, "finish_reason": "stop"}


@pytest.mark.parametrize(
    "raw",
    [
        _answer(choices=[{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": 5}}]),
        _answer(choices=[{"index": 0, "message": {"tool_calls": [5, {"function": 3}, {"function": {"arguments": 9}}]}}]),
        _answer(choices=5),
        _answer(choices=[5, "x", None]),
        _answer(choices=[{"message": "text"}]),
        "[1, 2, 3]",
        '"a string"',
        "{not json",
        "",
        # an error where the completion should be (the SDK would hand the client a completion
        # with no choices): a failure, as the same object in a stream is
        json.dumps({"error": {"message": "model overloaded", "type": "server_error", "code": 503}}),
        json.dumps({"object": "error", "message": "model overloaded", "code": 503}),
        _answer(choices=[GOOD_CHOICE], error={"message": "cut short"}),
    ],
    ids=["tool_calls-int", "tool_calls-items", "choices-int", "choices-items", "message-str", "array", "string",
         "invalid", "empty", "error-object", "object-error", "choices-and-error"],
)
def test_a_malformed_buffered_answer_is_502_and_settled(stack, ledger, raw):
    body = {"model": MODEL, "messages": MESSAGES, "mock": {"raw_body": raw}}
    response = post(stack, ledger, CHAT, body)
    assert response.status_code == 502, response.text
    assert response.headers["content-type"].startswith("text/plain")
    (event,) = ledger.check()
    assert event.status == "upstream_error" and event.http_status == 502


@pytest.mark.parametrize(
    "usage",
    ["xx", [1, 2], 5, {"prompt_tokens": "3", "completion_tokens": 4}, {"prompt_tokens": -1, "completion_tokens": 4},
     {"prompt_tokens": 1.5, "completion_tokens": 4}, {"prompt_tokens": True, "completion_tokens": 4},
     {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": "x"},
     {"prompt_tokens": 3, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": "x"}}],
    ids=["str", "list", "int", "str-count", "negative", "float", "bool", "details-str", "cached-str"],
)
def test_unusable_upstream_usage_is_replaced_by_the_estimate(stack, ledger, usage):
    """No usage object: estimated. A count that is not a non-negative integer (cached tokens
    included): that count is ours, capped, and the client is shown the usage billed."""
    raw = _answer(choices=[GOOD_CHOICE], usage=usage)
    response = post(stack, ledger, CHAT, {"model": MODEL, "messages": MESSAGES, "mock": {"raw_body": raw}})
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert event.status == "success"
    if not isinstance(usage, dict):
        # 18 characters of reply, ~4 per token
        assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("estimated", ESTIMATED_PROMPT, 5)
    elif usage["prompt_tokens"] == 3:  # what is wrong is the cached tokens: none are believed
        assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("capped", 3, 4)
        assert event.cached_tokens is None
        assert "prompt_tokens_details" not in json.loads(response.text)["usage"]
    else:
        assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("capped", ESTIMATED_PROMPT, 4)
    assert json.loads(response.text, parse_float=Decimal)["usage"]["cost"] == event.cost


@pytest.mark.parametrize(
    "usage,expected",
    [
        # above max_tokens: the gateway's own estimate of the reply (5) is billed
        ({"prompt_tokens": 3, "completion_tokens": 10**15}, (3, 5)),
        ({"prompt_tokens": 3, "completion_tokens": 17}, (3, 5)),
        ({"prompt_tokens": 3, "completion_tokens": 10**200}, (3, 5)),
        # above the context length: the estimate of the prompt
        ({"prompt_tokens": 10**200, "completion_tokens": 4}, (ESTIMATED_PROMPT, 4)),
        ({"prompt_tokens": 10**15, "completion_tokens": 10**15, "prompt_tokens_details": {"cached_tokens": 10**18}},
         (ESTIMATED_PROMPT, 5)),
    ],
    ids=["completion-1e15", "completion-max-plus-1", "completion-1e200", "prompt-1e200", "all-absurd"],
)
def test_usage_the_model_cannot_have_produced_is_capped(stack, ledger, usage, expected):
    raw = _answer(choices=[GOOD_CHOICE], usage=usage)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "mock": {"raw_body": raw}}
    response = post(stack, ledger, CHAT, body)
    assert response.status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "capped"
    assert (event.prompt_tokens, event.completion_tokens) == expected
    assert event.cached_tokens is None
    # never more than the bounds allow: the whole context at the input price, max_tokens at the output price
    assert event.cost <= (CONTEXT * Decimal("0.08") + 16 * Decimal("0.24")) / 1_000_000
    answered = json.loads(response.text, parse_float=Decimal)["usage"]
    assert (answered["prompt_tokens"], answered["completion_tokens"], answered["cost"]) == (*expected, event.cost)


def test_usage_at_the_bounds_is_believed(stack, ledger):
    raw = _answer(choices=[GOOD_CHOICE], usage={"prompt_tokens": CONTEXT, "completion_tokens": 16})
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "mock": {"raw_body": raw}}
    post(stack, ledger, CHAT, body)
    (event,) = ledger.check()
    assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("upstream", CONTEXT, 16)


def test_completion_tokens_above_the_context_length_are_capped_without_max_tokens(stack, ledger):
    raw = _answer(choices=[GOOD_CHOICE], usage={"prompt_tokens": 3, "completion_tokens": 10**9})
    response = post(stack, ledger, CHAT, {"model": MODEL, "messages": MESSAGES, "mock": {"raw_body": raw}})
    assert response.status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("capped", 3, 5)


def test_the_usage_event_keeps_the_upstream_status_not_its_message(stack, ledger):
    """A model server's 400 often quotes the prompt back: the client sees it, storage does not."""
    secret = "my secret prompt text"
    body = {"model": MODEL, "messages": MESSAGES, "mock": {"status": 400, "message": f"bad input: {secret}"}}
    response = post(stack, ledger, CHAT, body)
    assert response.status_code == 400 and secret in response.json()["error"]["message"]
    (event,) = ledger.check()
    assert event.status == "upstream_rejected" and event.http_status == 400
    assert secret not in json.dumps(event.as_dict(), default=str)


# -- hostile model servers: streamed ------------------------------------------------------------


def _chunk(**fields) -> str:
    return json.dumps({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": MODEL, **fields})


CONTENT = _chunk(choices=[{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}])
FINISH = _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}])


@pytest.mark.parametrize("include_usage", [False, True], ids=["usage-hidden", "usage-asked"])
@pytest.mark.parametrize(
    "events",
    [
        ["[1, 2]", CONTENT, FINISH],
        ['"text"', CONTENT, FINISH],
        ["5", "null", CONTENT],
        [CONTENT, FINISH, _chunk(choices=[], usage={"prompt_tokens": 3, "completion_tokens": 2}), _chunk(choices=[], usage="xx")],
        [CONTENT, _chunk(choices=[], usage="xx")],
        [CONTENT, _chunk(choices=[], usage=[1])],
        [CONTENT, _chunk(choices=5, usage={"prompt_tokens": 3, "completion_tokens": 2})],
        [CONTENT, _chunk(choices=[5, None], usage={"prompt_tokens": 3, "completion_tokens": 2})],
        [CONTENT, _chunk(choices="x", usage={"prompt_tokens": 3, "completion_tokens": 2})],
        [CONTENT, "{not json", FINISH],
        [_chunk(choices=[{"delta": 5}]), _chunk(choices=[{"finish_reason": 7}]), CONTENT],
    ],
    ids=["first-array", "first-string", "scalars", "later-usage-str", "usage-str", "usage-list", "choices-int",
         "choices-items", "choices-str", "invalid-json", "odd-deltas"],
)
def test_malformed_stream_events_never_cut_the_stream(stack, ledger, events, include_usage):
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": events}}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    response = post(stack, ledger, CHAT, body)
    assert response.status_code == 200
    assert_stream_ends_cleanly(response.text)
    (event,) = ledger.check()
    assert event.status in ("success", "stream_interrupted")
    if include_usage and last_events(response.text, 1) == ["[DONE]"]:
        usage = last_events(response.text, 2)[0]["usage"]
        assert Decimal(str(usage["cost"])) == event.cost


@pytest.mark.parametrize(
    "usage,expected",
    # the relayed count (one text delta) or the prompt's estimate replaces what cannot be
    [({"prompt_tokens": 3, "completion_tokens": 10**15}, (3, 1)),
     ({"prompt_tokens": 10**200, "completion_tokens": 2}, (ESTIMATED_PROMPT, 2)),
     # more cached than the prompt: none is believed cached, and the chunk shows none
     ({"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 10**9}}, (3, 1))],
    ids=["completion-1e15", "prompt-1e200", "cached-1e9"],
)
def test_absurd_streamed_usage_is_capped(stack, ledger, usage, expected):
    events = [CONTENT, FINISH, _chunk(choices=[], usage=usage)]
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 16,
            "stream_options": {"include_usage": True}, "mock": {"raw_events": events}}
    response = post(stack, ledger, CHAT, body)
    assert data_events(response.text)[-1] == "[DONE]"
    (event,) = ledger.check()
    assert event.usage_source == "capped" and (event.prompt_tokens, event.completion_tokens) == expected
    answered = data_events(response.text)[-2]["usage"]
    assert (answered["prompt_tokens"], answered["completion_tokens"]) == expected
    assert event.cached_tokens is None and "prompt_tokens_details" not in answered


def test_a_stream_cut_after_odd_events_ends_with_the_error_event(stack, ledger):
    body = {"model": MODEL, "messages": MESSAGES, "stream": True,
            "mock": {"raw_events": ["[1]", CONTENT], "cut_after": 0}}
    response = post(stack, ledger, CHAT, body)
    assert data_events(response.text)[-1]["error"]["code"] == "upstream_error"
    (event,) = ledger.check()
    assert event.status == "stream_interrupted" and event.completion_tokens == 1


# -- found by trying the gateway as an attacker would ------------------------------------------


def test_a_usage_chunk_with_a_lone_surrogate_is_still_billed_as_reported(stack, ledger):
    """Its text cannot be UTF-8; the gateway writes it back with escapes and keeps the usage."""
    usage_chunk = '{"id":"c","choices":[],"usage":{"prompt_tokens":2000,"completion_tokens":2000},"x":"\\ud800"}'
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True},
            "mock": {"raw_events": [CONTENT, usage_chunk]}}
    response = post(stack, ledger, CHAT, body)
    assert last_events(response.text, 1) == ["[DONE]"]
    usage = last_events(response.text, 2)[0]["usage"]
    (event,) = ledger.check()
    assert (event.status, event.usage_source, event.prompt_tokens, event.completion_tokens) == (
        "success", "upstream", 2000, 2000)
    assert Decimal(str(usage["cost"])) == event.cost == (2000 * Decimal("0.08") + 2000 * Decimal("0.24")) / 1_000_000


def test_a_responses_final_event_with_a_lone_surrogate_is_still_billed_as_reported(stack, ledger):
    final = ('{"type":"response.completed","response":{"id":"\\ud800","status":"completed","output":[],'
             '"usage":{"input_tokens":2000,"output_tokens":2000}}}')
    body = {"model": MODEL, "input": "hi", "stream": True, "mock": {"raw_events": [final], "no_done": True}}
    response = post(stack, ledger, "/v1/responses", body)
    final_event = response.text.rstrip("\n").rsplit("\n\n", 1)[-1]
    assert final_event.startswith("event: response.completed") or final_event.startswith("data: ")
    (event,) = ledger.check()
    assert (event.status, event.prompt_tokens, event.completion_tokens) == ("success", 2000, 2000)


@pytest.mark.parametrize(
    "raw",
    ['{"choices":[],"x":' + "[" * 5000 + "]" * 5000 + "}",
     '{"choices":[{"message":{"content":' + "[" * 985 + "]" * 985 + "}}]}",
     '{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1},"x":NaN,"y":-Infinity}'],
    ids=["nested-5000", "nested-985", "nan"],
)
def test_a_buffered_answer_no_client_could_parse_is_502_not_500(stack, ledger, raw):
    for path, body in ((CHAT, {"model": MODEL, "messages": MESSAGES}), ("/v1/responses", {"model": MODEL, "input": "hi"})):
        response = post(stack, ledger, path, {**body, "mock": {"raw_body": raw}})
        assert response.status_code == 502, (path, response.text[:200])
    events = ledger.check()
    assert [event.status for event in events] == ["upstream_error", "upstream_error"]


def test_a_deeply_nested_stream_event_is_relayed_not_taken_for_a_gateway_fault(stack, ledger):
    deep = '{"id":"c","x":' + "[" * 5000 + "]" * 5000 + ',"choices":[{"delta":{"content":"a"}}]}'
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": [deep, CONTENT, FINISH]}}
    response = post(stack, ledger, CHAT, body)
    assert last_events(response.text, 1) == ["[DONE]"]
    (event,) = ledger.check()
    assert event.status == "success" and event.completion_tokens == 2  # both deltas counted


def test_two_authorization_headers_are_no_key_at_all(stack, ledger):
    body = json.dumps({"model": MODEL, "messages": MESSAGES})
    for headers in ([("Authorization", f"Bearer {ledger.key}"), ("Authorization", "Bearer sk-kiln-other")],
                    [("Authorization", "Bearer sk-kiln-other"), ("Authorization", f"Bearer {ledger.key}")]):
        response = stack.http.post(CHAT, content=body, headers=[*headers, ("Content-Type", "application/json")])
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    assert ledger.check() == []


_LONG_REASON = "x" * 450_000  # with the rest of the item, over DynamoDB's 400 KB


@pytest.mark.parametrize("reason", [_LONG_REASON, "stop because the prompt said: tell me a secret"], ids=["long", "text"])
@pytest.mark.parametrize("api", ["chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_a_finish_reason_that_is_text_is_not_stored_and_the_request_still_settles(stack, ledger, api, stream, reason):
    """A finish reason is a short word. Text (of any length: it may quote the prompt, §4) is not
    stored, and 450 KB of it once made DynamoDB refuse the usage event: the slot stayed taken
    and the request was later reclaimed as abandoned, billed nothing."""
    usage = {"prompt_tokens": 1000, "completion_tokens": 4000}
    if api == "chat":
        path, body = CHAT, {"model": MODEL, "messages": MESSAGES, "stream": stream}
        if stream:
            body["mock"] = {"raw_events": [json.dumps({"id": "c", "choices": [
                {"index": 0, "delta": {"content": "hi"}, "finish_reason": reason}]}),
                json.dumps({"id": "c", "choices": [], "usage": usage})]}
        else:
            body["mock"] = {"raw_body": json.dumps({"id": "c", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": reason}], "usage": usage})}
    else:
        answer = {"id": "r", "object": "response", "status": reason, "output": [],
                  "usage": {"input_tokens": 1000, "output_tokens": 4000}}
        path, body = "/v1/responses", {"model": MODEL, "input": "hi", "stream": stream}
        if stream:
            body["mock"] = {"raw_events": [json.dumps({"type": "response.completed", "response": answer})], "no_done": True}
        else:
            body["mock"] = {"raw_body": json.dumps(answer)}
    response = post(stack, ledger, path, body)
    assert response.status_code == 200
    (event,) = ledger.check()
    assert (event.status, event.prompt_tokens, event.completion_tokens) == ("success", 1000, 4000)
    assert event.finish_reason is None
    assert event.cost == (1000 * Decimal("0.08") + 4000 * Decimal("0.24")) / 1_000_000


_RESPONSES_DELTA = json.dumps({"type": "response.output_text.delta", "delta": "hi"})


@pytest.mark.parametrize("last", [
    '{"type":"response.completed","response":{"usage":{"input_tokens":1e999,"output_tokens":5}}}',
    '{"type":"response\\u002ecompleted","response":"done"}',
    '{"type":"error","code":"x","message":"boom"}',
], ids=["unreadable-final", "escaped-final-without-response", "upstream-error-event"])
def test_a_responses_stream_the_upstream_ends_badly_ends_with_one_error_event(stack, ledger, last):
    """§9: an upstream failure after the stream started ends it with one `event: error`; the
    upstream's unreadable final event (it carries no cost) or its own error event is not relayed."""
    body = {"model": MODEL, "input": "hi", "stream": True,
            "mock": {"raw_events": [_RESPONSES_DELTA, _RESPONSES_DELTA, last], "no_done": True}}
    response = post(stack, ledger, "/v1/responses", body)
    blocks = [block for block in response.text.split("\n\n") if block.strip() and not block.startswith(":")]
    payloads = [json.loads(block.split("data: ", 1)[1]) for block in blocks]
    assert [payload["type"] for payload in payloads] == ["response.output_text.delta"] * 2 + ["error"], blocks
    assert payloads[-1]["code"] == "upstream_error" and blocks[-1].startswith("event: error")
    (event,) = ledger.check()
    assert (event.status, event.completion_tokens, event.usage_source) == ("stream_interrupted", 2, "estimated")


@pytest.mark.parametrize("named", [True, False], ids=["object-response", "no-object"])
@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_a_failed_response_is_billed_as_reported_and_settled_as_an_upstream_error(stack, ledger, stream, named):
    """A failed response is a response, its error its own, whether or not the server names
    its `object` (it is one by its status and output, as an error object is not)."""
    answer = {"id": "r", "object": "response", "status": "failed", "output": [],
              "error": {"code": "server_error", "message": "the model crashed"},
              "usage": {"input_tokens": 100, "output_tokens": 20}}
    if not named:
        del answer["object"]
    body = {"model": MODEL, "input": "hi", "stream": stream,
            "mock": {"raw_events": [json.dumps({"type": "response.failed", "response": answer})], "no_done": True}
            if stream else {"raw_body": json.dumps(answer)}}
    response = post(stack, ledger, "/v1/responses", body)
    assert response.status_code == 200
    (event,) = ledger.check()
    assert (event.status, event.prompt_tokens, event.completion_tokens, event.finish_reason) == (
        "upstream_error", 100, 20, "failed")
    assert event.cost == (100 * Decimal("0.08") + 20 * Decimal("0.24")) / 1_000_000
    relayed = response.json() if not stream else json.loads(response.text.rstrip("\n").rsplit("data: ", 1)[1])["response"]
    assert Decimal(str(relayed["usage"]["cost"])) == event.cost  # the client still gets the failure, with its cost


@pytest.mark.parametrize("error", [{"error": {"object": "error", "message": "boom", "type": "BadRequestError",
                                                "code": 400}},
                                   {"error": "boom"}, {"error": ["boom"]}, {"error": True}],
                         ids=["vllm", "text", "list", "true"])
@pytest.mark.parametrize("done", [True, False], ids=["then-done", "no-done"])
def test_an_error_the_upstream_sends_mid_stream_ends_the_stream_with_the_error_event(stack, ledger, done, error):
    """vLLM reports a failure after the 200 as a `data: {"error": …}` event: the client gets the
    §5 error event (code upstream_error) once, never `[DONE]`, and the request is not a success.
    The OpenAI SDKs raise on any `error` that is not null or false (a text, a list, true): each
    is the server's error, never relayed."""
    error = json.dumps(error)
    body = {"model": MODEL, "messages": MESSAGES, "stream": True,
            "mock": {"raw_events": [CONTENT, CONTENT, error], "no_done": not done}}
    response = post(stack, ledger, CHAT, body)
    events = data_events(response.text)
    assert "[DONE]" not in events and "boom" not in response.text
    assert [e["error"]["code"] for e in events if isinstance(e, dict) and "error" in e] == ["upstream_error"]
    assert events[-1]["error"]["code"] == "upstream_error"
    (event,) = ledger.check()
    assert (event.status, event.completion_tokens) == ("stream_interrupted", 2)


def test_a_stream_whose_usage_is_below_what_it_relayed_is_billed_for_what_it_relayed(stack, ledger):
    """Four texts relayed, `completion_tokens: 0` reported: the model cannot have written four
    texts with no token (§4); the bill is the gateway's count, marked capped."""
    usage = json.dumps({"id": "c", "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 0}})
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": [CONTENT] * 4 + [usage]}}
    response = post(stack, ledger, CHAT, body)
    assert data_events(response.text)[-1] == "[DONE]"
    (event,) = ledger.check()
    assert (event.status, event.usage_source, event.prompt_tokens, event.completion_tokens) == (
        "success", "capped", 10, 4)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_long_text_in_one_delta_without_usage_is_billed_for_its_length(stack, ledger, api):
    """4 000 characters in one delta, no usage: billed as the same text buffered would be
    (4 characters a token), not 1 token."""
    text = "x" * 4000
    if api == "chat":
        chunk = json.dumps({"id": "c", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
        path, body = CHAT, {"model": MODEL, "messages": MESSAGES, "stream": True,
                            "mock": {"raw_events": [chunk], "no_usage": True}}
    else:
        final = json.dumps({"type": "response.completed", "response": {"id": "r", "status": "completed", "output": []}})
        path, body = "/v1/responses", {"model": MODEL, "input": "hi", "stream": True, "mock": {
            "raw_events": [json.dumps({"type": "response.output_text.delta", "delta": text}), final], "no_done": True}}
    response = post(stack, ledger, path, body)
    assert response.status_code == 200
    (event,) = ledger.check()
    assert (event.status, event.usage_source, event.completion_tokens) == ("success", "estimated", 1000)


# -- usage too small for what was relayed -------------------------------------------------------

LONG = "word " * 5000  # 25 000 characters: about 6 250 tokens, and at the very least 196


def _long_answer(path: str, usage: dict, stream: bool) -> dict:
    """A request to `path` whose model server answers LONG in one text, reporting `usage`."""
    if path == CHAT and not stream:
        answer = _answer(choices=[{"index": 0, "message": {"role": "assistant", "content": LONG}, "finish_reason": "stop"}],
                         usage=usage)
        return {"model": MODEL, "messages": MESSAGES, "mock": {"raw_body": answer}}
    if path == CHAT:
        text = _chunk(choices=[{"index": 0, "delta": {"content": LONG}, "finish_reason": None}])
        return {"model": MODEL, "messages": MESSAGES, "stream": True,
                "mock": {"raw_events": [text, FINISH, _chunk(choices=[], usage=usage)]}}
    final = json.dumps({"type": "response.completed", "response": {"id": "r", "status": "completed", "output": [],
                                                                   "usage": usage}})
    return {"model": MODEL, "input": "hi", "stream": True, "mock": {
        "raw_events": [json.dumps({"type": "response.output_text.delta", "delta": LONG}), final], "no_done": True}}


@pytest.mark.parametrize("path, stream", [(CHAT, False), (CHAT, True), ("/v1/responses", True)],
                         ids=["chat-buffered", "chat-stream", "responses-stream"])
def test_a_long_text_reported_as_one_token_is_billed_for_its_length(stack, ledger, path, stream):
    """A token is never 128 characters: one reported for 25 000 is usage the model cannot have
    produced (§4), replaced by the gateway's own count."""
    usage = ({"input_tokens": 4, "output_tokens": 1} if path != CHAT
             else {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5})
    response = post(stack, ledger, path, _long_answer(path, usage, stream))
    assert response.status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "capped" and event.completion_tokens == len(LONG) // 4


@pytest.mark.parametrize("message", [
    {"role": "assistant", "content": "", "reasoning": LONG},
    {"role": "assistant", "content": None, "refusal": LONG},
    {"role": "assistant", "content": [{"type": "text", "text": LONG}]},
    {"role": "assistant", "content": None, "function_call": {"name": "", "arguments": LONG}},
    {"role": "assistant", "content": None, "audio": {"id": "a", "data": "", "transcript": LONG}},
], ids=["reasoning", "refusal", "content-parts", "function_call", "audio-transcript"])
@pytest.mark.parametrize("usage", [{"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}, None],
                         ids=["reported-0", "no-usage"])
def test_every_text_of_a_buffered_answer_is_billed(stack, ledger, message, usage):
    """Whatever field the model server puts its text in, the text is counted: neither a 0
    reported nor no usage at all bills it as nothing."""
    answer = _answer(choices=[{"index": 0, "message": message, "finish_reason": "stop"}],
                     **({"usage": usage} if usage else {}))
    response = post(stack, ledger, CHAT, {"model": MODEL, "messages": MESSAGES, "mock": {"raw_body": answer}})
    assert response.status_code == 200
    (event,) = ledger.check()
    assert event.completion_tokens == len(LONG) // 4


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("usage", [None, {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}],
                         ids=["no-usage", "reported-1"])
def test_a_tool_call_name_is_text_the_model_wrote(stack, ledger, stream, usage):
    """A tool call's name is text the client gets: billed when the server reports nothing
    (llama.cpp), and a floor like any text, so 25 000 characters of it are not 1 token."""
    call = {"index": 0, "id": "c", "type": "function", "function": {"name": LONG, "arguments": ""}}
    if stream:
        named = _chunk(choices=[{"index": 0, "delta": {"role": "assistant", "tool_calls": [call]},
                                 "finish_reason": None}])
        events = [named, FINISH] + ([_chunk(choices=[], usage=usage)] if usage else [])
        body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": events}}
    else:
        message = {"role": "assistant", "content": None, "tool_calls": [call]}
        answer = _answer(choices=[{"index": 0, "message": message, "finish_reason": "tool_calls"}],
                         **({"usage": usage} if usage else {}))
        body = {"model": MODEL, "messages": MESSAGES, "mock": {"raw_body": answer}}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("capped" if usage else "estimated", len(LONG) // 4)


# the names servers give one reasoning text at once: vllm-mlx and mlx-vlm write both names,
# OpenRouter repeats it as the text of its reasoning_details
REASONING_TWICE = {
    "both-names": lambda text: {"reasoning": text, "reasoning_content": text},
    "details": lambda text: {"reasoning": text, "reasoning_details": [{"type": "reasoning.text", "text": text}]},
}


@pytest.mark.parametrize("reported", [True, False], ids=["reported", "no-usage"])
@pytest.mark.parametrize("choices", [1, 2])
@pytest.mark.parametrize("named", sorted(REASONING_TWICE))
def test_reasoning_a_server_writes_under_two_names_is_counted_once(stack, ledger, named, choices, reported):
    """40 reasoning tokens, each under two names in its chunk, then one of content; the server
    reports 41 a choice, honestly: believed (not replaced by 81 as below what was relayed), and
    without usage estimated as 41 a choice, not 81."""
    def delta_chunk(delta: dict) -> str:
        return _chunk(choices=[{"index": k, "delta": delta, "finish_reason": None} for k in range(choices)])

    events = [delta_chunk(REASONING_TWICE[named](f"r{k}")) for k in range(40)] + [delta_chunk({"content": "ok"}), FINISH]
    if reported:
        events.append(_chunk(choices=[], usage={"prompt_tokens": 3, "completion_tokens": 41 * choices}))
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "n": choices, "mock": {"raw_events": events}}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("upstream" if reported else "estimated", 41 * choices)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_reasoning_under_two_names_in_a_buffered_answer_is_estimated_once(stack, ledger, stream):
    """The same 4 000 characters of reasoning under both names, and no usage: 1 000 tokens
    estimated (as under one name), not 2 000; streamed in one delta alike."""
    text = "word" * 1000
    if stream:
        events = [_chunk(choices=[{"index": 0, "delta": REASONING_TWICE["both-names"](text), "finish_reason": None}]),
                  FINISH]
        body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": events}}
    else:
        message = {"role": "assistant", "content": None, **REASONING_TWICE["both-names"](text)}
        answer = _answer(choices=[{"index": 0, "message": message, "finish_reason": "stop"}])
        body = {"model": MODEL, "messages": MESSAGES, "mock": {"raw_body": answer}}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("estimated", 1000)


def test_different_texts_under_the_two_reasoning_names_are_both_counted(stack, ledger):
    events = [_chunk(choices=[{"index": 0, "delta": {"reasoning": f"a{k}", "reasoning_content": f"b{k}"},
                               "finish_reason": None}]) for k in range(30)] + [FINISH]
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": events}}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("estimated", 60)


# what the SDKs hand the client as the model's text though it is no string (a broken or hostile
# server's), each shape with the texts it holds: 60 words of 6 characters, or their JSON
WORDS = [f"word{k:02d}" for k in range(60)]
UNSTRUNG = {
    "content-strings": ({"content": WORDS}, 60),
    "content-nested": ({"content": [WORDS[:30], WORDS[30:]]}, 60),
    "reasoning-strings": ({"reasoning_content": WORDS}, 60),
    "content-numbers": ({"content": list(range(10**9, 10**9 + 60))}, 60),
    "arguments-object": ({"tool_calls": [{"index": 0, "id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": {"words": " ".join(WORDS)}}}]},
                         None),
}


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("usage", [None, {"prompt_tokens": 3, "completion_tokens": 0}], ids=["no-usage", "reported-0"])
@pytest.mark.parametrize("shape", sorted(UNSTRUNG))
def test_text_the_model_wrote_in_a_shape_other_than_a_string_is_billed(stack, ledger, shape, usage, stream):
    """An array of strings (or numbers) as content or reasoning, an object as a tool call's
    arguments: the client gets it, so it is counted, whether the server reports nothing or 0
    (before, 0 was believed and nothing estimated: the text went out free)."""
    fields, texts = UNSTRUNG[shape]
    if stream:
        events = [_chunk(choices=[{"index": 0, "delta": fields, "finish_reason": None}]), FINISH]
        events += [_chunk(choices=[], usage=usage)] if usage else []
        body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": events}}
    else:
        message = {"role": "assistant", "content": None, **fields}
        answer = _answer(choices=[{"index": 0, "message": message, "finish_reason": "stop"}],
                         **({"usage": usage} if usage else {}))
        body = {"model": MODEL, "messages": MESSAGES, "mock": {"raw_body": answer}}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == ("capped" if usage else "estimated")
    least = texts if texts is not None else len(json.dumps({"words": " ".join(WORDS)})) // 4
    assert event.completion_tokens >= least, event.completion_tokens


@pytest.mark.parametrize("usage", [{"prompt_tokens": 3, "completion_tokens": 30}, None], ids=["reported", "no-usage"])
@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_content_parts_and_logprobs_count_only_the_text_the_model_wrote(stack, ledger, stream, usage):
    """Honest shapes that hold arrays beside the text: content parts (`type` is no text) and
    chat's logprobs (its `content` array of tokens): 30 tokens of one word each, reported as
    30, believed, and estimated as 30 without usage (a token a chunk streamed; by length buffered)."""
    logprobs = {"content": [{"token": "w", "logprob": -0.1, "bytes": [119], "top_logprobs": []}]}
    if stream:
        events = [_chunk(choices=[{"index": 0, "delta": {"content": [{"type": "text", "text": "word"}]},
                                   "logprobs": logprobs, "finish_reason": None}]) for _ in range(30)]
        events += [FINISH] + ([_chunk(choices=[], usage=usage)] if usage else [])
        body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": events}}
    else:
        message = {"role": "assistant", "content": [{"type": "text", "text": "word" * 30}]}
        answer = _answer(choices=[{"index": 0, "message": message, "logprobs": {"content": logprobs["content"] * 30},
                                   "finish_reason": "stop"}], **({"usage": usage} if usage else {}))
        body = {"model": MODEL, "messages": MESSAGES, "mock": {"raw_body": answer}}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("upstream" if usage else "estimated", 30)


@pytest.mark.parametrize("offered", [False, True], ids=["not-offered", "offered"])
def test_a_tool_call_name_a_server_repeats_in_every_chunk_counts_once(stack, ledger, offered):
    """vLLM 0.6-0.7 with a named tool_choice sends the function's name in every chunk: it is
    counted once for its call, so an honest count (the 5 argument tokens, the name's, the
    end's) is believed (tests/unit/test_unit_sse.py: what a client that leaves pays); a name
    of one of the request's tools, which the server may write itself, is not counted at all,
    so the 5 argument tokens alone are believed."""
    chunks = [_chunk(choices=[{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "name": "get_current_weather_forecast", "arguments": piece}}]}, "finish_reason": None}]) for piece in
        ['{"', 'city', '":"', 'Paris', '"}']]
    reported = 5 if offered else 7
    usage = _chunk(choices=[], usage={"prompt_tokens": 4, "completion_tokens": reported, "total_tokens": 4 + reported})
    tools = [{"type": "function", "function": {"name": "get_current_weather_forecast", "description": "The forecast.",
                                               "parameters": {"type": "object"}}}]
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": [*chunks, FINISH, usage]},
            **({"tools": tools} if offered else {})}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("upstream", reported)


def test_a_usage_chunk_whose_key_is_spelled_with_an_escape_is_read_and_hidden(stack, ledger):
    """`"\\u0075sage"` is usage to every JSON reader, the SDKs included: it is billed as
    reported and, for a client that did not ask for usage, not relayed."""
    text = _chunk(choices=[{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}])
    usage = _chunk(choices=[], usage={"prompt_tokens": 900, "completion_tokens": 500, "total_tokens": 1400})
    body = {"model": MODEL, "messages": MESSAGES, "stream": True,
            "mock": {"raw_events": [text, usage.replace('"usage"', '"\\u0075sage"')]}}
    response = post(stack, ledger, CHAT, body)
    assert response.status_code == 200
    chunks = data_events(response.text)
    assert chunks[-1] == "[DONE]" and not [chunk for chunk in chunks if isinstance(chunk, dict) and "usage" in chunk]
    (event,) = ledger.check()
    assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("upstream", 900, 500)


def test_a_streamed_refusal_is_billed(stack, ledger):
    refusal = _chunk(choices=[{"index": 0, "delta": {"refusal": "Sorry"}, "finish_reason": None}])
    usage = _chunk(choices=[], usage={"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4})
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": [refusal] * 3 + [usage]}}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("capped", 3)


@pytest.mark.parametrize("usage", [{"input_tokens": 4, "output_tokens": 0}, None], ids=["reported-0", "no-usage"])
def test_a_responses_text_sent_only_in_its_final_response_is_billed(stack, ledger, usage):
    """No delta, the text only in output_item.done and the final response's output: still
    the model's text, billed for its length."""
    item = {"type": "message", "id": "m", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": LONG, "annotations": []}]}
    final = {"id": "r", "object": "response", "status": "completed", "output": [item]}
    events = [json.dumps({"type": "response.output_item.done", "output_index": 0, "item": item}),
              json.dumps({"type": "response.completed", "response": {**final, **({"usage": usage} if usage else {})}})]
    body = {"model": MODEL, "input": "hi", "stream": True, "mock": {"raw_events": events, "no_done": True}}
    assert post(stack, ledger, "/v1/responses", body).status_code == 200
    (event,) = ledger.check()
    assert event.completion_tokens == len(LONG) // 4


RESPONSES_ITEM = {"type": "message", "id": "m", "role": "assistant", "status": "completed",
                  "content": [{"type": "output_text", "text": LONG, "annotations": []}]}
DONE_EVENTS = {
    "output_text.done": {"type": "response.output_text.done", "item_id": "m", "output_index": 0, "content_index": 0,
                         "text": LONG},
    "content_part.done": {"type": "response.content_part.done", "item_id": "m", "output_index": 0, "content_index": 0,
                          "part": RESPONSES_ITEM["content"][0]},
    "output_item.done": {"type": "response.output_item.done", "output_index": 0, "item": RESPONSES_ITEM},
    "function_call_arguments.done": {"type": "response.function_call_arguments.done", "item_id": "f",
                                     "output_index": 0, "arguments": LONG},
    "a function call's name": {"type": "response.output_item.done", "output_index": 0, "item": {
        "type": "function_call", "id": "f", "call_id": "c", "name": LONG, "arguments": "", "status": "completed"}},
}


@pytest.mark.parametrize("done", [*DONE_EVENTS, "all three"])
@pytest.mark.parametrize("usage", [{"input_tokens": 4, "output_tokens": 1}, None], ids=["reported-1", "no-usage"])
def test_a_responses_text_sent_only_in_done_events_is_billed(stack, ledger, done, usage):
    """No delta, and a final response whose output is empty: the text the client got came
    whole in a done event (of a text, a part, an item), and is billed for its length; sent
    in the three at once, it is billed once."""
    kinds = ([DONE_EVENTS[name] for name in ("output_text.done", "content_part.done", "output_item.done")]
             if done == "all three" else [DONE_EVENTS[done]])
    final = {"id": "r", "object": "response", "status": "completed", "output": [], **({"usage": usage} if usage else {})}
    events = [json.dumps(event) for event in kinds] + [json.dumps({"type": "response.completed", "response": final})]
    body = {"model": MODEL, "input": "hi", "stream": True, "mock": {"raw_events": events, "no_done": True}}
    assert post(stack, ledger, "/v1/responses", body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("capped" if usage else "estimated", len(LONG) // 4)


def test_a_responses_text_mostly_sent_whole_is_billed_for_its_length(stack, ledger):
    """A delta or two, then the whole text in done events and the final response, no usage:
    the bill is what the whole texts say, not the deltas' one token."""
    events = [{"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0,
               "delta": "Hi"}, DONE_EVENTS["output_text.done"], DONE_EVENTS["output_item.done"],
              {"type": "response.completed", "response": {"id": "r", "object": "response", "status": "completed",
                                                          "output": [RESPONSES_ITEM]}}]
    body = {"model": MODEL, "input": "hi", "stream": True,
            "mock": {"raw_events": [json.dumps(event) for event in events], "no_done": True}}
    assert post(stack, ledger, "/v1/responses", body).status_code == 200
    (event,) = ledger.check()
    # the delta's token, and the rest of the text (all but its 2 characters) at 4 characters a token
    assert (event.usage_source, event.completion_tokens) == ("estimated", 1 + -(-(len(LONG) - 2) // 4))


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_a_text_under_a_key_spelled_with_an_escape_is_billed(stack, ledger, api):
    """The SDKs read `"\\u0063ontent"` as content: so does the bill."""
    if api == "chat":
        raw = '{"id":"x","choices":[{"index":0,"delta":{"\\u0063ontent":"%s"},"finish_reason":null}]}' % LONG
        path, body = CHAT, {"model": MODEL, "messages": MESSAGES, "stream": True, "mock": {"raw_events": [raw]}}
    else:
        raw = '{"type":"response.output_text.delta","\\u0064elta":"%s"}' % LONG
        final = json.dumps({"type": "response.completed", "response": {
            "id": "r", "status": "completed", "output": [], "usage": {"input_tokens": 4, "output_tokens": 0}}})
        path, body = "/v1/responses", {"model": MODEL, "input": "hi", "stream": True,
                                       "mock": {"raw_events": [raw, final], "no_done": True}}
    assert post(stack, ledger, path, body).status_code == 200
    (event,) = ledger.check()
    assert event.completion_tokens == len(LONG) // 4


# vLLM with --enable-prompt-embeds answers a prompt for each entry of `prompt_embeds`, `n`
# choices each: three embeddings, n=2, five tokens a choice
EMBEDS = {"prompt": None, "prompt_embeds": ["QUFB", "QkJC", "Q0ND"], "n": 2, "max_tokens": 5}
EMBEDS_REPLY = [" Paris", ",", " a", " city", " on"]


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_a_batch_of_prompt_embeddings_is_bounded_and_estimated_as_that_many_prompts(stack, ledger, stream):
    """§4: three prompts of embeddings, two choices each: 30 completion tokens reported are what
    the request can produce, believed (not capped at one prompt's 10); without usage, the 30
    chunks relayed are billed, and the prompts a token each at least (not 0)."""
    def text_chunk(choice, text):
        return json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
                           "choices": [{"index": choice, "text": text, "logprobs": None, "finish_reason": None}]})

    if stream:
        events = [text_chunk(choice, word) for word in EMBEDS_REPLY for choice in range(6)]
        body = {"model": MODEL, **EMBEDS, "stream": True, "mock": {"raw_events": events, "no_usage": True}}
    else:
        choices = [{"index": k, "text": "".join(EMBEDS_REPLY), "logprobs": None, "finish_reason": "length"}
                   for k in range(6)]
        raw = json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": MODEL, "choices": choices,
                          "usage": {"prompt_tokens": 30, "completion_tokens": 30, "total_tokens": 60}})
        body = {"model": MODEL, **EMBEDS, "mock": {"raw_body": raw}}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    if stream:
        assert (event.usage_source, event.completion_tokens) == ("estimated", 30)
        assert event.prompt_tokens >= 3
    else:
        assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("upstream", 30, 30)


# -- the prompt estimate, when no count came ------------------------------------------------------

# 40 000 characters of tool description, about 10 000 tokens, and never fewer than 312
DESCRIPTION = "word " * 8000
CHAT_TOOLS = [{"type": "function", "function": {"name": "lookup", "description": DESCRIPTION,
                                                "parameters": {"type": "object", "properties": {}}}}]
RESPONSES_TOOLS = [{"type": "function", "name": "lookup", "description": DESCRIPTION,
                    "parameters": {"type": "object", "properties": {}}}]


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS, "stream": True}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "documents": [{"title": "t", "text": DESCRIPTION}]}),
    ("/v1/responses", {"input": "hi", "tools": RESPONSES_TOOLS, "tool_choice": "none"}),
], ids=["chat-tools", "chat-tools-streamed", "chat-documents", "responses-tools"])
def test_the_prompt_estimate_counts_what_the_template_renders_beside_the_messages(stack, ledger, path, body):
    """Tool definitions (and vLLM's `documents`) are prompt the model reads: a server that
    reports no usage does not make 40 000 characters of them free."""
    response = post(stack, ledger, path, {"model": MODEL, **body, "mock": {"no_usage": True, "tool_calls": 0}})
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert event.usage_source == "estimated" and event.prompt_tokens >= len(DESCRIPTION) // 4, event.prompt_tokens


def test_a_client_that_leaves_mid_stream_pays_for_the_tools_it_sent(stack, ledger):
    """§7: billed the tokens seen so far, the whole prompt (tools included) among them."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS,
            "tool_choice": "none", "stream": True, "mock": {"token_delay_ms": 50}}
    with stack.http.stream("POST", CHAT, json=body, headers={"Authorization": f"Bearer {ledger.key}"}) as response:
        ledger.saw(response)
        seen = 0
        for line in response.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    (event,) = ledger.check()
    assert event.status == "client_disconnected" and event.prompt_tokens >= len(DESCRIPTION) // 4, event.prompt_tokens


@pytest.mark.parametrize("message", [
    {"role": "user", "type": "image", "content": DESCRIPTION},
    {"role": "user", "type": [], "content": DESCRIPTION},
    {"role": "user", "content": [{"type": {"a": 1}, "text": "x"}, {"type": "text", "text": DESCRIPTION}]},
], ids=["message-typed-as-an-image", "type-a-list", "part-type-an-object"])
@pytest.mark.parametrize("leaves", [False, True], ids=["no-usage", "client-leaves"])
def test_only_a_content_part_is_media_in_the_estimate(stack, ledger, message, leaves):
    """A message that says it is an image is still read for its text by the server; a type
    of any JSON type is no failure (a 200 stays a 200, a client that leaves pays its prompt)."""
    if leaves:
        body = {"model": MODEL, "messages": [message], "stream": True, "mock": {"token_delay_ms": 50}}
        with stack.http.stream("POST", CHAT, json=body, headers={"Authorization": f"Bearer {ledger.key}"}) as answer:
            ledger.saw(answer)
            for seen, _ in enumerate(line for line in answer.iter_lines() if line.startswith("data: ")):
                if seen >= 2:
                    break
    else:
        answer = post(stack, ledger, CHAT, {"model": MODEL, "messages": [message], "mock": {"no_usage": True}})
        assert answer.status_code == 200, answer.text
    (event,) = ledger.check()
    assert event.status == ("client_disconnected" if leaves else "success")
    assert event.prompt_tokens >= len(DESCRIPTION) // 4, event.prompt_tokens


PICTURE = "data:image/png;base64," + "iVBORw0KGgo" * 8000  # 88 000 characters of one image's data


@pytest.mark.parametrize("path, body", [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                      {"type": "image_url", "image_url": {"url": PICTURE}}]}]}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "what is this?"},
                                                              {"type": "input_image", "image_url": PICTURE}]}]}),
    ("/v1/responses", {"input": [  # a screenshot a function call returned
        {"type": "function_call", "call_id": "c1", "name": "screenshot", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_image", "image_url": PICTURE}]}]}),
], ids=["chat", "responses", "responses-tool-output"])
def test_the_prompt_estimate_counts_an_image_as_a_picture_not_as_the_text_of_its_data(stack, ledger, path, body):
    """An image's base64 is no text the model reads: 88 000 characters of it are not 22 000
    prompt tokens, but a picture of middling size's (256)."""
    response = post(stack, ledger, path, {"model": MODEL, **body, "mock": {"no_usage": True}})
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert event.usage_source == "estimated" and 256 < event.prompt_tokens < 256 + 30, event.prompt_tokens


# -- prompt usage too small for the prompt sent ------------------------------------------------

LONG_PROMPT = "word " * 16000  # 80 000 characters: about 20 000 tokens, and at the very least 625
ONE_TOKEN = {"prompt_tokens": 1, "completion_tokens": 4, "total_tokens": 5}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 80000}}


def _reported(path: str, usage: dict, stream: bool, body: dict) -> dict:
    """`body` sent to `path`, whose model server answers a short text, reporting `usage`."""
    if path == "/v1/responses":
        final = json.dumps({"type": "response.completed", "response": {"id": "r", "status": "completed", "output": [],
                                                                       "usage": usage}})
        return {**body, "stream": True, "mock": {
            "raw_events": [json.dumps({"type": "response.output_text.delta", "delta": "ok"}), final], "no_done": True}}
    if not stream:
        return {**body, "mock": {"raw_body": _answer(choices=[GOOD_CHOICE], usage=usage)}}
    text = _chunk(choices=[{"index": 0, "delta": {"content": "ok"}, "finish_reason": None}])
    return {**body, "stream": True, "mock": {"raw_events": [text, FINISH, _chunk(choices=[], usage=usage)]}}


@pytest.mark.parametrize("path, stream, body", [
    (CHAT, False, {"messages": [{"role": "user", "content": LONG_PROMPT}]}),
    (CHAT, True, {"messages": [{"role": "user", "content": LONG_PROMPT}]}),
    (CHAT, False, {"messages": [{"role": "user", "content": [{"type": "text", "text": LONG_PROMPT}]}]}),
    (COMPLETIONS, False, {"prompt": LONG_PROMPT}),
    (COMPLETIONS, True, {"prompt": [LONG_PROMPT[:40000], LONG_PROMPT[40000:]]}),
    ("/v1/responses", True, {"input": LONG_PROMPT}),
    ("/v1/responses", True, {"instructions": LONG_PROMPT, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}),
], ids=["chat-buffered", "chat-stream", "chat-text-part", "completions", "completions-batch", "responses-input",
        "responses-instructions"])
def test_a_long_prompt_reported_as_one_token_is_billed_for_its_length(stack, ledger, path, stream, body):
    """A prompt of 80 000 characters is never one token (no token is 128 characters): a count
    below what its texts hold at the least is usage the model cannot have produced (§4)."""
    usage = {"input_tokens": 1, "output_tokens": 4} if path == "/v1/responses" else ONE_TOKEN
    response = post(stack, ledger, path, _reported(path, usage, stream, {"model": MODEL, **body}))
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert event.usage_source == "capped" and event.prompt_tokens >= len(LONG_PROMPT) // 4
    assert event.completion_tokens == 4


def test_a_prompt_of_token_ids_is_at_least_one_token_each(stack, ledger):
    body = _reported(COMPLETIONS, ONE_TOKEN, False, {"model": MODEL, "prompt": [[7] * 500, [8] * 500]})
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "capped" and event.prompt_tokens >= 1000


@pytest.mark.parametrize("path, body", [
    # an image's base64 data is no text the model reads as text
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, IMAGE]}]}),
    # the server is asked to keep only the prompt's last tokens
    (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}], "truncate_prompt_tokens": 1}),
    (COMPLETIONS, {"prompt": LONG_PROMPT, "truncate_prompt_tokens": 1}),
    # a template of the client's own may leave the text out
    (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}], "chat_template": "{{ 'hi' }}"}),
    ("/v1/responses", {"input": LONG_PROMPT, "truncation": "auto"}),
], ids=["image", "chat-truncated", "completions-truncated", "chat-template", "responses-truncation"])
def test_a_small_prompt_count_the_request_allows_is_believed(stack, ledger, path, body):
    """What is not text, and a prompt the server is told to shorten, bound nothing from below:
    an honest small count is billed as reported."""
    usage = {"input_tokens": 1, "output_tokens": 4} if path == "/v1/responses" else ONE_TOKEN
    response = post(stack, ledger, path, _reported(path, usage, path == "/v1/responses", {"model": MODEL, **body}))
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("upstream", 1, 4)


@pytest.mark.parametrize("limit", [{"max_tokens": 0}, {"max_completion_tokens": 0}, {"max_tokens": 0, "n_predict": 0}])
def test_a_zero_token_limit_a_server_ignores_does_not_make_the_reply_free(stack, ledger, limit):
    """Some servers read a limit of 0 as no limit at all. The client then receives a whole reply;
    a bound of 0 tokens would bill it as nothing."""
    events = [CONTENT] * 40 + [FINISH, _chunk(choices=[], usage={"prompt_tokens": 3, "completion_tokens": 40})]
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, **limit,
            "stream_options": {"include_usage": True}, "mock": {"raw_events": events}}
    response = post(stack, ledger, CHAT, body)
    assert data_events(response.text)[-1] == "[DONE]"
    (event,) = ledger.check()
    assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("upstream", 3, 40)
    assert event.cost > 0


THINKING = "<think>" + "let me think about this step by step " * 1100 + "</think>Hello there."  # ~40 000 characters


@pytest.mark.parametrize("path, body", [
    # Qwen3's and DeepSeek-R1's templates drop the reasoning of earlier assistant turns
    (CHAT, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": THINKING},
                         {"role": "user", "content": "and now?"}]}),
    ("/v1/responses", {"input": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "output_text", "text": THINKING}]},
        {"role": "user", "content": "and now?"}]}),
    # Llama 3's template trims each message; a tokenizer may hold a long run of blanks in few tokens
    (CHAT, {"messages": [{"role": "user", "content": "hi" + "\n" * 20000}]}),
    (COMPLETIONS, {"prompt": "hi" + " " * 20000 + "there"}),
], ids=["chat-reasoning-in-history", "responses-reasoning-in-history", "chat-trimmed", "completions-blank-run"])
def test_text_a_template_or_tokenizer_may_shorten_is_no_floor(stack, ledger, path, body):
    """The floor holds only what every template keeps: an honest small count is believed."""
    usage = {"input_tokens": 9, "output_tokens": 4} if path == "/v1/responses" else {**ONE_TOKEN, "prompt_tokens": 9}
    response = post(stack, ledger, path, _reported(path, usage, path == "/v1/responses", {"model": MODEL, **body}))
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("upstream", 9, 4)


@pytest.mark.parametrize("usage", [
    {"prompt_tokens": 0, "completion_tokens": 4}, {"prompt_tokens": "1", "completion_tokens": 4},
    {"completion_tokens": 4}, {"prompt_tokens": -1, "completion_tokens": 4}, None,
], ids=["zero", "string", "missing", "negative", "no-usage"])
def test_a_prompt_count_replaced_for_any_reason_is_at_least_the_floor(stack, ledger, usage):
    """2 000 one-letter prompts are 2 000 tokens at the least, more than their estimate (500):
    reporting no count, or no usage, is no way under the floor that a count of 1 meets."""
    body = {"model": MODEL, "prompt": ["a"] * 2000, "mock": {"raw_body": _answer(
        choices=[GOOD_CHOICE], **({} if usage is None else {"usage": usage}))}}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert event.prompt_tokens >= 2000


@pytest.mark.parametrize("path, body", [
    # vLLM reads a bare string in a content list as text
    (CHAT, {"messages": [{"role": "user", "content": [LONG_PROMPT]}]}),
    ("/v1/responses", {"input": [{"type": "function_call_output", "call_id": "c", "output": LONG_PROMPT}]}),
], ids=["chat-string-part", "responses-tool-output"])
def test_more_prompt_texts_have_their_floor(stack, ledger, path, body):
    usage = {"input_tokens": 1, "output_tokens": 4} if path == "/v1/responses" else ONE_TOKEN
    response = post(stack, ledger, path, _reported(path, usage, path == "/v1/responses", {"model": MODEL, **body}))
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert event.usage_source == "capped" and event.prompt_tokens >= len(LONG_PROMPT) // 128


# -- echo: a reply that starts with the prompt (vLLM's echo, lm-eval's loglikelihood requests) ------

ECHOED = "word " * 4000  # 20 000 characters: at least 157 tokens, about 5 000


def _completion(text: str, usage: dict | None) -> str:
    return json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
                       "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}],
                       **({"usage": usage} if usage is not None else {})})


def _text_chunk(text: str, **fields) -> str:
    return json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
                       "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}], **fields})


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
@pytest.mark.parametrize("generated, completion_tokens", [("", 0), (" more words here", 3)],
                         ids=["prompt-only", "prompt-and-reply"])
def test_an_echoed_prompt_is_not_billed_as_completion(stack, ledger, stream, generated, completion_tokens):
    """With echo, the reply repeats the prompt before what the model wrote (with max_tokens 0,
    the prompt alone: lm-eval scores a text that way). The honest count is believed."""
    usage = {"prompt_tokens": 4001, "completion_tokens": completion_tokens, "total_tokens": 4001 + completion_tokens}
    if stream:
        events = [_text_chunk(ECHOED + generated), _text_chunk("", choices=[]), _text_chunk("", choices=[], usage=usage)]
        mock = {"raw_events": events}
    else:
        mock = {"raw_body": _completion(ECHOED + generated, usage)}
    body = {"model": MODEL, "prompt": ECHOED, "echo": True, "max_tokens": 0 if not generated else 5,
            "logprobs": 1, "stream": stream, "mock": mock}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = post(stack, ledger, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("upstream", 4001, completion_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_an_echoed_prompt_is_not_counted_when_no_usage_is_reported(stack, ledger, stream):
    if stream:
        mock = {"raw_events": [_text_chunk(ECHOED + " a"), _text_chunk(" b")]}
    else:
        mock = {"raw_body": _completion(ECHOED + " a b", None)}
    body = {"model": MODEL, "prompt": ECHOED, "echo": "true", "stream": stream, "mock": mock}
    response = post(stack, ledger, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert event.usage_source == "estimated" and event.completion_tokens <= 5


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_each_choice_of_a_batch_echoes_its_own_prompt_and_that_is_not_billed(stack, ledger, stream):
    """A batch of prompts with n choices each: vLLM's choice i echoes prompt i // n, then what
    the model wrote; the honest count (one token a choice) is believed."""
    prompts = [f"{i} " + "word " * 2000 for i in range(3)]
    texts = [(index, prompts[index // 2] + " x") for index in range(6)]
    usage = {"prompt_tokens": 6003, "completion_tokens": 6, "total_tokens": 6009}
    if stream:
        events = [_text_chunk("", choices=[{"index": i, "text": t, "logprobs": None, "finish_reason": None}])
                  for i, t in texts] + [_text_chunk("", choices=[], usage=usage)]
        mock = {"raw_events": events}
    else:
        mock = {"raw_body": json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": MODEL, "usage": usage,
                                        "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": "length"}
                                                    for i, t in texts]})}
    body = {"model": MODEL, "prompt": prompts, "n": 2, "echo": True, "max_tokens": 1, "stream": stream, "mock": mock,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("upstream", 6)


def test_an_echo_is_no_way_under_the_floor_of_what_follows_it(stack, ledger):
    """The prompt is taken off the reply's texts once: the text after it still has its floor."""
    answer = _completion(ECHOED + "x" * 80000, {"prompt_tokens": 4001, "completion_tokens": 1, "total_tokens": 4002})
    body = {"model": MODEL, "prompt": ECHOED, "echo": True, "mock": {"raw_body": answer}}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "capped" and event.completion_tokens >= 80000 // 128


def test_a_chat_echo_of_the_last_assistant_message_is_not_billed_as_completion(stack, ledger):
    """vLLM's chat echo starts the reply with the last message, when it is the assistant's."""
    answer = _answer(choices=[{"index": 0, "message": {"role": "assistant", "content": ECHOED + " done"},
                               "finish_reason": "stop"}],
                     usage={"prompt_tokens": 4010, "completion_tokens": 1, "total_tokens": 4011})
    body = {"model": MODEL, "echo": True, "add_generation_prompt": False, "continue_final_message": True,
            "messages": [{"role": "user", "content": "go on"}, {"role": "assistant", "content": ECHOED}],
            "mock": {"raw_body": answer}}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("upstream", 1)


# found by a hostile review: only an echo that is there is taken off

@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
def test_an_echo_of_token_ids_hides_nothing_the_server_wrote(stack, ledger, stream):
    """The prompt comes back as text the gateway cannot know: nothing is taken off, and the
    2 000 texts the server wrote are at least 2 000 tokens, whatever it reports."""
    usage = {"prompt_tokens": 1, "completion_tokens": 0, "total_tokens": 1}
    if stream:
        mock = {"raw_events": [_text_chunk(" w")] * 2000 + [_text_chunk("", choices=[], usage=usage)]}
    else:
        mock = {"raw_body": _completion("x" * 256000, usage)}
    body = {"model": MODEL, "prompt": [1], "echo": True, "max_tokens": 4000, "stream": stream, "mock": mock,
            **({"stream_options": {"include_usage": True}} if stream else {})}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "capped" and event.completion_tokens >= 2000 - 1  # the echo is 1 token at most


# found by a hostile model server: an echo of token ids was billed again as completion

@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "stream"])
@pytest.mark.parametrize("max_tokens", [0, None], ids=["max_tokens-0", "no-max_tokens"])
def test_an_echo_of_token_ids_is_not_billed_again_as_completion(stack, ledger, stream, max_tokens):
    """vLLM writes a prompt of token ids back as its text: 400 ids come back as 2 000
    characters the gateway cannot take off. Those are the prompt's 400 tokens, billed as
    prompt; the server's honest count of what it wrote (0, or 2) is believed, as for the same
    prompt sent as text, and not replaced by the echo's floor."""
    ids = list(range(1000, 1400))
    generated, completion_tokens = ("", 0) if max_tokens == 0 else (" and more", 2)
    usage = {"prompt_tokens": 400, "completion_tokens": completion_tokens, "total_tokens": 400 + completion_tokens}
    echoed = "word " * 400
    if stream:
        mock = {"raw_events": [_text_chunk(echoed[i:i + 100]) for i in range(0, len(echoed), 100)]
                + ([_text_chunk(generated)] if generated else []) + [_text_chunk("", choices=[], usage=usage)]}
    else:
        mock = {"raw_body": _completion(echoed + generated, usage)}
    body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1, "stream": stream, "mock": mock,
            **({"max_tokens": max_tokens} if max_tokens is not None else {}),
            **({"stream_options": {"include_usage": True}} if stream else {})}
    response = post(stack, ledger, COMPLETIONS, body)
    assert response.status_code == 200, response.text
    (event,) = ledger.check()
    assert (event.usage_source, event.prompt_tokens, event.completion_tokens) == ("upstream", 400, completion_tokens)


def test_each_choice_echoing_a_prompt_of_token_ids_is_not_billed_again(stack, ledger):
    """A batch of two prompts of token ids, n 2: four choices, each echoing its prompt's 300 ids."""
    prompts = [list(range(300)), list(range(300, 600))]
    texts = [(index, "tok " * 300 + " x") for index in range(4)]
    usage = {"prompt_tokens": 600, "completion_tokens": 4, "total_tokens": 604}
    answer = json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": MODEL, "usage": usage,
                         "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": "length"}
                                     for i, t in texts]})
    body = {"model": MODEL, "prompt": prompts, "n": "2", "echo": True, "mock": {"raw_body": answer}}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("upstream", 4)


# found in review: the ids came off for every choice asked for, and off any choice's count

def test_an_echo_of_token_ids_comes_off_only_the_choices_that_came(stack, ledger):
    """n 100, one choice sent, no usage: 100 × 400 ids came off its 40 000 tokens, billed 0."""
    answer = _completion("y" * 160000, None)
    body = {"model": MODEL, "prompt": list(range(400)), "echo": True, "n": 100, "mock": {"raw_body": answer}}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "estimated" and event.completion_tokens >= 40000 - 400


def test_an_echo_of_token_ids_comes_off_only_the_choice_of_that_prompt(stack, ledger):
    """A batch of a 400-id prompt and a 1-id prompt: only the second's choice came, with 1 600
    characters reported as 0 tokens; the first prompt's 400 ids are no choice's to take off."""
    answer = json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
                         "usage": {"prompt_tokens": 401, "completion_tokens": 0, "total_tokens": 401},
                         "choices": [{"index": 1, "text": "z" * 1600, "logprobs": None, "finish_reason": "length"}]})
    body = {"model": MODEL, "prompt": [list(range(400)), [7]], "echo": True, "mock": {"raw_body": answer}}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "capped" and event.completion_tokens >= 1600 // 128 - 1


def test_an_echo_a_server_ignores_takes_nothing_off_its_reply(stack, ledger):
    """n choices of a server that never repeats the prompt: every delta is the model's."""
    deltas = [_text_chunk(" w", choices=[{"index": i % 8, "text": " w", "logprobs": None, "finish_reason": None}])
              for i in range(4000)]
    body = {"model": MODEL, "prompt": ECHOED, "echo": True, "n": 8, "stream": True, "mock": {"raw_events": deltas}}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "estimated" and event.completion_tokens >= 4000


def test_choices_asked_for_but_not_sent_take_no_echo_off_the_one_that_came(stack, ledger):
    answer = _completion("y" * 64000, {"prompt_tokens": 4001, "completion_tokens": 0, "total_tokens": 4001})
    body = {"model": MODEL, "prompt": ECHOED, "echo": True, "n": 5, "mock": {"raw_body": answer}}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "capped" and event.completion_tokens >= 500


@pytest.mark.parametrize("prompt", ["東京は日本の首都です。" * 600, 'a "quoted"\\ line\n' * 500], ids=["cjk", "escapes"])
@pytest.mark.parametrize("pieces", [1, 40], ids=["one-chunk", "split"])
def test_a_streamed_echo_of_any_text_in_any_pieces_is_believed(stack, ledger, prompt, pieces):
    """vLLM sends the prompt in one chunk, other servers in several; its text may be written
    with escapes or in UTF-8 of three bytes a character: the honest 0 is believed."""
    size = -(-len(prompt) // pieces)
    events = [_text_chunk(prompt[i:i + size]) for i in range(0, len(prompt), size)]
    usage = {"prompt_tokens": 3000, "completion_tokens": 0, "total_tokens": 3000}
    events += [_text_chunk("", choices=[]), _text_chunk("", choices=[], usage=usage)]
    body = {"model": MODEL, "prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1, "stream": True,
            "stream_options": {"include_usage": True}, "mock": {"raw_events": events}}
    assert post(stack, ledger, COMPLETIONS, body).status_code == 200
    (event,) = ledger.check()
    assert (event.usage_source, event.completion_tokens) == ("upstream", 0)


def test_a_chat_echo_of_the_users_message_without_a_generation_prompt_is_not_counted(stack, ledger):
    events = [_chunk(choices=[{"index": 0, "delta": {"role": "user", "content": ECHOED}, "finish_reason": None}]),
              _chunk(choices=[{"index": 0, "delta": {"content": " ok"}, "finish_reason": "stop"}])]
    body = {"model": MODEL, "echo": True, "add_generation_prompt": False, "stream": True,
            "messages": [{"role": "user", "content": ECHOED}], "mock": {"raw_events": events}}
    assert post(stack, ledger, CHAT, body).status_code == 200
    (event,) = ledger.check()
    assert event.usage_source == "estimated" and event.completion_tokens <= 2
