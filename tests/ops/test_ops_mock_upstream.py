"""The mock model server (kiln_ops.mock_upstream), called directly over HTTP.

It stands in for vLLM in every other suite, so what it promises in its docstring is what
those suites rely on: the vLLM response shapes, deterministic token counts, and each fault.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from support import data_events, sse_events

CHAT_TEXT = "Hello! How can I help you today? Ask me anything."
CHAT_TOKENS = ["Hello", "!", " How", " can", " I", " help", " you", " today", "?", " Ask", " me", " anything."]
TEXT_TOKENS = [" Paris", ",", " a", " city", " on", " the", " Seine."]
BRIEF = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


@pytest.fixture
def api(mock):
    """An httpx client on the mock's /v1, with fresh stats."""
    # let requests of the previous test end first, so that max_in_flight starts from zero
    mock.wait_for(lambda stats: stats["in_flight"] <= 0)
    mock.reset()
    with httpx.Client(base_url=mock.url, timeout=10) as client:
        yield client


@pytest.fixture
def root(mock):
    """The mock's root URL (no /v1)."""
    return mock.url.rsplit("/v1", 1)[0]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "qwen3-32b", "messages": BRIEF, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "qwen3-32b", "prompt": "The capital of France is", **fields}


def content_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


# -- buffered -----------------------------------------------------------------------------------


def test_buffered_chat_is_a_vllm_chat_completion_with_exact_counts(api):
    response = api.post("/chat/completions", json=chat())
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "qwen3-32b"
    assert isinstance(body["created"], int) and abs(body["created"] - time.time()) < 60
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": CHAT_TEXT}, "logprobs": None, "finish_reason": "stop"}
    ]
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}


def test_buffered_completion_is_a_vllm_text_completion_with_exact_counts(api):
    body = api.post("/completions", json=completion()).json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": " Paris, a city on the Seine.", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


@pytest.mark.parametrize(
    "messages,prompt_tokens",
    [
        ([{"role": "user", "content": "one two  three\nfour"}], 3 + 4),
        ([{"role": "user", "content": [{"type": "text", "text": "two words"}, {"type": "text", "text": "three more words"}]}], 3 + 5),
        ([{"role": "user", "content": ""}, {"role": "assistant", "content": None}], 6),
    ],
    ids=["words", "parts", "empty"],
)
def test_chat_prompt_costs_a_token_per_word_plus_three_per_message(api, messages, prompt_tokens):
    usage = api.post("/chat/completions", json=chat(messages=messages)).json()["usage"]
    assert usage["prompt_tokens"] == prompt_tokens


def test_completion_prompt_as_token_ids_counts_each_id(api):
    usage = api.post("/completions", json=completion(prompt=[101, 102, 103, 104])).json()["usage"]
    assert usage["prompt_tokens"] == 4


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_cuts_the_reply_with_finish_reason_length(api, field):
    body = api.post("/chat/completions", json=chat(**{field: 3})).json()
    assert body["choices"][0]["message"]["content"] == "Hello! How"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3


def test_limits_are_read_as_vllm_reads_them(api):
    """Chat's max_completion_tokens over max_tokens; "3" and 3.0 are 3; completions ignore chat's."""
    assert api.post("/chat/completions", json=chat(max_tokens=9, max_completion_tokens=2)).json()["usage"][
        "completion_tokens"] == 2
    for spelling in ("3", 3.0):
        assert api.post("/chat/completions", json=chat(max_tokens=spelling)).json()["usage"]["completion_tokens"] == 3
    assert api.post("/completions", json=completion(max_completion_tokens=2)).json()["usage"]["completion_tokens"] == 7
    assert len(api.post("/chat/completions", json=chat(n="2")).json()["choices"]) == 2


def test_max_tokens_at_or_above_the_reply_is_a_normal_stop(api):
    body = api.post("/completions", json=completion(max_tokens=7)).json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 7


def test_tokens_option_sets_the_reply_length(api):
    body = api.post("/completions", json=completion(mock={"tokens": 10})).json()
    assert body["usage"]["completion_tokens"] == 10
    assert body["choices"][0]["text"] == "".join(TEXT_TOKENS + TEXT_TOKENS[:3])


