"""The Responses relay item by item (contract §4, §9): what honest servers send in their own
order and numbering (vLLM's final output mints new item ids; its gpt-oss function calls give
their deltas' item_id) is billed as reported or about its text; what a hostile one sends (an
id reused for many items, different texts under one id, an event only a client's parser
reads), never below what it relayed; and what the relay keeps of a stream, bounded."""

from __future__ import annotations

import json
import random
import string
import tracemalloc

import pytest

from kiln.apis import responses
from support import LedgerCheck

RESPONSES = "/v1/responses"
MODEL = "qwen3-32b"  # context length 40 960
LONG = "word " * 5000  # 25 000 characters: never fewer than 196 tokens


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
TOOLS = [{"type": "function", "name": "write_file", "parameters": {"type": "object"}}]


def message(text: str, item_id: str | None) -> dict:
    item = {"type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}
    if item_id is not None:
        item["id"] = item_id
    return item


def distinct_texts(n: int, length: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(string.ascii_letters + " ") for _ in range(length)) for _ in range(n)]


# -- 1. honest servers ------------------------------------------------------------------------


def gpt_oss_function_call(tokens: list[str], usage: dict | None) -> list[str]:
    """gpt-oss on vLLM (`_process_harmony_streaming_events`, serving_responses.py up to the
    release where `emit_function_call_delta_events` learned to "Always emit the delta
    (including on first call)"): the first argument token of a function call is spent on
    `response.output_item.added` and never sent as a delta; the done events, the item and
    the final response give the whole arguments, that token included."""
    args = "".join(tokens)
    item = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "write_file",
            "arguments": args, "status": "completed"}
    events = [ev("response.created", response=SHELL), ev("response.in_progress", response=SHELL),
              ev("response.output_item.added", output_index=1,
                 item={**item, "id": "msg_prev", "arguments": "", "status": "in_progress"})]
    events += [ev("response.function_call_arguments.delta", item_id="fc_1", output_index=1, delta=t)
               for t in tokens[1:]]  # the first token: no delta
    events += [ev("response.function_call_arguments.done", item_id="fc_1", output_index=2, name="write_file",
                  arguments=args),
               ev("response.output_item.done", output_index=2, item=item)]
    if usage is not False:
        events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": [item],
                                                         "usage": usage}))
    return events


ARG_TOKENS = ['{"co'] + ["de x"] * 999  # 1 000 tokens of 4 characters: 4 000 characters of arguments


def test_an_honest_gpt_oss_function_call_whose_first_token_is_no_delta_is_believed(stack, ledger):
    """1 000 argument tokens, 999 of them as deltas; output_tokens 1 012 (the arguments and
    the harmony header, `<|constrain|>json<|message|>`, `<|call|>`). The whole arguments
    neither equal, lie in, nor begin with the deltas (they *end* with them), so all 4 000
    characters count "beyond" the deltas: floor 999 + 32 = 1 031 > 1 012, `capped`."""
    reported = len(ARG_TOKENS) + 12
    usage = {"input_tokens": 20, "output_tokens": reported, "total_tokens": 20 + reported}
    response = post(stack, ledger, gpt_oss_function_call(ARG_TOKENS, usage), tools=TOOLS)
    assert response.status_code == 200
    (record,) = ledger.check()
    assert (record.usage_source, record.completion_tokens) == ("upstream", reported)


def test_an_honest_gpt_oss_function_call_cut_before_its_usage_is_billed_about_its_text(stack, ledger):
    """The same stream cut before response.completed: 999 deltas + the 4 000 characters
    estimated again: 1 999 tokens billed for 4 000 characters (1 000 tokens)."""
    response = post(stack, ledger, gpt_oss_function_call(ARG_TOKENS, False), tools=TOOLS,
                    mock={"cut_after": 0})
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens <= 1.25 * len("".join(ARG_TOKENS)) / 4, record.completion_tokens


