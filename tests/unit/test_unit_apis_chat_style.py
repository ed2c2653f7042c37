"""kiln.apis.base and kiln.apis.chat: how chat and text completions are read, billed and ended
(contract §3, §4, §7), what a model without a capability is told (§3), and the defaults a new
endpoint's rules inherit."""

import json
from decimal import Decimal

import pytest

from kiln.apis.base import ModelApi, capability_check, stream_flag
from kiln.apis.chat import API as CHAT
from kiln.apis.completions import API as COMPLETIONS
from kiln.catalog import Capabilities, ModelEntry, Pricing
from kiln.errors import GatewayError, InvalidType, UnsupportedParameter
from kiln.metering import TokenUsage
from kiln.sse import DONE, SseRelay, error_event

COST = Decimal("0.000000665")
PLAIN = ModelEntry("plain", "kiln", 0, 4096, Pricing(Decimal(1), Decimal(1)))
CAPABLE = ModelEntry(
    "capable", "kiln", 0, 4096, Pricing(Decimal(1), Decimal(1)),
    capabilities=Capabilities(forced_tool_choice=True, json_response_format=True, ignore_eos=False),
)


def error_of(call):
    with pytest.raises(GatewayError) as info:
        call()
    return info.value.status, json.loads(info.value.body())["error"]


def test_each_endpoint_says_who_it_is_and_where_it_goes_upstream():
    assert (CHAT.name, CHAT.upstream_path) == ("chat.completions", "/chat/completions")
    assert (COMPLETIONS.name, COMPLETIONS.upstream_path) == ("completions", "/completions")
    assert CHAT.unfinished == COMPLETIONS.unfinished == "the stream ended before [DONE]"


# -- forwarding ----------------------------------------------------------------------------


def test_a_buffered_request_is_forwarded_as_sent_with_stream_a_boolean():
    body = {"model": "m", "messages": [], "stream": "false", "stream_options": "odd", "x": 1}
    forwarded, wants = CHAT.forward(body, False)
    assert forwarded == {**body, "stream": False} and wants is False
    assert CHAT.forward({"model": "m"}, False) == ({"model": "m"}, False)
    assert body["stream"] == "false"  # the client's body is not modified


@pytest.mark.parametrize(
    "options, wants",
    [(None, False), ({}, False), ({"include_usage": False}, False), ({"include_usage": True}, True),
     ({"include_usage": "true"}, True), ({"include_usage": "no"}, False), ({"include_usage": "maybe"}, False)],  # as vLLM reads it
)
def test_a_stream_always_asks_upstream_for_usage_and_remembers_whether_the_client_did(options, wants):
    body = {"model": "m", "stream": True, "stream_options": options, "x": 1}
    forwarded, client_wants = COMPLETIONS.forward(body, True)
    assert forwarded == {"model": "m", "stream": True, "stream_options": {**(options or {}), "include_usage": True}, "x": 1}
    assert client_wants is wants


def test_stream_options_of_another_type_are_refused_when_streaming():
    assert error_of(lambda: CHAT.forward({"stream_options": [1]}, True)) == (
        400,
        {
            "message": "Invalid type for 'stream_options': expected an object.",
            "type": "invalid_request_error",
            "param": "stream_options",
            "code": "invalid_type",
        },
    )


def test_stream_flag_refuses_what_is_not_a_boolean_with_the_contracts_message():
    for value in (2, "yes", None, 1.0, [True]):
        with pytest.raises(InvalidType) as info:
            stream_flag(value)
        assert info.value.param == "stream"
        assert info.value.message == "Invalid type for 'stream': expected a boolean (true/false, \"true\"/\"false\" or 1/0)."
    assert [stream_flag(v) for v in (True, "true", 1, False, "false", 0)] == [True, True, True, False, False, False]


# -- capabilities (contract §3, §9) -----------------------------------------------------------


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_forced_tool_choice_on_a_model_without_it_is_refused_with_the_way_out(choice):
    assert error_of(lambda: capability_check(PLAIN, choice, (None, "response_format"))) == (
        400,
        {
            "message": 'The model `plain` does not support forced tool choice; send tool_choice "auto" instead.',
            "type": "invalid_request_error",
            "param": "tool_choice",
            "code": "unsupported_parameter",
        },
    )
    capability_check(CAPABLE, choice, (None, "response_format"))