def test_n_choices_each_get_the_reply_and_are_all_counted(api):
    body = api.post("/chat/completions", json=chat(n=3)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == CHAT_TEXT for c in body["choices"])
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 36, "total_tokens": 45}


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", chat(n=1_000_000)),
    ("/chat/completions", chat(n=100, mock={"tokens": 2_000})),
    ("/completions", completion(mock={"tokens": 10**9})),
    ("/chat/completions", chat(tools=[WEATHER_TOOL], mock={"tool_calls": 10**9})),
    ("/responses", {"model": "qwen3-32b", "input": "hi", "mock": {"tokens": 10**9}}),
])
def test_a_reply_too_large_to_make_is_a_400_not_the_machines_memory(api, path, body):
    """`n` of a million through `kiln dev` made the mock build a million replies: 23 GB, and
    the kernel killed it. The mock answers at most 100 000 tokens a request, every choice's
    together (vLLM bounds no `n`, nor does the mock: 200 choices are served)."""
    answer = api.post(path, json=body)
    assert answer.status_code == 400 and "the mock answers at most" in answer.json()["message"], answer.text
    assert len(api.post("/chat/completions", json=chat(n=200)).json()["choices"]) == 200
    # a long reply cut short by its max_tokens is the short one
    cut = api.post("/completions", json=completion(max_tokens=10, mock={"tokens": 10**9})).json()
    assert cut["usage"]["completion_tokens"] == 10 and cut["choices"][0]["finish_reason"] == "length"
    cut = api.post("/responses", json={"model": "qwen3-32b", "input": "hi", "max_output_tokens": 10,
                                       "mock": {"tokens": 10**9}}).json()
    assert cut["usage"]["output_tokens"] == 10 and cut["status"] == "incomplete"


def test_tools_given_means_a_tool_call(api):
    body = api.post("/chat/completions", json=chat(tools=[WEATHER_TOOL])).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "n": 0}
    assert body["usage"]["completion_tokens"] > 0


def test_tool_calls_option_and_tool_choice_none(api):
    two = api.post("/chat/completions", json=chat(tools=[WEATHER_TOOL], mock={"tool_calls": 2})).json()
    calls = two["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"])["n"] for c in calls] == [0, 1]
    assert len({c["id"] for c in calls}) == 2

    none = api.post("/chat/completions", json=chat(tools=[WEATHER_TOOL], tool_choice="none")).json()
    assert none["choices"][0]["message"] == {"role": "assistant", "content": CHAT_TEXT}
    assert none["choices"][0]["finish_reason"] == "stop"


def test_cached_tokens_are_reported_and_capped_at_the_prompt(api):
    usage = api.post("/chat/completions", json=chat(mock={"cached_tokens": 4})).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 4}
    assert usage["prompt_tokens"] == 9
    usage = api.post("/completions", json=completion(mock={"cached_tokens": 50})).json()["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 5}
    assert "prompt_tokens_details" not in api.post("/completions", json=completion()).json()["usage"]


# -- streamed -----------------------------------------------------------------------------------


def test_streamed_chat_has_the_vllm_shape(api):
    response = api.post("/chat/completions", json=chat(stream=True))
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream"
    assert response.headers["cache-control"] == "no-cache"
    assert all(event.startswith("data: ") for event in sse_events(response.text))
    events = data_events(response.text)
    assert events[-1] == "[DONE]"
    assert response.text.count("data: [DONE]") == 1 and response.text.endswith("data: [DONE]\n\n")
    chunks = events[:-1]
    assert len(chunks) == 1 + 12 + 1  # role, one token each, finish; no usage unless asked
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["model"] for c in chunks} == {"qwen3-32b"}
    assert all("usage" not in c for c in chunks)
    assert chunks[0]["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert [c["choices"][0]["delta"] for c in chunks[1:-1]] == [{"content": token} for token in CHAT_TOKENS]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]
    # compact JSON on the wire, as vLLM writes it
    assert response.text.startswith('data: {"id":"chatcmpl-')


def test_streamed_chat_usage_only_when_stream_options_ask_for_it_as_in_vllm(api):
    for options in (None, {"include_usage": False}, {"include_usage": "no"}):
        body = chat(stream=True) if options is None else chat(stream=True, stream_options=options)
        assert '"usage"' not in api.post("/chat/completions", json=body).text
    for options in ({}, {"continuous_usage_stats": False}, {"include_usage": "true"}):  # vLLM's default is true
        assert '"usage"' in api.post("/chat/completions", json=chat(stream=True, stream_options=options)).text
    events = data_events(api.post("/chat/completions", json=chat(stream=True, stream_options={"include_usage": True})).text)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21}
    assert usage_chunk["id"] == events[0]["id"]
    assert events[-3]["choices"][0]["finish_reason"] == "stop"


