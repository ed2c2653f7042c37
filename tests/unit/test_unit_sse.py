"""kiln.sse: the SSE relay (contract §3 stream_options, §4 relayed tokens, §5 error event, §7)."""

import contextlib
import json
import re
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln import sse
from kiln.metering import TokenUsage, UsageBounds, billable_usage
from kiln.sse import KEEPALIVE, EventTooLarge, SseRelay, error_event, usage_event

ROLE = b'data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}\n\n'
HELLO = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
THINK = b'data: {"id":"c1","choices":[{"index":0,"delta":{"reasoning_content":"hmm"},"finish_reason":null}]}\n\n'
STOP = b'data: {"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
USAGE = b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12}}\n\n'
DONE = b"data: [DONE]\n\n"
COMMENT = b": keepalive\n\n"
STREAM = ROLE + COMMENT + THINK + HELLO + STOP + USAGE + DONE
CONTENT = ROLE + COMMENT + THINK + HELLO + STOP  # what a client that did not ask for usage gets


def relay_all(chunks, wants_usage=False):
    relay = SseRelay(client_wants_usage=wants_usage)
    out = b"".join(relay.feed(chunk) for chunk in chunks)
    return out, relay


def state(relay):
    # leftover is compared without whitespace: stray blank-line bytes after the last event are harmless
    return relay.done, relay.usage, relay.usage_chunk, relay.relayed_tokens, relay.finish_reason, relay.leftover().strip()


@pytest.mark.parametrize("wants_usage", [False, True])
def test_full_stream(wants_usage):
    out, relay = relay_all([STREAM], wants_usage)
    assert out == CONTENT  # usage chunk held back, [DONE] swallowed, the rest byte-identical
    assert relay.done is True
    assert relay.usage == TokenUsage(5, 7)
    assert relay.usage_chunk == json.loads(USAGE[6:])
    assert relay.finish_reason == "stop"
    assert relay.relayed_tokens == 2  # "hmm" and "Hel"; the empty role delta does not count
    assert relay.first_chunk["id"] == "c1"


@pytest.mark.parametrize(
    "event",
    [
        b'data:{"choices":[{"delta":{"content":"x"}}]}\n\n',
        b'data:    {"choices":[{"delta":{"content":"x"}}]}\n\n',
        b'data: { "choices" : [ { "delta" : { "content" : "x" } , "finish_reason" : null } ] }\n\n',
        b'data: {"choices":[{"delta":{"content":"caf\xc3\xa9 \\u00e9 \\"usage\\": 1"}}]}\n\n',
        b'event: chunk\ndata: {"choices":[{"delta":{"content":"x"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n',
    ],
)
def test_content_event_passes_byte_identical(event):
    out, relay = relay_all([event])
    assert out == event
    assert relay.relayed_texts == 1


# Regression: at dff3098, '"usage": null' (with a space) let \s* backtrack past (?!null) in
# _USAGE_PRESENT, and the content chunk was re-serialized with its usage key removed.
def test_content_event_with_spaced_null_usage_passes_byte_identical():
    event = b'data: {"choices": [{"delta": {"content": "x"}, "finish_reason": null}], "usage": null}\n\n'
    assert relay_all([event])[0] == event


def test_events_after_done_are_dropped():
    out, relay = relay_all([HELLO + DONE + HELLO])
    assert out == HELLO and relay.done


@pytest.mark.parametrize("wants_usage", [False, True])
def test_usage_chunk_without_choices_key_is_held_back(wants_usage):
    chunk = b'data: {"id":"c1","usage":{"prompt_tokens":3,"completion_tokens":4}}\n\n'
    out, relay = relay_all([HELLO + chunk], wants_usage)
    assert out == HELLO
    assert relay.usage == TokenUsage(3, 4)


def test_usage_on_content_chunk_stripped_when_client_did_not_ask():
    event = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":2,"completion_tokens":1}}\n\n'
    out, relay = relay_all([event], wants_usage=False)
    assert out.startswith(b"data: ") and out.endswith(b"\n\n")
    forwarded = json.loads(out[6:])
    expected = json.loads(event[6:])
    del expected["usage"]
    assert forwarded == expected
    assert relay.usage == TokenUsage(2, 1)
    assert relay.relayed_tokens == 1 and relay.finish_reason == "length"
    assert relay_all([event], wants_usage=True)[0] == event


