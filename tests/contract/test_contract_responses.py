"""Contract §9: POST /v1/responses, through the official openai SDK and raw HTTP.

Same keys, admission, generation-id header, errors and billing as chat; usage read from
`input_tokens`/`output_tokens`, `usage.cost` added to the buffered response and to the final
`response.completed` event; the stream relayed as `event:`/`data:` pairs, in order.
"""

from __future__ import annotations

import json
import threading
import time
from decimal import Decimal

import httpx
import openai
import pytest
from openai.types.responses import ResponseErrorEvent

from kiln.store.orgs import set_status
from support import LedgerCheck, assert_a_plain_429, sse_events

RESPONSES = "/v1/responses"
MODEL = "gpt-oss-120b"  # $0.035 / $0.07 per million tokens, $0.0175 cached
PRICE_IN, PRICE_OUT, PRICE_CACHED = Decimal("0.035"), Decimal("0.07"), Decimal("0.0175")
BODY = {"model": MODEL, "input": "The capital of France is"}


def price(input_tokens: int, output_tokens: int, cached: int = 0) -> Decimal:
    return ((input_tokens - cached) * PRICE_IN + cached * PRICE_CACHED + output_tokens * PRICE_OUT) / 1_000_000


@pytest.fixture
def client(stack, org):
    return openai.OpenAI(base_url=stack.base_url, api_key=org[1], max_retries=0)


def test_buffered_response_through_the_sdk_is_billed_and_recorded(stack, org, client):
    ledger = LedgerCheck(stack, org[0])
    raw = client.responses.with_raw_response.create(model=MODEL, input="The capital of France is")
    ledger.saw(httpx.Response(raw.status_code, headers=raw.headers))
    response = raw.parse()
    assert response.output_text == "Hello! How can I help you today? Ask me anything."
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (8, 12)  # 5 words + 3 for the item; the 12-token reply
    cost = json.loads(raw.http_response.text, parse_float=Decimal)["usage"]["cost"]
    assert cost == price(8, 12)
    (event,) = ledger.check()
    assert (event.endpoint, event.status, event.streamed, event.usage_source) == ("responses", "success", False, "upstream")
    assert (event.prompt_tokens, event.completion_tokens, event.cost) == (8, 12, cost)
    assert event.gen_id == raw.headers["X-Neocloud-Generation-Id"]


def test_streamed_response_through_the_sdk_ends_with_usage_and_cost(stack, org, client):
    ledger = LedgerCheck(stack, org[0])
    with client.responses.with_streaming_response.create(model=MODEL, input="The capital of France is", stream=True,
                                                          extra_body={"mock": {"cached_tokens": 3}}) as raw:
        ledger.saw(httpx.Response(raw.status_code, headers=raw.headers))
        events = list(raw.parse())
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "Hello! How can I help you today? Ask me anything.")
    final = events[-1].response
    assert final.usage.input_tokens_details.cached_tokens == 3
    cost = Decimal(str(final.usage.model_extra["cost"]))
    (event,) = ledger.check()
    assert event.streamed and event.endpoint == "responses" and event.cost == price(8, 12, cached=3)
    assert cost == event.cost


def test_the_stream_is_relayed_as_sent_but_for_the_final_usage(stack, org, mock):
    """Byte for byte against the mock itself, except `cost` in the final event's usage."""
    body = {**BODY, "stream": True, "mock": {"id": "fixed"}}
    through = stack.post(RESPONSES, body, org[1])
    direct = httpx.post(f"{mock.url}/responses", json=body)
    assert through.headers["content-type"].startswith("text/event-stream")
    ours, theirs = list(sse_events(through.text)), list(sse_events(direct.text))
    assert ours[:-1] == theirs[:-1]
    assert ours[-1].split("\n")[0] == theirs[-1].split("\n")[0] == "event: response.completed"
    final = json.loads(ours[-1].split("\n", 1)[1][len("data: "):], parse_float=Decimal)
    expected = json.loads(theirs[-1].split("\n", 1)[1][len("data: "):], parse_float=Decimal)
    cost = final["response"]["usage"].pop("cost")
    assert final == expected and cost == price(8, 12)
    assert "[DONE]" not in through.text