@pytest.mark.parametrize("choice", ["auto", "none", None, {"type": "auto"}, "function"])
def test_a_tool_choice_that_forces_nothing_is_no_forced_choice(choice):
    capability_check(PLAIN, choice, (None, "response_format"))


@pytest.mark.parametrize("kind", ["json_object", "json_schema", "structural_tag", "regex", "JSON_OBJECT"])
@pytest.mark.parametrize("param", ["response_format", "text.format"])
def test_structured_output_on_a_model_without_it_is_refused_naming_the_field(kind, param):
    """Any constrained format, not only the two the contract names: vLLM and SGLang serve more."""
    status, body = error_of(lambda: capability_check(PLAIN, "auto", ({"type": kind}, param)))
    assert status == 400 and body["param"] == param and body["code"] == "unsupported_parameter"
    assert body["message"] == (
        f"The model `plain` does not support {param} '{kind}'; ask for JSON in the prompt and validate it client-side."
    )
    capability_check(CAPABLE, "auto", ({"type": kind}, param))


@pytest.mark.parametrize("value", [{"type": "text"}, "json_object", {"kind": "json_object"}, {"type": 3}, None])
def test_plain_text_or_unreadable_formats_need_no_capability(value):
    """Plain text, or a format the model server itself refuses (no type it could serve)."""
    capability_check(PLAIN, None, (value, "response_format"))


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs", "structural_tag", "regex", "ebnf", "json_schema",
                                   "grammar"])
def test_a_model_servers_constrained_output_needs_the_json_capability(field):
    body = {"model": "plain", "messages": [{"role": "user", "content": "hi"}], field: {"type": "object"}}
    status, error = error_of(lambda: CHAT.check(body, PLAIN))
    assert (status, error["code"], error["param"]) == (400, "unsupported_parameter", field)
    assert error["message"].startswith(f"The model `plain` does not support constrained output ({field})")
    CHAT.check(body, CAPABLE)
    CHAT.check({**body, field: None}, PLAIN)


def test_ignore_eos_on_a_model_without_it_is_refused_with_the_contracts_message():
    body = {"model": "capable", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    assert error_of(lambda: CHAT.check(body, CAPABLE)) == (
        400,
        {
            "message": "The model `capable` does not support ignore_eos; remove it from the request.",
            "type": "invalid_request_error",
            "param": "ignore_eos",
            "code": "unsupported_parameter",
        },
    )
    CHAT.check({**body, "ignore_eos": False}, CAPABLE)
    CHAT.check(body, PLAIN)


def test_messages_and_tools_of_the_wrong_type_are_named_in_the_message():
    assert error_of(lambda: CHAT.check({"messages": "hi"}, PLAIN))[1]["message"] == (
        "Invalid type for 'messages': expected an array of messages."
    )
    status, body = error_of(lambda: CHAT.check({"messages": [], "tools": {"type": "function"}}, PLAIN))
    assert (status, body["param"], body["message"]) == (400, "tools", "Invalid type for 'tools': expected an array.")
    CHAT.check({"messages": [], "tools": None}, PLAIN)


def test_only_function_tools_need_a_description():
    tools = [
        {"type": "web_search"},
        "not an object",
        {"function": {"name": "f", "description": "does f"}},  # a tool's type defaults to function
        {"type": "function", "function": {"name": "g", "description": 7}},
    ]
    status, body = error_of(lambda: CHAT.check({"messages": [], "tools": tools}, PLAIN))
    assert (status, body["param"], body["code"]) == (400, "tools[3].function.description", "missing_required_parameter")
    assert body["message"] == (
        "Missing required parameter: 'tools[3].function.description'. Every function tool must say what it does."
    )
    status, body = error_of(lambda: CHAT.check({"messages": [], "tools": [{"type": "function"}]}, PLAIN))
    assert body["param"] == "tools[0].function.description"
    status, body = error_of(lambda: CHAT.check({"messages": [], "tools": [{"function": {"name": "f"}}]}, PLAIN))
    assert body["param"] == "tools[0].function.description"  # no type: a function tool
    CHAT.check({"messages": [], "tools": tools[:3]}, PLAIN)


def test_empty_messages_are_refused_before_anything_else():
    for body in ({}, {"messages": None}, {"messages": []}):
        status, error = error_of(lambda body=body: CHAT.check_before_model(body))
        assert (status, error["param"], error["code"]) == (400, "messages", "empty_array")
        assert error["message"] == "Invalid 'messages': the array must contain at least one message."
    COMPLETIONS.check_before_model({})
    COMPLETIONS.check({"messages": 3, "tools": 3, "tool_choice": "required"}, PLAIN)  # nothing checked


# -- a buffered answer -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer, problem",
    [
        ({"choices": {}}, "choices is not an array"),
        ({"choices": ["x"]}, "a choice is not an object"),
        ({"choices": [{"message": "x"}]}, "a message is not an object"),
        ({"choices": [{"message": {"tool_calls": {}}}]}, "tool_calls is not an array of objects"),
        ({"choices": [{"message": {"tool_calls": [{}, "x"]}}]}, "tool_calls is not an array of objects"),
        ({"choices": [{"message": {"tool_calls": [{"id": "1"}]}}, {"message": None}, {"text": "t"}]}, None),
        ({"choices": [{"message": {"content": "x", "tool_calls": None}}]}, None),
        ({"choices": [{"message": None}, {"message": "x"}]}, "a message is not an object"),
        ({}, None),
        ({"error": {"message": "overloaded"}}, "an error object, not a completion"),
        ({"object": "error", "message": "overloaded"}, "an error object, not a completion"),
        ({"choices": [{"message": {"content": "x"}}], "error": "cut"}, "an error object, not a completion"),
        ({"choices": [{"message": {"content": "x"}}], "error": None}, None),  # null: no error, as the SDKs read it
    ],
)
def test_a_chat_answer_is_readable_or_its_problem_named(answer, problem):
    assert CHAT.shape_problem(answer) == problem