def test_crlf_and_cr_line_endings_give_the_lf_output():
    expected, lf = relay_all([STREAM])
    for ending in (b"\r\n", b"\r"):
        out, relay = relay_all([STREAM.replace(b"\n", ending)])
        assert out == expected
        assert state(relay) == state(lf)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_every_split_point_gives_the_same_output(ending):
    stream = STREAM.replace(b"\n", ending)
    whole, reference = relay_all([stream])
    for cut in range(1, len(stream)):
        out, relay = relay_all([stream[:cut], stream[cut:]])
        assert out == whole, cut
        assert state(relay) == state(reference), cut
    assert relay_all([stream[i : i + 1] for i in range(len(stream))])[0] == whole


# Regression: at dff3098, feed() turned a chunk-final \r into \n before the \n of the same CRLF
# arrived, so an event split between \r and \n became two events.
def test_multi_line_crlf_event_split_between_cr_and_lf():
    stream = b'event: message\r\ndata: {"choices":[{"delta":{"content":"a"}}]}\r\n\r\n'
    whole = relay_all([stream])[0]
    cut = stream.index(b"\r\n") + 1
    assert relay_all([stream[:cut], stream[cut:]])[0] == whole


def test_each_non_empty_text_delta_is_relayed_text_and_at_least_a_token():
    events = [
        b'data: {"choices":[{"delta":{"content":null,"tool_calls":[{"function":{"arguments":"{\\"a\\""}}]}}]}\n\n',
        b'data: {"choices":[{"text":"once","finish_reason":null}]}\n\n',  # /v1/completions
        b'data: {"choices":[{"delta":{"reasoning":"r"}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":""}}]}\n\n',
        b'data: {"choices":[{"delta":{"content":null}}]}\n\n',
    ]
    relay = relay_all(events)[1]
    assert relay.relayed_texts == 3
    assert relay.relayed_tokens == 3  # each text no longer than a token: one each


@pytest.mark.parametrize(("length", "tokens"), [(1, 1), (16, 1), (17, 5), (4000, 1000)])
def test_a_text_delta_longer_than_a_token_counts_a_token_per_4_bytes_of_it(length, tokens):
    """A model server that sends its whole answer in one delta (and no usage) is billed for it,
    as the same answer buffered would be: not 1 token for 4 000 characters."""
    event = b'data: {"choices":[{"delta":{"content":"' + b"x" * length + b'"}}]}\n\n'
    relay = relay_all([event, DONE])[1]
    assert (relay.relayed_texts, relay.relayed_tokens) == (1, tokens)


