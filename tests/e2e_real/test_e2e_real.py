"""The gateway in front of a real model server (llama.cpp serving Gemma 3 270M on the CPU).

Run by `make e2e-real` (kiln e2e-real), which starts the server and the local stack and
sets the environment: KILN_E2E_BASE_URL, KILN_API_KEY and the stack's KILN_*/AWS_* exports.
This server ignores `stream_options.include_usage` and never sends a usage chunk: the
gateway must still bill and report usage (contract §4).
"""

from __future__ import annotations

import asyncio
import os
from decimal import Decimal

import httpx
import openai
import pytest

from kiln.settings import Settings
from kiln.store import bind
from kiln.store.keys import create_key
from kiln.store.orgs import create_org
from kiln.store.usage import get_event

BASE_URL = os.environ["KILN_E2E_BASE_URL"]
KEY = os.environ["KILN_API_KEY"]
MESSAGES = [{"role": "user", "content": "Name three colours."}]
# qwen3-32b's catalog prices, per million tokens (infra/catalog.json)
INPUT, OUTPUT = Decimal("0.08"), Decimal("0.24")


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE_URL, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tables():
    return bind(Settings.from_env())


def event_of(tables, gen_id: str):
    return get_event(tables, gen_id)


def priced(usage) -> Decimal:
    return (usage.prompt_tokens * INPUT + usage.completion_tokens * OUTPUT) / 1_000_000


def test_buffered_chat_has_real_text_usage_and_cost(client, tables):
    raw = client.chat.completions.with_raw_response.create(model="qwen3-32b", messages=MESSAGES, max_tokens=16)
    response = raw.parse()
    assert response.choices[0].message.content.strip()
    usage = response.usage
    assert usage.prompt_tokens > 0 and 0 < usage.completion_tokens <= 16
    assert Decimal(str(usage.model_extra["cost"])) == priced(usage)
    event = event_of(tables, raw.headers["X-Neocloud-Generation-Id"])
    assert (event.status, event.prompt_tokens, event.completion_tokens) == ("success", usage.prompt_tokens, usage.completion_tokens)


def test_streamed_chat_is_billed_although_the_server_reports_no_usage(client, tables):
    raw = client.chat.completions.with_raw_response.create(
        model="qwen3-32b", messages=MESSAGES, max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens > 0 and usage.model_extra["cost"] > 0
    event = event_of(tables, raw.headers["X-Neocloud-Generation-Id"])
    assert event.usage_source == "estimated" and event.cost > 0
    assert event.completion_tokens == usage.completion_tokens


def test_without_include_usage_no_usage_chunk_reaches_the_client(client):
    chunks = list(client.chat.completions.create(model="qwen3-32b", messages=MESSAGES, max_tokens=8, stream=True))
    assert chunks and all(c.usage is None for c in chunks)


def test_completions_buffered_and_streamed(client):
    response = client.completions.create(model="qwen3-32b", prompt="The capital of France is", max_tokens=8)
    assert response.choices[0].text and response.usage.model_extra["cost"] > 0
    chunks = list(
        client.completions.create(
            model="qwen3-32b", prompt="The capital of France is", max_tokens=8, stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.model_extra["cost"] > 0


def test_the_concurrency_limit_holds_in_front_of_a_real_server(tables):
    org_id = f"e2e-{os.getpid()}"
    create_org(tables, org_id, concurrency=1, credits=Decimal("1"))
    key = create_key(tables, org_id).secret
    body = {"model": "qwen3-32b", "messages": MESSAGES, "max_tokens": 32, "stream": True}

    async def both() -> list[int]:
        async with httpx.AsyncClient(base_url=BASE_URL, timeout=120) as http:
            async def one(delay: float) -> int:
                await asyncio.sleep(delay)
                async with http.stream("POST", "/chat/completions", json=body,
                                       headers={"Authorization": f"Bearer {key}"}) as response:
                    await response.aread()
                    return response.status_code

            return await asyncio.gather(one(0), one(0.3))

    assert sorted(asyncio.run(both())) == [200, 429]


def test_keepalives_while_the_cpu_model_is_busy(client):
    """The server answers one request at a time: the second stream waits, with keepalives."""
    body = {"model": "qwen3-32b", "messages": MESSAGES, "max_tokens": 64, "stream": True}

    async def both() -> list[str]:
        async with httpx.AsyncClient(base_url=BASE_URL, timeout=120) as http:
            async def one(delay: float) -> str:
                await asyncio.sleep(delay)
                response = await http.post("/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
                return response.text

            return await asyncio.gather(one(0), one(0.2))

    first, second = asyncio.run(both())
    assert ": keepalive" in first + second
    assert second.rstrip().endswith("data: [DONE]")


def test_the_servers_own_errors_map_per_contract(client):
    # a wrong type makes llama.cpp's server answer 500 with a Python traceback in its message:
    # a 5xx, so (no other backend) the client gets 502 plain text, and never the traceback
    response = httpx.post(
        f"{BASE_URL}/chat/completions",
        json={"model": "qwen3-32b", "messages": MESSAGES, "max_tokens": {"ten": 10}},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
    )
    assert response.status_code == 502
    assert response.headers["content-type"].startswith("text/plain")
    assert "Traceback" not in response.text and "File " not in response.text
    # bad JSON (which it answers with a plain-text 500) never reaches it: the gateway answers it itself
    response = httpx.post(f"{BASE_URL}/chat/completions", content=b"{not json",
                          headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_models_lists_the_catalog(client):
    assert {"qwen3-32b", "gpt-oss-120b"} <= {model.id for model in client.models.list()}
