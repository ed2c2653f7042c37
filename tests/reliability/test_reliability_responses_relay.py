"""The Responses relay against model servers' real event sequences (contract §4, §9).

Honest servers (vLLM's own numbering of its events, gpt-oss's, an MCP call's) are billed
their reported counts, or about their text when they report none; hostile ones relay no
text past the bill; an in-band error the SDKs raise on ends the stream with the one error event.
"""

from __future__ import annotations

import json

import pytest

from support import LedgerCheck, sse_events

RESPONSES = "/v1/responses"
CHAT = "/v1/chat/completions"
MODEL = "qwen3-32b"  # context length 40 960
LONG = "word " * 5000  # 25 000 characters: ~6 250 tokens, never fewer than 196


def fewest(text: str) -> int:
    return -(-len(text) // 128)  # kiln.metering.fewest_tokens


def post(stack, ledger: LedgerCheck, path, body):
    return ledger.saw(stack.post(path, body, ledger.key))


def ev(kind: str, **fields) -> str:
    return json.dumps({"type": kind, **fields})


SHELL = {"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL, "status": "in_progress",
         "output": [], "usage": None, "metadata": None, "error": None, "incomplete_details": None}


def vllm_simple(tokens: list[str], usage: dict | None, final: bool = True) -> list[str]:
    """The events vLLM's `_process_simple_streaming_events` writes for a plain reply (any model
    without harmony), as in vllm/entrypoints/openai/serving_responses.py: `current_content_index`
    goes up by one for the part added and for every delta, so output_text.done and
    content_part.done carry content_index N+1 and N+2 while the item's (and the final
    response's) content list holds the text at index 0."""
    text = "".join(tokens)
    events = [ev("response.created", response=SHELL, sequence_number=0),
              ev("response.in_progress", response=SHELL, sequence_number=1),
              ev("response.output_item.added", output_index=0,
                 item={"id": "m", "type": "message", "role": "assistant", "content": [], "status": "in_progress"}),
              ev("response.content_part.added", output_index=0, item_id="m", content_index=0,
                 part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
    index = 1
    for token in tokens:
        events.append(ev("response.output_text.delta", content_index=index, output_index=0, item_id="m",
                         delta=token, logprobs=[]))
        index += 1
    part = {"type": "output_text", "text": text, "annotations": []}
    item = {"id": "m", "type": "message", "role": "assistant", "content": [part], "status": "completed"}
    events += [ev("response.output_text.done", output_index=0, content_index=index, text=text, logprobs=[],
                  item_id="m"),
               ev("response.content_part.done", item_id="m", output_index=0, content_index=index + 1, part=part),
               ev("response.output_item.done", output_index=0, item=item)]
    if final:
        events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": [item],
                                                         "usage": usage}))
    return events


