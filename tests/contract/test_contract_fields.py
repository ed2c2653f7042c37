"""Contract §3, every row, through HTTP: what the gateway rejects, rewrites and forwards."""

from __future__ import annotations

import pytest

from support import data_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Hello!"}]


def chat(model: str = "qwen3-32b", **fields):
    return {"model": model, "messages": MESSAGES, **fields}


def error_of(response) -> dict:
    return response.json()["error"]


# -- model -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("model", [None, 42, ["qwen3-32b"], {"id": "x"}])
def test_missing_or_non_string_model_is_400(stack, org, path, model):
    body = {"messages": MESSAGES, "prompt": "x"}
    if model is not None:
        body["model"] = model
    response = stack.post(path, body, org[1])
    assert response.status_code == 400
    assert error_of(response) == {
        "message": error_of(response)["message"],
        "type": "invalid_request_error",
        "param": "model",
        "code": "missing_required_parameter",
    }


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_unknown_model_is_404_with_the_exact_body(stack, org, path):
    response = stack.post(path, {"model": "not-a-model", "messages": MESSAGES, "prompt": "x"}, org[1])
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `not-a-model` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert stack.mock.stats["requests"] == 0


# -- stream ------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [True, "true", 1])
def test_true_spellings_stream_and_are_forwarded_as_boolean(stack, org, value):
    response = stack.post(CHAT, chat(stream=value), org[1])
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert stack.mock.last_body()["stream"] is True


@pytest.mark.parametrize("value", [False, "false", 0, "absent"])
def test_false_spellings_are_buffered_and_forwarded_as_boolean(stack, org, value):
    body = chat() if value == "absent" else chat(stream=value)
    response = stack.post(COMPLETIONS, {**body, "prompt": "x"}, org[1])
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    forwarded = stack.mock.last_body()
    if value == "absent":
        assert "stream" not in forwarded
    else:
        assert forwarded["stream"] is False


@pytest.mark.parametrize("value", ["yes", 2, 1.0, None, [], {}, "True"])
def test_other_stream_values_are_400_invalid_type(stack, org, value):
    response = stack.post(CHAT, chat(stream=value), org[1])
    assert response.status_code == 400
    error = error_of(response)
    assert (error["code"], error["param"], error["type"]) == ("invalid_type", "stream", "invalid_request_error")


# -- stream_options.include_usage --------------------------------------------------------------


def test_usage_is_always_asked_upstream_and_hidden_unless_asked(stack, org):
    response = stack.post(CHAT, chat(stream=True), org[1])
    assert stack.mock.last_body()["stream_options"] == {"include_usage": True}
    chunks = data_events(response.text)
    assert chunks[-1] == "[DONE]"
    assert all("usage" not in chunk for chunk in chunks[:-1])


