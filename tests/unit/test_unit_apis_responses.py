"""kiln.apis.responses: the Responses API's checks, usage, estimates and stream (contract §9)."""

import json
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.apis.responses import API as RESPONSES
from kiln.apis.responses import FINAL_EVENTS, ResponsesRelay
from kiln.catalog import Capabilities, ModelEntry, Pricing
from kiln.errors import GatewayError
from kiln.metering import TokenUsage

COST = Decimal("0.000001155")
PLAIN = ModelEntry("plain", "kiln", 0, 4096, Pricing(Decimal(1), Decimal(1)))
CAPABLE = ModelEntry(
    "capable", "kiln", 0, 4096, Pricing(Decimal(1), Decimal(1)),
    capabilities=Capabilities(forced_tool_choice=True, json_response_format=True),
)


def event(name, data):
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


USAGE = {"input_tokens": 8, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 12, "total_tokens": 20}
CREATED = event("response.created", {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}})
DELTA = event("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1", "delta": "Hel"})
EMPTY_DELTA = event("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1", "delta": ""})
ARGS = event("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta", "delta": "{\"a\""})
COMPLETED = event("response.completed", {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "usage": USAGE}})


def error_of(call):
    with pytest.raises(GatewayError) as info:
        call()
    return info.value.status, json.loads(info.value.body())["error"]


def test_the_endpoint_says_who_it_is_and_how_its_stream_ends():
    assert (RESPONSES.name, RESPONSES.upstream_path) == ("responses", "/responses")
    assert RESPONSES.unfinished == "the stream ended before its final event"
    assert FINAL_EVENTS == ("response.completed", "response.incomplete", "response.failed")


# -- checks ------------------------------------------------------------------------------------


def test_a_forced_tool_choice_needs_the_capability():
    status, body = error_of(lambda: RESPONSES.check({"tool_choice": "required"}, PLAIN))
    assert (status, body["param"], body["code"]) == (400, "tool_choice", "unsupported_parameter")
    RESPONSES.check({"tool_choice": "required"}, CAPABLE)


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_json_text_format_needs_the_capability_and_is_named_text_format(kind):
    status, body = error_of(lambda: RESPONSES.check({"text": {"format": {"type": kind}}}, PLAIN))
    assert (status, body["param"], body["code"]) == (400, "text.format", "unsupported_parameter")
    assert f"does not support text.format '{kind}'" in body["message"]
    RESPONSES.check({"text": {"format": {"type": kind}}}, CAPABLE)


@pytest.mark.parametrize("body", [{}, {"text": "json_schema"}, {"text": {"format": {"type": "text"}}}, {"input": 3, "tools": "x"}])
def test_the_rest_of_the_body_is_the_model_servers_business(body):
    RESPONSES.check_before_model(body)
    RESPONSES.check(body, PLAIN)


# -- usage and estimates -------------------------------------------------------------------------


def test_the_usage_is_read_in_the_chat_names():
    assert RESPONSES.reported_usage(USAGE) == {"prompt_tokens": 8, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 3}}
    assert RESPONSES.reported_usage({"input_tokens": 1, "input_tokens_details": "x"}) == {
        "prompt_tokens": 1, "completion_tokens": None, "prompt_tokens_details": None,
    }
    assert RESPONSES.reported_usage(None) is None
    assert RESPONSES.reported_usage([1]) == [1]


def test_the_prompt_is_estimated_from_the_instructions_and_each_input_item():
    assert RESPONSES.estimate_prompt({"input": "The capital of France is"}) == 3 + 6
    items = [{"role": "user", "content": [{"type": "input_text", "text": "abcd"}]}, {"type": "message", "content": "ab"}]
    # "user" "input_text" "abcd": 18 characters, 5 tokens; "message" "ab": 9, 3
    assert RESPONSES.estimate_prompt({"input": items, "instructions": "abcdefgh"}) == 2 + (3 + 5) + (3 + 3)
    assert RESPONSES.estimate_prompt({"instructions": "abcd"}) == 1
    assert RESPONSES.estimate_prompt({"instructions": ["abcd"], "input": None}) == 0


LONG = "x" * 1000  # at least 8 tokens