def test_identical_texts_streamed_in_three_items_are_not_billed_five_times(stack, ledger):
    """Three parallel function calls (three tools of the request) with the same arguments, each
    streamed as 100 one-token deltas: the final response holds the text 3 times, the rule
    takes off one spelling (`extra = times - 1`) though three delta groups spelled it, so two
    more copies count: 300 + 250 = 550 estimated for 1 500 characters (375 by text/4)."""
    args = "word " * 100
    tools = [{"type": "function", "name": f"f{k}", "parameters": {"type": "object"}} for k in range(3)]
    items, events = [], [ev("response.created", response=SHELL)]
    for k in range(3):
        item = {"type": "function_call", "id": f"fc{k}", "call_id": f"c{k}", "name": f"f{k}", "arguments": args,
                "status": "completed"}
        items.append(item)
        events.append(ev("response.output_item.added", output_index=k, item={**item, "arguments": ""}))
        events += [ev("response.function_call_arguments.delta", item_id=f"fc{k}", output_index=k, delta="word ")
                   for _ in range(100)]
        events += [ev("response.function_call_arguments.done", item_id=f"fc{k}", output_index=k, arguments=args),
                   ev("response.output_item.done", output_index=k, item=item)]
    events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": items}))
    response = post(stack, ledger, events, tools=tools)
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens <= 1.25 * 3 * len(args) / 4, record.completion_tokens


# -- 2. hostile servers -----------------------------------------------------------------------


def test_a_delta_group_holding_every_later_whole_text_does_not_lower_the_bill(stack, ledger):
    """100 messages given whole (output_item.added, items b0..b99), each a different
    24 900-character text: alone they are billed at least 100 × 195 tokens. One delta of
    25 000 random characters first, in item a, of which each message is a substring: every
    whole text is "in" the deltas, the floor falls to 196 and output_tokens 196 is believed
    for 2.5 MB relayed. Sending more text lowers the bill."""
    rng = random.Random(7)
    junk = "".join(rng.choice(string.ascii_letters + " ") for _ in range(25_000))
    texts = [junk[k:k + 24_900] for k in range(100)]
    events = [ev("response.output_text.delta", item_id="a", output_index=0, content_index=0, delta=junk)]
    events += [ev("response.output_item.added", output_index=k + 1, item=message(text, f"b{k}"))
               for k, text in enumerate(texts)]
    events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": [],
                                                     "usage": {"input_tokens": 4, "output_tokens": fewest(junk)}}))
    response = post(stack, ledger, events)
    assert response.status_code == 200 and texts[-1] in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= sum(fewest(text) for text in texts), (record.completion_tokens,
                                                                             record.usage_source)


def test_one_text_in_fifty_items_is_billed_for_each_item(stack, ledger):
    """50 output_item.added events, 50 message items (m0..m49, output indexes 0..49), each the
    same 25 000 characters; the final event's output is empty. The SDK's snapshot holds 50
    messages; the relay counts the text once (the most times *one* event held it): 196 tokens
    believed for 1.25 MB relayed."""
    events = [ev("response.output_item.added", output_index=k, item=message(LONG, f"m{k}")) for k in range(50)]
    events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": [],
                                                     "usage": {"input_tokens": 4, "output_tokens": fewest(LONG)}}))
    response = post(stack, ledger, events)
    assert response.status_code == 200 and response.text.count(LONG) >= 50
    (record,) = ledger.check()
    assert record.completion_tokens >= 50 * fewest(LONG), (record.completion_tokens, record.usage_source)


@pytest.mark.parametrize("usage", [{"input_tokens": 4, "output_tokens": fewest(LONG)}, None],
                         ids=["one-copy-reported", "no-usage"])