def test_usage_chunk_with_cost_when_the_client_asks(stack, org):
    response = stack.post(CHAT, chat("gpt-oss-120b", stream=True, stream_options={"include_usage": True}), org[1])
    chunks = data_events(response.text)
    usage_chunk = chunks[-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["cost"] > 0
    assert [c for c in chunks[:-2] if "usage" in c] == []


@pytest.mark.parametrize("spelling, asked", [("true", True), (1, True), ("yes", True), ("false", False), (0, False)])
def test_include_usage_is_read_as_the_model_server_reads_it(stack, org, spelling, asked):
    """A client that spells true as vLLM reads it gets the usage chunk it would get from vLLM."""
    options = {"include_usage": spelling}
    chunks = data_events(stack.post(CHAT, chat("gpt-oss-120b", stream=True, stream_options=options), org[1]).text)
    usage = [chunk["usage"] for chunk in chunks[:-1] if "usage" in chunk]
    assert (len(usage) == 1 and usage[0]["cost"] > 0) if asked else usage == []


def test_other_stream_options_pass_through(stack, org):
    options = {"include_usage": False, "continuous_usage_stats": False}
    stack.post(CHAT, chat(stream=True, stream_options=options), org[1])
    assert stack.mock.last_body()["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}


# -- forwarded unchanged -----------------------------------------------------------------------

FORWARDED = {
    "max_tokens": 5,
    "temperature": 0.7,
    "top_p": 0.9,
    "n": 2,
    "seed": 12345678901234567890,
    "presence_penalty": -0.5,
    "frequency_penalty": 1.5,
    "logprobs": True,
    "parallel_tool_calls": False,
    "reasoning_effort": "high",
    "stop": ["\n", "END"],
    "some_future_field": {"nested": [1, 2.5, None, "x"]},
}


def test_listed_and_unknown_chat_fields_are_forwarded_unchanged(stack, org):
    response = stack.post(CHAT, chat(**FORWARDED), org[1])
    assert response.status_code == 200
    forwarded = stack.mock.last_body()
    for name, value in FORWARDED.items():
        assert forwarded[name] == value, name
    assert len(response.json()["choices"]) == 2


def test_completion_fields_are_forwarded_unchanged(stack, org):
    fields = {"prompt": ["a b", "c"], "echo": True, "stop": "x", "logprobs": 2, "ignore_eos": True, "best_of": 3}
    response = stack.post(COMPLETIONS, {"model": "gpt-oss-120b", **fields}, org[1])
    assert response.status_code == 200
    forwarded = stack.mock.last_body()
    for name, value in fields.items():
        assert forwarded[name] == value, name


def test_completions_prompt_is_not_validated_a_missing_one_is_the_upstreams_400(stack, org):
    org_id, key = org
    response = stack.post(COMPLETIONS, {"model": "qwen3-32b"}, key)
    assert response.status_code == 400
    assert stack.mock.stats["requests"] == 1  # it reached the model server
    assert "prompt" in error_of(response)["message"]
    assert response.headers["X-Neocloud-Generation-Id"]


def test_content_parts_pass_through_unchanged(stack, org):
    parts = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]
    response = stack.post(CHAT, chat(messages=[{"role": "user", "content": parts}]), org[1])
    assert response.status_code == 200
    assert stack.mock.last_body()["messages"][0]["content"] == parts


# -- messages ----------------------------------------------------------------------------------

EMPTY_ARRAY = {
    "error": {
        "message": "Invalid 'messages': the array must contain at least one message.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "empty_array",
    }
}


@pytest.mark.parametrize("messages", [[], "absent", None])
def test_missing_or_empty_messages_is_400_with_the_exact_body(stack, org, messages):
    body = {"model": "qwen3-32b"} if messages == "absent" else {"model": "qwen3-32b", "messages": messages}
    response = stack.post(CHAT, body, org[1])
    assert response.status_code == 400
    assert response.json() == EMPTY_ARRAY


def test_empty_messages_is_checked_before_the_model(stack, org):
    response = stack.post(CHAT, {"model": "not-a-model", "messages": []}, org[1])
    assert response.json() == EMPTY_ARRAY


def test_messages_that_are_not_an_array_are_400_invalid_type(stack, org):
    response = stack.post(CHAT, {"model": "qwen3-32b", "messages": "hi"}, org[1])
    assert response.status_code == 400
    assert (error_of(response)["code"], error_of(response)["param"]) == ("invalid_type", "messages")


# -- tools -------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather for a city", "parameters": {"type": "object"}}}


def test_a_tool_without_description_is_400_before_the_upstream(stack, org):
    nameless = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    response = stack.post(CHAT, chat(tools=[WEATHER, nameless]), org[1])
    assert response.status_code == 400
    error = error_of(response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == "tools[1].function.description"
    assert stack.mock.stats["requests"] == 0


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_tool_choice_auto_and_none_are_forwarded(stack, org, choice):
    response = stack.post(CHAT, chat(tools=[WEATHER], tool_choice=choice), org[1])
    assert response.status_code == 200
    assert stack.mock.last_body()["tool_choice"] == choice


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}])
def test_forced_tool_choice_on_a_model_without_the_capability_is_400(stack, org, choice):
    response = stack.post(CHAT, chat("qwen3-32b", tools=[WEATHER], tool_choice=choice), org[1])
    assert response.status_code == 400
    assert (error_of(response)["code"], error_of(response)["param"]) == ("unsupported_parameter", "tool_choice")
    assert stack.mock.stats["requests"] == 0


@pytest.mark.parametrize("model", ["qwen3-32b", "gpt-oss-120b"])
@pytest.mark.parametrize("choice", [["required"], 1, True, [{"type": "function", "function": {"name": "weather"}}]])
def test_a_tool_choice_neither_string_nor_object_is_400_before_the_upstream(stack, org, model, choice):
    # forwarded, it is whatever the model server makes of it (a plain-text 500, an empty 200)
    response = stack.post(CHAT, chat(model, tools=[WEATHER], tool_choice=choice), org[1])
    assert response.status_code == 400
    assert (error_of(response)["code"], error_of(response)["param"]) == ("invalid_type", "tool_choice")
    assert stack.mock.stats["requests"] == 0