def test_the_prompt_is_at_least_the_fewest_tokens_of_its_instructions_and_input_texts():
    assert RESPONSES.fewest_prompt_tokens({"input": LONG, "instructions": LONG}) == 16
    items = [{"role": "user", "content": [{"type": "input_text", "text": LONG},
                                          {"type": "input_image", "image_url": "data:," + LONG}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": LONG}]},
             {"type": "function_call_output", "call_id": "c", "output": LONG}, {"content": LONG}, 5, None]
    # the user's text, the tool's output and the bare content; not the image, nor the assistant's
    # text, which the model's template may drop
    assert RESPONSES.fewest_prompt_tokens({"input": items}) == 8 + 8 + 8
    assert RESPONSES.fewest_prompt_tokens({"input": items[1:2]}) == 0
    assert RESPONSES.fewest_prompt_tokens({"input": [{"type": "function_call_output", "output": LONG}]}) == 8
    assert RESPONSES.fewest_prompt_tokens({"input": {"text": LONG}, "instructions": 5}) == 0
    assert RESPONSES.fewest_prompt_tokens({"input": LONG, "truncation": "disabled"}) == 8


@pytest.mark.parametrize("truncation", ["auto", "other", 1])
def test_a_response_the_server_may_truncate_has_no_prompt_floor(truncation):
    assert RESPONSES.fewest_prompt_tokens({"input": LONG, "truncation": truncation}) == 0


def test_a_buffered_answer_needs_output_items_that_are_objects():
    assert RESPONSES.shape_problem({"output": [{"type": "message"}]}) is None
    assert RESPONSES.shape_problem({}) is None
    for output in ({"type": "message"}, [{"type": "message"}, "x"], "x"):
        assert RESPONSES.shape_problem({"output": output}) == "output is not an array of objects"


def test_output_tokens_are_estimated_from_texts_reasoning_and_arguments():
    answer = {
        "output": [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "abcdefgh"}, "x"]},  # 2 + 1
            {"type": "message", "content": [{"type": "output_text", "text": "abcde"}, {"type": "refusal"}]},  # 2
            {"type": "function_call", "arguments": '{"a":1}'},  # 2
            # a content that is one text, a summary that is one part: the client's SDK shows them
            {"type": "message", "content": "not parts", "summary": {"text": "abcd"}},  # 3 + 1
            {"type": "code_interpreter_call", "code": "print(1)", "outputs": [{"logs": "1"}]},  # 2: not its output
            {"type": "web_search_call", "action": {"type": "search", "query": "kiln", "queries": ["a b"]}},  # 1 + 1
            "not an item",
        ]
    }
    assert RESPONSES.estimate_completion(answer) == 15
    assert RESPONSES.estimate_completion({"output": None}) == RESPONSES.estimate_completion({}) == 0
    assert RESPONSES.fewest_completion_tokens(answer) == 9  # one at least for each text
    assert RESPONSES.fewest_completion_tokens({"output": [{"type": "message", "content": [{"text": ""}]}]}) == 0


def test_a_believed_usage_gets_its_cost_and_any_other_is_replaced_by_the_billed_one():
    answer = {"usage": dict(USAGE)}
    RESPONSES.with_usage(answer, TokenUsage(8, 12, 3), COST)
    assert answer["usage"] == {**USAGE, "cost": COST}
    for usage, reported in ((TokenUsage(8, 5, None, "capped"), dict(USAGE)), (TokenUsage(8, 12, 3), "odd")):
        answer = {"usage": reported}
        RESPONSES.with_usage(answer, usage, COST)
        assert answer["usage"] == {
            "input_tokens": 8,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 8 + usage.completion_tokens,
            "cost": COST,
        }


@pytest.mark.parametrize("answer, reason", [({"status": "incomplete"}, "incomplete"), ({"status": 1}, None), ({}, None)])
def test_the_finish_reason_is_the_status(answer, reason):
    assert RESPONSES.finish_reason(answer) == reason


# -- the stream -------------------------------------------------------------------------------------


def relayed(*pieces):
    relay = RESPONSES.relay(client_wants_usage=False, max_event_bytes=64 * 1024)
    assert isinstance(relay, ResponsesRelay)
    return b"".join(relay.feed(piece) for piece in pieces), relay


def test_every_event_is_relayed_as_sent_but_the_final_one_which_is_held_back():
    stream = CREATED + b": keepalive\n\n" + DELTA + EMPTY_DELTA + ARGS + COMPLETED
    out, relay = relayed(stream)
    assert out == CREATED + b": keepalive\n\n" + DELTA + EMPTY_DELTA + ARGS
    assert relay.done is True
    assert relay.final == json.loads(COMPLETED.split(b"data: ")[1])
    assert relay.reported_usage == USAGE and relay.finish_reason == "completed"
    assert relay.relayed_texts == 2  # "Hel" and the arguments; the empty delta does not count
    # and at every split point, the same
    for cut in range(1, len(stream)):
        again, other = relayed(stream[:cut], stream[cut:])
        assert (again, other.final, other.relayed_texts) == (out, relay.final, 2), cut