def test_completion_tokens_are_estimated_from_every_text_of_every_choice():
    answer = {
        "choices": [
            {"message": {"content": "abcd" * 3, "reasoning_content": "abcdefgh"}},  # 3 + 2
            {"text": "abcde"},  # 2
            {"message": {"tool_calls": [{"function": {"arguments": '{"a": 1}'}}, {"function": "x"}, "y"]}},  # 2
            "not a choice",
            {"message": "not a message", "text": "abcd"},  # 1
        ]
    }
    assert CHAT.estimate_completion(answer) == 10
    assert CHAT.estimate_completion({"choices": {"text": "abcd"}}) == 0
    assert CHAT.estimate_completion({}) == 0
    # the fewest tokens it can be: one per non-empty text (the floor of reported usage)
    assert CHAT.fewest_completion_tokens(answer) == 5
    assert CHAT.fewest_completion_tokens({"choices": [{"message": {"content": ""}, "text": ""}]}) == 0


def test_the_billed_usage_goes_into_the_answer_with_its_cost():
    answer = {"usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "extra": 1}}
    CHAT.with_usage(answer, TokenUsage(5, 7), COST)
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "extra": 1, "cost": COST}
    for source in ("estimated", "capped"):
        answer = {"usage": {"prompt_tokens": 10**9, "completion_tokens": 7}}
        CHAT.with_usage(answer, TokenUsage(5, 7, 2, source), COST)
        assert answer["usage"] == {
            "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 2}, "cost": COST,
        }


@pytest.mark.parametrize(
    "answer, reason",
    [
        ({"choices": [{"finish_reason": "length"}, {"finish_reason": "stop"}]}, "length"),
        ({"choices": [{"finish_reason": None}]}, None),
        ({"choices": [{"finish_reason": 3}]}, None),
        ({"choices": ["stop"]}, None),
        ({"choices": []}, None),
        ({"choices": {"finish_reason": "stop"}}, None),
        ({}, None),
    ],
)
def test_the_finish_reason_is_the_first_choices(answer, reason):
    assert CHAT.finish_reason(answer) == reason


# -- the end of a stream ------------------------------------------------------------------------

HELLO = b'data: {"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
USAGE = (
    b'data: {"id":"c1","model":"m","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12,'
    b'"completion_tokens_details":{"reasoning_tokens":2}}}\n\n'
)