@pytest.mark.parametrize("length", [1, 2, 15, 16, 17, 127, 128, 129, 300])
@pytest.mark.parametrize("texts_a_chunk", [1, 2])
def test_every_chunks_texts_count_as_tokens_and_as_a_floor_by_their_length(length, texts_a_chunk):
    """A text no longer than a token (16 bytes) counts one token and one at fewest; a longer one
    4 bytes a token, and at fewest a token per 128 bytes: whether a chunk holds one text (as
    nearly every chunk does) or more, and whether it is the stream's first chunk or a later one."""
    text = "y" * length
    delta = {"content": text, "reasoning": text} if texts_a_chunk == 2 else {"content": text}
    event = b"data: " + json.dumps({"choices": [{"delta": delta}]}).encode() + b"\n\n"
    relay = relay_all([event, event, event, DONE])[1]
    texts = 3 * texts_a_chunk
    tokens = 1 if length <= 16 else -(-length // 4)
    assert (relay.relayed_texts, relay.relayed_bytes) == (texts, texts * length)
    assert (relay.relayed_tokens, relay.fewest_tokens) == (texts * tokens, texts * -(-length // 128))


X = "abcdefghij" * 64  # 640 characters: 160 tokens estimated
TWICE_SHOWN = {
    # one choice's reasoning under two names is shown once (the SDKs' delta has both fields)
    "both-names": ([{"reasoning": X, "reasoning_content": X}], 1),
    "details": ([{"reasoning": X, "reasoning_details": [{"type": "reasoning.text", "text": X}]}], 1),
    "three-names": ([{"reasoning": X, "reasoning_content": X, "reasoning_details": [{"text": X}]}], 1),
    # the same text as reasoning and as a content part, or in two choices, is shown twice
    "reasoning-and-content-part": ([{"reasoning": X, "content": [{"type": "text", "text": X}]}], 2),
    "reasoning-and-content-object": ([{"reasoning": X, "content": {"type": "text", "text": X}}], 2),
    "two-choices-one-name-each": ([{"reasoning": X}, {"reasoning_content": X}], 2),
    "two-choices-both-names": ([{"reasoning": X, "reasoning_content": X}, {"reasoning": X, "reasoning_content": X}], 2),
    "reasoning-and-another-choices-part": ([{"reasoning": X}, {"content": [{"type": "text", "text": X}]}], 2),
    "different-texts": ([{"reasoning": X, "reasoning_content": X[::-1]}], 2),
}


@pytest.mark.parametrize("case", sorted(TWICE_SHOWN))
@pytest.mark.parametrize("escaped", [False, True], ids=["as-sent", "with-an-escape"])
def test_reasoning_under_several_names_counts_once_a_choice_and_every_other_text_counts(case, escaped):
    deltas, shown = TWICE_SHOWN[case]
    chunk = {"id": "c1", "choices": [{"index": k, "delta": delta} for k, delta in enumerate(deltas)]}
    if escaped:
        chunk["id"] = "c\u0031"
    event = b"data: " + json.dumps(chunk).encode().replace(b"c\\\\u0031", b"c\\u0031") + b"\n\n"
    relay = relay_all([ROLE, event])[1]
    assert relay.relayed_tokens == shown * 160


@pytest.mark.parametrize("delta", [
    {"content": [{"type": "text", "text": [X]}]},
    {"content": {"type": "text", "text": [X]}},
    {"reasoning_details": [{"type": "reasoning.text", "text": [X]}]},
    {"content": [[X]]},
], ids=["part-text-array", "object-text-array", "detail-text-array", "nested-array"])
def test_text_in_an_array_inside_a_part_or_a_detail_is_counted(delta):
    """What the SDKs hand the client, however deep a broken server puts it: 640 characters."""
    chunk = {"id": "c1", "choices": [{"index": 0, "delta": delta}]}
    relay = relay_all([ROLE, b"data: " + json.dumps(chunk).encode() + b"\n\n"])[1]
    assert relay.relayed_tokens == 160


def _named(name: str, arguments: str, *, choice: int = 0, call: int = 0) -> bytes:
    chunk = {"choices": [{"index": choice, "delta": {"tool_calls": [{"index": call, "function": {
        "name": name, "arguments": arguments}}]}, "finish_reason": None}]}
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def test_a_tool_call_name_sent_again_in_every_chunk_counts_once_for_its_call():
    """vLLM 0.6-0.7 with a named tool_choice repeats the name in every chunk: what a client
    that leaves pays (the relayed count) holds it once, and so does the floor; another call,
    another choice, or another name for the same call (a server that streams it in pieces) counts."""
    name = "get_current_weather_forecast"  # 28 bytes: 7 tokens
    relay = relay_all([_named(name, piece) for piece in ['{"', "city", '":"', "Paris", '"}']])[1]
    assert (relay.relayed_tokens, relay.fewest_tokens) == (5 + 7, 5 + 1)
    relay = relay_all([_named(name, "{}"), _named(name, "{}", call=1), _named(name, "{}", choice=1),
                       _named("get_", ""), _named("weather", "")])[1]
    assert relay.relayed_tokens == 3 * (1 + 7) + 1 + 1


def test_a_tool_call_name_under_a_key_spelled_with_an_escape_is_counted():
    chunk = b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"\\u006eame":"' + \
        b"f" * 400 + b'"}}]}}]}\n\n'
    assert relay_all([chunk])[1].fewest_tokens == 400 // 128 + 1


def test_finish_reason_is_the_last_one_seen():
    first = b'data: {"choices":[{"delta":{},"finish_reason":"tool_calls"}]}\n\n'
    assert relay_all([HELLO, first])[1].finish_reason == "tool_calls"
    assert relay_all([HELLO])[1].finish_reason is None


def test_comments_and_unparsable_data_pass_through():
    events = COMMENT + b": upstream ping\n\n" + b"data: not json\n\n"
    assert relay_all([events])[0] == events


def test_unfinished_event_is_kept_as_leftover():
    out, relay = relay_all([HELLO + b'data: {"choices":[{"delta":{"con'])
    assert out == HELLO
    assert relay.leftover() == b'data: {"choices":[{"delta":{"con'


def test_error_event_shape():
    event = error_event('upstream "died"\nmid-stream')
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert b"\n" not in event[:-2]  # one data line, whatever the message
    assert json.loads(event[6:]) == {
        "error": {"message": 'upstream "died"\nmid-stream', "type": "server_error", "param": None, "code": "upstream_error"}
    }