def test_streamed_completion_has_the_vllm_shape(api):
    body = completion(stream=True, stream_options={"include_usage": True})
    events = data_events(api.post("/completions", json=body).text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert {c["object"] for c in events[:-1]} == {"text_completion"}
    assert chunks[0]["id"].startswith("cmpl-")
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == TEXT_TOKENS  # no role chunk, one token each
    assert chunks[-1]["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}]
    assert usage_chunk["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


def test_streamed_max_tokens_stops_with_length(api):
    body = chat(stream=True, max_tokens=2, stream_options={"include_usage": True})
    events = data_events(api.post("/chat/completions", json=body).text)
    assert content_of(events[:-1]) == "Hello!"
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["completion_tokens"] == 2


def test_streamed_n_choices_stream_every_choice_with_one_usage(api):
    body = chat(stream=True, n=2, stream_options={"include_usage": True})
    events = data_events(api.post("/chat/completions", json=body).text)
    chunks = [e for e in events[:-1] if e["choices"]]
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["choices"][0]["delta"]["role"] == "assistant"
        assert content_of(mine) == CHAT_TEXT
        assert mine[-1]["choices"][0]["finish_reason"] == "stop"
    usage = [e for e in events[:-1] if "usage" in e]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 24


def test_streamed_tool_call_arguments_arrive_in_pieces(api):
    body = chat(stream=True, tools=[WEATHER_TOOL], stream_options={"include_usage": True})
    events = data_events(api.post("/chat/completions", json=body).text)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    first, pieces = calls[0], calls[1:]
    assert first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(pieces) > 1 and all(set(p) == {"index", "function"} for p in pieces)
    assert json.loads("".join(p["function"]["arguments"] for p in pieces)) == {"city": "Paris", "n": 0}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert events[-2]["usage"]["completion_tokens"] == len(pieces)


def test_streamed_cached_tokens_are_in_the_usage_chunk(api):
    body = chat(stream=True, stream_options={"include_usage": True}, mock={"cached_tokens": 7})
    events = data_events(api.post("/chat/completions", json=body).text)
    assert events[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}


# -- faults -------------------------------------------------------------------------------------


@pytest.mark.parametrize("status,kind", [(503, "InternalServerError"), (429, "BadRequestError"), (400, "BadRequestError")])
def test_status_answers_a_vllm_style_json_error(api, status, kind):
    response = api.post("/chat/completions", json=chat(stream=True, mock={"status": status}))
    assert response.status_code == status
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"object": "error", "message": "mock failure", "type": kind, "param": None, "code": status}


def test_status_with_message_and_plain_text(api):
    response = api.post("/completions", json=completion(mock={"status": 400, "message": "too long"}))
    assert response.json()["message"] == "too long"
    response = api.post("/completions", json=completion(mock={"status": 500, "plain_text": True}))
    assert response.status_code == 500
    assert response.headers["content-type"].startswith("text/plain")
    assert response.text == "Internal Server Error"


def test_headers_delay_holds_back_even_the_status(api, mock):
    with pytest.raises(httpx.ReadTimeout):  # not even the status line within 0.1 s
        api.post("/chat/completions", json=chat(stream=True, mock={"headers_delay_ms": 300}), timeout=0.1)
    # the client gave up: the request ends there, unanswered, as vLLM aborts one whose client left
    mock.wait_for(lambda s: s["disconnects"] == 1 and s["in_flight"] == 0 and s["completed"] == 0)
    start = time.monotonic()
    response = api.post("/chat/completions", json=chat(mock={"headers_delay_ms": 200}))
    assert response.status_code == 200 and time.monotonic() - start >= 0.2


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", chat(mock={"ttft_ms": 3000})),
    ("/chat/completions", chat(mock={"token_delay_ms": 1000})),
    ("/responses", {"model": "m", "input": "x", "mock": {"ttft_ms": 3000}}),
    ("/chat/completions", chat(stream=True, mock={"endless": True, "token_delay_ms": 3000})),
])
def test_a_client_gone_during_a_wait_ends_the_request_there(api, mock, path, body):
    """A buffered answer's wait before its tokens, and an endless stream's between them, went on
    after the client had left: the request stayed in flight for the whole wait, more than a
    gateway that had closed it had at the model server, as vLLM, which aborts it, never is."""
    with pytest.raises(httpx.ReadTimeout):
        api.post(path, json=body, timeout=0.3)
    seen = mock.wait_for(lambda s: s["in_flight"] == 0, timeout=1.5)  # well before the wait's end
    assert seen["disconnects"] == 1 and seen["completed"] == 0