def relayed(*events, wants=True):
    relay = CHAT.relay(client_wants_usage=wants, max_event_bytes=1024)
    assert type(relay) is SseRelay
    for event in events:
        relay.feed(event)
    return relay


def chunk_of(event):
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    return json.loads(event[6:-2], parse_float=Decimal)


def test_a_client_that_did_not_ask_for_usage_gets_only_done():
    assert CHAT.stream_tail(relayed(HELLO, USAGE, wants=False), TokenUsage(5, 7), COST, False) == DONE


def test_a_believed_usage_chunk_goes_out_as_the_upstream_wrote_it_with_the_cost():
    tail = CHAT.stream_tail(relayed(HELLO, USAGE), TokenUsage(5, 7), COST, True)
    assert tail.endswith(b"\n\n" + DONE) and tail.count(DONE) == 1
    assert chunk_of(tail[: -len(DONE)]) == {
        "id": "c1",
        "model": "m",
        "choices": [],
        "usage": {
            "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "completion_tokens_details": {"reasoning_tokens": 2},
            "cost": COST,
        },
    }


def test_a_usage_the_gateway_did_not_believe_is_replaced_by_the_billed_one():
    tail = CHAT.stream_tail(relayed(HELLO, USAGE), TokenUsage(5, 3, None, "capped"), COST, True)
    assert chunk_of(tail[: -len(DONE)])["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "cost": COST}


def test_with_no_usage_chunk_the_gateway_writes_one_on_the_first_chunks_header():
    tail = CHAT.stream_tail(relayed(HELLO), TokenUsage(2, 1, None, "estimated"), COST, True)
    assert chunk_of(tail[: -len(DONE)]) == {
        "id": "c1", "model": "m", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3, "cost": COST},
    }
    # usage that rode on content chunks, believed: still a chunk of its own at the end
    riding = b'data: {"id":"c2","choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\n'
    tail = CHAT.stream_tail(relayed(riding), TokenUsage(2, 1), COST, True)
    assert chunk_of(tail[: -len(DONE)])["id"] == "c2"
    # nothing at all to copy a header from
    tail = CHAT.stream_tail(relayed(), TokenUsage(2, 0, None, "estimated"), COST, True)
    assert chunk_of(tail[: -len(DONE)]) == {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 0, "total_tokens": 2, "cost": COST}}


def test_a_failed_chat_stream_ends_with_the_error_event():
    relay = SseRelay(client_wants_usage=False)
    assert CHAT.stream_error("the model server went away", relay) == error_event("the model server went away")


@pytest.mark.parametrize("api,body", [
    (COMPLETIONS, {"prompt": "é" * 2000, "echo": True}),
    (CHAT, {"messages": [{"role": "assistant", "content": "é" * 2000}], "echo": True}),
])
def test_an_echo_s_first_event_is_bounded_by_the_model_s_bound_and_what_it_repeats(api, body):
    """A streamed completion with `echo` repeats its prompt in its first event: a prompt larger
    than the event bound was relayed as the error event, billed whole, and counted against the
    backend. The bound now takes in the request, as escaped (é written \\u00e9: three times its bytes)."""
    sent = len(json.dumps(body, ensure_ascii=False).encode())
    first = b'data: ' + json.dumps({"choices": [{"index": 0, "text": "é" * 2000}]}).encode() + b"\n\n"  # escaped
    assert len(first) > 2 * sent
    relay = api.relay(client_wants_usage=True, max_event_bytes=200, request_bytes=sent, echoes=api.echoes(body))
    assert relay.feed(first) == first
    with pytest.raises(Exception, match="over"):  # the bound stays a bound
        relay.feed(b"data: " + b"x" * (3 * sent + 201) + b"\n\n")
    unechoed = api.relay(client_wants_usage=True, max_event_bytes=200, request_bytes=sent,
                         echoes=api.echoes({**body, "echo": False}))
    with pytest.raises(Exception, match="over 200 bytes"):
        unechoed.feed(first)
    padded = {**body, "padding": "x" * 100_000}  # forwarded, never echoed: it raises no bound
    relay = api.relay(client_wants_usage=True, max_event_bytes=200, request_bytes=sent + 100_000,
                      echoes=api.echoes(padded))
    with pytest.raises(Exception, match=f"over {200 + 3 * len(('é' * 2000).encode())} bytes"):
        relay.feed(b"data: " + b"x" * 50_000 + b"\n\n")


