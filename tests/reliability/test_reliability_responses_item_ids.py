"""The Responses relay's items by their ids (contract §4, §9): an id a hostile server reuses
for many items, or tells different texts under, is billed for every text; vLLM's final output,
whose items have new ids, and its gpt-oss function calls, whose items give their deltas'
item_id, are billed about their text; an event the gateway cannot read is never relayed."""

from __future__ import annotations

import json
import random
import string

from support import LedgerCheck

RESPONSES = "/v1/responses"
MODEL = "qwen3-32b"


def fewest(text: str) -> int:
    return -(-len(text) // 128)  # kiln.metering.fewest_tokens


def ev(kind: str, **fields) -> str:
    return json.dumps({"type": kind, **fields})


def post(stack, ledger: LedgerCheck, events: list[str], **extra):
    body = {"model": MODEL, "input": "hi", "stream": True,
            "mock": {"raw_events": events, "no_done": True, **extra.pop("mock", {})}, **extra}
    return ledger.saw(stack.post(RESPONSES, body, ledger.key))


SHELL = {"id": "resp_1", "object": "response", "created_at": 1, "model": MODEL, "status": "in_progress",
         "output": [], "usage": None, "metadata": None, "error": None, "incomplete_details": None}


def message(text: str, item_id: str | None) -> dict:
    item = {"type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    if item_id is not None:
        item["id"] = item_id
    return item


def distinct_texts(n: int, length: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(string.ascii_letters + " ") for _ in range(length)) for _ in range(n)]


# -- hostile: many items under one id -----------------------------------------------------------


def test_one_item_id_reused_for_many_distinct_items_is_billed_for_all_they_relayed(stack, ledger):
    """100 different messages, each 4 000 characters, all with id "m" (output_item.done and the
    final output): the client gets 400 000 characters; keeping only the longest whole of the
    id, the relay's floor was 32 tokens and output_tokens 32 was believed."""
    texts = distinct_texts(100, 4000)
    items = [message(text, "m") for text in texts]
    events = [ev("response.created", response=SHELL)]
    events += [ev("response.output_item.done", output_index=k, item=item) for k, item in enumerate(items)]
    usage = {"input_tokens": 5, "output_tokens": 32, "total_tokens": 37}
    events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": items,
                                                     "usage": usage}))
    response = post(stack, ledger, events)
    assert response.status_code == 200 and texts[-1] in response.text and texts[0] in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= sum(fewest(t) for t in texts), (record.usage_source, record.completion_tokens)


def test_one_item_id_reused_for_many_distinct_items_without_usage_is_estimated_for_all(stack, ledger):
    """The same with no usage: the estimate was one message's (250 tokens) for 100 of them
    (within the model's context, which bounds any estimate)."""
    texts = distinct_texts(100, 1000)
    items = [message(text, "m") for text in texts]
    events = [ev("response.output_item.done", output_index=k, item=item) for k, item in enumerate(items)]
    events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": items}))
    response = post(stack, ledger, events)
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens >= 0.8 * sum(len(t) for t in texts) / 4, record.completion_tokens


# -- hostile: item-level and part-level tellings of different texts -------------------------------


def test_an_item_telling_one_text_whole_and_another_as_its_part_is_billed_for_both(stack, ledger):
    """Under id "m": output_text.done gives text A (25 000 chars), output_item.done gives an
    item whose content is text B (25 000 chars, different). Taking the longer of the two
    tellings, the relay's floor was 196 for 50 000 distinct characters relayed (392)."""
    a, b = distinct_texts(2, 25_000, seed=3)
    events = [ev("response.output_text.done", item_id="m", output_index=0, content_index=0, text=a),
              ev("response.output_item.done", output_index=0, item=message(b, "m"))]
    usage = {"input_tokens": 5, "output_tokens": fewest(a), "total_tokens": 5 + fewest(a)}
    events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": [message(b, "m")],
                                                     "usage": usage}))
    response = post(stack, ledger, events)
    assert response.status_code == 200 and a in response.text and b in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= fewest(a) + fewest(b), (record.usage_source, record.completion_tokens)


def test_an_unreadable_event_whose_last_type_is_a_final_with_text_is_not_relayed_uncounted(stack, ledger):
    """`{"type":"response.output_text.delta","delta":"x", "n":1e999, "type":"response.completed",
    "response":{... 100 000 characters of output ...}}`: not JSON the gateway reads (1e999), but
    a delta type is in it, so it was relayed as a one-token delta. Python's json (the OpenAI SDK)
    reads it, keeping the last "type": a response.completed with the whole text."""
    text = distinct_texts(1, 100_000, seed=9)[0]
    final = json.dumps({**SHELL, "status": "completed", "output": [message(text, "m")]})
    sneaky = ('{"type":"response.output_text.delta","item_id":"m","delta":"x","n":1e999,'
              '"type":"response.completed","response":' + final + '}')
    assert json.loads(sneaky)["type"] == "response.completed"  # what a client reads
    response = post(stack, ledger, [sneaky])
    assert response.status_code == 200
    (record,) = ledger.check()
    assert text not in response.text or record.completion_tokens >= fewest(text), record.completion_tokens


