"""kiln.normalize: contract §3 field by field, and the order of checks of §2 step 4."""

import copy
import json

import pytest

from kiln.apis.chat import API as CHAT
from kiln.apis.completions import API as COMPLETIONS
from kiln.catalog import Catalog
from kiln.errors import GatewayError
from kiln.normalize import normalize


def model(model_id, **capabilities):
    return {"id": model_id, "context_length": 4096, "pricing": {"input": "1", "output": "1"}, "capabilities": capabilities}


# Names deliberately disagree with capabilities: behaviour must follow the catalog, not the name.
CATALOG = Catalog.from_document(
    {
        "models": [
            model("plain", forced_tool_choice=False, json_response_format=False, ignore_eos=True),
            model("no-eos", forced_tool_choice=True, json_response_format=False, ignore_eos=False),
            model("gpt-oss-120b", forced_tool_choice=True, json_response_format=True, ignore_eos=True),
            model("qwen3-32b", forced_tool_choice=True, json_response_format=True, ignore_eos=False),
        ]
    }
)
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {}}}


def chat(**fields):
    return {"model": "plain", "messages": HI, **fields}


def rejected(body, endpoint=CHAT):
    with pytest.raises(GatewayError) as info:
        normalize(endpoint, body, CATALOG)
    error = info.value
    return error.status, error.code, error.param


# -- model, messages ----------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("body", [{}, {"model": None}, {"model": 7}, {"model": ["plain"]}])
def test_missing_or_non_string_model(endpoint, body):
    assert rejected({**body, "messages": HI}, endpoint) == (400, "missing_required_parameter", "model")