def test_an_echo_of_token_ids_is_bounded_by_what_so_many_tokens_can_be_not_by_the_request():
    """A prompt of token ids comes back as text the gateway cannot know: its bound took in the
    whole request, so 5 MB of fields never echoed beside [1, 2, 3] let through a 5 MB event."""
    body = {"prompt": list(range(1000)), "echo": True}
    relay = COMPLETIONS.relay(client_wants_usage=True, max_event_bytes=200, request_bytes=5000,
                              echoes=COMPLETIONS.echoes(body))
    event = b"data: " + b"y" * 14_900 + b"\n\n"  # the request (5 000 bytes) escaped: the lesser
    assert relay.feed(event) == event
    padded = COMPLETIONS.relay(client_wants_usage=True, max_event_bytes=200, request_bytes=5_000_000,
                               echoes=COMPLETIONS.echoes({"prompt": [1, 2, 3], "echo": True}))
    with pytest.raises(Exception, match=f"over {200 + 3 * 3 * 128} bytes"):  # 3 ids of 128 bytes, escaped
        padded.feed(b"data: " + b"y" * 100_000 + b"\n\n")


# -- what a new endpoint inherits -------------------------------------------------------------


def test_a_new_endpoint_must_say_how_it_is_billed():
    api = ModelApi()
    assert api.reported_usage({"input_tokens": 1}) == {"input_tokens": 1}
    assert api.shape_problem({}) is None and api.finish_reason({"status": "done"}) is None
    assert api.forward({"model": "m", "stream": 1}, True) == ({"model": "m", "stream": True}, False)
    api.check_before_model({}), api.check({}, PLAIN)
    for call in (
        lambda: api.estimate_prompt({}),
        lambda: api.estimate_completion({}),
        lambda: api.fewest_completion_tokens({}),
        lambda: api.with_usage({}, TokenUsage(1, 1), COST),
        lambda: api.stream_tail(SseRelay(client_wants_usage=False), TokenUsage(1, 1), COST, False),
    ):
        with pytest.raises(NotImplementedError):
            call()
    assert api.stream_error("cut", SseRelay(client_wants_usage=False)) == error_event("cut")
    riding = b'data: {"choices":[{"delta":{"content":"x"}}],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    relay = api.relay(client_wants_usage=True, max_event_bytes=200)
    assert relay.feed(riding) == riding  # the client asked: its usage stays on the content
    relay = api.relay(client_wants_usage=False, max_event_bytes=200, request_bytes=10_000)
    assert json.loads(relay.feed(riding)[6:]) == {"choices": [{"delta": {"content": "x"}}]}
    with pytest.raises(Exception, match="over 200 bytes"):  # its events echo no request: the model's bound
        relay.feed(b"data: " + b"x" * 300 + b"\n\n")


def test_the_prompt_of_each_endpoint_is_estimated_from_its_own_field():
    body = {"messages": [{"role": "user", "content": "abcdefgh"}], "prompt": "abcdefghijklmnop"}
    assert CHAT.estimate_prompt(body) == 3 + 3  # "user" + "abcdefgh"
    assert COMPLETIONS.estimate_prompt(body) == 4


LONG = "x" * 1000  # at least 8 tokens


@pytest.mark.parametrize(("messages", "fewest"), [
    ([{"role": "system", "content": LONG}, {"role": "user", "content": [{"type": "text", "text": LONG}]}], 16),
    # an image's data, a tool call's arguments, an odd message: no text to count
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:," + LONG}}]},
      {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": LONG}}]},
      "odd", 5, None, {"content": {"text": LONG}}], 0),
    ([{"role": "user", "content": "hi"}], 1),
    # what the model wrote before, which its template may drop (its reasoning, in Qwen3's)
    ([{"role": "assistant", "content": LONG}, {"role": "user", "content": ["hi", LONG]}], 1 + 8),
    # blanks a template may trim, or a tokenizer hold in few tokens: one character a run
    ([{"role": "user", "content": "\n" * 5000 + "hi" + " " * 5000 + "there" + "\t" * 5000}], 1),
    ([{"role": "user", "content": " " * 5000}], 0),
])
def test_a_chat_prompt_is_at_least_its_texts_fewest_tokens(messages, fewest):
    assert CHAT.fewest_prompt_tokens({"messages": messages}) == fewest