def test_ttft_sends_the_headers_at_once_and_the_first_token_late(api):
    with api.stream("POST", "/chat/completions", json=chat(stream=True, mock={"ttft_ms": 400})) as response:
        assert response.status_code == 200  # the headers are in…
        headers_in = time.monotonic()
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        waited = time.monotonic() - headers_in
        rest = list(lines)
    # …and the first token still took (at least most of) its 400 ms after them
    assert waited >= 0.3, waited
    assert json.loads(first[len("data: ") :])["choices"][0]["delta"]["role"] == "assistant"
    assert "data: [DONE]" in rest


def test_token_delay_spaces_out_the_tokens(api):
    start = time.monotonic()
    arrivals = []
    body = chat(stream=True, mock={"token_delay_ms": 60, "tokens": 4})
    with api.stream("POST", "/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                arrivals.append(time.monotonic() - start)
    assert len(arrivals) == 4
    # the tokens are spaced on the mock's clock: one token read late by a busy client shortens
    # the next gap, never the time from the first token to the last (3 delays of 60 ms)
    assert arrivals[-1] - arrivals[0] >= 0.17, arrivals
    buffered_start = time.monotonic()
    api.post("/chat/completions", json=chat(mock={"token_delay_ms": 60, "tokens": 4}))
    assert time.monotonic() - buffered_start >= 0.24


def test_cut_after_breaks_the_stream_mid_way(api, mock):
    received = []
    with pytest.raises(httpx.RemoteProtocolError):
        with api.stream("POST", "/chat/completions", json=chat(stream=True, mock={"cut_after": 3})) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line:
                    received.append(line)
    chunks = [json.loads(line[len("data: ") :]) for line in received]
    assert len(chunks) == 3  # the role chunk and two tokens, then the connection drops
    assert content_of(chunks) == "Hello!"
    assert "data: [DONE]" not in received
    assert mock.stats["completed"] == 0


def test_cut_after_breaks_a_buffered_body_half_way(api):
    with pytest.raises(httpx.RemoteProtocolError):
        api.post("/chat/completions", json=chat(mock={"cut_after": 1}))


def test_no_done_ends_cleanly_without_done(api):
    body = chat(stream=True, stream_options={"include_usage": True}, mock={"no_done": True})
    response = api.post("/chat/completions", json=body)  # a clean end: no protocol error
    events = data_events(response.text)
    assert "[DONE]" not in events
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert events[-2]["choices"][0]["finish_reason"] == "stop"


def test_no_usage_reports_no_usage_anywhere(api):
    body = api.post("/chat/completions", json=chat(mock={"no_usage": True})).json()
    assert "usage" not in body and body["choices"][0]["message"]["content"] == CHAT_TEXT
    text = api.post(
        "/chat/completions", json=chat(stream=True, stream_options={"include_usage": True}, mock={"no_usage": True})
    ).text
    assert '"usage"' not in text and text.endswith("data: [DONE]\n\n")


def test_spaced_writes_the_same_json_with_spaces(api):
    body = chat(stream=True, stream_options={"include_usage": True}, mock={"id": "same"})
    compact = api.post("/chat/completions", json=body).text
    spaced = api.post("/chat/completions", json={**body, "mock": {"id": "same", "spaced": True}}).text
    assert compact != spaced
    assert data_events(compact) == data_events(spaced)
    for event in list(sse_events(spaced))[:-1]:
        assert event.startswith('data: {"id": "chatcmpl-same", "object": ')
    assert ", " not in list(sse_events(compact))[0]


def test_id_fixes_the_id_and_created_so_outputs_compare_equal(api):
    body = chat(stream=True, stream_options={"include_usage": True}, mock={"id": "fixed-id"})
    first, second = (api.post("/chat/completions", json=body).text for _ in range(2))
    assert first == second
    chunk = data_events(first)[0]
    assert chunk["id"].endswith("fixed-id") and chunk["created"] == 1700000000
    buffered = api.post("/completions", json=completion(mock={"id": "abc"})).json()
    assert buffered["id"].endswith("abc") and buffered["created"] == 1700000000
    other = data_events(api.post("/chat/completions", json=chat(stream=True)).text)[0]
    assert "fixed-id" not in other["id"]


def test_string_option_values_are_coerced(api):
    response = api.post("/completions", json=completion(mock={"status": "418", "plain_text": "yes", "message": "teapot"}))
    assert (response.status_code, response.text) == (418, "teapot")
    body = api.post("/completions", json=completion(mock={"plain_text": "false", "tokens": "2"})).json()
    assert body["usage"]["completion_tokens"] == 2


# -- the /x/ prefix: a whole backend that misbehaves --------------------------------------------


def test_path_prefix_applies_options_to_every_request(root):
    sick = f"{root}/x/status=503,plain_text=1/v1"
    response = httpx.post(f"{sick}/chat/completions", json=chat(), timeout=10)
    assert response.status_code == 503 and response.text == "Internal Server Error"
    short = f"{root}/x/tokens=2,cached_tokens=1/v1"
    body = httpx.post(f"{short}/completions", json=completion(), timeout=10).json()
    assert body["choices"][0]["text"] == " Paris,"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_path_prefix_is_url_decoded_and_the_body_overrides_it(root):
    spec = "status%3D500%2Cmessage%3Ddown"  # status=500,message=down
    response = httpx.post(f"{root}/x/{spec}/v1/chat/completions", json=chat(), timeout=10)
    assert response.status_code == 500 and response.json()["message"] == "down"
    body = chat(mock={"status": 409})
    assert httpx.post(f"{root}/x/status=500/v1/chat/completions", json=body, timeout=10).status_code == 409


def test_path_prefix_streams_with_the_faults(root):
    text = httpx.post(
        f"{root}/x/no_done=true,tokens=3/v1/completions", json=completion(stream=True), timeout=10
    ).text
    events = data_events(text)
    assert "[DONE]" not in events
    assert [e["choices"][0]["text"] for e in events] == TEXT_TOKENS[:3] + [""]


# -- requests it refuses ------------------------------------------------------------------------


def test_completion_without_a_prompt_is_400(api, mock):
    for stream in (False, True):
        response = api.post("/completions", json={"model": "qwen3-32b", "stream": stream})
        assert response.status_code == 400
        assert response.json() == {
            "object": "error",
            "message": "'prompt' is a required property",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    assert mock.stats["completed"] == 0


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b""], ids=["malformed", "array", "empty"])
def test_a_body_that_is_not_a_json_object_is_400_and_not_counted(api, mock, raw):
    response = api.post("/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["message"] == "Invalid JSON body"
    assert mock.stats["requests"] == 0


def test_unknown_routes_are_404_and_models_is_empty(api):
    assert api.post("/embeddings", json={}).status_code == 404
    assert api.get("/chat/completions").status_code == 404
    assert api.get("/models").json() == {"object": "list", "data": []}


# -- /mock/stats ----------------------------------------------------------------------------------


def stats(root: str) -> dict[str, Any]:
    return httpx.get(f"{root}/mock/stats", timeout=10).json()


def test_stats_count_requests_and_keep_the_bodies(api, root):
    api.post("/chat/completions", json=chat(user="first"))
    api.post("/completions", json=completion(user="second", mock={"status": 500}))
    seen = stats(root)
    assert seen["requests"] == 2
    assert seen["completed"] == 1  # the 500 did not complete
    assert seen["in_flight"] == 0 and seen["max_in_flight"] == 1 and seen["disconnects"] == 0
    assert [b["user"] for b in seen["bodies"]] == ["first", "second"]
    assert seen["bodies"][1]["mock"] == {"status": 500}


def test_stats_report_the_most_requests_in_flight_at_once(api, root, mock):
    def slow() -> None:  # long enough for the three to be in flight at once on a loaded machine
        with httpx.Client(base_url=mock.url, timeout=10) as client:
            client.post("/chat/completions", json=chat(stream=True, mock={"ttft_ms": 2000}))

    threads = [threading.Thread(target=slow) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        during = mock.wait_for(lambda s: s["in_flight"] == 3)
        assert during["completed"] == 0
        assert stats(root)["in_flight"] == 3
    finally:
        for thread in threads:
            thread.join(10)
    after = stats(root)
    assert (after["requests"], after["completed"], after["in_flight"], after["max_in_flight"]) == (3, 3, 0, 3)


def test_stats_count_a_client_that_disconnects_mid_stream(api, mock, root):
    body = chat(stream=True, mock={"token_delay_ms": 100})
    with api.stream("POST", "/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if '"content":"Hello"' in line:
                break
    seen = mock.wait_for(lambda s: s["disconnects"] == 1, timeout=3)
    assert seen["completed"] == 0
    seen = mock.wait_for(lambda s: s["in_flight"] == 0, timeout=3)
    assert stats(root)["disconnects"] == 1


def test_reset_while_a_request_is_in_flight_never_counts_below_zero(api, root, mock):
    waiting = threading.Thread(target=lambda: api.post("/chat/completions", json=chat(mock={"ttft_ms": 300})))
    waiting.start()  # its client waits for the answer, 300 ms away
    mock.wait_for(lambda s: s["in_flight"] == 1, timeout=3)
    httpx.post(f"{root}/mock/reset", timeout=10)
    waiting.join(timeout=5)
    mock.wait_for(lambda s: s["completed"] == 1, timeout=3)  # the stale request finished…
    time.sleep(0.05)  # …and left `_answer` (in_flight is decremented right after the last send)
    assert stats(root)["in_flight"] >= 0


def test_reset_clears_the_stats(api, root):
    api.post("/chat/completions", json=chat())
    assert stats(root)["requests"] == 1
    assert httpx.post(f"{root}/mock/reset", timeout=10).json() == {"reset": True}
    assert stats(root) == {"requests": 0, "in_flight": 0, "max_in_flight": 0, "completed": 0, "disconnects": 0, "bodies": [],
                           "max_in_flight_by_tag": {}}


# -- hostile model server (the gateway's bounds are tested against these) ------------------------


def test_header_bytes_sends_that_many_bytes_of_response_headers(api, root):
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(root)
    body = json.dumps(chat(mock={"header_bytes": 200_000})).encode()
    with socket.create_connection((address.hostname, address.port), timeout=10) as raw:
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        head = b""
        while b"\r\n\r\n" not in head:  # (httpx's parser refuses heads this big: so does the gateway's)
            head += raw.recv(65536)
    assert head.startswith(b"HTTP/1.1 200") and head.index(b"\r\n\r\n") >= 200_000


def test_body_bytes_sends_a_buffered_body_of_that_size(api):
    response = api.post("/chat/completions", json=chat(mock={"body_bytes": 3 * 1024 * 1024}))
    assert response.status_code == 200 and len(response.content) == 3 * 1024 * 1024


def test_event_bytes_streams_one_event_that_never_ends(api):
    response = api.post("/chat/completions", json=chat(stream=True, mock={"event_bytes": 300_000}))
    assert response.text.startswith("data: ") and "\n\n" not in response.text
    assert len(response.content) == 300_000


def test_endless_streams_until_the_client_leaves(api, mock):
    with api.stream("POST", "/chat/completions", json=chat(stream=True, mock={"endless": True, "token_delay_ms": 1})) as response:
        events = 0
        for text in response.iter_text():
            events += text.count("\n\n")
            if events >= 200:
                break
    assert events >= 200
    mock.wait_for(lambda stats: stats["in_flight"] == 0)  # it noticed the client leave
