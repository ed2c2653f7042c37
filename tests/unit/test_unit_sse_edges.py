"""kiln.sse: the relay at the edges of the SSE format, its bounds, and what it holds back."""

import json

import pytest

from kiln.metering import TokenUsage
from kiln.sse import DEFAULT_MAX_EVENT_BYTES, EventTooLarge, SseRelay, usage_event

HELLO = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}\n\n'
USAGE = b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n'
DONE = b"data: [DONE]\n\n"


def relay_all(chunks, wants_usage=False, **kwargs):
    relay = SseRelay(client_wants_usage=wants_usage, **kwargs)
    out = b"".join(relay.feed(chunk) for chunk in chunks)
    return out, relay


def summary(relay):
    return (relay.done, relay.usage, relay.usage_chunk, relay.relayed_tokens, relay.finish_reason, relay.first_chunk)


def test_a_stream_with_no_usage_chunk_holds_nothing_back():
    out, relay = relay_all([HELLO, DONE])
    assert out == HELLO and relay.done is True
    assert relay.usage_chunk is None and relay.reported_usage is None and relay.usage is None
    assert SseRelay(client_wants_usage=False).feed(b"") == b""


# multi-line events: field lines, comments and data split over several lines (the SSE format)
MULTI = (
    b"id: 1\nevent: chunk\n" + HELLO
    + b'data: {"id":"c1","choices":[{"index":0,\ndata: "delta":{"content":"lo"},"finish_reason":"stop"}]}\n\n'
    + b": a comment line\n\n"
    + b'id: 3\ndata:{"id":"c1","choices":[],\ndata:"usage":{"prompt_tokens":2,"completion_tokens":2}}\n\n'
    + b"id: 4\ndata: [DONE]\n\n"
)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_multi_line_events_give_the_same_output_at_every_split_point(ending):
    stream = MULTI.replace(b"\n", ending)
    whole, reference = relay_all([stream])
    # content relayed (without the upstream's stream fields); usage held back; [DONE] swallowed
    assert whole == MULTI[: MULTI.index(b"id: 3")].replace(b"id: 1\n", b"")
    assert reference.done is True
    assert reference.usage == TokenUsage(2, 2)
    assert reference.relayed_tokens == 2 and reference.finish_reason == "stop"
    for cut in range(1, len(stream)):
        out, relay = relay_all([stream[:cut], stream[cut:]])
        assert out == whole, cut
        assert summary(relay) == summary(reference), cut
    out, relay = relay_all([stream[i : i + 1] for i in range(len(stream))])
    assert out == whole and summary(relay) == summary(reference)


def test_a_blank_line_split_between_pieces_ends_the_event_there():
    a = b'data: {"choices":[{"delta":{"content":"a"}}]}'
    b = b'data: {"choices":[{"delta":{"content":"b"}}]}'
    out, relay = relay_all([a + b"\n", b"\n" + b, b"\n\n"])
    assert out == a + b"\n\n" + b + b"\n\n"
    assert relay.relayed_tokens == 2


def test_line_endings_may_change_from_one_piece_to_the_next():
    pieces = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n', b'\ndata: {"choices":[{"delta":{"content":"b"}}]}\r\n\r\n']
    out, relay = relay_all(pieces)
    assert out == b'data: {"choices":[{"delta":{"content":"a"}}]}\n\ndata: {"choices":[{"delta":{"content":"b"}}]}\n\n'
    assert relay.relayed_tokens == 2


def test_a_usage_chunk_written_without_the_space_after_data_is_held_back():
    out, relay = relay_all([HELLO + USAGE.replace(b"data: ", b"data:")])
    assert out == HELLO
    assert relay.usage == TokenUsage(5, 7)


def test_only_data_lines_carry_data():
    """An event whose only line names it has no data: not relayed (the Python SDK would read it
    as an event with empty data and raise), and nothing of it counted."""
    event = b'event: {"id":"x","choices":[{"delta":{"content":"x"}}]}\n\n'
    out, relay = relay_all([event])
    assert out == b""
    assert relay.relayed_tokens == 0 and relay.first_chunk is None