def test_an_unreadable_event_whose_last_type_is_a_done_with_text_is_not_relayed_uncounted(stack, ledger):
    """The same trick on output_item.done: a 100 000-character item relayed for one token."""
    text = distinct_texts(1, 100_000, seed=11)[0]
    sneaky = ('{"type":"response.output_text.delta","item_id":"m","delta":"x","n":1e999,'
              '"type":"response.output_item.done","output_index":0,"item":' + json.dumps(message(text, "m")) + '}')
    usage = {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6}
    events = [sneaky, ev("response.completed", response={**SHELL, "status": "completed", "output": [],
                                                          "usage": usage})]
    response = post(stack, ledger, events)
    assert response.status_code == 200
    (record,) = ledger.check()
    assert text not in response.text or record.completion_tokens >= fewest(text), record.completion_tokens


# -- honest: vLLM's final response numbers its items afresh ------------------------------------------


def vllm_simple(reasoning: list[str], content: list[str], *, final: bool, usage=None) -> list[str]:
    """vLLM `_process_simple_streaming_events` (reasoning parser on): the reasoning item and the
    message stream under uuid4 ids; `responses_full_generator` builds the final output with
    `_make_response_output_items`, whose items are `rs_{random_uuid()}` / `msg_{random_uuid()}`."""
    rid, mid = "0b7f5a4e-reasoning", "9c1d2e3f-message"
    r_text, m_text = "".join(reasoning), "".join(content)
    events = [ev("response.created", response=SHELL), ev("response.in_progress", response=SHELL),
              ev("response.output_item.added", output_index=0,
                 item={"type": "reasoning", "id": rid, "summary": [], "status": "in_progress"}),
              ev("response.content_part.added", output_index=0, item_id=rid, content_index=0,
                 part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
    events += [ev("response.reasoning_text.delta", item_id=rid, output_index=0, content_index=1, delta=t)
               for t in reasoning]
    r_item = {"type": "reasoning", "id": rid, "summary": [], "status": "completed",
              "content": [{"type": "reasoning_text", "text": r_text}]}
    events += [ev("response.reasoning_text.done", item_id=rid, output_index=0, content_index=1, text=r_text),
               ev("response.output_item.done", output_index=0, item=r_item),
               ev("response.output_item.added", output_index=0,
                  item={"type": "message", "id": rid, "role": "assistant", "content": [], "status": "in_progress"}),
               ev("response.content_part.added", output_index=1, item_id=mid, content_index=0,
                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
    events += [ev("response.output_text.delta", item_id=mid, output_index=1, content_index=1, delta=t, logprobs=[])
               for t in content]
    part = {"type": "output_text", "text": m_text, "annotations": []}
    events += [ev("response.output_text.done", item_id=mid, output_index=1, content_index=1, text=m_text, logprobs=[]),
               ev("response.content_part.done", item_id=mid, output_index=1, content_index=2, part=part),
               ev("response.output_item.done", output_index=1,
                  item={"type": "message", "id": mid, "role": "assistant", "content": [part], "status": "completed"})]
    if final:
        output = [{"type": "reasoning", "id": "rs_fresh1", "summary": [], "status": None,
                   "content": [{"type": "reasoning_text", "text": r_text}]},
                  message(m_text, "msg_fresh2")]
        events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": output,
                                                         "usage": usage}))
    return events


TOKENS = ["word"] * 1000  # 1 000 tokens of 4 characters


def test_an_honest_vllm_stream_without_usage_is_estimated_about_its_text_not_twice(stack, ledger):
    """1 000 reasoning + 1 000 content tokens (8 000 characters): the final output's items have
    fresh ids, so each counted again as an item of its own: about 4 000 estimated for 2 000."""
    response = post(stack, ledger, vllm_simple(TOKENS, TOKENS, final=True, usage=None))
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens <= 1.25 * 2000, record.completion_tokens


def test_an_honest_gpt_oss_function_call_with_no_item_id_cut_is_billed_about_its_text(stack, ledger):
    """vLLM's harmony path sends a function call's output_item.done as ResponseFunctionToolCall
    built with item_id=… (an extra field) and no id: the item counted apart from its deltas.
    Cut before response.completed: 1 000 deltas + 4 000 characters were estimated again."""
    tools = [{"type": "function", "name": "write_file", "parameters": {"type": "object"}}]
    args = "".join(TOKENS)
    events = [ev("response.created", response=SHELL),
              ev("response.output_item.added", output_index=1,
                 item={"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "write_file",
                       "arguments": "", "status": "in_progress"})]
    events += [ev("response.function_call_arguments.delta", item_id="fc_1", output_index=1, delta=t) for t in TOKENS]
    events += [ev("response.function_call_arguments.done", item_id="fc_1", output_index=2, name="write_file",
                  arguments=args),
               ev("response.output_item.done", output_index=2,
                  item={"type": "function_call", "arguments": args, "name": "write_file", "item_id": "fc_1",
                        "output_index": 2, "sequence_number": -1, "call_id": "fc_x", "status": "completed"})]
    response = post(stack, ledger, events, tools=tools, mock={"cut_after": 0})
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens <= 1.25 * len(args) / 4, record.completion_tokens