def test_usage_not_reported_is_estimated_and_still_in_the_final_event(stack, org):
    ledger = LedgerCheck(stack, org[0])
    for stream in (False, True):
        response = ledger.saw(stack.post(RESPONSES, {**BODY, "stream": stream, "mock": {"no_usage": True}}, org[1]))
        assert response.status_code == 200
        if stream:
            final = json.loads(list(sse_events(response.text))[-1].split("\n", 1)[1][6:], parse_float=Decimal)
            usage = final["response"]["usage"]
        else:
            usage = json.loads(response.text, parse_float=Decimal)["usage"]
        assert usage["output_tokens"] > 0 and usage["cost"] > 0
    events = ledger.check()
    assert [event.usage_source for event in events] == ["estimated", "estimated"]
    assert all(event.completion_tokens == 12 for event in events if event.streamed)  # one token per delta


def test_an_unknown_model_is_404_with_the_exact_body(stack, org):
    response = stack.post(RESPONSES, {**BODY, "model": "nope"}, org[1])
    assert response.status_code == 404
    assert response.json() == {"error": {
        "message": "The model `nope` does not exist or you do not have access to it.",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    assert "X-Neocloud-Generation-Id" not in response.headers


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"model": "qwen3-32b", "tool_choice": "required"}, "tool_choice"),
        ({"model": "qwen3-32b", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}}, "text.format"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"model": "qwen3-32b", "tool_choice": "REQUIRED"}, "tool_choice"),
        ({"model": "qwen3-32b", "tool_choice": {"type": "allowed_tools", "mode": "required", "tools": []}}, "tool_choice"),
        ({"model": "qwen3-32b", "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"model": "qwen3-32b", "tool_choice": {"type": "mcp", "server_label": "s"}}, "tool_choice"),
    ],
)
def test_capabilities_are_checked_as_for_chat(stack, org, extra, param):
    response = stack.post(RESPONSES, {**BODY, **extra}, org[1])
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", param)
    assert stack.events(org[0]) == []


@pytest.mark.parametrize("model", ["qwen3-32b", MODEL])
@pytest.mark.parametrize("choice", [["required"], 0, False])
def test_a_tool_choice_neither_string_nor_object_is_400_as_for_chat(stack, org, mock, model, choice):
    response = stack.post(RESPONSES, {**BODY, "model": model, "tool_choice": choice}, org[1])
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_type", "tool_choice")
    assert mock.stats["requests"] == 0 and stack.events(org[0]) == []


@pytest.mark.parametrize(("model", "extra"), [
    ("qwen3-32b", {"structured_outputs": {"json": {"type": "object"}}}),
    ("qwen3-32b", {"guided_json": {"type": "object"}}),
    ("gpt-oss-120b", {"ignore_eos": True}),
])
def test_the_servers_own_fields_are_forwarded_whatever_the_models_capabilities(stack, org, mock, model, extra):
    """§9: only a forced tool_choice and a constrained text.format are checked against the
    catalog; the fields chat checks besides (§3: a server's own constrained output, ignore_eos)
    are forwarded unchanged here, as docs/deploy.md says."""
    body = {**BODY, "model": model, **extra}
    response = stack.post(RESPONSES, body, org[1])
    assert response.status_code == 200
    assert mock.last_body() == body
    assert [event.status for event in stack.events(org[0])] == ["success"]


def test_other_fields_are_forwarded_unchanged(stack, org, mock):
    body = {**BODY, "model": "gpt-oss-120b", "tool_choice": "required", "text": {"format": {"type": "text"}},
            "store": True, "previous_response_id": "resp_1", "max_output_tokens": 5, "input": [{"role": "user",
                                                                                               "content": "hi"}]}
    assert stack.post(RESPONSES, body, org[1]).status_code == 200
    forwarded = mock.last_body()
    assert forwarded == {**body, "model": "gpt-oss-120b"}


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_failover_and_the_upstream_errors_are_chats(stack, org, stream):
    """§9: same failover and upstream errors as §5: a backend that refuses is passed over, every
    backend failing is a plain-text 502, a model with no backend a 503; each settled once."""
    ledger = LedgerCheck(stack, org[0])
    served = ledger.saw(stack.post(RESPONSES, {"model": "failover-model", "input": "x", "stream": stream}, org[1]))
    assert served.status_code == 200
    failed = ledger.saw(stack.post(RESPONSES, {"model": "all-down-model", "input": "x", "stream": stream}, org[1]))
    assert failed.status_code == 502 and failed.headers["content-type"].startswith("text/plain")
    none = stack.post(RESPONSES, {"model": "no-backend-model", "input": "x", "stream": stream}, org[1])
    assert none.status_code == 503 and none.json()["error"]["code"] == "no_backend_available"
    ledger.gen_ids.append(none.headers["X-Neocloud-Generation-Id"])
    events = {event.gen_id: event for event in ledger.check()}
    assert [events[gen_id].status for gen_id in ledger.gen_ids] == ["success", "upstream_error", "no_backend_available"]
    assert all(event.endpoint == "responses" for event in events.values())