def test_a_delta_that_is_no_utf8_is_relayed_as_the_sse_format_reads_it():
    """§9: a delta with bytes that are no UTF-8 went out as sent: the OpenAI Python SDK raised
    UnicodeDecodeError (no APIError) and the request was billed as a success."""
    bad = DELTA.replace(b"Hel", b"He\xff\xfeo")
    assert bad != DELTA
    out, relay = relayed(CREATED + bad + COMPLETED)
    assert out == CREATED + bad.replace(b"\xff\xfe", "\ufffd\ufffd".encode())
    assert relay.done and relay.relayed_texts == 1
    out.decode("utf-8")


@pytest.mark.parametrize("kind, status", [("response.incomplete", "incomplete"), ("response.failed", "failed")])
def test_the_other_final_events_end_the_stream_too(kind, status):
    final = event(kind, {"type": kind, "response": {"status": status}})
    out, relay = relayed(DELTA + final + DELTA)
    assert out == DELTA and relay.done
    assert relay.finish_reason == status and relay.reported_usage is None


def test_a_final_event_without_its_event_line_or_status_is_still_final():
    final = b'data: {"type":"response.completed","response":{"status":3}}\n\n'
    out, relay = relayed(DELTA + final)
    assert out == DELTA and relay.done and relay.finish_reason is None


@pytest.mark.parametrize(
    "data",
    [
        b'{"type":"response.completed.extra","response":{}}',
        b'{"note":{"type":"response.completed"},"type":"response.output_text.done","response":{}}',
        b'{"note":{"type":"error"},"type":"response.output_text.delta","delta":"caf\\u00e9"}',
        b'["type","response.completed"]',
    ],
)
def test_what_only_looks_like_a_final_or_error_event_is_relayed(data):
    odd = b"event: x\ndata: " + data + b"\n\n"
    out, relay = relayed(odd + DELTA)
    assert out == odd + DELTA and relay.done is False and relay.final is None and relay.failure is None


def test_an_event_the_gateway_cannot_read_that_may_hold_text_ends_the_stream_unrelayed():
    """Broken JSON with an escape (which may spell any type): what the gateway cannot read it
    cannot count, so it is not relayed; the stream ends with the one error event."""
    odd = b'event: x\ndata: {"type":"response.output_text.delta","delta":"\\u00e9", oops\n\n'
    out, relay = relayed(DELTA + odd + DELTA)
    assert out == DELTA and relay.done and relay.failure


@pytest.mark.parametrize(
    "data",
    [
        b'{"type":"response.completed","response":"done"}',
        b'{"type":"response.completed"}',
        b'{"type":"response.completed", oops',
        b'{"type":"response.completed","response":{"usage":{"input_tokens":1e999}}}',
        b'{"type":"error","code":"x","message":"boom"}',
        b'{"type":"\\u0065rror","message":"boom"}',
        b'{"\\u0074ype":"response.incomplete","response":"x"}',
    ],
    ids=["response-not-object", "no-response", "not-json", "unreadable-number", "error", "escaped-error",
         "escaped-key"],
)
def test_a_final_event_the_gateway_cannot_read_or_an_error_event_ends_the_stream_unrelayed(data):
    """One terminal event reaches the client (§9): the gateway's error event, not the
    upstream's unreadable final event (without cost) or its own error event before it."""
    out, relay = relayed(DELTA + b"event: x\ndata: " + data + b"\n\n" + DELTA)
    assert out == DELTA and relay.done and relay.failure and relay.final is None


def test_an_escaped_final_event_is_still_the_final_event():
    final = b'event: response.completed\ndata: {"type":"response\\u002ecompleted","response":{"status":"completed","usage":{"input_tokens":3,"output_tokens":5}}}\n\n'
    out, relay = relayed(DELTA + final)
    assert out == DELTA and relay.done and relay.failure is None
    assert relay.reported_usage == {"input_tokens": 3, "output_tokens": 5} and relay.upstream_failed is False


def test_a_failed_response_is_the_final_event_and_the_upstreams_failure():
    final = event("response.failed", {"type": "response.failed", "response": {"status": "failed"}})
    out, relay = relayed(DELTA + final)
    assert out == DELTA and relay.done and relay.upstream_failed and relay.failure is None


def test_nothing_after_the_final_event_is_relayed():
    out, relay = relayed(DELTA + COMPLETED + DELTA + b": late comment\n\n" + b"event: x\n\n")
    assert out == DELTA and relay.relayed_tokens == 1