@pytest.mark.parametrize("body", [[], "text", None, 3])
def test_body_must_be_an_object(body):
    assert rejected(body) == (400, "invalid_json", None)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_unknown_model_is_404_with_exact_body(endpoint):
    with pytest.raises(GatewayError) as info:
        normalize(endpoint, {"model": "gpt-5", "messages": HI, "prompt": "x"}, CATALOG)
    assert info.value.status == 404
    assert json.loads(info.value.body()) == {
        "error": {
            "message": "The model `gpt-5` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


@pytest.mark.parametrize("body", [{"model": "plain"}, {"model": "plain", "messages": []}, {"model": "plain", "messages": None}])
def test_missing_or_empty_messages_exact_body(body):
    with pytest.raises(GatewayError) as info:
        normalize(CHAT, body, CATALOG)
    assert info.value.status == 400
    assert json.loads(info.value.body()) == {
        "error": {
            "message": "Invalid 'messages': the array must contain at least one message.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "empty_array",
        }
    }


def test_messages_of_wrong_type():
    assert rejected(chat(messages="hi")) == (400, "invalid_type", "messages")


def test_completions_need_no_messages_and_prompt_is_not_validated():
    for body in ({"model": "plain"}, {"model": "plain", "prompt": ["a", [1, 2]]}, {"model": "plain", "prompt": 5}):
        assert normalize(COMPLETIONS, body, CATALOG).body == body


def test_content_parts_and_unknown_fields_forwarded_unchanged():
    body = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:x"}}]}],
        max_tokens=5, temperature=0.2, top_p=0.9, n=2, seed=1, presence_penalty=0.1, frequency_penalty=0.1,
        logprobs=True, stop=["\n"], parallel_tool_calls=False, reasoning_effort="low",
        tools=[TOOL], tool_choice="auto", response_format={"type": "text"}, vendor_extension={"a": [1, None]},
    )
    original = copy.deepcopy(body)
    call = normalize(CHAT, body, CATALOG)
    assert call.body == original
    assert body == original  # the client's body is not mutated
    assert call.model is CATALOG.get("plain") and call.api is CHAT


# -- stream and stream_options ------------------------------------------------------------


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("value, expected", [(True, True), ("true", True), (1, True), (False, False), ("false", False), (0, False)])
def test_stream_flag_rewritten_to_boolean(endpoint, value, expected):
    call = normalize(endpoint, chat(stream=value, prompt="p"), CATALOG)
    assert call.stream is expected
    assert call.body["stream"] is expected


def test_absent_stream_is_not_streaming():
    call = normalize(CHAT, chat(), CATALOG)
    assert call.stream is False and call.client_wants_usage is False
    assert call.body.get("stream", False) is False


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("value", ["yes", "True", "1", "", 2, -1, None, [], {}, [True]])
def test_other_stream_values_are_invalid_type(endpoint, value):
    assert rejected(chat(stream=value, prompt="p"), endpoint) == (400, "invalid_type", "stream")


@pytest.mark.parametrize(
    "options, wants",
    [(None, False), ({}, False), ({"include_usage": False}, False), ({"include_usage": True}, True)],
)
def test_include_usage_forced_upstream_client_choice_remembered(options, wants):
    body = chat(stream=True) if options is None else chat(stream=True, stream_options=options)
    call = normalize(CHAT, body, CATALOG)
    assert call.body["stream_options"]["include_usage"] is True
    assert call.client_wants_usage is wants


def test_other_stream_options_keys_pass_through():
    body = {"model": "plain", "prompt": "p", "stream": "true", "stream_options": {"continuous_usage_stats": True}}
    call = normalize(COMPLETIONS, body, CATALOG)
    assert call.body["stream_options"] == {"continuous_usage_stats": True, "include_usage": True}
    assert body["stream_options"] == {"continuous_usage_stats": True}


def test_stream_options_must_be_an_object_when_streaming():
    assert rejected(chat(stream=True, stream_options="usage")) == (400, "invalid_type", "stream_options")


# -- tools, tool_choice, response_format, ignore_eos --------------------------------------


def test_function_tool_without_description_names_its_index():
    bare = {"type": "function", "function": {"name": "f", "parameters": {}}}
    status, _, param = rejected(chat(tools=[TOOL, bare]))
    assert (status, param) == (400, "tools[1].function.description")
    assert rejected(chat(tools=[{"type": "function"}]))[2] == "tools[0].function.description"


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_tool_choice_forwarded(choice):
    assert normalize(CHAT, chat(tools=[TOOL], tool_choice=choice), CATALOG).body["tool_choice"] == choice


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_needs_the_capability(choice):
    assert rejected(chat(tools=[TOOL], tool_choice=choice)) == (400, "unsupported_parameter", "tool_choice")
    assert normalize(CHAT, chat(model="no-eos", tools=[TOOL], tool_choice=choice), CATALOG).body["tool_choice"] == choice


@pytest.mark.parametrize("kind", ["json_object", "json_schema"])
def test_json_response_format_needs_the_capability(kind):
    fmt = {"type": kind}
    assert rejected(chat(response_format=fmt)) == (400, "unsupported_parameter", "response_format")
    assert normalize(CHAT, chat(model="gpt-oss-120b", response_format=fmt), CATALOG).body["response_format"] == fmt


def test_ignore_eos_on_chat_follows_capability_not_name():
    assert rejected(chat(model="no-eos", ignore_eos=True)) == (400, "unsupported_parameter", "ignore_eos")
    assert rejected(chat(model="qwen3-32b", ignore_eos=True))[1] == "unsupported_parameter"
    assert normalize(CHAT, chat(model="gpt-oss-120b", ignore_eos=True), CATALOG).body["ignore_eos"] is True
    assert normalize(CHAT, chat(model="no-eos", ignore_eos=False), CATALOG).body["ignore_eos"] is False


def test_ignore_eos_on_completions_always_forwarded():
    body = {"model": "no-eos", "prompt": "p", "ignore_eos": True}
    assert normalize(COMPLETIONS, body, CATALOG).body["ignore_eos"] is True


# -- order of checks (§2 step 4): empty_array, model_not_found, unsupported_parameter, invalid_type


def test_empty_messages_before_unknown_model():
    assert rejected({"model": "gpt-5", "messages": []})[1] == "empty_array"


def test_unknown_model_before_unsupported_and_invalid_type():
    assert rejected({"model": "gpt-5", "messages": HI, "tool_choice": "required", "stream": "yes"})[1] == "model_not_found"


def test_unsupported_parameter_before_invalid_type():
    assert rejected(chat(tool_choice="required", stream="yes"))[1] == "unsupported_parameter"
    assert rejected(chat(response_format={"type": "json_object"}, tools="all"))[1] == "unsupported_parameter"
    assert rejected(chat(ignore_eos=True, model="no-eos", messages="hi"))[1] == "unsupported_parameter"
