"""Contract §7: SSE relaying, keepalives, exactly one [DONE], client disconnects."""

from __future__ import annotations

import httpx

from support import data_events, sse_events, wait_for_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(**fields):
    return {"model": "qwen3-32b", "messages": [{"role": "user", "content": "Hello!"}], "stream": True, **fields}


def test_stream_headers(stack, org):
    response = stack.post(CHAT, chat(), org[1])
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["X-Neocloud-Generation-Id"].startswith("gen-")


def test_content_chunks_arrive_as_the_upstream_sent_them(stack, org):
    body = chat(stream_options={"include_usage": True}, mock={"spaced": True, "id": "fixed-id"})
    through_gateway = stack.post(CHAT, body, org[1]).text
    direct = httpx.post(f"{stack.mock.url}/chat/completions", json=body, timeout=10).text
    upstream_content = [e for e in sse_events(direct) if '"usage"' not in e and e != "data: [DONE]"]
    gateway_content = [e for e in sse_events(through_gateway) if '"usage"' not in e and e != "data: [DONE]"]
    assert gateway_content == upstream_content  # same bytes, same order, none merged
    assert ", " in gateway_content[1]  # the upstream's spacing survived


def test_exactly_one_done_at_the_very_end(stack, org):
    for body in (chat(), chat(stream_options={"include_usage": True}), chat(n=3)):
        text = stack.post(CHAT, body, org[1]).text
        assert text.count("data: [DONE]") == 1
        assert text.endswith("data: [DONE]\n\n")


def test_n_choices_stream_every_choice(stack, org):
    chunks = data_events(stack.post(CHAT, chat(n=3), org[1]).text)[:-1]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}


def test_keepalives_while_the_upstream_is_silent(stack_factory):
    stack = stack_factory(keepalive_seconds=0.1)
    _, key = stack.org()
    text = stack.post(CHAT, chat(mock={"ttft_ms": 700}), key).text
    events = list(sse_events(text))
    first_data = next(i for i, e in enumerate(events) if e.startswith("data: "))
    assert first_data >= 3
    assert set(events[:first_data]) == {": keepalive"}
    assert data_events(text)[-1] == "[DONE]"


def test_no_keepalive_before_the_upstream_answered(stack_factory):
    """An upstream that takes its time to say 400 still gets its 400 through, not a 200."""
    stack = stack_factory(keepalive_seconds=0.1)
    org_id, key = stack.org()
    response = stack.post(CHAT, chat(mock={"headers_delay_ms": 600, "status": 400, "message": "bad"}), key)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "bad"


def test_tokens_reach_the_client_while_the_upstream_is_still_generating(stack, org):
    with stack.http.stream(
        "POST", CHAT, json=chat(mock={"token_delay_ms": 150}), headers={"Authorization": f"Bearer {org[1]}"}
    ) as response:
        for line in response.iter_lines():
            if '"content":"Hello"' in line:
                # read now: leaving the loop closes the client's connection, and a gateway that
                # notices at once has closed the upstream's by the next line
                stats = stack.mock.stats
                break
    assert stats["completed"] == 0 and stats["in_flight"] == 1


def test_client_disconnect_closes_the_upstream_releases_the_slot_and_bills_what_was_seen(stack, org):
    org_id, key = org
    received = 0
    with stack.http.stream(
        "POST", CHAT, json=chat(mock={"token_delay_ms": 200}), headers={"Authorization": f"Bearer {key}"}
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                received += 1
            if received == 3:  # the role chunk and two tokens
                break
    stack.mock.wait_for(lambda s: s["disconnects"] == 1 and s["in_flight"] == 0)
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.status == "client_disconnected"
    assert 2 <= event.completion_tokens < 12
    assert event.cost > 0
    assert stack.org_info(org_id).in_flight == 0


def test_a_delta_that_is_no_utf8_reaches_the_python_sdk_as_the_sse_format_reads_it(stack, org):
    """§7: a model server's delta holding bytes that are no UTF-8 (a lone surrogate, as a
    tokenizer's bug may write it) went out as sent, and the OpenAI Python SDK raised
    UnicodeDecodeError, no APIError, mid-answer. It reads U+FFFD there now, as a browser's
    EventSource does, and the rest of the answer after it."""
    import openai

    head = '{"id":"c1","object":"chat.completion.chunk","created":1,"model":"qwen3-32b","choices":[{"index":0,'
    events = [head + '"delta":{"role":"assistant","content":"He"},"finish_reason":null}]}',
              head + '"delta":{"content":"\udcffo"},"finish_reason":null}]}',
              head + '"delta":{"content":" there"},"finish_reason":"stop"}]}',
              '{"id":"c1","object":"chat.completion.chunk","created":1,"model":"qwen3-32b","choices":[],'
              '"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}}']
    mock = stack.mock.app
    plain = mock.defaults
    mock.defaults = plain.merged({"raw_events": events})
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key=org[1], max_retries=0)
        stream = client.chat.completions.create(model="qwen3-32b", messages=[{"role": "user", "content": "hi"}],
                                                stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    finally:
        mock.defaults = plain
    assert text == "He\ufffd\ufffd\ufffdo there"
    (event,) = wait_for_events(stack, org[0], 1)
    assert event.status == "success" and event.completion_tokens == 3
    assert stack.org_info(org[0]).in_flight == 0