def test_comments_pass_and_an_event_with_a_name_and_no_data_does_not():
    """The Python SDK reads `event: ping` with no data as an event with empty data, and raises."""
    out, relay = relayed(b"event: ping\n\n" + b": hi\n\n" + COMPLETED)
    assert out == b": hi\n\n" and relay.first_chunk is None


def test_the_final_event_goes_out_last_with_the_cost_in_its_usage():
    _, relay = relayed(CREATED + DELTA + COMPLETED)
    tail = RESPONSES.stream_tail(relay, TokenUsage(8, 12, 3), COST, False)
    assert tail.startswith(b"event: response.completed\ndata: ") and tail.endswith(b"}\n\n")
    final = json.loads(tail.split(b"data: ", 1)[1], parse_float=Decimal)
    assert final == {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "usage": {**USAGE, "cost": COST}}}
    assert relay.final["response"]["usage"] == USAGE  # what the relay kept is not changed
    capped = json.loads(RESPONSES.stream_tail(relay, TokenUsage(8, 1, None, "capped"), COST, True).split(b"data: ", 1)[1])
    assert capped["response"]["usage"]["output_tokens"] == 1 and capped["response"]["id"] == "resp_1"


def test_a_failed_stream_ends_with_an_error_event_of_the_responses_shape():
    relay = RESPONSES.relay(client_wants_usage=True, max_event_bytes=1 << 20)
    tail = RESPONSES.stream_error('cut "short"', relay)
    assert tail.startswith(b"event: error\ndata: ") and tail.endswith(b"\n\n") and tail.count(b"\n") == 3
    assert json.loads(tail.split(b"data: ", 1)[1]) == {
        "type": "error", "code": "upstream_error", "message": 'cut "short"', "param": None, "sequence_number": 0}


@pytest.mark.parametrize("events, expected", [
    ([b'{"type":"response.created","sequence_number":0,"response":{"metadata":{"sequence_number":99}}}'], 1),
    ([b'{"type":"response.output_text.delta","item_id":"m","delta":"\\"sequence_number\\": 50,","sequence_number":4}'], 5),
    ([b'{"type":"response.output_text.delta","sequence_number":12,"delta":"a"}',
      b'{"type":"response.output_text.delta","delta":"b"}'], 14),
    ([b'{"type":"response.output_text.delta","sequence_number":-3,"delta":"a"}'], 1),
    ([b'{"type":"response.output_text.delta","sequence_number":1e3,"delta":"a"}'], 1),
])
def test_the_gateways_error_event_takes_the_number_after_the_last_event_relayed(events, expected):
    """Read from the event's own field (a number in a text or in the echoed request is not it),
    else one more than the last; a number that is no count of events is not taken."""
    relay = RESPONSES.relay(client_wants_usage=True, max_event_bytes=1 << 20)
    for event in events:
        relay.feed(b"data: " + event + b"\n\n")
    assert json.loads(RESPONSES.stream_error("cut", relay).split(b"data: ", 1)[1])["sequence_number"] == expected


def test_the_stream_is_held_to_the_models_bound_on_one_event():
    relay = RESPONSES.relay(client_wants_usage=True, max_event_bytes=len(DELTA))
    assert relay.feed(DELTA) == DELTA
    with pytest.raises(Exception, match=f"over {len(DELTA)} bytes"):
        relay.feed(DELTA.replace(b"Hel", b"Hello!"))


def test_the_bound_on_one_event_makes_room_for_the_request_it_echoes():
    """As a server escaping the request's non-ASCII text writes it: up to three times its size."""
    request_bytes = 700 * 2 + 100  # 700 é of instructions, and the rest of the request
    escaped = event("response.created", {"type": "response.created", "response": {"instructions": "é" * 700}})
    assert len(escaped) > len(DELTA) + 2 * request_bytes  # \u00e9, 6 bytes a letter: 2 bytes in the request
    held = RESPONSES.relay(client_wants_usage=True, max_event_bytes=len(DELTA), request_bytes=request_bytes)
    assert held.feed(escaped) == escaped
    bound = len(DELTA) + 3 * request_bytes
    with pytest.raises(Exception, match=f"over {bound} bytes"):
        held.feed(event("response.created", {"response": {"instructions": "x" * bound}}))


@pytest.mark.parametrize("done", [b"data: [DONE]\n\n", b"data: [DONE] \n\n"], ids=["as chat sends it", "trailing space"])
def test_a_chat_style_done_marker_is_never_relayed(done):
    out, relay = relayed(DELTA + done + COMPLETED)
    assert out == DELTA and relay.final is not None