def test_an_event_is_relayed_with_its_own_last_characters():
    events = b"data: not json, ends in X \t\n\n" + b"data: X\n\n" + b": ping X\n\n"
    assert relay_all([events])[0] == events


def test_a_finish_reason_that_is_not_utf8_is_read_with_replacement():
    event = b'data: {"choices":[{"delta":{},"finish_reason":"st\xffp"}]}\n\n'
    out, relay = relay_all([event])
    assert out == event.replace(b"\xff", "\ufffd".encode()) and relay.finish_reason == "st\ufffdp"


@pytest.mark.parametrize("bad", [b"\xff\xfe", b"\xed\xb3\xbf", b"\xe2\x82", b"\xc0\xaf"])
def test_bytes_that_are_no_utf8_reach_the_client_as_the_sse_format_reads_them(bad):
    """§7: an SSE stream is UTF-8, and its readers decode an invalid sequence as U+FFFD (a
    browser's EventSource, the Node SDK). The OpenAI Python SDK raises UnicodeDecodeError on it,
    no APIError: relayed as sent, a stream with such a delta broke that client mid-answer and
    was billed as a success. Each invalid sequence is relayed as the format reads it, at every
    point the upstream's pieces may split it; the rest of the stream as sent."""
    delta = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"He' + bad + b'o"},"finish_reason":null}]}\n\n'
    sound = "data: {\"choices\":[{\"delta\":{\"content\":\"é€😀\"}}]}\n\n".encode()
    stream = HELLO + delta + sound + USAGE + DONE
    expected = HELLO + delta.replace(bad, bad.decode("utf-8", "replace").encode()) + sound
    for cut in range(1, len(stream)):
        out, relay = relay_all([stream[:cut], stream[cut:]])
        assert out == expected, cut
        out.decode("utf-8")  # strictly, as the Python SDK reads it
        assert relay.relayed_tokens == 3 and relay.usage is not None and relay.done


def test_the_event_bound_is_on_the_bytes_the_upstream_sent_not_their_replacement():
    """§5 bounds what an upstream sends: an event within it whose invalid bytes each become a
    3-byte U+FFFD is relayed, not cut as over the bound."""
    event = b'data: {"choices":[{"delta":{"content":"' + b"\xff" * 400 + b'"}}]}\n\n'
    out, relay = relay_all([event], max_event_bytes=len(event))
    assert out == event.replace(b"\xff", "\ufffd".encode()) and relay.failure is None


# -- usage riding on content chunks (continuous usage stats) ---------------------------------------


def continuous(text, n):
    return (
        b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"' + text + b'"},"finish_reason":null}],'
        b'"usage":{"prompt_tokens":4,"completion_tokens":' + str(n).encode() + b"}}\n\n"
    )


def test_continuous_usage_counts_every_chunks_tokens_and_keeps_the_last_usage():
    out, relay = relay_all([continuous(b"a", 1), continuous(b"b", 2), continuous(b"c", 3)], wants_usage=True)
    assert out == continuous(b"a", 1) + continuous(b"b", 2) + continuous(b"c", 3)
    assert relay.relayed_tokens == 3
    assert relay.usage == TokenUsage(4, 3)
    assert relay.usage_chunk is None  # nothing held back: the content went out


def test_usage_on_a_chunk_whose_choices_are_not_objects_is_read_and_the_chunk_relayed():
    event = b'data: {"choices":["odd",{"delta":{"content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1}}\n\n'
    out, relay = relay_all([event], wants_usage=True)
    assert out == event
    assert relay.finish_reason == "stop" and relay.usage == TokenUsage(1, 1)


def test_a_usage_key_inside_a_choice_is_no_usage_chunk():
    event = b'data: {"id":"c1","choices":[{"delta":{"content":"x"},"usage":{"prompt_tokens":1}}]}\n\n'
    out, relay = relay_all([event], wants_usage=False)
    assert json.loads(out[6:]) == json.loads(event[6:])  # content and its odd key kept
    assert relay.relayed_tokens == 1 and relay.usage is None