def vllm_harmony(reasoning: list[str], message: list[str], usage: dict | None) -> list[str]:
    """gpt-oss on vLLM (`_process_harmony_streaming_events`): the output index goes up when the
    parser expects the next message's start, before the previous message's done events are
    written (they carry the next index), and the content index is never reset."""
    r_text, m_text = "".join(reasoning), "".join(message)
    events = [ev("response.created", response=SHELL), ev("response.in_progress", response=SHELL),
              ev("response.output_item.added", output_index=0,
                 item={"type": "reasoning", "id": "r1", "summary": [], "status": "in_progress"}),
              ev("response.reasoning_part.added", output_index=0, item_id="r1", content_index=0,
                 part={"text": "", "type": "reasoning_text"})]
    events += [ev("response.reasoning_text.delta", item_id="r1", output_index=0, content_index=0, delta=t)
               for t in reasoning]
    content = {"text": r_text, "type": "reasoning_text"}
    r_item = {"type": "reasoning", "id": "r1", "content": [content], "summary": [], "status": "completed"}
    events += [ev("response.reasoning_text.done", item_id="r1", output_index=1, content_index=0, text=r_text),
               ev("response.reasoning_part.done", item_id="r1", output_index=1, content_index=0, part=content),
               ev("response.output_item.done", output_index=1, item=r_item),
               ev("response.output_item.added", output_index=1,
                  item={"id": "m1", "type": "message", "role": "assistant", "content": [], "status": "in_progress"}),
               ev("response.content_part.added", output_index=1, item_id="m1", content_index=1,
                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
    events += [ev("response.output_text.delta", content_index=1, output_index=1, item_id="m1", delta=t, logprobs=[])
               for t in message]
    part = {"type": "output_text", "text": m_text, "annotations": []}
    m_item = {"id": "m1", "type": "message", "role": "assistant", "content": [part], "status": "completed"}
    events += [ev("response.output_text.done", output_index=1, content_index=1, text=m_text, logprobs=[], item_id="m1"),
               ev("response.content_part.done", item_id="m1", output_index=1, content_index=1, part=part),
               ev("response.output_item.done", output_index=1, item=m_item),
               ev("response.completed", response={**SHELL, "status": "completed", "output": [r_item, m_item],
                                                  "usage": usage})]
    return events


# -- 1. honest servers: counts believed, estimates about the text ------------------------------

TOKENS = ["word "] * 500  # 500 deltas, 2 500 characters: 500 tokens (625 by the 4-characters rule)


@pytest.mark.parametrize("end", ["cut-before-final", "final-without-usage"])
def test_an_honest_vllm_stream_without_usage_is_billed_about_its_text_not_three_times(stack, ledger, end):
    """vLLM's plain stream (its own content_index numbering) of 500 one-token deltas, cut before
    response.completed (or a final without usage): the relay counts the same text at three
    places, (0, content, 0), (0, content, 501) and (0, content, 502), and bills 500 deltas +
    5 000 characters "beyond" them: 1 750 tokens for 500 relayed (before 29493c5: 500)."""
    events = vllm_simple(TOKENS, None, final=end != "cut-before-final")
    mock = {"raw_events": events, "no_done": True}
    if end == "cut-before-final":
        mock["cut_after"] = 0  # the connection drops after the events (kiln_ops.mock_upstream._scripted)
    response = post(stack, ledger, RESPONSES, {"model": MODEL, "input": "hi", "stream": True, "mock": mock})
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens <= 1.25 * len("".join(TOKENS)) / 4, record.completion_tokens


def test_an_honest_gpt_oss_stream_without_usage_is_billed_about_its_text(stack, ledger):
    """gpt-oss on vLLM, reasoning (300 deltas) then the answer (200 deltas), final usage null:
    the done events sit one output index after their deltas and the content index is not reset,
    so the texts are counted at three places: billed 950 tokens for 500 deltas (1 750 characters
    of reasoning, 1 000 of answer: ~700 by the 4-characters rule)."""
    events = vllm_harmony(["think "] * 300, ["word "] * 200, None)
    response = post(stack, ledger, RESPONSES, {"model": MODEL, "input": "hi", "stream": True,
                                               "mock": {"raw_events": events, "no_done": True}})
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens <= 1.25 * (6 * 300 + 5 * 200) / 4, record.completion_tokens


@pytest.mark.parametrize("tokens,reported", [(["Yes"], 2), (["Positive"], 1), (["Yes", "."], 2)],
                         ids=["yes+eos", "one-token", "two-tokens"])
def test_an_honest_short_vllm_reply_is_believed(stack, ledger, tokens, reported):
    """A one- or two-token answer (a classifier's "Yes") from vLLM with its honest
    output_tokens: the relay's floor is 3 (the one text at three places), above the count,
    so the event is `capped` and billed 3 (before 29493c5: believed)."""
    usage = {"input_tokens": 9, "output_tokens": reported, "total_tokens": 9 + reported}
    response = post(stack, ledger, RESPONSES, {"model": MODEL, "input": "hi", "stream": True,
                                               "mock": {"raw_events": vllm_simple(tokens, usage), "no_done": True}})
    assert response.status_code == 200
    (record,) = ledger.check()
    assert (record.usage_source, record.completion_tokens) == ("upstream", reported)


# -- 2. hostile servers: text relayed past the bill ---------------------------------------------


def message(text: str, item_id: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def test_two_items_at_one_output_index_are_both_billed(stack, ledger):
    """Two output_item.added events, both `output_index: 0`, each a different 25 000-character
    message (the OpenAI SDK appends both to its snapshot's output). The relay keeps only the
    longest text of the place: its floor is 196, `output_tokens: 196` is believed for 50 000
    characters relayed, which are never fewer than 392 tokens."""
    other = "text " * 5000
    events = [ev("response.created", response=SHELL),
              ev("response.output_item.added", output_index=0, item=message(LONG, "a")),
              ev("response.output_item.added", output_index=0, item=message(other, "b")),
              ev("response.completed", response={**SHELL, "status": "completed", "output": [],
                                                 "usage": {"input_tokens": 4, "output_tokens": fewest(LONG)}})]
    response = post(stack, ledger, RESPONSES, {"model": MODEL, "input": "hi", "stream": True,
                                               "mock": {"raw_events": events, "no_done": True}})
    assert response.status_code == 200 and LONG in response.text and other in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= fewest(LONG) + fewest(other), (record.completion_tokens, record.usage_source)


def test_a_text_sent_only_in_response_queued_is_billed(stack, ledger):
    """`response.queued` (an event of the OpenAI Responses stream, with the response object)
    whose output holds a 25 000-character message: the walker reads created and in_progress
    only, so the text is relayed and billed as the 1 token reported."""
    queued = {**SHELL, "status": "queued", "output": [message(LONG, "m")]}
    events = [ev("response.queued", response=queued),
              ev("response.completed", response={**SHELL, "status": "completed", "output": [],
                                                 "usage": {"input_tokens": 4, "output_tokens": 1}})]
    response = post(stack, ledger, RESPONSES, {"model": MODEL, "input": "hi", "stream": True,
                                               "mock": {"raw_events": events, "no_done": True}})
    assert response.status_code == 200 and LONG in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= fewest(LONG), (record.completion_tokens, record.usage_source)


@pytest.mark.parametrize("usage", [{"input_tokens": 4, "output_tokens": 1600}, None], ids=["reported", "no-usage"])
def test_deltas_in_one_place_and_a_whole_text_in_another_are_both_billed(stack, ledger, usage):
    """1 600 deltas of 16 characters for the message at output 0 (1 600 tokens), and a
    25 000-character message given whole at output 1, never as deltas. The relay's bill is
    the deltas plus what the whole texts hold *beyond the deltas' length*: 25 600 bytes of
    deltas hide the 25 000 characters at another place. Billed 1 600 (reported, believed:
    the floor is the larger source, not their sum; or estimated) for 1 600 + ≥196 tokens."""
    chunk = "abcdefghijklmno "  # 16 characters: one token each by the relay's rule
    events = [ev("response.output_item.added", output_index=0,
                 item={"type": "message", "id": "a", "role": "assistant", "status": "in_progress", "content": []})]
    events += [ev("response.output_text.delta", item_id="a", output_index=0, content_index=0, delta=chunk)
               for _ in range(1600)]
    events += [ev("response.output_item.added", output_index=1, item=message(LONG, "b")),
               ev("response.completed", response={**SHELL, "status": "completed", "output": [],
                                                  **({"usage": usage} if usage else {})})]
    response = post(stack, ledger, RESPONSES, {"model": MODEL, "input": "hi", "stream": True,
                                               "mock": {"raw_events": events, "no_done": True}})
    assert response.status_code == 200 and LONG in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= 1600 + fewest(LONG), (record.completion_tokens, record.usage_source)


# -- 3. errors the SDKs raise on --------------------------------------------------------------


def test_a_chat_chunk_with_choices_and_an_error_ends_the_stream_with_the_one_error_event(stack, ledger):
    """`{"choices": [...], "error": {...}}`: the OpenAI SDK raises on any truthy `error`
    (openai/_streaming.py: `if is_mapping(data) and data.get("error")`), choices or not. The
    gateway's `is_error_object` needs no choices: it relays the upstream's error (its message), goes
    on, and ends with [DONE] as a success."""
    content = json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                          "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": None}]})
    error = json.dumps({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                        "choices": [{"index": 0, "delta": {}, "finish_reason": "error"}],
                        "error": {"message": "boom: secret prompt", "type": "InternalServerError", "code": 500}})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
            "mock": {"raw_events": [content, error, content]}}
    response = post(stack, ledger, CHAT, body)
    blocks = [block for block in sse_events(response.text) if not block.startswith(":")]
    assert "boom" not in response.text, blocks
    assert "data: [DONE]" not in blocks
    (record,) = ledger.check()
    assert record.status == "stream_interrupted"


