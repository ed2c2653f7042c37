"""kiln.upstream_key: the model servers' bearer token from an SSM SecureString.

Against the embedded AWS: the key is stored encrypted, the gateway reads it decrypted
through its parameter cache and sends it only to the backends that name it; a rotation is
one put-parameter, with no deploy; without it the gateway answers 503, never a model
server's 401.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest

from kiln.catalog import Catalog
from kiln.parameters import CachedParameter
from kiln.upstream_key import ENV_NAME, UpstreamKey, parse_key
from kiln_ops.mock_upstream import MockUpstream
from kiln_ops.serve import ServerThread
from support import TELEMETRY, MockHandle, catalog_for_tests, make_stack

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


class RecordingUpstream:
    """The mock model server, remembering the Authorization header of every request."""

    def __init__(self) -> None:
        self.app = MockUpstream()
        self.authorization: list[str | None] = []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/completions"):
            value = dict(scope["headers"]).get(b"authorization")
            self.authorization.append(value.decode() if value else None)
        await self.app(scope, receive, send)


@pytest.fixture(scope="module")
def upstream():
    recording = RecordingUpstream()
    server = ServerThread(recording).start()
    yield recording, f"{server.url}/v1"
    server.stop()


@pytest.fixture
def keyed_stack(aws, mock, upstream):
    """A stack whose catalog has one model behind a backend that needs the key, one that does not."""
    recording, url = upstream
    recording.authorization.clear()
    document = catalog_for_tests(mock.url)
    base = next(model for model in document["models"] if model["id"] == "qwen3-32b")
    document["models"] = [
        {**base, "id": "keyed-model", "backends": [{"name": "keyed", "url": url, "api_key_env": ENV_NAME}]},
        {**base, "id": "open-model", "backends": [{"name": "open", "url": url}]},
    ]
    name = f"/t{secrets.token_hex(5)}/upstream-api-key"
    stack = make_stack(aws.url, MockHandle(url, recording.app), catalog=document, upstream_api_key_parameter=name,
                       upstream_api_key_cache_seconds=0.0, parameter_first_read_seconds=0.2)
    yield stack, recording, name
    stack.close()


def test_the_key_is_read_decrypted_from_a_secure_string_and_sent_only_where_named(keyed_stack):
    stack, recording, name = keyed_stack
    key = f"sk-upstream-{secrets.token_hex(8)}"
    stack.ssm.put_parameter(Name=name, Value=key, Type="SecureString", Overwrite=True)
    assert stack.ssm.get_parameter(Name=name)["Parameter"]["Value"] != key  # stored encrypted
    _, secret = stack.org()

    assert stack.post("/v1/chat/completions", {**CHAT, "model": "keyed-model"}, secret).status_code == 200
    assert stack.post("/v1/chat/completions", {**CHAT, "model": "open-model"}, secret).status_code == 200
    assert recording.authorization == [f"Bearer {key}", None]
    assert key not in TELEMETRY.text()


def test_a_rotated_key_is_used_without_a_deploy(keyed_stack):
    stack, recording, name = keyed_stack
    _, secret = stack.org()
    for generation in (1, 2):
        stack.ssm.put_parameter(Name=name, Value=f"sk-upstream-gen{generation}", Type="SecureString", Overwrite=True)
        assert stack.post("/v1/chat/completions", {**CHAT, "model": "keyed-model"}, secret).status_code == 200
    assert recording.authorization == ["Bearer sk-upstream-gen1", "Bearer sk-upstream-gen2"]


def test_without_the_key_the_gateway_answers_503_and_calls_no_model_server(keyed_stack):
    stack, recording, _ = keyed_stack
    _, secret = stack.org()
    response = stack.post("/v1/chat/completions", {**CHAT, "model": "keyed-model"}, secret)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "storage_unavailable"
    assert recording.authorization == []


def test_a_catalog_that_names_no_key_is_served_without_one_stored(aws, mock):
    """deploy.md stores the key only for backends that name it, but the template always names
    the parameter: with none stored, every model request of a catalog that needs no key was
    answered 503."""
    name = f"/t{secrets.token_hex(5)}/upstream-api-key"  # never stored
    stack = make_stack(aws.url, mock, upstream_api_key_parameter=name, parameter_first_read_seconds=0.2)
    try:
        _, secret = stack.org()
        response = stack.post("/v1/chat/completions", {**CHAT, "model": "qwen3-32b"}, secret)
        assert response.status_code == 200, response.text
    finally:
        stack.close()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_rotation_reaches_an_environment_within_the_cache_time_and_the_catalog_is_rebound_only_then():
    clock, value = Clock(), ["sk-old"]

    async def fetch():
        return value[0]

    key = UpstreamKey(CachedParameter("/kiln/upstream-api-key", fetch, parse_key, max_age=300, clock=clock,
                                      rand=lambda: 0.0))
    catalog = Catalog.from_document({"models": [{
        "id": "m", "context_length": 8, "pricing": {"input": "1", "output": "1"},
        "backends": [{"url": "http://a/v1", "api_key_env": ENV_NAME}, {"url": "http://b/v1"}],
    }]})

    async def scenario():
        first = await key.bind(catalog)
        assert [b.api_key() for b in first.get("m").backends] == ["sk-old", None]
        assert await key.bind(catalog) is first  # no rebuild per request
        value[0] = "sk-new"
        clock.now = 299
        assert (await key.bind(catalog)).get("m").backends[0].api_key() == "sk-old"
        clock.now = 301
        assert (await key.bind(catalog)).get("m").backends[0].api_key() == "sk-new"
        assert "sk-new" not in repr((await key.bind(catalog)).get("m").backends[0])

    asyncio.run(scenario())


def test_an_empty_key_is_refused():
    with pytest.raises(ValueError):
        parse_key("  ")
    with pytest.raises(ValueError):
        parse_key(None)