def test_forced_tool_choice_on_a_capable_model_is_forwarded(stack, org):
    response = stack.post(CHAT, chat("gpt-oss-120b", tools=[WEATHER], tool_choice="required"), org[1])
    assert response.status_code == 200
    assert stack.mock.last_body()["tool_choice"] == "required"


def test_several_tool_calls_are_neither_merged_nor_dropped(stack, org):
    body = chat(tools=[WEATHER], parallel_tool_calls=False, mock={"tool_calls": 3})
    calls = stack.post(CHAT, body, org[1]).json()["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 3
    streamed = data_events(stack.post(CHAT, {**body, "stream": True}, org[1]).text)
    indexes = {call["index"] for chunk in streamed[:-1] for call in chunk["choices"][0]["delta"].get("tool_calls", [])}
    assert indexes == {0, 1, 2}


# -- response_format ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["json_object", "json_schema", "structural_tag"])
def test_json_response_format_on_a_model_without_the_capability_is_400(stack, org, kind):
    response = stack.post(CHAT, chat(response_format={"type": kind}), org[1])
    assert response.status_code == 400
    assert (error_of(response)["code"], error_of(response)["param"]) == ("unsupported_parameter", "response_format")


@pytest.mark.parametrize("field, value", [("guided_json", {"type": "object"}), ("guided_regex", "[a-z]+"),
                                          ("guided_choice", ["yes", "no"]), ("structured_outputs", {"json": {}}),
                                          ("regex", "[0-9]+"), ("grammar", "root ::= \"a\""),
                                          ("structural_tag", '{"structures": [], "triggers": ["<f>"]}')])
def test_a_model_servers_own_constrained_output_needs_the_capability_too(stack, org, field, value):
    """vLLM's, SGLang's and llama.cpp's fields for the same thing fail on such a model the same way."""
    response = stack.post(CHAT, chat(**{field: value}), org[1])
    assert response.status_code == 400
    assert (error_of(response)["code"], error_of(response)["param"]) == ("unsupported_parameter", field)
    assert stack.mock.stats["requests"] == 0


def test_text_response_format_passes(stack, org):
    response = stack.post(CHAT, chat(response_format={"type": "text"}), org[1])
    assert response.status_code == 200
    assert stack.mock.last_body()["response_format"] == {"type": "text"}


# -- ignore_eos --------------------------------------------------------------------------------


def test_ignore_eos_on_a_gpt_oss_chat_is_400_before_the_upstream(stack, org):
    response = stack.post(CHAT, chat("gpt-oss-120b", ignore_eos=True), org[1])
    assert response.status_code == 400
    assert (error_of(response)["code"], error_of(response)["param"]) == ("unsupported_parameter", "ignore_eos")
    assert stack.mock.stats["requests"] == 0


def test_ignore_eos_is_forwarded_on_other_models(stack, org):
    assert stack.post(CHAT, chat("qwen3-32b", ignore_eos=True), org[1]).status_code == 200
    assert stack.mock.last_body()["ignore_eos"] is True
    assert stack.post(CHAT, chat("gpt-oss-120b", ignore_eos=False), org[1]).status_code == 200


@pytest.mark.parametrize("spelling", [1, 1.0, "true", "True", "1", "yes", "on"])
def test_ignore_eos_spelled_as_the_model_server_reads_true_is_refused_too(stack, org, spelling):
    """vLLM reads these as true: forwarded, each is the silent failure the check is for."""
    response = stack.post(CHAT, chat("gpt-oss-120b", ignore_eos=spelling), org[1])
    assert response.status_code == 400
    assert (error_of(response)["code"], error_of(response)["param"]) == ("unsupported_parameter", "ignore_eos")
    assert stack.mock.stats["requests"] == 0


@pytest.mark.parametrize("spelling", [0, "false", "no", "off", "maybe"])
def test_ignore_eos_the_model_server_does_not_read_as_true_is_forwarded_unchanged(stack, org, spelling):
    assert stack.post(CHAT, chat("gpt-oss-120b", ignore_eos=spelling), org[1]).status_code == 200
    assert stack.mock.last_body()["ignore_eos"] == spelling


def test_a_backend_model_name_replaces_the_public_one_upstream(stack, org):
    response = stack.post(CHAT, chat("renamed-model"), org[1])
    assert response.status_code == 200
    assert stack.mock.last_body()["model"] == "served-name"
