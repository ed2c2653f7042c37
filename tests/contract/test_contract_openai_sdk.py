"""The official openai Python SDK against the gateway on a real port (contract preamble)."""

from __future__ import annotations

import openai
import pytest

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}]
WEATHER = {
    "type": "function",
    "function": {"name": "weather", "description": "Weather for a city", "parameters": {"type": "object"}},
}


@pytest.fixture
def client(stack, org):
    return openai.OpenAI(base_url=stack.base_url, api_key=org[1], max_retries=0)


def test_buffered_chat(client):
    response = client.chat.completions.create(model="gpt-oss-120b", messages=MESSAGES, max_tokens=800)
    assert response.choices[0].message.content == "Hello! How can I help you today? Ask me anything."
    assert response.usage.total_tokens == 21
    assert response.usage.model_extra["cost"] == pytest.approx(0.000001155)


def test_streamed_chat_without_and_with_usage(client):
    chunks = list(client.chat.completions.create(model="qwen3-32b", messages=MESSAGES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith("Hello!")
    assert all(c.usage is None for c in chunks)

    chunks = list(
        client.chat.completions.create(
            model="gpt-oss-120b", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 21
    assert chunks[-1].usage.model_extra["cost"] == pytest.approx(0.000001155)


def test_buffered_and_streamed_completions(client):
    response = client.completions.create(model="gpt-oss-120b", prompt="The capital of France is", max_tokens=32)
    assert response.choices[0].text == " Paris, a city on the Seine."
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 7)
    chunks = list(
        client.completions.create(
            model="gpt-oss-120b",
            prompt="The capital of France is",
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " Paris, a city on the Seine."
    assert chunks[-1].usage.model_extra["cost"] == pytest.approx(0.000000665)


def test_tool_calls_buffered_and_streamed(client):
    response = client.chat.completions.create(model="qwen3-32b", messages=MESSAGES, tools=[WEATHER])
    (call,) = response.choices[0].message.tool_calls
    assert call.function.name == "weather" and response.choices[0].finish_reason == "tool_calls"

    arguments = ""
    for chunk in client.chat.completions.create(model="qwen3-32b", messages=MESSAGES, tools=[WEATHER], stream=True):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            arguments += delta.function.arguments or ""
    assert arguments == call.function.arguments


def test_keepalive_comments_are_invisible_to_the_sdk(stack_factory):
    stack = stack_factory(keepalive_seconds=0.05)
    _, key = stack.org()
    client = openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0)
    chunks = list(
        client.chat.completions.create(
            model="qwen3-32b", messages=MESSAGES, stream=True, extra_body={"mock": {"ttft_ms": 400}}
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith("Hello!")


def test_each_error_status_is_the_sdks_matching_exception(stack, org, client):
    cases = [
        (openai.BadRequestError, dict(model="qwen3-32b", messages=[])),
        (openai.NotFoundError, dict(model="not-a-model", messages=MESSAGES)),
        (openai.BadRequestError, dict(model="gpt-oss-120b", messages=MESSAGES, extra_body={"ignore_eos": True})),
        (openai.InternalServerError, dict(model="qwen3-32b", messages=MESSAGES, extra_body={"mock": {"status": 500}})),
        (openai.InternalServerError, dict(model="no-backend-model", messages=MESSAGES)),
        (openai.UnprocessableEntityError, dict(model="qwen3-32b", messages=MESSAGES, extra_body={"mock": {"status": 422}})),
    ]
    for exception, kwargs in cases:
        with pytest.raises(exception) as caught:
            client.chat.completions.create(**kwargs)
        assert caught.value.status_code in (400, 404, 422, 500, 502, 503)

    with pytest.raises(openai.AuthenticationError) as caught:
        openai.OpenAI(base_url=stack.base_url, api_key="sk-kiln-wrong", max_retries=0).models.list()
    assert caught.value.code == "invalid_api_key"

    _, broke = stack.org(credits="0")
    with pytest.raises(openai.APIStatusError) as caught:
        openai.OpenAI(base_url=stack.base_url, api_key=broke, max_retries=0).chat.completions.create(
            model="qwen3-32b", messages=MESSAGES
        )
    assert caught.value.status_code == 402 and caught.value.code == "insufficient_credits"


def test_permission_denied_and_rate_limit(stack):
    from kiln.store.orgs import set_status

    org_id, key = stack.org(concurrency=1)
    client = openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0)
    stream = client.chat.completions.create(
        model="qwen3-32b", messages=MESSAGES, stream=True, extra_body={"mock": {"token_delay_ms": 300}}
    )
    next(iter(stream))  # holding the org's only slot
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="qwen3-32b", messages=MESSAGES)
    stream.close()
    set_status(stack.tables, org_id, "disabled")
    with pytest.raises(openai.PermissionDeniedError) as caught:
        client.chat.completions.create(model="qwen3-32b", messages=MESSAGES)
    assert caught.value.code == "organization_disabled"


def test_a_stream_that_fails_midway_raises_in_the_sdk(client):
    stream = client.chat.completions.create(
        model="qwen3-32b", messages=MESSAGES, stream=True, extra_body={"mock": {"cut_after": 3}}
    )
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            pass
    assert caught.value.code == "upstream_error"
