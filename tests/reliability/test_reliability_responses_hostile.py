"""POST /v1/responses against hostile clients and model servers (contract §4, §5, §7, §9):
every text relayed is billed, once; a count the model server reports honestly is believed;
an error the server writes mid-stream, in any dialect, ends the stream with the one error event.
"""

from __future__ import annotations

import json

import pytest
from openai.types.responses import ResponseErrorEvent

from support import LedgerCheck, sse_events

RESPONSES = "/v1/responses"
MODEL = "qwen3-32b"  # context length 40 960; $0.08 / $0.24 per million tokens
CONTEXT = 40960
LONG = "word " * 5000  # 25 000 characters: ~6 250 tokens, never fewer than 196


def post(stack, ledger: LedgerCheck, body, **kwargs):
    return ledger.saw(stack.post(RESPONSES, body, ledger.key, **kwargs))


def blocks(text: str) -> list[str]:
    return [block for block in sse_events(text) if not block.startswith(":")]


def payload_of(block: str):
    data = [line[len("data:"):].lstrip(" ") for line in block.split("\n") if line.startswith("data:")]
    return json.loads("\n".join(data)) if data else None


def final(response: dict, kind: str = "response.completed") -> str:
    return json.dumps({"type": kind, "response": response})


def billed_for_long(stack, ledger: LedgerCheck, answer: dict, stream: bool):
    """The usage event of `answer`, sent buffered or as the final event of a stream, once the
    client got its LONG text: never fewer tokens than that text can be."""
    body = {"model": MODEL, "input": "hi", "stream": stream}
    body["mock"] = ({"raw_events": [final(answer)], "no_done": True} if stream else {"raw_body": json.dumps(answer)})
    response = post(stack, ledger, body)
    assert response.status_code == 200 and LONG in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= -(-len(LONG) // 128), (record.completion_tokens, record.usage_source)
    return record


# -- usage the model cannot have produced (§4) -----------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_n_on_a_responses_request_does_not_raise_the_bound_on_output_tokens(stack, ledger, stream):
    """The Responses API has no `n` (vLLM's and SGLang's ResponsesRequest ignore it): one reply,
    at most the context length. With `n: 8` in the body, output_tokens of 3 × the context were
    believed and billed, the bound multiplied by a field the server never honoured."""
    usage = {"input_tokens": 10, "output_tokens": 3 * CONTEXT}
    answer = {"id": "r", "object": "response", "status": "completed", "output": [], "usage": usage}
    body = {"model": MODEL, "input": "hi", "n": 8, "stream": stream}
    body["mock"] = ({"raw_events": [final(answer)], "no_done": True} if stream else {"raw_body": json.dumps(answer)})
    response = post(stack, ledger, body)
    assert response.status_code == 200
    (event,) = ledger.check()
    assert event.completion_tokens <= CONTEXT, (event.completion_tokens, event.usage_source)
    assert event.usage_source == "capped"


# -- text relayed but never billed (§4: billed tokens never less than relayed) ----------------

ITEM = {"type": "message", "id": "m", "role": "assistant", "status": "in_progress",
        "content": [{"type": "output_text", "text": LONG, "annotations": []}]}


@pytest.mark.parametrize("where", ["output_item.added", "content_part.added", "in_progress"])
@pytest.mark.parametrize("usage", [{"input_tokens": 4, "output_tokens": 1}, None], ids=["reported-1", "no-usage"])
def test_a_text_sent_only_in_an_added_or_in_progress_event_is_billed(stack, ledger, where, usage):
    """The client's SDK reads the whole text from `response.output_item.added` (its item),
    `response.content_part.added` (its part) or a `response.in_progress` whose output holds it:
    25 000 characters relayed were billed as 1 token (or 0 by the estimate)."""
    if where == "output_item.added":
        event = {"type": "response.output_item.added", "output_index": 0, "item": ITEM}
    elif where == "content_part.added":
        event = {"type": "response.content_part.added", "item_id": "m", "output_index": 0, "content_index": 0,
                 "part": ITEM["content"][0]}
    else:
        event = {"type": "response.in_progress", "response": {"id": "r", "object": "response",
                                                              "status": "in_progress", "output": [ITEM]}}
    last = {"id": "r", "object": "response", "status": "completed", "output": [], **({"usage": usage} if usage else {})}
    body = {"model": MODEL, "input": "hi", "stream": True,
            "mock": {"raw_events": [json.dumps(event), final(last)], "no_done": True}}
    response = post(stack, ledger, body)
    assert response.status_code == 200
    assert LONG in response.text  # the client got the text
    (record,) = ledger.check()
    assert record.completion_tokens >= -(-len(LONG) // 128), (record.completion_tokens, record.usage_source)


# -- an upstream failure after the stream started (§9) ---------------------------------------

DELTA = json.dumps({"type": "response.output_text.delta", "item_id": "m", "output_index": 0, "content_index": 0,
                    "delta": "hi"})


@pytest.mark.parametrize("error", [
    {"error": {"object": "error", "message": "boom: secret prompt", "type": "BadRequestError", "code": 400}},
    {"object": "error", "message": "boom: secret prompt", "type": "InternalServerError", "code": 500},
], ids=["vllm-error-object", "object-error"])
def test_a_chat_style_error_in_a_responses_stream_ends_it_with_the_one_error_event(stack, ledger, error):
    """vLLM and SGLang report a failure after the 200 as `data: {"error": {...}}`: §9 says the
    stream ends with ONE `event: error` (type error, code upstream_error). The Responses relay
    once relayed the upstream's own error (the SDK raises on it, with the upstream's message),
    and the gateway's event followed: two errors."""
    body = {"model": MODEL, "input": "hi", "stream": True,
            "mock": {"raw_events": [DELTA, DELTA, json.dumps(error)], "no_done": True}}
    response = post(stack, ledger, body)
    events = [payload_of(block) for block in blocks(response.text)]
    errors = [e for e in events if isinstance(e, dict) and (e.get("type") == "error" or "error" in e
                                                             or e.get("object") == "error")]
    assert len(errors) == 1, events
    assert errors[0]["code"] == "upstream_error" and blocks(response.text)[-1].startswith("event: error")
    assert "boom" not in response.text
    (record,) = ledger.check()
    assert record.status == "stream_interrupted"


@pytest.mark.parametrize("error", [{"message": "boom: secret prompt", "type": "server_error"}, "boom", {}])
@pytest.mark.parametrize("kind", ["response.completed", "response.incomplete", "response.failed"])
def test_a_final_event_carrying_an_error_ends_the_stream_with_the_one_error_event(stack, ledger, kind, error):
    """Both SDKs raise on any event whose `error` is set, the final one included: a final event
    with an error was relayed as the end of a success (cost added, the server's message with it),
    billed as one, and the client's SDK raised the server's message. The stream now ends with
    the gateway's one error event, settled as the failure it is."""
    final = {"type": kind, "sequence_number": 1, "error": error,
             "response": {"id": "r", "object": "response", "status": kind.split(".")[1], "output": [],
                          "usage": {"input_tokens": 4, "output_tokens": 2}}}
    body = {"model": MODEL, "input": "hi", "stream": True,
            "mock": {"raw_events": [DELTA, json.dumps(final)], "no_done": True}}
    response = post(stack, ledger, body)
    assert blocks(response.text)[-1].startswith("event: error"), blocks(response.text)[-1][:200]
    assert "boom" not in response.text
    (record,) = ledger.check()
    assert record.status == "stream_interrupted" and record.cost > 0


@pytest.mark.parametrize("numbered", [
    ([], None, 0),  # cut before any event: the gateway's is the first
    ([7, 8, 9], None, 10),  # one past the last the server gave
    ([None, None], None, 2),  # a server that numbers none: one for each event relayed
    ([0, "x", True], None, 3),  # numbers the gateway cannot take: counted
    ([0, 1], "error", 2),  # the server's own error, not relayed, takes no number
], ids=["none-relayed", "numbered", "unnumbered", "odd-numbers", "server-error"])
def test_the_gateways_error_event_is_numbered_after_the_last_event_relayed(stack, ledger, numbered):
    """The gateway's `event: error` ends a cut stream (§9) in the shape the OpenAI SDKs read:
    the Vercel AI SDK's schema requires `sequence_number` (without it the app's onError got a
    type validation error, not the gateway's code and message), openai-python types it as an int."""
    numbers, server_error, expected = numbered
    events = []
    for number in numbers:
        delta = json.loads(DELTA)
        if number is not None:
            delta["sequence_number"] = number
        events.append(json.dumps(delta))
    if server_error:
        events.append(json.dumps({"type": "error", "code": "boom", "message": "boom", "sequence_number": 2}))
    body = {"model": MODEL, "input": "hi", "stream": True, "mock": {"raw_events": events, "no_done": True}}
    response = post(stack, ledger, body)
    error = payload_of(blocks(response.text)[-1])
    assert ResponseErrorEvent.model_validate(error, strict=True).sequence_number == expected, error
    assert error["param"] is None and error["code"] == "upstream_error"
    (record,) = ledger.check()
    assert record.status == "stream_interrupted"


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("content", [LONG, {"type": "output_text", "text": LONG, "annotations": []}],
                         ids=["string", "object"])
def test_a_message_content_that_is_not_a_list_is_still_billed(stack, ledger, stream, content):
    """An output message whose `content` is the text itself (or one part, not in a list): the
    client gets 25 000 characters; `output_tokens: 1` was believed, as only a content list
    was read."""
    item = {"type": "message", "id": "m", "role": "assistant", "status": "completed", "content": content}
    answer = {"id": "r", "object": "response", "status": "completed", "output": [item],
              "usage": {"input_tokens": 4, "output_tokens": 1}}
    billed_for_long(stack, ledger, answer, stream)


# -- an honest count disbelieved: the request's own echo counted as the model's text ----------


def test_metadata_echoed_in_the_stream_is_not_billed_as_output(stack, ledger):
    """vLLM echoes the request's `metadata` in every event that carries the response object
    (response.created, response.in_progress, the final). A metadata value under the key
    "delta" matched the relay's delta pattern: the echo was counted as relayed text, its floor
    (196 tokens) above the honest `output_tokens: 2`, and the request billed ~6 250 output
    tokens, marked capped, instead of the 2 the model wrote. Deltas count only in delta events."""
    metadata = {"delta": "y" * 500, "note": "x"}  # 500 characters: OpenAI's limit for a value is 512
    shell = {"id": "r", "object": "response", "status": "in_progress", "output": [], "metadata": metadata}
    item = {"type": "message", "id": "m", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "Hi!", "annotations": []}]}
    done = {**shell, "status": "completed", "output": [item], "usage": {"input_tokens": 9, "output_tokens": 2}}
    events = [json.dumps({"type": "response.created", "response": shell}),
              json.dumps({"type": "response.in_progress", "response": shell}),
              json.dumps({"type": "response.output_text.delta", "item_id": "m", "output_index": 0,
                          "content_index": 0, "delta": "Hi"}),
              json.dumps({"type": "response.output_text.delta", "item_id": "m", "output_index": 0,
                          "content_index": 0, "delta": "!"}),
              final(done)]
    body = {"model": MODEL, "input": "hi", "stream": True, "metadata": metadata,
            "mock": {"raw_events": events, "no_done": True}}
    response = post(stack, ledger, body)
    assert response.status_code == 200
    (record,) = ledger.check()
    assert (record.usage_source, record.prompt_tokens, record.completion_tokens) == ("upstream", 9, 2)