def test_a_missing_input_is_the_model_servers_400(stack, org):
    response = stack.post(RESPONSES, {"model": MODEL}, org[1])
    assert response.status_code == 400 and "input" in response.json()["error"]["message"]


def test_a_failure_mid_stream_ends_with_one_error_event(stack, org):
    ledger = LedgerCheck(stack, org[0])
    response = ledger.saw(stack.post(RESPONSES, {**BODY, "stream": True, "mock": {"cut_after": 5}}, org[1]))
    last = list(sse_events(response.text))[-1]
    name, data = last.split("\n")
    assert name == "event: error"
    payload = json.loads(data[len("data: "):])
    assert (payload["type"], payload["code"]) == ("error", "upstream_error") and payload["message"]
    # the OpenAI SDKs' own shape of it: `sequence_number` (the Vercel AI SDK drops an error
    # event without one, and the error with it) one past the last event relayed, and `param`
    relayed = [json.loads(block.split("data: ", 1)[1]) for block in list(sse_events(response.text))[:-1]
               if "data: " in block]
    assert ResponseErrorEvent.model_validate(payload, strict=True).sequence_number == relayed[-1]["sequence_number"] + 1
    assert "param" in payload and payload["param"] is None
    (event,) = ledger.check()
    # created, in_progress, the item and its part, one delta: then the cut
    assert event.status == "stream_interrupted" and event.completion_tokens == 1


def test_keepalives_while_the_model_server_is_silent(stack_factory):
    stack = stack_factory(keepalive_seconds=0.2)
    _, key = stack.org()
    response = stack.post(RESPONSES, {**BODY, "stream": True, "mock": {"ttft_ms": 700}}, key)
    events = list(sse_events(response.text))
    assert ": keepalive" in events and events[-1].startswith("event: response.completed")
    client = openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0)
    streamed = list(client.responses.create(model=MODEL, input="x", stream=True, extra_body={"mock": {"ttft_ms": 500}}))
    assert streamed[-1].type == "response.completed"


@pytest.mark.parametrize("value, streams", [(True, True), ("true", True), (1, True), (False, False), ("false", False),
                                            (0, False)])
def test_stream_is_read_as_for_chat_and_forwarded_as_a_boolean(stack, org, mock, value, streams):
    """§9: `stream` as in §3, its spellings read alike and forwarded as a boolean."""
    response = stack.post(RESPONSES, {**BODY, "stream": value}, org[1])
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream" if streams else "application/json")
    assert mock.last_body()["stream"] is streams


def test_a_stream_spelled_as_nothing_the_gateway_reads_is_400_invalid_type(stack, org, mock):
    response = stack.post(RESPONSES, {**BODY, "stream": "maybe"}, org[1])
    assert response.status_code == 400
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == ("invalid_type", "stream")
    assert mock.stats["requests"] == 0


def test_the_same_keys_and_credits_answer_as_for_chat(stack, org):
    """§9: the same order of checks, keys and 402 bodies: 401 for no key or an unknown one,
    403 for a disabled org, 402 out of credits with no generation id and no event."""
    for headers in ({}, {"Authorization": "Bearer sk-kiln-" + "A" * 43}):
        response = stack.http.post(RESPONSES, json=BODY, headers=headers)
        assert (response.status_code, response.json()["error"]["code"]) == (401, "invalid_api_key")
    broke_id, broke = stack.org(credits="0")
    response = stack.post(RESPONSES, BODY, broke)
    assert (response.status_code, response.json()["error"]["code"]) == (402, "insufficient_credits")
    assert "X-Neocloud-Generation-Id" not in response.headers and stack.events(broke_id) == []
    disabled_id, disabled = stack.org()
    set_status(stack.tables, disabled_id, "disabled")
    response = stack.post(RESPONSES, {"model": "not-a-model"}, disabled)
    assert (response.status_code, response.json()["error"]["code"]) == (403, "organization_disabled")