def test_usage_event_has_no_choices_and_exact_cost():
    template = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [{"delta": {"content": "x"}}]}
    event = usage_event(template, {"prompt_tokens": 5, "completion_tokens": 7, "cost": Decimal("0.000000665")})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert b'"cost":0.000000665' in event
    chunk = json.loads(event[6:], parse_float=Decimal)
    assert chunk["choices"] == [] and chunk["id"] == "c1" and chunk["model"] == "m"
    assert chunk["usage"]["cost"] == Decimal("0.000000665")
    assert template["choices"]  # the template is not modified


# -- bounds and linear cost (contract §5) -------------------------------------------------


def fed_in_pieces(relay, data, piece=4096):
    return b"".join(relay.feed(data[i : i + piece]) for i in range(0, len(data), piece))


@pytest.mark.parametrize("shape", ["unterminated", "events"])
def test_relay_work_grows_linearly_with_the_bytes_fed_in_small_pieces(shape):
    # Regression: the relay re-scanned its whole pending buffer on every read, so an event
    # without a blank line cost time quadratic in its size (50 MB: 12 s of CPU).
    def work(size):
        relay = SseRelay(client_wants_usage=False, max_event_bytes=64 * 1024 * 1024)
        if shape == "unterminated":
            data = b"data: " + b"a" * size
        else:
            data = HELLO * (size // len(HELLO))
        fed_in_pieces(relay, data)
        return relay.bytes_scanned / len(data)

    small, large = work(1024 * 1024), work(8 * 1024 * 1024)
    assert large <= small * 1.05  # per byte, 8 MB cost what 1 MB did
    assert large <= 4  # each byte is touched a few times, not once per read


def test_an_event_over_the_bound_without_a_blank_line_ends_the_relay_and_frees_it():
    relay = SseRelay(client_wants_usage=False, max_event_bytes=64 * 1024)
    assert relay.feed(HELLO) == HELLO
    with pytest.raises(EventTooLarge):
        fed_in_pieces(relay, b"data: " + b"a" * (65 * 1024))
    assert relay.leftover() == b""  # nothing of it is kept


def test_a_whole_event_over_the_bound_in_one_piece_is_refused_too():
    relay = SseRelay(client_wants_usage=False, max_event_bytes=1024)
    with pytest.raises(EventTooLarge):
        relay.feed(b"data: " + b"a" * 2048 + b"\n\n")


def test_an_event_just_under_the_bound_passes_whatever_the_pieces():
    event = b'data: {"choices":[{"delta":{"content":"' + b"x" * 1000 + b'"}}]}\n\n'
    relay = SseRelay(client_wants_usage=False, max_event_bytes=len(event))
    assert fed_in_pieces(relay, event + event, piece=7) == event + event


@pytest.mark.parametrize("error", [
    b'{"error":{"object":"error","message":"boom","type":"BadRequestError","code":400}}',  # vLLM
    b'{"object":"error","message":"boom","type":"InternalServerError","code":500}',
    b'{"\\u0065rror":{"message":"boom"}}',
    # a chunk with an error beside its choices: the OpenAI SDKs raise on any `error` not null or false
    b'{"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"x"}}],"error":{"soft":1}}',
    b'{"id":"c1","choices":[],"error":"boom"}',
    # JavaScript holds an empty object or array true: the Node SDK raises on them
    b'{"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}],"error":{}}',
    b'{"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}],"error":[]}',
])
def test_an_error_the_upstream_sends_in_the_stream_ends_it_unrelayed(error):
    out, relay = relay_all([ROLE + HELLO + b"data: " + error + b"\n\n" + HELLO + DONE])
    assert out == ROLE + HELLO and relay.done and relay.failure


@pytest.mark.parametrize("chunk", [
    b'{"id":"c1","choices":[{"index":0,"delta":{"content":"{\\"error\\": {\\"x\\": 1}}"},"finish_reason":null}]}',
    b'{"id":"c1","choices":[{"index":0,"delta":{"content":"caf\\u00e9"},"finish_reason":null}]}',
    # an error that is null, false, 0 or "": no error to either SDK
    b'{"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}],"error":null}',
    b'{"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}],"error":false}',
    b'{"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}],"error":0}',
    b'{"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}],"error":""}',
])
def test_content_that_only_mentions_an_error_is_relayed(chunk):
    event = b"data: " + chunk + b"\n\n"
    out, relay = relay_all([ROLE + event + DONE])
    assert out == ROLE + event and relay.done and relay.failure is None


def _usage_of(completion: int) -> bytes:
    return (b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":%d,"total_tokens":%d}}\n\n'
            % (completion, completion + 5))


def _billed(relay: SseRelay) -> TokenUsage:
    return billable_usage(relay.reported_usage, UsageBounds(10_000, 100_000), prompt_estimate=lambda: 5,
                          completion_count=lambda: relay.relayed_tokens, completion_floor=relay.fewest_tokens)[0]


LONG_NAME = "x" * 25_000


@pytest.mark.parametrize("extra", [b',"x":NaN', b',"x":1e999', b',"x":' + b"[" * 201 + b"]" * 201],
                         ids=["NaN", "1e999", "depth-201"])
def test_a_name_in_a_chunk_the_gateway_cannot_read_is_still_a_floor(extra):
    """Clients read such a chunk (the SDK reads NaN and 1e999; any parser reads 201 levels):
    its names are counted as sent, and a 1-token report for 25 000 characters is refused."""
    chunk = (b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c1","type":"function",'
             b'"function":{"name":"' + LONG_NAME.encode() + b'","arguments":"{}"}}]}}]' + extra + b"}\n\n")
    out, relay = relay_all([chunk, _usage_of(1), DONE])
    assert LONG_NAME.encode() in out
    assert _billed(relay).completion_tokens >= len(LONG_NAME) // 128


def test_a_name_with_a_lone_surrogate_escape_is_relayed_and_counted():
    chunk = (b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":'
             b'{"name":"get_\\ud83d","arguments":"{}"}}]}}]}\n\n')
    out, relay = relay_all([chunk, _usage_of(3), DONE])
    assert out == chunk and relay.fewest_tokens >= 2


def test_the_names_remembered_do_not_hold_the_names_themselves():
    """A hostile server's 10 000 calls of 1 MiB names must not stay in memory for the stream."""
    import tracemalloc

    relay = SseRelay(client_wants_usage=False)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for call in range(40):
            relay.feed(b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":%d,"function":'
                       b'{"name":"%s"}}]}}]}\n\n' % (call, b"n" * 900_000))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 4 * 1024 * 1024, f"{held / 1e6:.1f} MB held by the relay after the events"


def test_a_name_of_one_of_the_requests_tools_is_not_the_models_to_count():
    """vLLM writes the name itself for a named tool_choice: a call cut at the context (no end
    token, completion_tokens the argument deltas alone) is believed; a name the request did not
    offer is text the model wrote."""
    name = "get_current_weather_forecast"
    pieces = ['{"', "city", '":"', "Paris", ",", " France", '"']
    chunks = [b"data: " + json.dumps({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "name": name, "arguments": piece}}]}, "finish_reason": None}]}).encode() + b"\n\n" for piece in pieces]
    stop = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}\n\n'
    relay = SseRelay(client_wants_usage=False, offered={name, "other"})
    for chunk in [*chunks, stop, _usage_of(len(pieces)), DONE]:
        relay.feed(chunk)
    assert (_billed(relay).source, _billed(relay).completion_tokens) == ("upstream", len(pieces))
    unoffered = SseRelay(client_wants_usage=False, offered={"other"})
    for chunk in chunks:
        unoffered.feed(chunk)
    assert unoffered.fewest_tokens == len(pieces) + 1


