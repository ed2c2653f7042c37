"""Bad input never makes the gateway answer 5xx, every error it makes is in the contract's shape,
and after every request, the ledger still adds up (`support.LedgerCheck`): the org's slots are
back, each generation id has exactly one usage event, and Σ event cost = credits debited."""

from __future__ import annotations

import json
from decimal import Decimal

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.endpoints import ENDPOINTS
from kiln.store.keys import list_keys
from kiln.web import openapi_path
from support import LedgerCheck

CHAT = "/v1/chat/completions"
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
FIELDS = ["model", "messages", "stream", "stream_options", "tools", "tool_choice", "response_format", "ignore_eos",
          "max_tokens", "n", "prompt", "temperature"]
bodies = st.fixed_dictionaries(
    {},
    optional={
        **{name: json_values for name in FIELDS},
        "model": st.sampled_from(["qwen3-32b", "gpt-oss-120b", "not-a-model", ""]) | json_values,
        "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": json_values}),
                             max_size=3) | json_values,
        # a model server that reports no usage makes the gateway estimate from whatever the body holds
        "mock": st.just({"no_usage": True}),
    },
)


def assert_gateway_answer(response: httpx.Response) -> None:
    assert_answer(response.status_code, response.content)


def assert_answer(status: int, body: bytes) -> None:
    """Not a 5xx of the gateway's own making; an error in the contract's shape (or 502 plain text)."""
    assert status < 500 or status in (502, 503), body[:300]
    if status >= 400 and status != 502:
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"]


@pytest.fixture(scope="module")
def fuzz_org(shared_stack):
    return shared_stack.org(credits="1000", concurrency=64)


@pytest.fixture(scope="module")
def fuzz_key(fuzz_org):
    return fuzz_org[1]


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_fuzzed_bodies(shared_stack, fuzz_org, path):
    ledger = LedgerCheck(shared_stack, fuzz_org[0])

    @FUZZ
    @given(body=bodies)
    def check(body):
        response = ledger.saw(shared_stack.post(path, body, fuzz_org[1]))
        assert_gateway_answer(response)
        assert response.status_code not in (502, 503)  # the mock is healthy: nothing upstream can fail
        ledger.check()

    check()


# What a broken or hostile model server may answer 200 with: any JSON, or none.
upstream_bodies = json_values.map(json.dumps) | st.text(max_size=40) | st.fixed_dictionaries(
    {"choices": json_values, "usage": json_values | st.fixed_dictionaries(
        {"prompt_tokens": json_values | st.integers(min_value=-5, max_value=10**30),
         "completion_tokens": json_values | st.integers(min_value=-5, max_value=10**30)})},
).map(json.dumps)
upstream_events = st.lists(upstream_bodies | st.sampled_from(["[DONE]", ""]), max_size=6)


@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_fuzzed_upstream_answers(shared_stack, fuzz_org, stream):
    """A model server answering 200 with anything: never a 500 or a cut stream, the ledger exact."""
    ledger = LedgerCheck(shared_stack, fuzz_org[0])

    @FUZZ
    @given(answer=upstream_bodies, events=upstream_events, include_usage=st.booleans(), max_tokens=st.integers(1, 64))
    def check(answer, events, include_usage, max_tokens):
        mock = {"raw_events": events} if stream else {"raw_body": answer}
        body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": stream,
                "max_tokens": max_tokens, "mock": mock}
        if stream:
            body["stream_options"] = {"include_usage": include_usage}
        response = ledger.saw(shared_stack.post(CHAT, body, fuzz_org[1]))
        assert response.status_code in (200, 502), response.text[:300]
        if stream:
            assert response.text.endswith("\n\n")  # never cut mid-event
            last = response.text.rstrip("\n").rsplit("\n\n", 1)[-1]
            assert last == "data: [DONE]" or json.loads(last[6:])["error"]["code"] == "upstream_error", last
        for event in ledger.check():
            # a bill within what the request could have produced: the whole context, max_tokens of reply
            assert event.cost <= (40960 * Decimal("0.08") + max_tokens * Decimal("0.24")) / 1_000_000

    check()


# printable ASCII without surrounding spaces: what an HTTP client can send at all
header_values = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=80).map(str.strip)


def test_fuzzed_headers(shared_stack, fuzz_key):
    @FUZZ
    @given(
        authorization=st.one_of(st.just(f"Bearer {fuzz_key}"), header_values, st.just("Bearer "), st.just("bearer " + fuzz_key)),
        content_type=header_values,
        extra=st.dictionaries(st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,20}", fullmatch=True), header_values, max_size=3),
    )
    def check(authorization, content_type, extra):
        headers = {**extra, "Authorization": authorization.strip(), "Content-Type": content_type}
        body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}]}
        response = shared_stack.http.post(CHAT, content=json.dumps(body), headers=headers)
        assert_gateway_answer(response)

    check()


@pytest.mark.parametrize(
    "raw,code",
    [
        (b"\xff\xfe\x00{", "invalid_json"),
        (b'{"model": "qwen3-32b", "messages": "\xc3\x28"}', "invalid_json"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid_json"),
        (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "invalid_json"),
        (b'{"model": "qwen3-32b", "max_tokens": 1e999}', "invalid_json"),
        (b'{"model": "qwen3-32b", "max_tokens": ' + b"9" * 5000 + b"}", "invalid_json"),
        (b'{"model": "qwen3-32b", "temperature": NaN}', "invalid_json"),
        (b'{"model": "qwen3-32b"} trailing', "invalid_json"),
    ],
    ids=["invalid-utf8", "invalid-utf8-in-string", "deep-arrays", "deep-objects", "huge-float", "huge-int", "nan", "trailing"],
)
def test_hostile_bodies_are_400(shared_stack, fuzz_key, raw, code):
    response = shared_stack.post(CHAT, raw, fuzz_key, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == code


def test_an_oversize_body_is_413_before_it_is_read(shared_stack, fuzz_key):
    big = b'{"model": "qwen3-32b", "messages": [{"role": "user", "content": "' + b"x" * (7 * 1024 * 1024) + b'"}]}'
    response = shared_stack.post(CHAT, big, fuzz_key, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


# -- schemathesis: every operation of the app's OpenAPI schema --------------------------------


def test_openapi_operations(shared_stack, fuzz_org, fuzz_key):
    """Cases generated by schemathesis from the app's own schema, for each operation (the
    key management ones with a management key, so that the cases reach their validation)."""
    schema = schemathesis.openapi.from_url(f"{shared_stack.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} == {
        f"{route.method} {openapi_path(route.path)}" for endpoint in ENDPOINTS for route in endpoint.routes
    }
    manager = shared_stack.key(fuzz_org[0], role="management")
    for operation in operations:
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(case=operation.as_strategy())
        def check(case):
            key = manager if case.operation.path.startswith("/v1/keys") else fuzz_key
            case.headers = {**(case.headers or {}), "Authorization": f"Bearer {key}"}
            response = case.call(base_url=shared_stack.url, timeout=30)
            assert_answer(response.status_code, response.content)
            assert response.status_code not in (502, 503)

        check()
    # the management cases reached their handlers: some of the generated keys were made
    assert len(list_keys(shared_stack.tables, fuzz_org[0])) > 2