# -- the bound on one event (contract §5) ------------------------------------------------------


def test_the_default_bound_is_one_mebibyte():
    assert DEFAULT_MAX_EVENT_BYTES == 1024 * 1024
    event = b'data: {"choices":[{"delta":{"content":"' + b"x" * (DEFAULT_MAX_EVENT_BYTES - 100) + b'"}}]}\n\n'
    assert relay_all([event])[0] == event
    with pytest.raises(EventTooLarge, match=f"^an SSE event over {DEFAULT_MAX_EVENT_BYTES} bytes$"):
        relay_all([b"data: " + b"x" * DEFAULT_MAX_EVENT_BYTES + b"\n\n"])


@pytest.mark.parametrize("size", [64, 1000])
def test_an_event_of_exactly_the_bound_passes_whole_or_unfinished(size):
    event = b"data: " + b"a" * (size - 6)
    assert len(event) == size
    # whole, with its blank line
    assert relay_all([event + b"\n\n"], max_event_bytes=size)[0] == event + b"\n\n"
    # unfinished, first in a piece of its own, then behind a finished event
    out, relay = relay_all([event], max_event_bytes=size)
    assert out == b"" and relay.leftover() == event
    out, relay = relay_all([b"data: x\n\n" + event], max_event_bytes=size)
    assert out == b"data: x\n\n" and relay.leftover() == event
    # one byte more is refused, in each of those shapes
    for chunks in ([event + b"a\n\n"], [event + b"a"], [b"data: x\n\n" + event + b"a"]):
        with pytest.raises(EventTooLarge, match=f"over {size} bytes"):
            relay_all(chunks, max_event_bytes=size)


@pytest.mark.parametrize("shape", ["whole", "unfinished"])
def test_the_events_before_one_over_the_bound_in_the_same_read_are_handed_over(shape):
    """They were counted as relayed: they reach the client before the error event."""
    big = b"data: " + b"y" * 3000 + (b"\n\n" if shape == "whole" else b"")
    relay = SseRelay(client_wants_usage=False, max_event_bytes=2048)
    with pytest.raises(EventTooLarge) as raised:
        relay.feed(HELLO + HELLO + big)
    assert raised.value.relayed == HELLO + HELLO and relay.relayed_texts == 2


def test_what_follows_done_in_the_same_read_is_ignored_whatever_its_size():
    relay = SseRelay(client_wants_usage=False, max_event_bytes=2048)
    assert relay.feed(HELLO + b"data: [DONE]\n\n" + b"data: " + b"z" * 3000) == HELLO
    assert relay.done and relay.leftover() == b""


def test_leftover_is_every_piece_of_the_unfinished_event():
    out, relay = relay_all([HELLO, b'data: {"choices"', b':[{"delta"', b':{"con'])
    assert out == HELLO
    assert relay.leftover() == b'data: {"choices":[{"delta":{"con'


# -- the work counter the linear-cost test reads ---------------------------------------------------


def test_the_work_counter_counts_each_pass_over_the_bytes():
    # searched once, then joined and split: three passes over an event fed whole
    relay = SseRelay(client_wants_usage=False)
    relay.feed(HELLO * 3)
    assert relay.bytes_scanned == 3 * len(HELLO * 3)
    relay.feed(HELLO)
    assert relay.bytes_scanned == 3 * len(HELLO * 4)
    # CRLF line ends normalized to LF first: one pass more
    relay = SseRelay(client_wants_usage=False)
    relay.feed(HELLO.replace(b"\n", b"\r\n"))
    assert relay.bytes_scanned == 4 * len(HELLO)
    relay.feed(HELLO.replace(b"\n", b"\r\n"))
    assert relay.bytes_scanned == 8 * len(HELLO)