@pytest.mark.parametrize("given_before", [0, 1])
def test_identical_items_given_only_in_the_final_event_are_billed_for_each_item(stack, ledger, usage, given_before):
    """30 message items, the same 25 000 characters each, in response.completed (fresh ids),
    none or one of them given before (output_item.added): the SDK's final response holds 30
    messages. At most the one given before is restated, so each other counts: not 196 tokens
    believed, nor 6 250 estimated, for 750 000 characters."""
    output = [message(LONG, f"m{k}") for k in range(30)]
    events = [ev("response.created", response=SHELL)]
    events += [ev("response.output_item.added", output_index=0, item=message(LONG, "m_before"))] * given_before
    events += [ev("response.completed", response={**SHELL, "status": "completed", "output": output, "usage": usage})]
    response = post(stack, ledger, events)
    assert response.status_code == 200 and response.text.count(LONG) >= 30
    (record,) = ledger.check()
    assert record.completion_tokens >= 30 * fewest(LONG), (record.completion_tokens, record.usage_source)
    if usage is None:
        # as estimated, up to the model's context (40 960)
        assert record.completion_tokens >= min(30 * len(LONG) // 4, 40_960), record.completion_tokens


def parallel_calls(args: str, calls: int, *, streamed: bool) -> list[str]:
    """`calls` function calls with the same arguments: streamed (added, deltas, done, under
    their ids, as vLLM streams them) with a final output of fresh ids, or given only in the final."""
    items = [{"type": "function_call", "id": f"fc{k}", "call_id": f"c{k}", "name": "write_file",
              "arguments": args, "status": "completed"} for k in range(calls)]
    events = [ev("response.created", response=SHELL)]
    if streamed:
        for k, item in enumerate(items):
            events.append(ev("response.output_item.added", output_index=k, item={**item, "arguments": ""}))
            events += [ev("response.function_call_arguments.delta", item_id=item["id"], output_index=k, delta=t)
                       for t in (args[i:i + 5] for i in range(0, len(args), 5))]  # 5 characters a delta
            events += [ev("response.function_call_arguments.done", item_id=item["id"], output_index=k, arguments=args),
                       ev("response.output_item.done", output_index=k, item=item)]
    fresh = [{**item, "id": f"fc_fresh{k}"} for k, item in enumerate(items)]
    events.append(ev("response.completed", response={**SHELL, "status": "completed", "output": fresh}))
    return events


@pytest.mark.parametrize("streamed", [False, True], ids=["final-only", "streamed-then-final"])
def test_parallel_calls_with_the_same_arguments_are_estimated_for_each_call_once(stack, ledger, streamed):
    """20 calls of one tool with the same 400-character arguments and no usage: each call's
    arguments count, whether the calls came only in the final event or were streamed first
    and restated there under fresh ids (then not twice: the old rule took that case right, and
    the final-only case as one call)."""
    args = "word " * 80  # 80 deltas a call when streamed
    response = post(stack, ledger, parallel_calls(args, 20, streamed=streamed), tools=TOOLS)
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    # a call's arguments: 80 deltas (a token each), or 400 characters given whole (100 by text/4)
    assert 20 * 80 <= record.completion_tokens <= 1.25 * 20 * 100, record.completion_tokens


def _never_relayed_unbilled(stack, ledger, events: list[str], text: str, **extra) -> None:
    response = post(stack, ledger, events, **extra)
    assert response.status_code == 200
    if text in response.text:  # relayed: then billed
        (record,) = ledger.check()
        assert record.completion_tokens >= fewest(text), (record.completion_tokens, record.usage_source)
        return
    # not relayed: the stream ends with the one error event, as for a final event it cannot read
    assert response.text.rstrip("\n").rsplit("\n\n", 1)[-1].startswith("event: error"), response.text[-300:]
    (record,) = ledger.check()
    assert record.status == "stream_interrupted"


def test_an_event_the_gateway_cannot_read_but_the_sdks_can_is_never_relayed_unbilled(stack, ledger):
    """`response.output_item.added` with a 25 000-character message and an extra field
    `"x": 1e999`: Python's json.loads (the OpenAI SDK) reads it as inf, JSON.parse as
    Infinity, and both hand the item to the client; the gateway's strict parser rejects it.
    It was relayed with nothing counted, billed the 1 token reported: what the gateway
    cannot read (and so count) it does not relay."""
    added = ev("response.output_item.added", output_index=0, item=message(LONG, "m"))[:-1] + ', "x": 1e999}'
    assert json.loads(added)["item"]["content"][0]["text"] == LONG
    events = [added, ev("response.completed", response={**SHELL, "status": "completed", "output": [],
                                                        "usage": {"input_tokens": 4, "output_tokens": 1}})]
    _never_relayed_unbilled(stack, ledger, events, LONG)


def test_a_delta_with_an_escape_in_an_event_the_gateway_cannot_read_is_never_relayed_unbilled(stack, ledger):
    """A `response.output_text.delta` of 16 000 characters with one `\\u00e9` escape and
    `"x": 1e999`: the escape makes the relay read the event, the read fails, and the delta was
    relayed uncounted (cut before any final event: billed 0 completion tokens)."""
    delta = ev("response.output_text.delta", item_id="m", output_index=0, content_index=0,
               delta="\u00e9" + "abcd" * 4000)[:-1] + ', "x": 1e999}'
    assert "\\u00e9" in delta and len(json.loads(delta)["delta"]) == 16_001
    _never_relayed_unbilled(stack, ledger, [delta], "abcd" * 4000, mock={"cut_after": 0})


def test_a_delta_the_gateway_cannot_read_without_an_escape_is_billed_as_sent(stack, ledger):
    delta = ev("response.output_text.delta", item_id="m", output_index=0, content_index=0,
               delta="abcd" * 4000)[:-1] + ', "x": 1e999}'
    response = post(stack, ledger, [delta], mock={"cut_after": 0})
    assert "abcd" * 4000 in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= fewest("abcd" * 4000), (record.completion_tokens, record.usage_source)


# -- memory ------------------------------------------------------------------------------------


def test_what_a_stream_remembers_stays_bounded_however_many_items_and_parts_it_sends():
    """Whole texts were once remembered as texts (a str and a dict entry each, ~85 bytes for
    4 characters: ~330 MB for one stream of tiny texts). The relay keeps counts by item, at
    most MAX_ITEMS of them, each with at most MAX_ITEM_PARTS hashes of its texts."""
    relay = responses.ResponsesRelay(max_event_bytes=1 << 20)
    alphabet = string.ascii_letters + string.digits
    names = iter(a + b + c + d for a in alphabet for b in alphabet for c in alphabet for d in alphabet)
    tracemalloc.start()
    try:
        for item in range(2 * responses.MAX_ITEMS):
            texts = [next(names) for _ in range(2 * responses.MAX_ITEM_PARTS)]
            for text in texts:
                payload = json.dumps({"type": "response.content_part.done", "item_id": f"m{item}",
                                      "part": {"type": "output_text", "text": text}})
                relay.feed(b"data: " + payload.encode() + b"\n\n")
            if item % 500 == 0:
                retained, _ = tracemalloc.get_traced_memory()
                assert retained <= 8 << 20, (item, retained)
    finally:
        tracemalloc.stop()
    # and every text still counted: one token at least each
    assert relay.fewest_tokens >= 2 * responses.MAX_ITEMS * 2 * responses.MAX_ITEM_PARTS


@pytest.mark.parametrize("kind", ["delta", "done", "escaped-delta"])
def test_what_a_stream_remembers_stays_bounded_however_long_its_item_ids(kind):
    """Every event within its 1 MiB bound, each item with a 128 KiB id: the relay kept each id
    whole, a gigabyte for one stream of a thousand items with 1 MiB ids. Past MAX_ID_BYTES an id is
    remembered by its digest; items are still told apart and their texts counted."""
    relay = responses.ResponsesRelay(max_event_bytes=1 << 20)
    tracemalloc.start()
    try:
        for item in range(200):
            item_id = f"{item:06d}" + "i" * (128 * 1024)
            event = {"type": "response.output_text.delta", "item_id": item_id, "delta": "x y"}
            if kind == "done":
                event = {"type": "response.output_text.done", "item_id": item_id, "text": "x y"}
            payload = json.dumps(event).encode()
            if kind == "escaped-delta":  # read as JSON: an escape may spell anything
                payload = payload.replace(b'"x y"', b'"x \\u0079"')
            relay.feed(b"data: " + payload + b"\n\n")
        retained, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert retained <= 8 << 20, f"{retained / 2**20:.0f} MiB retained by one stream's relay"
    assert relay.fewest_tokens >= 200  # a token at least, each item's


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


def junk_then_whole(text: str, deltas: int, usage: dict | None) -> list[str]:
    """`deltas` deltas of 16 characters (a token each by the relay's rule) under id "m", then a
    different text given whole under the same id (its done events and the final output)."""
    junk = distinct_texts(deltas, 16, seed=5)
    events = [ev("response.output_text.delta", item_id="m", output_index=0, content_index=0, delta=piece)
              for piece in junk]
    events += [ev("response.output_text.done", item_id="m", output_index=0, content_index=0, text=text),
               ev("response.output_item.done", output_index=0, item=message(text, "m"))]
    final = {**SHELL, "status": "completed", "output": [message(text, "m")]}
    if usage is not None:
        final["usage"] = usage
    return events + [ev("response.completed", response=final)]


def test_junk_deltas_then_a_different_whole_text_under_one_id_are_estimated_for_both(stack, ledger):
    """1 000 deltas of 16 characters, then a different 16 000-character text given whole, all
    under id "m", no usage. The relay took the whole text to be the deltas' text when it was no
    longer than their bytes: 1 000 tokens estimated for the deltas and ~4 000 of text."""
    text = distinct_texts(1, 16_000, seed=13)[0]
    response = post(stack, ledger, junk_then_whole(text, 1000, None))
    assert response.status_code == 200 and text in response.text
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert record.completion_tokens >= 1000 + 0.8 * len(text) / 4, record.completion_tokens


def test_junk_deltas_then_a_different_whole_text_under_one_id_are_both_the_floor(stack, ledger):
    """The same with output_tokens 1 000 reported: the floor was the larger of the deltas' (1 000)
    and the whole text's (125), so 1 000 was believed for both."""
    text = distinct_texts(1, 16_000, seed=13)[0]
    usage = {"input_tokens": 5, "output_tokens": 1000, "total_tokens": 1005}
    response = post(stack, ledger, junk_then_whole(text, 1000, usage))
    assert response.status_code == 200 and text in response.text
    (record,) = ledger.check()
    assert record.completion_tokens >= 1000 + fewest(text), (record.usage_source, record.completion_tokens)


def test_a_text_streamed_in_part_and_given_whole_is_estimated_about_its_length(stack, ledger):
    """An honest odd server: the first 4 000 characters of a text as 1 000 deltas, then the whole
    8 000 characters in the done events and the final output, no usage: about 2 000 tokens, the
    streamed part counted once."""
    text = "word" * 2000
    events = [ev("response.output_text.delta", item_id="m", output_index=0, content_index=0, delta="word")
              for _ in range(1000)]
    events += [ev("response.output_text.done", item_id="m", output_index=0, content_index=0, text=text),
               ev("response.output_item.done", output_index=0, item=message(text, "m")),
               ev("response.completed", response={**SHELL, "status": "completed", "output": [message(text, "m")]})]
    response = post(stack, ledger, events)
    assert response.status_code == 200
    (record,) = ledger.check()
    assert record.usage_source == "estimated"
    assert 0.8 * len(text) / 4 <= record.completion_tokens <= 1.25 * len(text) / 4, record.completion_tokens


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