# -- content chunks taken as sent ------------------------------------------------------------------

_TEXTS = ["Hel", "lo", "", " ", "a" * 40, 'q\\"uote', "line\\nend", "é", "\\u0041", "[DONE]", "usage", "name"]
_EVENT_PARTS = [
    ROLE, HELLO, THINK, STOP, USAGE, DONE, COMMENT, b"data: not json\n\n", b"\n", b"event: x\ndata: {}\n\n",
    b"data:   \n\n", b"data: \t\x0c\n\n", b'data: {"choices":[{"delta":{"content":"y"}}]} \t\n\n',  # blank data, blanks after
    b'data: {"choices":[{"delta":{"content":"\xc3\xa9"}}]}\n\n', b'data: {"choices":[{"delta":{"content":"\xff"}}]}\n\n',
    b"data:\n\n", b"id: 7\n\n", b"retry: 10\n\n", b"event: ping\n", b": a comment", b'data: {"choices":[{"delta":',
    b'data: {"choices":[{"delta":{"content":"z"}}]}\nx',  # a line, then one more byte: no blank line yet
    b'data: {"choices":[{"delta":{"content":"a\rb"}}]}\n\n', b'data: {"choices":[{"delta":{"content":"cr"}}]}\r\n\r',
    b'data: {"choices":[{"delta":{"content":"' + b"x" * 5000 + b'"}}]}\n\n',  # over the tests' bound of 4096
    b'data: {"choices":[{"delta":{"content":"unterminated\n\n', b'data: x"}]}\n\n',
    b'data: {"choices":[{"delta":{},"finish_reason":"len\n\n', b'data: gth"}]}\n\n',
    b'data: {"error":{"message":"boom"}}\n\n', b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"name":"f"}}]}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"x"}}],"usage":null}\n\n', b"data:{\"choices\":[]}\n\n",
    # reasoning under two names, alike or not; text in shapes other than a string; logprobs' array
    b'data: {"choices":[{"delta":{"reasoning":"r","reasoning_content":"r"}}]}\n\n',
    b'data: {"choices":[{"delta":{"reasoning":"r","reasoning_content":"s"}}]}\n\n',
    b'data: {"choices":[{"delta":{"reasoning":"r","reasoning_details":[{"text":"r"}]}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":["a","bc",7]}}]}\n\n', b'data: {"choices":[{"delta":{"content":12}}]}\n\n',
    b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":{"k":"v"}}}]}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":"w"},"logprobs":{"content":[{"token":"w"}]}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":[{"type":"text","text":"p"}]}}]}\n\n',
    b'data: {"choices":[{"delta":{"content":[{"type":"text","text":["q","r"]}]}}]}\n\n',
    b'data: {"choices":[{"delta":{"reasoning_details":[{"type":"reasoning.text","text":["s"]}]}}]}\n\n',
]