BUILT_IN_CALLS = {
    # vLLM's gpt-oss path: the python tool's code the model wrote, the browser's query it wrote
    "code_interpreter_call": {"type": "code_interpreter_call", "id": "ci", "status": "completed", "code": LONG,
                              "container_id": "c", "outputs": []},
    "web_search_call": {"type": "web_search_call", "id": "ws", "status": "completed",
                        "action": {"type": "search", "query": LONG}},
}


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
@pytest.mark.parametrize("usage", [{"input_tokens": 4, "output_tokens": 1}, None], ids=["reported-1", "no-usage"])
@pytest.mark.parametrize("kind", BUILT_IN_CALLS)
def test_text_the_model_wrote_for_a_built_in_tool_is_billed(stack, ledger, kind, usage, stream):
    """gpt-oss on vLLM calls its built-in python and browser tools: the output item carries the
    code (or the query) the model wrote. Read only for names, arguments, input and content,
    25 000 characters of code were billed as the 1 token reported, or as 0 output tokens with
    no usage reported (§4: never billed zero for what was relayed)."""
    answer = {"id": "r", "object": "response", "status": "completed", "output": [BUILT_IN_CALLS[kind]],
              **({"usage": usage} if usage else {})}
    billed_for_long(stack, ledger, answer, stream)