@pytest.mark.parametrize(("prompt", "fewest"), [
    (LONG, 8), ([LONG, LONG], 16), ([7] * 300, 300), ([[7] * 300, [8] * 200], 500),
    ([True, 1.5, "ab", None, {"x": LONG}], 1), (None, 0), ({"text": LONG}, 0),
])
def test_a_text_prompt_is_at_least_its_texts_and_a_token_per_id(prompt, fewest):
    assert COMPLETIONS.fewest_prompt_tokens({"prompt": prompt}) == fewest


@pytest.mark.parametrize("field", [{"truncate_prompt_tokens": 1}, {"truncate_prompt_tokens": -1},
                                   {"truncate_prompt_tokens": "x"}, {"chat_template": "{{ 'hi' }}"}])
def test_a_prompt_the_server_may_shorten_has_no_floor(field):
    body = {"messages": [{"role": "user", "content": LONG}], "prompt": LONG, **field}
    assert CHAT.fewest_prompt_tokens(body) == 0
    assert COMPLETIONS.fewest_prompt_tokens(body) == (8 if "chat_template" in field else 0)


def test_unsupported_parameter_is_what_a_missing_capability_raises():
    with pytest.raises(UnsupportedParameter):
        capability_check(PLAIN, "required", (None, "response_format"))


def test_a_completion_may_echo_its_prompts_and_a_chat_reply_its_last_message():
    def texts(api, body):
        echoes = api.echoes(body)
        return echoes._texts if echoes else ()

    assert texts(COMPLETIONS, {"prompt": LONG}) == ()
    assert texts(COMPLETIONS, {"prompt": LONG, "echo": False}) == ()
    assert texts(COMPLETIONS, {"prompt": LONG, "echo": "true"}) == (LONG,)
    # a batch's prompts in their places (choice i echoes prompt i // n): token ids echo no text
    assert texts(COMPLETIONS, {"prompt": [LONG, "ab", [1, 2], 5], "echo": 1}) == (LONG, "ab", "", "")
    assert texts(COMPLETIONS, {"prompt": [1, 2, 3], "echo": True}) == ()  # token ids: text it cannot know
    assert texts(COMPLETIONS, {"prompt": {"x": 1}, "echo": True}) == ()
    # what the texts of choices echoing token ids may hold of them: each choice that comes, its
    # own prompt's ids, at most what its own texts count
    def unseen(body, choices):
        echoes = COMPLETIONS.echoes(body)
        echoes.answer({"choices": [{"index": index, "text": text} for index, text in choices]})
        return echoes.unseen_floor, echoes.unseen_count

    long = "w" * 1280  # 10 tokens at the fewest, 320 by the estimate
    assert unseen({"prompt": [1, 2, 3], "echo": True, "n": "2"}, [(0, long), (1, long)]) == (6, 6)
    assert unseen({"prompt": [1, 2, 3], "echo": True, "n": 100}, [(5, long)]) == (3, 3)  # one choice came
    assert unseen({"prompt": list(range(50)), "echo": True}, [(0, long)]) == (10, 50)  # no more than it holds
    assert unseen({"prompt": [[1, 2], [3], "ab"], "echo": True, "n": 2}, [(2, long), (4, long)]) == (1, 1)
    assert unseen({"prompt": [1, 2, 3], "n": 2}, [(0, long)]) == (0, 0)  # no echo
    assert unseen({"prompt": ["ab", True, 1.0], "echo": True}, [(0, long), (1, long)]) == (0, 0)
    continued = [{"role": "user", "content": "go on"}, {"role": "assistant", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert texts(CHAT, {"messages": continued, "echo": True}) == ("a\nb", "ab")
    assert texts(CHAT, {"messages": continued}) == ()
    # the last message echoes when it has the reply's role: any, without a generation prompt
    assert texts(CHAT, {"messages": continued[:1], "echo": True}) == ()
    assert texts(CHAT, {"messages": continued[:1], "echo": True, "add_generation_prompt": False}) == ("go on",)
    assert texts(CHAT, {"messages": "x", "echo": True}) == ()