def _content(text: str, finish: str | None = None) -> bytes:
    reason = "null" if finish is None else f'"{finish}"'
    return b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"' + text.encode() + b'"},"finish_reason":' + \
        reason.encode() + b"}]}\n\n"


_ALL_EVENTS = st.one_of(
    st.sampled_from(_EVENT_PARTS),
    st.builds(_content, st.sampled_from(_TEXTS), st.one_of(st.none(), st.sampled_from(["stop", "length", "a\nb"]))),
)


def relayed_reads(chunks: list[bytes], wants_usage: bool) -> tuple:
    """What a relay fed `chunks` sends on, and what it counted."""
    relay, out = SseRelay(client_wants_usage=wants_usage, max_event_bytes=4096), []
    try:
        for chunk in chunks:
            out.append(relay.feed(chunk))
    except EventTooLarge as exc:  # what came before the event over the bound is relayed, then the error
        out.append(exc.relayed + b"too large")
    return b"".join(out), (state(relay), relay.relayed_texts, relay.relayed_bytes, relay.text_fewest,
                           relay.text_tokens, relay.failure, relay.first_chunk)


@contextlib.contextmanager
def every_event_read_in_full():
    """The relay with no event taken as sent: each read as `_event` reads it."""
    taken_as_sent = sse.reads_further
    sse.reads_further = lambda event: True
    try:
        yield
    finally:
        sse.reads_further = taken_as_sent


@settings(max_examples=300, deadline=None)
@given(events=st.lists(_ALL_EVENTS, max_size=12), wants_usage=st.booleans(), cuts=st.lists(st.integers(0, 2000)))
def test_content_chunks_relayed_and_counted_as_sent_are_what_reading_each_gives(events, wants_usage, cuts):
    """The relay takes most content chunks as sent, without reading their JSON: whatever the
    stream (hostile events included) and however it is cut into reads, that relays and counts
    what reading every event in full does."""

    stream = b"".join(events)
    with every_event_read_in_full():
        reference = relayed_reads([stream], wants_usage)
    assert relayed_reads([stream], wants_usage) == reference
    points = sorted({min(cut, len(stream)) for cut in cuts} | {0, len(stream)})
    assert relayed_reads([stream[a:b] for a, b in zip(points, points[1:], strict=False)], wants_usage) == reference


@settings(max_examples=500, deadline=None)
@given(events=st.lists(_ALL_EVENTS, max_size=12), wants_usage=st.booleans())
def test_a_stream_read_an_event_at_a_time_is_relayed_and_counted_as_read_whole(events, wants_usage):
    """A read that is one whole event (a model server's every read, nearly) is taken by its own
    short way: what it relays and counts is what the general way gives the same stream read
    whole, and what reading every event in full gives."""

    with every_event_read_in_full():
        reference = relayed_reads(events, wants_usage)
    assert relayed_reads(events, wants_usage) == relayed_reads([b"".join(events)], wants_usage) == reference


@pytest.mark.parametrize("end", [DONE, b'data: {"error":{"message":"boom"}}\n\n'], ids=["done", "error"])
def test_an_event_over_the_bound_after_the_streams_end_in_the_same_read_changes_nothing(end):
    """After [DONE] (or the upstream's error) nothing counts: an event over the bound in the same
    read did end a finished stream as too large, where in a read of its own it was ignored."""
    big = b'data: {"choices":[{"delta":{"content":"' + b"x" * 5000 + b'"}}]}\n\n'
    relay = SseRelay(client_wants_usage=False, max_event_bytes=4096)
    out = relay.feed(ROLE + HELLO + end + big)
    assert out == ROLE + HELLO and relay.done and relay.relayed_texts == 1
    assert relay.failure == (None if end == DONE else "the model server sent an error in the stream")