def test_the_ninth_request_in_flight_is_429(stack, org):
    ledger = LedgerCheck(stack, org[0])
    slow = {**BODY, "stream": True, "mock": {"ttft_ms": 1500}}
    threads = [threading.Thread(target=lambda: ledger.saw(stack.post(RESPONSES, slow, org[1]))) for _ in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while stack.org_info(org[0]).in_flight < 8:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ninth = stack.post(RESPONSES, BODY, org[1])
    assert_a_plain_429(ninth)
    assert ninth.json()["error"]["code"] == "rate_limit_exceeded"
    for thread in threads:
        thread.join()
    assert len(ledger.check()) == 8


def test_buffered_tool_calls_pass_through(stack, org):
    tools = [{"type": "function", "name": "weather", "description": "d", "parameters": {"type": "object"}}]
    response = stack.post(RESPONSES, {**BODY, "tools": tools, "mock": {"tool_calls": 2}}, org[1])
    output = response.json()["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call"]
    assert output[0]["name"] == "weather" and json.loads(output[1]["arguments"]) == {"city": "Paris", "n": 1}


@pytest.mark.parametrize("answer", [
    {"id": "r", "object": "response", "output": 5},
    # an error where the response should be (a failed response is a response: status "failed")
    {"error": {"message": "model overloaded", "type": "server_error", "code": "overloaded"}},
    {"object": "error", "message": "model overloaded"},
], ids=["output-int", "error-object", "object-error"])
def test_a_malformed_answer_is_502_and_settled(stack, org, answer):
    ledger = LedgerCheck(stack, org[0])
    raw = json.dumps(answer)
    response = ledger.saw(stack.post(RESPONSES, {**BODY, "mock": {"raw_body": raw}}, org[1]))
    assert response.status_code == 502
    (event,) = ledger.check()
    assert event.status == "upstream_error"


def test_the_generation_id_finds_the_responses_usage_event(stack, org):
    response = stack.post(RESPONSES, BODY, org[1])
    gen_id = response.headers["X-Neocloud-Generation-Id"]
    generation = stack.http.get(f"/v1/generations/{gen_id}", headers={"Authorization": f"Bearer {org[1]}"}).json()
    assert (generation["id"], generation["endpoint"], generation["status"]) == (gen_id, "responses", "success")
    assert (generation["usage"]["prompt_tokens"], generation["usage"]["completion_tokens"]) == (8, 12)
    assert Decimal(str(generation["usage"]["cost"])) == price(8, 12)


def test_a_choice_among_allowed_tools_in_auto_mode_is_not_forced(stack, org):
    body = {**BODY, "model": "qwen3-32b", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}
    assert stack.post(RESPONSES, body, org[1]).status_code == 200


def test_an_upstream_done_marker_is_not_relayed_so_the_sdk_still_sees_the_cut(stack, org):
    """A chat-style `data: [DONE]` would make the SDK stop before the error event."""
    delta = json.dumps({"type": "response.output_text.delta", "delta": "a", "item_id": "m", "output_index": 0,
                        "content_index": 0, "sequence_number": 1, "logprobs": []})
    response = stack.post(RESPONSES, {**BODY, "stream": True, "mock": {"raw_events": [delta]}}, org[1])
    assert "[DONE]" not in response.text
    assert list(sse_events(response.text))[-1].startswith("event: error")
    client = openai.OpenAI(base_url=stack.base_url, api_key=org[1], max_retries=0)
    events = list(client.responses.create(model=MODEL, input="hi", stream=True, extra_body={"mock": {"raw_events": [delta]}}))
    assert [event.type for event in events] == ["response.output_text.delta", "error"]
    assert events[-1].code == "upstream_error"


@pytest.mark.parametrize("letter", ["x", "é", "\U0001f600"], ids=["ascii", "escaped", "escaped pair"])
def test_a_stream_echoing_a_request_larger_than_the_event_bound_is_relayed_whole(stack, org, letter):
    """The Responses API's events carry the response object, which echoes the request's
    `instructions`: a request within the body limit but over the model's per-event bound
    (1 MiB) still streams to its end, billed as the model server reported. A server that
    escapes non-ASCII text (as the test's does, as Python's JSON writes it) repeats é's 2 bytes
    as 6 and an emoji's 4 as 12: the bound takes that in, as an echoed prompt's does."""
    ledger = LedgerCheck(stack, org[0])
    instructions = letter * (1100 * 1024 // len(letter.encode()))
    body = {**BODY, "instructions": instructions, "stream": True}
    response = ledger.saw(stack.post(RESPONSES, body, org[1]))
    events = list(sse_events(response.text))
    names = [event.split("\n")[0] for event in events]
    assert names[0] == "event: response.created" and names[-1] == "event: response.completed", names[-1]
    final = json.loads(events[-1].split("\n", 1)[1][len("data: "):], parse_float=Decimal)
    assert final["response"]["instructions"] == instructions
    (event,) = ledger.check()
    assert (event.status, event.usage_source) == ("success", "upstream")
    assert event.cost == final["response"]["usage"]["cost"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("background", [True, "true", 1])
def test_a_background_response_is_refused_before_admission(stack, org, stream, background):
    """A background response runs on after its request ends, where the gateway cannot meter
    it (and it keeps no route to fetch it by): it would be unbilled work on the model server."""
    response = stack.post(RESPONSES, {**BODY, "stream": stream, "background": background}, org[1])
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_parameter", "background")
    assert "background" in error["message"]
    assert stack.events(org[0]) == []


def test_a_background_response_through_the_sdk_is_a_bad_request(client, stack, org):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, input="hi", background=True)
    assert refused.value.body["param"] == "background"
    # background false is a plain response
    assert client.responses.create(model=MODEL, input="hi", background=False).status == "completed"
    assert len(stack.events(org[0])) == 1


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_the_usage_shown_totals_what_was_billed_and_no_count_below_zero(stack, org, stream):
    """§4 for the Responses API: a believed usage object is shown with its total the billed
    tokens' sum and no count below zero; what the server adds (per turn, tool output) as written."""
    org_id, key = org
    # vLLM's gpt-oss usage: counts per turn, and tool output that may exceed the reply's tokens
    usage = {"input_tokens": 8, "input_tokens_details": {"cached_tokens": 2, "input_tokens_per_turn": [5, 3],
                                                         "cached_tokens_per_turn": [0, 2]},
             "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": -1, "tool_output_tokens": 1470,
                                                            "output_tokens_per_turn": [4, 8]},
             "total_tokens": {"x": -7}, "cost": {"usd": -1}}
    if stream:
        events = _payloads(stack.post(RESPONSES, {**BODY, "stream": True}, key).text)
        assert events[-1]["type"] == "response.completed"
        events[-1]["response"]["usage"] = usage
        body = {**BODY, "stream": True, "mock": {"raw_events": [json.dumps(event) for event in events]}}
        shown = _payloads(stack.post(RESPONSES, body, key).text)[-1]["response"]["usage"]
    else:
        answer = stack.post(RESPONSES, BODY, key).json()
        answer["usage"] = usage
        shown = stack.post(RESPONSES, {**BODY, "mock": {"raw_body": json.dumps(answer)}}, key).json()["usage"]
    event = max(stack.events(org_id), key=lambda event: event.created_at)
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (8, 12, 2)
    assert Decimal(str(shown.pop("cost"))) == event.cost
    assert shown == {**{name: value for name, value in usage.items() if name != "cost"}, "total_tokens": 20,
                     "output_tokens_details": {**usage["output_tokens_details"], "reasoning_tokens": 0}}


def _payloads(text: str) -> list[dict]:
    """The data of each event of a Responses stream (named events: `event:` then `data:`)."""
    return [json.loads(line[len("data: "):]) for block in sse_events(text) for line in block.split("\n")
            if line.startswith("data: ")]


def _schema_nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_a_request_at_the_nesting_bound_is_served_though_its_events_echo_it_a_level_deeper(stack, org, stream):
    """A request nested as deeply as a body may be (200 levels: a function tool's schema) is
    accepted; the response object repeats its `tools`, and a stream's events wrap that object
    once more. Read with the clients' bound, the stream's first event was unreadable: the client
    got the error event under a 200 and was billed an estimate for a request the server served."""
    ledger = LedgerCheck(stack, org[0])
    tool = {"type": "function", "name": "lookup", "description": "d", "parameters": _schema_nested(98)}
    body = {**BODY, "tools": [tool], "stream": stream}
    # root, tools, the tool, then the schema's 197 levels: exactly the bound, and accepted
    response = ledger.saw(stack.post(RESPONSES, body, org[1]))
    assert response.status_code == 200, response.text
    if stream:
        events = list(sse_events(response.text))
        names = [event.split("\n")[0] for event in events]
        assert names[0] == "event: response.created" and names[-1] == "event: response.completed", names
        final = json.loads(events[-1].split("\n", 1)[1][len("data: "):], parse_float=Decimal)["response"]
    else:
        final = response.json(parse_float=Decimal)
    assert final["tools"] == [tool]
    (event,) = ledger.check()
    assert (event.status, event.usage_source) == ("success", "upstream")
    assert event.cost == final["usage"]["cost"]