def test_code_sent_whole_in_its_done_event_is_billed(stack, ledger):
    """`response.code_interpreter_call_code.done` carries the whole code (`code`), as the
    delta events would have: sent only there, it was not counted."""
    done = {"type": "response.code_interpreter_call_code.done", "item_id": "ci", "output_index": 0, "code": LONG}
    last = {"id": "r", "object": "response", "status": "completed", "output": []}
    body = {"model": MODEL, "input": "hi", "stream": True,
            "mock": {"raw_events": [json.dumps(done), final(last)], "no_done": True}}
    response = post(stack, ledger, body)
    assert response.status_code == 200 and LONG in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= -(-len(LONG) // 128), (record.completion_tokens, record.usage_source)


def test_a_delta_after_a_whole_text_is_not_billed_twice(stack, ledger):
    """No usage reported; the whole text comes first (output_text.done), then one delta "x".
    The client got 25 001 characters (~6 251 tokens). The relay's `relayed_tokens += …` read
    the property (deltas + whole texts beyond them) and stored it back as the deltas' count, so
    the whole text was counted twice: billed 12 501 output tokens."""
    done = {"type": "response.output_text.done", "item_id": "m", "output_index": 0, "content_index": 0, "text": LONG}
    delta = {"type": "response.output_text.delta", "item_id": "m2", "output_index": 1, "content_index": 0, "delta": "x"}
    last = {"id": "r", "object": "response", "status": "completed", "output": []}
    body = {"model": MODEL, "input": "hi", "stream": True,
            "mock": {"raw_events": [json.dumps(done), json.dumps(delta), final(last)], "no_done": True}}
    response = post(stack, ledger, body)
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens <= len(LONG) // 4 + 2, record.completion_tokens
