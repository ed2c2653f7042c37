"""Contract §4 (and the generation id of §1): cost, usage events, credits, estimated usage."""

from __future__ import annotations

import json
import threading
from decimal import Decimal

import pytest

from support import TELEMETRY, data_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PAGE_CHAT = {
    "model": "gpt-oss-120b",
    "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}],
    "max_tokens": 800,
}
PAGE_COMPLETION = {"model": "gpt-oss-120b", "prompt": "The capital of France is", "max_tokens": 32}


def test_worked_example_5_plus_7_costs_0_000000665(stack, org):
    response = stack.post(COMPLETIONS, PAGE_COMPLETION, org[1])
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (5, 7)
    # the number as written, and as parsed exactly
    assert '"cost":0.000000665' in response.text
    assert json.loads(response.text, parse_float=Decimal)["usage"]["cost"] == Decimal("0.000000665")


def test_worked_example_9_plus_12_costs_0_000001155(stack, org):
    response = stack.post(CHAT, PAGE_CHAT, org[1])
    usage = json.loads(response.text, parse_float=Decimal)["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (9, 12, 21)
    assert usage["cost"] == Decimal("0.000001155")


def test_streamed_usage_chunk_has_the_same_cost(stack, org):
    body = {**PAGE_COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    response = stack.post(COMPLETIONS, body, org[1])
    assert '"cost":0.000000665' in response.text
    usage_chunk = data_events(response.text)[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["total_tokens"] == 12


def test_cached_tokens_are_kept_and_priced_at_the_cached_price(stack, org):
    body = {**PAGE_CHAT, "mock": {"cached_tokens": 4}}
    usage = json.loads(stack.post(CHAT, body, org[1]).text, parse_float=Decimal)["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
    # 5 uncached × 0.035 + 4 cached × 0.0175 + 12 × 0.07, per million
    assert usage["cost"] == (5 * Decimal("0.035") + 4 * Decimal("0.0175") + 12 * Decimal("0.07")) / 1_000_000


def test_every_admitted_request_writes_one_event_that_the_header_finds(stack, org):
    org_id, key = org
    ids = set()
    for body, path in ((PAGE_CHAT, CHAT), ({**PAGE_CHAT, "stream": True}, CHAT), (PAGE_COMPLETION, COMPLETIONS)):
        response = stack.post(path, body, key)
        ids.add(response.headers["X-Neocloud-Generation-Id"])
    assert len(ids) == 3
    events = {event.gen_id: event for event in stack.events(org_id)}
    assert set(events) == ids
    chat = events[min(ids)]  # generation ids sort by time: the first request
    assert chat.status == "success" and chat.http_status == 200
    assert (chat.model, chat.endpoint, chat.streamed) == ("gpt-oss-120b", "chat.completions", False)
    assert (chat.prompt_tokens, chat.completion_tokens, chat.cost) == (9, 12, Decimal("0.000001155"))
    assert chat.finish_reason == "stop" and chat.usage_source == "upstream" and chat.upstream == "local"
    assert chat.ttfb_ms is not None and chat.duration_ms >= chat.ttfb_ms
    assert {e.endpoint for e in events.values()} == {"chat.completions", "completions"}


def test_credits_are_debited_by_exactly_the_cost(stack):
    org_id, key = stack.org(credits="1")
    for _ in range(3):
        stack.post(CHAT, PAGE_CHAT, key)
    assert stack.org_info(org_id).credits == Decimal("1") - 3 * Decimal("0.000001155")
    assert sum(e.cost for e in stack.events(org_id)) == 3 * Decimal("0.000001155")


def test_the_slot_is_released_before_the_last_byte(stack):
    """With a limit of 1, back-to-back requests never see a 429."""
    org_id, key = stack.org(concurrency=1)
    statuses = []
    for index in range(12):
        body = {**PAGE_CHAT, "stream": index % 2 == 0}
        statuses.append(stack.post(CHAT, body, key).status_code)
    assert statuses == [200] * 12
    assert stack.org_info(org_id).in_flight == 0


def test_usage_not_reported_upstream_is_estimated_and_still_billed(stack, org):
    org_id, key = org
    silent = {"no_usage": True}
    buffered = stack.post(CHAT, {**PAGE_CHAT, "mock": silent}, key)
    usage = buffered.json()["usage"]
    assert usage["completion_tokens"] > 0 and usage["prompt_tokens"] > 0 and usage["cost"] > 0

    streamed = stack.post(CHAT, {**PAGE_CHAT, "stream": True, "mock": silent}, key)
    assert all("usage" not in c for c in data_events(streamed.text)[:-1])

    asked = stack.post(
        COMPLETIONS, {**PAGE_COMPLETION, "stream": True, "stream_options": {"include_usage": True}, "mock": silent}, key
    )
    chunks = data_events(asked.text)
    assert chunks[-1] == "[DONE]"
    usage_chunk = chunks[-2]
    assert usage_chunk["choices"] == [] and usage_chunk["id"] == chunks[0]["id"]
    assert usage_chunk["usage"]["completion_tokens"] == 7  # one per token relayed
    assert usage_chunk["usage"]["cost"] > 0

    events = stack.events(org_id)
    assert len(events) == 3
    assert {e.usage_source for e in events} == {"estimated"}
    assert all(e.cost > 0 for e in events)
    streamed_event = next(e for e in events if e.endpoint == "chat.completions" and e.streamed)
    assert streamed_event.completion_tokens == 12


def test_reasoning_tokens_are_billed_as_reported(stack, org):
    """completion_tokens is billed as the upstream reports it, its reasoning tokens included:
    the reasoning is neither billed again nor dropped, and its breakdown reaches the client."""
    org_id, key = org
    reasoning, answer = 18, 12
    raw = json.dumps({
        "id": "chatcmpl-r1", "object": "chat.completion", "created": 1700000000, "model": "gpt-oss-120b",
        "choices": [{
            "index": 0, "finish_reason": "stop",
            "message": {"role": "assistant", "reasoning_content": "The user greets; greet back. " * 6, "content": "Hello! How can I help?"},
        }],
        "usage": {
            "prompt_tokens": 9, "completion_tokens": reasoning + answer, "total_tokens": 9 + reasoning + answer,
            "completion_tokens_details": {"reasoning_tokens": reasoning},
        },
    })
    response = stack.post(CHAT, {**PAGE_CHAT, "mock": {"raw_body": raw}}, key)
    usage = json.loads(response.text, parse_float=Decimal)["usage"]
    assert usage["completion_tokens"] == 30
    assert usage["completion_tokens_details"] == {"reasoning_tokens": 18}
    assert usage["cost"] == (9 * Decimal("0.035") + 30 * Decimal("0.07")) / 1_000_000
    (event,) = stack.events(org_id)
    assert (event.completion_tokens, event.usage_source, event.cost) == (30, "upstream", usage["cost"])


def test_a_buffered_answer_opened_by_a_byte_order_mark_is_served_and_billed(stack, org):
    """A model server's JSON answer that starts with a UTF-8 byte order mark (which a JSON reader
    may ignore, and the SDKs do, as the SSE format drops one that opens a stream): it was a 502
    and unbilled, where the same server's stream was served."""
    org_id, key = org
    raw = "\ufeff" + json.dumps({
        "id": "chatcmpl-b1", "object": "chat.completion", "created": 1700000000, "model": "gpt-oss-120b",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
    })
    response = stack.post(CHAT, {**PAGE_CHAT, "mock": {"raw_body": raw}}, key)
    assert response.status_code == 200, response.text
    assert not response.content.startswith(b"\xef\xbb\xbf")  # no mark is passed on
    answer = json.loads(response.content, parse_float=Decimal)
    assert answer["choices"][0]["message"]["content"] == "Hi"
    (event,) = stack.events(org_id)
    assert (event.status, event.usage_source, event.cost) == ("success", "upstream", Decimal("0.000001155"))
    assert answer["usage"]["cost"] == event.cost


def test_generation_ids_are_unique_under_concurrency(stack):
    org_id, key = stack.org(concurrency=16)
    seen: list[str] = []

    def call():
        seen.append(stack.post(CHAT, PAGE_CHAT, key).headers["X-Neocloud-Generation-Id"])

    threads = [threading.Thread(target=call) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(seen)) == 16
    assert {e.gen_id for e in stack.events(org_id)} == set(seen)


def _completion_answer(prompts: int, per_choice: int, prompt_tokens: int) -> str:
    return json.dumps({
        "id": "cmpl-batch", "object": "text_completion", "created": 1700000000, "model": "gpt-oss-120b",
        "choices": [{"index": index, "text": " w" * per_choice, "finish_reason": "length"} for index in range(prompts)],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": prompts * per_choice,
                  "total_tokens": prompt_tokens + prompts * per_choice},
    })


def test_a_batch_of_prompts_is_billed_for_every_prompt_and_its_choices(stack, org):
    """/v1/completions takes a list of prompts; the usage of all of them is what the model
    can have produced, and is believed (contract §4)."""
    org_id, key = org
    body = {"model": "gpt-oss-120b", "prompt": ["hello there"] * 20, "max_tokens": 10,
            "mock": {"raw_body": _completion_answer(20, 10, 40)}}
    usage = json.loads(stack.post(COMPLETIONS, body, key).text, parse_float=Decimal)["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (40, 200)
    (event,) = stack.events(org_id)
    assert (event.prompt_tokens, event.completion_tokens, event.usage_source) == (40, 200, "upstream")
    assert event.cost == (40 * Decimal("0.035") + 200 * Decimal("0.07")) / 1_000_000


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", ["4", 4.0, " 4 "])
def test_n_spelled_as_the_model_server_reads_it_is_billed_for_every_choice(stack, org, n, stream):
    """vLLM serves n "4" or 4.0 as 4 choices and reports their tokens: all of them are
    believed and billed, not capped to one choice's worth."""
    org_id, key = org
    body = {"model": "gpt-oss-120b", "prompt": "The capital of France is", "max_tokens": 3, "n": n,
            "stream": stream}
    response = stack.post(COMPLETIONS, body, key)
    assert response.status_code == 200
    if not stream:
        assert len(response.json()["choices"]) == 4
    (event,) = stack.events(org_id)
    assert (event.completion_tokens, event.usage_source) == (12, "upstream")
    assert event.cost == (5 * Decimal("0.035") + 12 * Decimal("0.07")) / 1_000_000


def test_more_choices_than_openai_allows_are_billed_when_the_server_serves_them(stack, org):
    """vLLM has no limit on n: its usage for 200 choices is what they cost, not 128's."""
    org_id, key = org
    response = stack.post(CHAT, {**PAGE_CHAT, "n": 200, "max_tokens": 12}, key)
    assert len(response.json()["choices"]) == 200
    (event,) = stack.events(org_id)
    assert (event.completion_tokens, event.usage_source) == (2400, "upstream")


def test_a_batch_still_caps_what_no_prompt_of_it_can_have_produced(stack, org):
    org_id, key = org
    body = {"model": "gpt-oss-120b", "prompt": ["a", "b"], "max_tokens": 10,
            "mock": {"raw_body": _completion_answer(2, 11, 2)}}  # 11 per prompt: above max_tokens
    mark = len(TELEMETRY.text())
    assert stack.post(COMPLETIONS, body, key).status_code == 200
    (event,) = stack.events(org_id)
    assert event.usage_source == "capped" and event.completion_tokens <= 20
    # §4: "… and logs a warning", naming the request and what was not believed
    (warning,) = [json.loads(line) for line in TELEMETRY.text()[mark:].splitlines() if "usage_capped" in line]
    logged = warning["message"] if isinstance(warning.get("message"), dict) else json.loads(warning["message"])
    assert warning["level"] == "WARNING" and logged["generation_id"] == event.gen_id and logged["problems"]


def test_a_limit_of_another_endpoint_caps_nothing(stack, org):
    """max_output_tokens is the Responses API's, max_completion_tokens chat's: a server of
    another endpoint ignores them, so they bound nothing of its usage."""
    org_id, key = org
    chat = {**PAGE_CHAT, "max_output_tokens": 1, "mock": {"tokens": 6}}
    completion = {**PAGE_COMPLETION, "max_tokens": 7, "max_completion_tokens": 1, "max_output_tokens": 1}
    assert json.loads(stack.post(CHAT, chat, key).text)["usage"]["completion_tokens"] == 6
    assert json.loads(stack.post(COMPLETIONS, completion, key).text)["usage"]["completion_tokens"] == 7
    events = sorted(stack.events(org_id), key=lambda event: event.endpoint)
    assert [(e.endpoint, e.completion_tokens, e.usage_source) for e in events] == [
        ("chat.completions", 6, "upstream"), ("completions", 7, "upstream")]


def test_either_chat_limit_may_be_the_one_the_server_honours(stack, org):
    """vLLM lets max_completion_tokens win over max_tokens, others the reverse: a reply up to
    the larger of the two is one the model can have produced."""
    org_id, key = org
    body = {**PAGE_CHAT, "max_tokens": 1, "max_completion_tokens": 4000, "mock": {"tokens": 9}}
    body["mock"]["raw_body"] = json.dumps({
        "id": "chatcmpl-l", "object": "chat.completion", "created": 1700000000, "model": "gpt-oss-120b",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "w " * 9}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18}})
    assert json.loads(stack.post(CHAT, body, key).text)["usage"]["completion_tokens"] == 9
    (event,) = stack.events(org_id)
    assert (event.completion_tokens, event.usage_source) == (9, "upstream")


ZERO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_buffered_answer_with_text_reported_as_zero_tokens_is_not_billed_zero(stack, org, endpoint):
    """A model server that reports 0 tokens for a prompt and an answer that hold text: a
    token per non-empty text of the answer at least, as for a stream (a token per text
    relayed), and the prompt as the gateway estimates it (contract §4: never billed zero)."""
    org_id, key = org
    if endpoint == "chat":
        path, body = CHAT, {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "hello there"}]}
        answer = {"id": "c1", "object": "chat.completion", "created": 1, "model": "gpt-oss-120b", "usage": ZERO_USAGE,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello there"},
                               "finish_reason": "stop"}]}
    else:
        path, body = COMPLETIONS, {"model": "gpt-oss-120b", "prompt": "hello there"}
        answer = {"id": "c1", "object": "text_completion", "created": 1, "model": "gpt-oss-120b", "usage": ZERO_USAGE,
                  "choices": [{"index": 0, "text": " and welcome", "finish_reason": "stop"}]}
    response = stack.post(path, {**body, "mock": {"raw_body": json.dumps(answer)}}, key)
    assert response.status_code == 200, response.text
    usage = json.loads(response.text, parse_float=Decimal)["usage"]
    (event,) = stack.events(org_id)
    assert event.usage_source == "capped" and event.prompt_tokens > 0 and event.completion_tokens > 0
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (event.prompt_tokens, event.completion_tokens)
    assert event.cost > 0 and usage["cost"] == event.cost