@pytest.mark.parametrize("name", [b"event: error", b"event:error"])
@pytest.mark.parametrize("data", [HELLO.strip(), b'data: {"message":"the prompt was: secret"}', b""])
def test_an_event_named_error_ends_the_stream_unrelayed_whatever_its_data(name, data):
    """The Node SDK raises on an event named `error` on any stream: it is the upstream's failure,
    and its text (which may quote the prompt) is not the client's to see."""
    event = name + (b"\n" + data if data else b"") + b"\n\n"
    out, relay = relay_all([ROLE + HELLO + event + HELLO + DONE])
    assert out == ROLE + HELLO and relay.done and relay.failure


def test_events_named_otherwise_are_relayed_as_sent():
    event = b"event: message\n" + HELLO
    out, relay = relay_all([ROLE + event + DONE])
    assert out == ROLE + event and relay.failure is None


@pytest.mark.parametrize("fields", [b"id: 7\n", b"id:7\n", b"id\n", b"retry: 3000\n", b"id: 1\nretry: 10\n"])
def test_the_upstreams_stream_fields_are_not_relayed_so_a_keepalive_stays_a_comment_to_the_sdk(fields):
    """An upstream's `id:` (or `retry:`) relayed would make the OpenAI Python SDK read each later
    blank line, the gateway's keepalive's included, as an event with empty data and raise."""
    from openai._streaming import SSEDecoder

    stream = ROLE + fields + HELLO + fields + b"\n" + STOP + USAGE + DONE
    out, relay = relay_all([stream], wants_usage=True)
    assert b"id" not in out.replace(b'"id"', b"") and b"retry" not in out
    assert out.startswith(ROLE + HELLO + STOP) and relay.usage == TokenUsage(5, 7, None)
    decoder = SSEDecoder()
    events = list(decoder.iter_bytes(iter([ROLE + HELLO, KEEPALIVE, STOP, KEEPALIVE])))
    assert [json.loads(e.data)["choices"][0]["delta"] for e in events] == [
        {"role": "assistant", "content": ""}, {"content": "Hel"}, {}]
    out, relay = relay_all([ROLE + fields + b"\n" + HELLO + DONE])  # the fields alone: no event left
    assert out == ROLE + HELLO


def test_why_the_stream_fields_are_not_relayed():
    """What the Python SDK makes of a relayed id and the gateway's keepalive after it, and of a
    `retry:` in an event of its own: an event with empty data, which it fails to read as JSON."""
    from openai._streaming import SSEDecoder

    assert list(SSEDecoder().iter_bytes(iter([ROLE, b"id: 7\n" + HELLO, KEEPALIVE])))[-1].data == ""
    assert list(SSEDecoder().iter_bytes(iter([ROLE, b"retry: 3000\n\n", HELLO])))[1].data == ""


def test_a_field_that_only_starts_like_id_is_the_events_own():
    event = b"idx: 7\n" + HELLO
    out, relay = relay_all([ROLE + event + DONE])
    assert out == ROLE + event


def test_an_event_named_error_whose_data_is_done_ends_the_stream_as_done():
    """Both SDKs end a stream at [DONE] before they look at the event's name."""
    out, relay = relay_all([ROLE + HELLO + b"event: error\ndata: [DONE]\n\n"])
    assert out == ROLE + HELLO and relay.done and relay.failure is None


@pytest.mark.parametrize("event", [b"event: ping\n\n", b"event: ping\nid: 3\n\n", b"event\n\n"])
def test_an_event_with_a_name_and_no_data_is_not_relayed_and_comments_are(event):
    """The Python SDK reads an event with a name and no data as one with empty data and raises on
    it; comments and fields it does not know it skips."""
    from openai._streaming import SSEDecoder

    assert list(SSEDecoder().iter_bytes(iter([b"event: ping\n\n"])))[0].data == ""  # why
    kept = b": one\n: two\n\n" + b"foo: bar\n\n"
    out, relay = relay_all([ROLE + event + HELLO + kept + DONE])
    assert out == ROLE + HELLO + kept and relay.failure is None