def test_usage_event_puts_choices_and_usage_after_the_templates_fields():
    template = {"id": "c1", "choices": [{"delta": {}}], "usage": {"prompt_tokens": 1}, "model": "m"}
    assert usage_event(template, {"prompt_tokens": 2}) == b'data: {"id":"c1","model":"m","choices":[],"usage":{"prompt_tokens":2}}\n\n'


def test_a_comment_line_does_not_hide_the_data_of_its_event():
    # A comment line is ignored wherever it is (the SSE format): the event's data still counts.
    usage = b": usage follows\n" + USAGE
    done = b": end\n" + DONE
    out, relay = relay_all([HELLO + usage + done + HELLO])
    assert out == HELLO
    assert relay.usage == TokenUsage(5, 7) and relay.done is True


@pytest.mark.parametrize("first_line", [b"data: ", b"data:"])
def test_a_usage_chunk_split_over_data_lines_is_read_whole(first_line):
    usage = first_line + b'{"id":"c1","choices":[],\ndata: "usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n'
    out, relay = relay_all([HELLO + usage + DONE], wants_usage=True)
    assert out == HELLO
    assert relay.usage == TokenUsage(5, 7) and relay.usage_chunk["id"] == "c1"


UNREADABLE_USAGE = [
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":300,"completion_tokens":300},"x":'
    + b"[" * 250 + b"]" * 250 + b"}\n\n",  # nested past the strict parser's depth
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1e999}}\n\n',  # overflows
    b'data: {"id":"c1","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":NaN}}\n\n',
]


@pytest.mark.parametrize("event", UNREADABLE_USAGE, ids=["too deep", "1e999", "NaN"])
def test_a_usage_event_the_relay_cannot_read_never_reaches_a_client_that_did_not_ask(event):
    """Not readable, its usage can be neither read nor costed: it is relayed to no client (the
    usage billed is the gateway's own count, which a client that asked for usage gets in the
    gateway's own usage chunk, with its cost: one usage chunk, which the SDKs can read)."""
    for wants_usage in (False, True):
        out, relay = relay_all([HELLO, event, DONE], wants_usage=wants_usage)
        assert out == HELLO and relay.usage is None and relay.done and relay.usage_chunk is None


def test_an_unreadable_content_chunk_carrying_usage_keeps_its_content():
    """Continuous usage stats put usage on every content chunk: one the relay cannot read is
    still the client's content, passed on as it came and counted."""
    chunk = (b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"Hello"},"logprob":NaN}],'
             b'"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n')
    out, relay = relay_all([chunk, DONE])
    assert out == chunk and relay.relayed_texts == 1 and relay.usage is None


def test_the_usage_chunk_a_client_gets_states_the_usage_billed_when_later_usage_replaced_it():
    """A usage chunk (3 tokens), then a content chunk carrying usage (50): the bill is the last
    reported, and the usage chunk the client gets says the same, cost included."""
    from decimal import Decimal

    from kiln.apis.chat import API as CHAT_API

    relay = SseRelay(client_wants_usage=True)
    relay.feed(b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":3}}\n\n'
               b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"x"}}],'
               b'"usage":{"prompt_tokens":5,"completion_tokens":50}}\n\n')
    assert relay.reported_usage == {"prompt_tokens": 5, "completion_tokens": 50}
    tail = CHAT_API.stream_tail(relay, TokenUsage(5, 50, None, "upstream"), Decimal("0.001"), True)
    sent = json.loads(tail.split(b"\n\n")[0][len(b"data: "):])
    assert (sent["usage"]["completion_tokens"], sent["usage"]["cost"]) == (50, 0.001)


# what SSE clients do at the edges: a BOM that starts the stream is dropped (the SSE format),
# and any data that starts with [DONE] ends the stream (the OpenAI SDKs)
BOM = b"\xef\xbb\xbf"


@pytest.mark.parametrize("split", [0, 1, 2, 3, 4], ids=lambda at: f"split at {at}")
def test_a_bom_that_starts_the_stream_is_dropped_and_the_first_event_counted(split):
    stream = BOM + HELLO + DONE
    out, relay = relay_all([stream[:split], stream[split:]] if split else [stream])
    assert out == HELLO and relay.done
    assert (relay.relayed_texts, relay.relayed_tokens, relay.first_chunk["id"]) == (1, 1, "c1")