def test_a_price_changed_under_a_stream_bills_it_the_price_it_was_admitted_at(stack_factory):
    """The catalog is changed while a stream runs: the stream is billed, and shown, the price
    of the catalog it was validated against; the next request the new one."""
    stack = stack_factory(catalog_cache_seconds=0)
    org_id, key = stack.org()
    name = stack.settings.catalog_parameter
    catalog = json.loads(stack.ssm.get_parameter(Name=name)["Parameter"]["Value"])
    body = {**PAGE_CHAT, "stream": True, "stream_options": {"include_usage": True},
            "mock": {"tokens": 10, "token_delay_ms": 100}}
    answers = []
    streaming = threading.Thread(target=lambda: answers.append(stack.post(CHAT, body, key)))
    streaming.start()
    while stack.org_info(org_id).in_flight == 0:
        threading.Event().wait(0.02)
    for model in catalog["models"]:
        if model["id"] == "gpt-oss-120b":
            model["pricing"] = {"input": "0.35", "output": "0.7"}
    stack.ssm.put_parameter(Name=name, Value=json.dumps(catalog), Type="String", Overwrite=True)
    streaming.join()
    later = json.loads(stack.post(CHAT, PAGE_CHAT, key).text, parse_float=Decimal)["usage"]

    usage = json.loads(json.dumps(data_events(answers[0].text)[-2]["usage"]), parse_float=Decimal)
    old_price = (usage["prompt_tokens"] * Decimal("0.035") + usage["completion_tokens"] * Decimal("0.07")) / 10**6
    assert usage["cost"] == old_price
    assert later["cost"] == (later["prompt_tokens"] * Decimal("0.35") + later["completion_tokens"] * Decimal("0.7")) / 10**6
    events = {event.streamed: event.cost for event in stack.events(org_id)}
    assert events == {True: old_price, False: later["cost"]}
    assert Decimal("10") - stack.org_info(org_id).credits == old_price + later["cost"]