def test_an_error_that_is_an_empty_object_is_no_error_in_a_buffered_answer():
    """Neither SDK looks for an `error` in a buffered answer; in a stream, the Node SDK raises on {}."""
    from kiln.sse import is_error_object

    answer = {"choices": [{"message": {"content": "x"}}], "error": {}}
    assert not is_error_object(answer) and is_error_object(answer, streamed=True)
    assert is_error_object({"error": {"message": "boom"}}) and is_error_object({"object": "error"})


@pytest.mark.parametrize("event", [b"data:\n\n", b"data: \n\n", b"data:   \t\n\n", b"data\n\n",
                                   b"event: ping\ndata:\n\n", b"data: \x0c\n\n", b"data\ndata\n\n"])
def test_an_event_whose_data_is_empty_is_not_relayed(event):
    """The Python SDK reads an event with empty data as JSON, and raises (after the stream's first
    chunk too, where chunks are relayed as sent)."""
    out, relay = relay_all([ROLE + HELLO + event + HELLO + DONE])
    assert out == ROLE + HELLO + HELLO and relay.failure is None and relay.relayed_texts == 2
    out, relay = relay_all([ROLE + event + HELLO + DONE])
    assert out == ROLE + HELLO and relay.failure is None and relay.relayed_texts == 1


def test_an_error_field_as_llama_cpp_writes_one_mid_stream_ends_the_stream_as_the_servers_error():
    out, relay = relay_all([ROLE + HELLO + b'error: {"code":500,"message":"the prompt was: secret","type":"server_error"}'
                            b"\n\n"])
    assert out == ROLE + HELLO and relay.done and relay.failure == "the model server sent an error event"


def test_a_data_line_with_no_colon_is_an_empty_line_of_the_events_data():
    event = b"data\n" + HELLO
    out, relay = relay_all([ROLE + event + DONE])
    assert out == ROLE + event and relay.relayed_texts == 1


# the pieces the relay's checks are made of, and what sits around them in chunks
_PIECES = [b'"error"', b'"object"', b'"usage"', b'"name"', b'"type"', b"[DONE]", b"\\u", b"\\", b":", b" ", b"\n",
           b"null", b"n", b'"', b"{", b"}", b"[", b"]", b",", b'"error" : {', b'"usage":null', b'"usage": {}',
           b'"response.output_text.done"', b'"response.completed"', b'"response.output_text.delta"', b"x", b"0"]


@given(st.lists(st.sampled_from(_PIECES), max_size=24).map(b"".join))
@settings(max_examples=3000, deadline=None)
def test_the_relays_literal_first_checks_answer_as_the_alternations_they_stand_for(event):
    """reads_further, may_be_error and the Responses relay's _read find what one regex of all
    their alternatives finds, on any arrangement of what those alternatives are made of."""
    from kiln.apis import responses

    read_further = re.compile(rb"\[DONE\]|\\u|\"name\"|" + sse._IN_BAND_ERROR.pattern + rb"|" + sse._USAGE_PRESENT.pattern)
    assert sse.reads_further(event) == bool(read_further.search(event))
    assert sse.may_be_error(event) == bool(sse._IN_BAND_ERROR.search(event))
    read = re.compile(responses._WHOLE.pattern + rb"|\\u|" + responses._ERROR.pattern + rb"|" + sse._IN_BAND_ERROR.pattern)
    assert responses._read(event) == bool(read.search(event))


@given(st.lists(st.sampled_from([b'"', b"\\", b'\\"', b"\\\\", b"a", b" ", b":", b"\n", b'"content"', b'"name"',
                                 b'"delta"', b'"item_id"', b"\xc3\xa9"]), max_size=24).map(b"".join))
@settings(max_examples=3000, deadline=None)
def test_the_relays_string_patterns_find_what_the_plain_alternation_finds(text):
    """NON_EMPTY_STRING and STRING are JSON string contents written as runs between escapes:
    on any arrangement of quotes, escapes and keys they find what `(?:[^"\\]|\\.)+` and `*` find."""
    plain, maybe_empty = rb'(?:[^"\\]|\\.)+', rb'(?:[^"\\]|\\.)*'
    for key in (b'"(?:content|name)"', b'"delta"'):
        fast = re.compile(key + rb'\s*:\s*"(' + sse.NON_EMPTY_STRING + rb')"')
        assert fast.findall(text) == re.compile(key + rb'\s*:\s*"(' + plain + rb')"').findall(text)
    fast = re.compile(rb'"item_id"\s*:\s*"(' + sse.STRING + rb')"')
    assert fast.findall(text) == re.compile(rb'"item_id"\s*:\s*"(' + maybe_empty + rb')"').findall(text)