def test_a_line_opened_by_a_bom_later_in_the_stream_is_no_field_and_not_relayed():
    out, relay = relay_all([HELLO + BOM + HELLO + DONE])
    assert out == HELLO and relay.relayed_texts == 1 and relay.done and relay.failure is None


@pytest.mark.parametrize("done", [b"data: [DONE] \n\n", b"data: [DONE]\t\n\n", b"data:[DONE]x\n\n"],
                         ids=["trailing space", "trailing tab", "trailing text"])
def test_data_that_starts_with_done_ends_the_stream_as_the_sdks_read_it(done):
    out, relay = relay_all([HELLO, done, HELLO])
    assert out == HELLO and relay.done  # never relayed: the gateway sends its own [DONE] after the usage


@pytest.mark.parametrize("framing", [b"data: ", b"data:   ", b"event: message\ndata: ", b"data:\t",
                                     b"data: \ndata: "],
                         ids=["one line", "spaces before it", "with a name", "a tab before it", "a line before it"])
def test_a_chunk_whose_data_opens_with_a_byte_order_mark_ends_the_stream_unrelayed(framing):
    """A mark may open a stream, not an event's data: openai-python's reader raises on it (a
    JSONDecodeError, no APIError) and the Node SDK's too. It is the model server's broken
    event: the stream ends with the gateway's error event, as for any event no client reads."""
    chunk = framing + b"\xef\xbb\xbf" + HELLO[len(b"data: "):]
    out, relay = relay_all([HELLO, chunk, HELLO, DONE])
    assert out == HELLO and relay.failure and not relay.usage
    # at the stream's start a mark is the stream's, dropped as the SSE format drops it
    out, relay = relay_all([b"\xef\xbb\xbf" + HELLO, DONE])
    assert out == HELLO and relay.failure is None and relay.done


@pytest.mark.parametrize("before", [b"\xef\xbb\xbf", b"\n\n", b"event: ping\n\n", b"id: 1\n\n", b": hi\n\n",
                                    b"id: 1\n", b"retry: 5\n", b"id: 1\r", b"x: y\n"],
                         ids=["a second mark", "blank lines", "a named event", "an id", "a comment",
                              "an id in its event", "a retry in its event", "an id, CR framed", "a field in its event"])
def test_a_line_opened_by_a_byte_order_mark_after_the_streams_start_is_never_relayed(before):
    """Past the stream's start, a mark makes a line no field a client knows, unless it becomes
    the first bytes of the gateway's own stream, where the client's reader drops it and reads
    the line as data: a chunk relayed uncounted. Such a line is never relayed."""
    chunk = b"\xef\xbb\xbf" + HELLO
    out, relay = relay_all([b"\xef\xbb\xbf" + before + chunk, HELLO, DONE])
    assert b"\xef\xbb\xbf" not in out and out.endswith(HELLO) and out.count(b"Hel") == 1
    assert relay.relayed_texts == 1 and relay.done and relay.failure is None


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
def test_a_text_that_is_a_number_no_json_reader_takes_is_counted_as_sent(value):
    """openai-python reads NaN and Infinity as numbers and hands them to the client as text:
    a chunk of them was relayed and counted as nothing."""
    chunk = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":' + value + b'},"finish_reason":null}]}\n\n'
    out, relay = relay_all([HELLO, chunk * 50, DONE])
    assert out == HELLO + chunk * 50 and relay.relayed_tokens >= 51


def test_only_the_line_a_mark_opens_is_dropped_the_rest_of_its_event_is_read():
    """A client ignores the line (a field it does not know) and reads the rest of the event."""
    out, relay = relay_all([HELLO, b"\xef\xbb\xbfx: y\n" + HELLO, DONE])
    assert out == HELLO + HELLO and relay.relayed_texts == 2 and relay.failure is None