def test_an_honest_mcp_call_without_usage_is_billed_its_arguments_once(stack, ledger):
    """The OpenAI Responses stream of an MCP tool call: arguments deltas, then
    `response.mcp_call_arguments.done` (the whole arguments), then `response.output_item.done`
    (the mcp_call item, with the same arguments). The first is a kind the relay does not know,
    counted "in a place of its own" (output, "mcp_call_arguments", "arguments"), the item at
    (output, "arguments"): the arguments count twice, ~1 125 tokens billed for 500 deltas."""
    args = "word " * 500
    item = {"type": "mcp_call", "id": "mcp_1", "server_label": "s", "name": "echo", "arguments": args,
            "output": "ok", "status": "completed"}
    events = [ev("response.created", response=SHELL),
              ev("response.output_item.added", output_index=0, item={**item, "arguments": "", "output": None,
                                                                     "status": "in_progress"})]
    events += [ev("response.mcp_call_arguments.delta", item_id="mcp_1", output_index=0, delta="word ")
               for _ in range(500)]
    events += [ev("response.mcp_call_arguments.done", item_id="mcp_1", output_index=0, arguments=args),
               ev("response.mcp_call.completed", item_id="mcp_1", output_index=0),
               ev("response.output_item.done", output_index=0, item=item),
               ev("response.completed", response={**SHELL, "status": "completed", "output": [item]})]
    response = post(stack, ledger, RESPONSES, {"model": MODEL, "input": "hi", "stream": True,
                                               "mock": {"raw_events": events, "no_done": True}})
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens <= 1.25 * len(args) / 4, record.completion_tokens