# a model server's usage whose prompt and completion tokens are believed, but not its total, a
# cost of its own or a count below zero (SGLang puts `reasoning_tokens` at the top); what it adds
# is shown as written
UNBELIEVED_DETAILS = {
    "prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 10**30, "reasoning_tokens": -2, "cost": -1,
    "prompt_tokens_details": {"cached_tokens": 2, "audio_tokens": 99},
    "completion_tokens_details": {"reasoning_tokens": -5, "accepted_prediction_tokens": 2, "note": "x"},
}
SHOWN_DETAILS = {
    "prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12, "reasoning_tokens": 0,
    "prompt_tokens_details": {"cached_tokens": 2, "audio_tokens": 99},
    "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": 2, "note": "x"},
}


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_the_usage_shown_totals_what_was_billed_and_no_count_below_zero(stack, org, stream):
    """§4: what the client is shown is what was billed. A believed usage object is relayed
    with its total made the billed tokens' sum, and no count below zero."""
    org_id, key = org
    header = {"id": "chatcmpl-u1", "created": 1700000000, "model": "gpt-oss-120b"}
    if stream:
        chunk = {**header, "object": "chat.completion.chunk"}
        events = [json.dumps({**chunk, "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]}),
                  json.dumps({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
                  json.dumps({**chunk, "choices": [], "usage": UNBELIEVED_DETAILS})]
        body = {**PAGE_CHAT, "stream": True, "stream_options": {"include_usage": True}, "mock": {"raw_events": events}}
        response = stack.post(CHAT, body, key)
        shown = json.loads(json.dumps(data_events(response.text)[-2]["usage"]), parse_float=Decimal)
    else:
        raw = json.dumps({**header, "object": "chat.completion", "usage": UNBELIEVED_DETAILS, "choices": [
            {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"}}]})
        response = stack.post(CHAT, {**PAGE_CHAT, "mock": {"raw_body": raw}}, key)
        shown = json.loads(response.text, parse_float=Decimal)["usage"]
    (event,) = stack.events(org_id)
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (9, 3, 2)
    assert shown == {**SHOWN_DETAILS, "cost": event.cost}
    generation = stack.http.get(f"/v1/generations/{event.gen_id}", headers={"Authorization": f"Bearer {key}"}).json()
    assert generation["usage"]["total_tokens"] == shown["total_tokens"]