@pytest.mark.parametrize("lines", [b"id: 9\nevent: response\nevent: response.completed\n",
                                   b"event: thread.run.completed\n", b"event: response.output_text.done\n", b""],
                         ids=["two names", "an assistants name", "another event's name", "none"])
def test_the_final_event_the_gateway_writes_is_named_by_its_type(lines):
    """The final event is written again, with the cost: it goes out named by its type, whatever
    the server named it. Named `thread.run.completed`, openai-python read it as an Assistants
    event: no `response.completed` reached `get_final_response()`, and the client never saw
    the usage it was billed for."""
    final = lines + COMPLETED.split(b"\n", 1)[1]
    _, relay = relayed(DELTA + final)
    assert relay.done and relay.reported_usage == USAGE
    tail = RESPONSES.stream_tail(relay, TokenUsage(8, 12, 3), COST, True)
    assert tail.startswith(b"event: response.completed\ndata: {")


def test_a_comment_line_does_not_hide_the_final_event():
    out, relay = relayed(DELTA + b": last one\n" + COMPLETED + DELTA)
    assert out == DELTA and relay.done and relay.reported_usage == USAGE


def streamed_then_whole(deltas, whole, *, raw=False):
    """The relay's estimate for an item "m" streamed as `deltas`, then given `whole`; `raw`: each
    delta written as JSON may write it, with `\\/` for a slash."""
    pieces = []
    for delta in deltas:
        data = json.dumps({"type": "response.output_text.delta", "item_id": "m", "delta": delta})
        pieces.append(b"data: " + (data.replace("/", "\\/") if raw else data).encode() + b"\n\n")
    pieces.append(event("response.output_text.done", {"type": "response.output_text.done", "item_id": "m",
                                                       "text": whole}))
    _, relay = relayed(b"".join(pieces))
    return relay.relayed_tokens, relay.fewest_tokens


def test_a_whole_text_the_deltas_held_counts_no_more():
    assert streamed_then_whole(["ab/c"] * 100, "ab/c" * 100) == (100, 100)
    assert streamed_then_whole(["ab/c"] * 100, "ab/c" * 100, raw=True) == (100, 100)
    assert streamed_then_whole(["a\n\u00e9\"\\"] * 100, "a\n\u00e9\"\\" * 100) == (100, 100)


def test_what_a_whole_text_holds_beyond_its_streamed_start_or_end_counts_as_text():
    tokens = [f"<{k:03d}>" for k in range(100)]  # 5 characters each
    rest = "".join(f"[{k:03d}]" for k in range(100))  # 500 characters none of the deltas hold
    # the start streamed, the rest given whole; all but the first token streamed (gpt-oss)
    assert streamed_then_whole(tokens, "".join(tokens) + rest) == (100 + 125, 100 + 4)
    assert streamed_then_whole(tokens[1:], "{\"co" + "".join(tokens[1:])) == (99 + 2, 99 + 1)  # {\"co as sent


def test_a_whole_text_other_than_the_deltas_counts_whole_beside_them():
    assert streamed_then_whole(["x" * 16] * 100, "y" * 1600) == (100 + 400, 100 + 13)
    # the deltas' text held twice (a distinct text given whole twice) counts by its bytes beyond them
    pieces = [event("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "m",
                                                    "delta": "abcd" * 4}) for _ in range(100)]
    for text in ("abcd" * 400, "bcda" * 399):
        pieces.append(event("response.output_text.done", {"type": "response.output_text.done", "item_id": "m",
                                                           "text": text}))
    _, relay = relayed(b"".join(pieces))
    assert (relay.relayed_tokens, relay.fewest_tokens) == (100 + 399, 100 + 13)


@pytest.mark.parametrize("bound", ["MAX_KEPT_DELTA_BYTES", "MAX_SEARCHED_BYTES"])
def test_past_the_deltas_kept_or_searched_a_whole_text_counts_again(monkeypatch, bound):
    from kiln.apis import responses
    tokens = [f"<{k:03d}>" for k in range(400)]
    middle = "".join(tokens[100:300])  # 1 000 characters the deltas spell, not at their start or end
    assert streamed_then_whole(tokens, middle) == (400, 400)
    monkeypatch.setattr(responses, bound, 0)
    assert streamed_then_whole(tokens, middle) == (400 + 250, 400 + 8)


# -- a text given whole many times over, and the search's cost ---------------------------------


def test_an_items_parts_repeated_in_its_item_are_each_counted():
    """A message item whose content is 90 000 one-character parts (an alphabet of 29 texts)
    spells any text to the client (`response.output_text` joins the parts), but each distinct
    text counted once per item (by hash): 29 tokens were estimated and 29 the floor."""
    msg = "The quick brown fox jumps over the lazy dog. " * 2000
    item = {"id": "m", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": c, "annotations": []} for c in msg]}
    final = {"type": "response.completed",
             "response": {"id": "r", "status": "completed", "output": [item],
                          "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}}
    relay = RESPONSES.relay(client_wants_usage=False, max_event_bytes=8 << 20)
    relay.feed(event("response.output_item.done", {"type": "response.output_item.done", "output_index": 0,
                                                  "item": item}) + event("response.completed", final))
    shown = "".join(part["text"] for part in relay.final["response"]["output"][0]["content"])
    assert shown == msg
    assert relay.relayed_tokens >= 0.8 * len(msg) / 4, relay.relayed_tokens
    assert relay.fewest_tokens >= len(msg) // 128, relay.fewest_tokens


def test_texts_given_whole_one_character_each_in_done_events_are_each_counted():
    """The same spelled as 22 500 `response.output_text.done` events of one character each
    (a streaming client shows them): 29 tokens were estimated."""
    msg = "The quick brown fox jumps over the lazy dog. " * 500
    pieces = [event("response.output_text.done", {"type": "response.output_text.done", "item_id": "m",
                                                  "output_index": 0, "content_index": k, "text": c})
              for k, c in enumerate(msg)]
    _, relay = relayed(b"".join(pieces))
    assert relay.relayed_tokens >= 0.4 * len(msg) / 4, relay.relayed_tokens


def test_the_search_for_whole_texts_is_linear_and_bounded_against_a_short_deltas_text(monkeypatch):
    """2 496 bytes of deltas ("a"), 32 distinct texts (MAX_ITEM_PARTS), then `a*1000 b a*1000`
    given whole 1 300 times: each time searched for, in a haystack CPython searches naively
    under 30 000 bytes (its time, the haystack's length times the needle's): ~5 s of CPU for
    2.75 MB relayed. A haystack is searched padded to LINEAR_SEARCH_BYTES, each text past
    MAX_ITEM_PARTS is not searched for, and the bytes searched stay within the budget."""
    from kiln.apis import responses
    searched: list[int] = []

    def contains(haystack, piece):
        searched.append(len(haystack))
        return piece in haystack

    monkeypatch.setattr(responses, "_contains", contains)
    hay = "a" * 2496
    pieces = [event("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "m",
                                                   "delta": hay[k:k + 16]}) for k in range(0, len(hay), 16)]
    pieces += [event("response.output_text.done", {"type": "response.output_text.done", "item_id": "m",
                                                   "text": f"z{k}"}) for k in range(31)]
    odd = "a" * 1000 + "b" + "a" * 1000
    pieces += [event("response.output_text.done", {"type": "response.output_text.done", "item_id": "m",
                                                   "text": odd})] * 1300
    _, relay = relayed(b"".join(pieces))
    assert searched and min(searched) >= responses.LINEAR_SEARCH_BYTES
    assert sum(searched) <= responses.MAX_SEARCHED_BYTES + responses.LINEAR_SEARCH_BYTES
    assert len(searched) <= 32 * 2 * 12, len(searched)  # the 32 distinct texts' searches, once each
    assert relay.relayed_tokens >= 1300 * len(odd) / 4 / 2  # each time counted, ~half of it as bytes beyond the deltas


@pytest.mark.parametrize("spelled", ['msg\\/1', "m" * 300 + "\\/1"], ids=["short", "past-the-digest-length"])
def test_an_item_id_with_an_escaped_slash_is_one_item_in_its_deltas_and_its_done_event(spelled):
    """A delta not parsed was keyed by its id as sent (`"msg\\/1"`), the done event, parsed, by
    its id as `dumps` writes it (`"msg/1"`): one item counted as two, its text twice over, so
    an honest usage fell below the relay's floor and was not believed."""
    def counted(item_id: str) -> tuple[int, int]:
        relay = ResponsesRelay(max_event_bytes=1 << 20)
        words = ["Hello", " there", ",", " how", " are", " you", " to", "day", "?"]
        for word in words:
            relay.feed(('data: {"type":"response.output_text.delta","item_id":"' + item_id + '","delta":"'
                        + word + '"}\n\n').encode())
        relay.feed(('data: {"type":"response.output_text.done","item_id":"' + item_id + '","text":"'
                    + "".join(words) + '"}\n\n').encode())
        return relay.relayed_tokens, relay.fewest_tokens

    assert counted(spelled) == counted(spelled.replace("\\/", "_"))


# -- what the final event restates ---------------------------------------------------------------

_WORDS = ["alpha " * 40, "beta " * 50, "gamma " * 30]  # texts of 240, 250 and 180 characters
_IDS = ["a", "b", "c", None]


def _message(item_id, texts):
    item = {"type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []} for text in texts]}
    if item_id is not None:
        item["id"] = item_id
    return item


def _final(output):
    return event("response.completed", {"type": "response.completed",
                                        "response": {"id": "r", "status": "completed", "output": output}})


def _billed(*events):
    relay = ResponsesRelay(max_event_bytes=1 << 24)
    for piece in events:
        relay.feed(piece)
    assert relay.done
    return relay.fewest_tokens, relay.relayed_tokens


_ITEMS = st.tuples(st.sampled_from(_IDS + ["f1", "f2", "f3"]), st.lists(st.sampled_from(_WORDS), min_size=1, max_size=3))
_BEFORE = st.lists(st.tuples(st.sampled_from(["response.output_item.added", "response.output_item.done",
                                              "response.in_progress"]),
                             st.sampled_from(_IDS), st.lists(st.sampled_from(_WORDS), min_size=1, max_size=3)),
                   max_size=8)


def _told(kind, item_id, texts):
    item = _message(item_id, texts)
    if kind == "response.in_progress":
        return event(kind, {"type": kind, "response": {"id": "r", "status": "in_progress", "output": [item]}})
    return event(kind, {"type": kind, "output_index": 0, "item": item})


@settings(max_examples=300, deadline=None)
@given(before=_BEFORE, output=st.lists(_ITEMS, max_size=8))
def test_a_stream_is_never_billed_less_than_its_final_event_alone(before, output):
    """Whatever items a server gives whole before (ids seen again or not, texts repeated in
    them or not, in whichever kinds of event), the final event's items with fresh ids restate
    only what the stream billed for items this event does not hold again: the bill, its floor
    and its estimate, is never below what the final event alone is billed."""
    final = _final([_message(item_id, texts) for item_id, texts in output])
    fewest, estimated = _billed(*(_told(*told) for told in before), final)
    alone = _billed(final)
    assert fewest >= alone[0] and estimated >= alone[1], (fewest, estimated, alone)


def test_items_given_before_and_restated_under_fresh_ids_count_once():
    """vLLM's final output: every item given before again, under a fresh id; billed as the
    items were, not twice."""
    told = [_told("response.output_item.done", item_id, [text]) for item_id, text in zip("abc", _WORDS, strict=True)]
    restated = _final([_message(f"fresh-{item_id}", [text]) for item_id, text in zip("abc", _WORDS, strict=True)])
    assert _billed(*told, restated) == _billed(*told, _final([]))


# a model server's texts that are no strings: the SDKs hand them to the client as they came
UNSTRUNG = [["a" * 900] * 5, 12345678901234567890, {"k%d" % n: "v" * 40 for n in range(20)}]


@pytest.mark.parametrize("value", UNSTRUNG, ids=["an array", "a number", "an object"])
@pytest.mark.parametrize("kind", ["output_text", "function_call_arguments", "reasoning_text"])
def test_a_streamed_text_that_is_no_string_is_counted_as_the_client_gets_it(value, kind):
    """§4: the gateway counts what it relayed. A delta (and its done event's text) holding an
    array, a number or an object reached the client, and was billed as no token at all."""
    as_text = json.dumps(value, separators=(",", ":"))
    field = "arguments" if kind == "function_call_arguments" else "text"
    for pieces in ([{"type": f"response.{kind}.delta", "item_id": "m", "delta": value}],
                   [{"type": f"response.{kind}.done", "item_id": "m", field: value}],
                   [{"type": f"response.{kind}.delta", "item_id": "m", "delta": value},
                    {"type": f"response.{kind}.done", "item_id": "m", field: value}]):
        stream = b"".join(event(piece["type"], piece) for piece in pieces)
        out, relay = relayed(stream + event("response.completed", {"type": "response.completed",
                                                                   "response": {"status": "completed"}}))
        assert out == stream
        # as its text (as sent: escaped, as every delta is counted), and not twice when repeated whole
        expected = RESPONSES.estimate_completion({"output": [{"type": "message", "content": [{"text": as_text}]}]})
        as_sent = json.dumps(as_text)[1:-1]
        most = RESPONSES.estimate_completion({"output": [{"type": "message", "content": [{"text": as_sent}]}]})
        assert expected <= relay.relayed_tokens <= most + 1, (pieces, relay.relayed_tokens, expected, most)
        assert relay.fewest_tokens >= 1


@pytest.mark.parametrize("value", UNSTRUNG, ids=["an array", "a number", "an object"])
def test_a_buffered_answers_text_that_is_no_string_is_counted_as_the_client_gets_it(value):
    as_text = json.dumps(value, separators=(",", ":"))
    expected = RESPONSES.estimate_completion({"output": [{"type": "message", "content": [{"text": as_text}]}]})
    for item in ({"type": "message", "content": [{"type": "output_text", "text": value}]},
                 {"type": "function_call", "name": "f", "arguments": value}):
        answer = {"output": [item]}
        assert RESPONSES.estimate_completion(answer) >= expected, item
        assert RESPONSES.fewest_completion_tokens(answer) >= 1, item


BIG = "w" * 8000


@pytest.mark.parametrize("shape", [
    b'"delta":{"delta":"a","pad":"' + BIG.encode() + b'"}',
    b'"x":{"delta":"a"},"delta":["' + BIG.encode() + b'"]',
    b'"delta":"a","delta":["' + BIG.encode() + b'"]',
    b'"delta":NaN',
    b'"delta":' + b"9" * 8000,
], ids=["a delta within it", "a delta beside it", "the key twice", "NaN", "a long number"])
def test_a_delta_that_is_no_string_is_counted_beside_any_string_under_that_name(shape):
    """A delta event read without parsing counted the strings named `delta` it found: one beside
    or within an array or object delta hid it, and the client's 8 000 characters billed a token."""
    piece = b'data: {"type":"response.output_text.delta","item_id":"m",' + shape + b"}\n\n"
    out, relay = relayed(piece)
    assert out == piece
    expected = 1 if shape == b'"delta":NaN' else RESPONSES.estimate_completion({"output": [{"content": [{"text": BIG}]}]})
    assert relay.relayed_tokens >= expected


@pytest.mark.parametrize("data", [
    {"type": "response.output_text.done", "item_id": "m", "text": "Hello"},
    {"type": "response.created", "response": {"id": "resp_1", "status": "in_progress"}},
    {"type": "response.output_text.delta", "item_id": "m", "delta": ["Hel"]},
], ids=["a done event", "the response so far", "a delta read as JSON"])
def test_an_event_whose_data_opens_with_a_byte_order_mark_is_never_relayed(data):
    """A whole body may open with a byte order mark; an event's data may not: no SDK's reader
    takes it there (openai-python: JSONDecodeError, no APIError). Read leniently, such an event
    reached the client, and the stream it broke was billed as a success."""
    piece = b"event: " + data["type"].encode() + b"\ndata: \xef\xbb\xbf" + json.dumps(data).encode() + b"\n\n"
    out, relay = relayed(DELTA + piece + COMPLETED)
    assert out == DELTA and relay.failure and relay.final is None


@pytest.mark.parametrize("delta", ["", "delta"], ids=["empty", "the word"])
def test_a_string_delta_beside_an_unreadable_field_counts_as_the_string(delta):
    """A delta event is read as JSON only when a delta in it is no string: an empty delta, or
    the word "delta" as the text, beside logprobs no JSON reader here takes (-Infinity), billed
    the whole event as text (about 90 tokens for one)."""
    piece = (b'data: {"type":"response.output_text.delta","item_id":"m","delta":' + json.dumps(delta).encode()
             + b',"logprobs":[{"token":"x","logprob":-Infinity,"top_logprobs":[]}]}\n\n')
    out, relay = relayed(piece)
    assert out == piece and relay.relayed_tokens == (1 if delta else 0)


@pytest.mark.parametrize("beside", [b',"meta":{"delta":"' + b"word " * 200 + b'"}', b',"\\"delta":"' + b"word " * 200 + b'"'],
                         ids=["within another field", "a key that ends in it"])
def test_an_empty_delta_counts_nothing_whatever_other_strings_are_named_delta(beside):
    """The client's delta is the event's own: an empty one is no text, though a string under
    another `delta` key (nested, or a key spelled to end in it) was counted, 250 tokens."""
    piece = b'data: {"type":"response.output_text.delta","item_id":"m","delta":""' + beside + b"}\n\n"
    json.loads(piece[len(b"data: "):])  # JSON a client reads
    out, relay = relayed(piece)
    assert out == piece and relay.relayed_tokens == 0 and relay.fewest_tokens == 0
