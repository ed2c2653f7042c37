"""Contract §2: every status of the order of checks, and that order, through HTTP."""

from __future__ import annotations

import json
import threading
import time
from decimal import Decimal

import pytest

from kiln.store.keys import list_keys, revoke_key
from kiln.store.orgs import add_credits, set_status
from support import assert_a_plain_429

CHAT = "/v1/chat/completions"
GOOD = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "hi"}]}


def error_of(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_maintenance_answers_503_before_anything_else(stack, org):
    _, key = org
    stack.set_maintenance({"enabled": True, "message": "Back soon."})
    # not even a body or a key is looked at
    response = stack.post(CHAT, b"not json", None)
    assert response.status_code == 503
    assert error_of(response)["code"] == "maintenance"
    assert response.headers["Retry-After"].isdigit()
    assert "X-Neocloud-Generation-Id" not in response.headers


def test_body_that_is_not_json_is_400_invalid_json(stack, org):
    _, key = org
    for raw in (b"{not json", b"[1, 2]", b'"text"', b"", b"\xff\xfe{}", b'{"a": NaN}', b"[" * 5000 + b"]" * 5000):
        response = stack.post(CHAT, raw, key, headers={"content-type": "application/json"})
        assert response.status_code == 400, raw[:20]
        assert error_of(response)["code"] == "invalid_json"


def test_body_is_checked_before_the_key(stack):
    response = stack.post(CHAT, b"{oops", "sk-kiln-not-a-key")
    assert response.status_code == 400
    assert error_of(response)["code"] == "invalid_json"


def test_oversize_body_is_413(stack_factory):
    stack = stack_factory(max_body_bytes=1024)
    _, key = stack.org()
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * 2000}]}
    response = stack.post(CHAT, big, key)
    assert response.status_code == 413
    assert error_of(response)["code"] == "request_too_large"

    # also when the client does not declare a length (chunked upload)
    def chunks():
        yield b'{"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "'
        yield b"y" * 4000
        yield b'"}]}'

    response = stack.http.post(CHAT, content=chunks(), headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 413


def test_missing_malformed_and_unknown_keys_are_401(stack, org):
    for headers in (
        {},
        {"Authorization": "sk-kiln-abc"},
        {"Authorization": "Basic Zm9vOmJhcg=="},
        {"Authorization": "Bearer"},
        {"Authorization": "Bearer sk-kiln-" + "A" * 43},  # well-formed, unknown
        {"Authorization": "Bearer sk-other-" + "A" * 43},
    ):
        response = stack.http.post(CHAT, json=GOOD, headers=headers)
        assert response.status_code == 401, headers
        error = error_of(response)
        assert error["code"] == "invalid_api_key"
        assert "sk-kiln-AAAA" not in response.text  # the key is never echoed


def _signed(key_header: dict | None = None) -> dict:
    """What a caller of a Function URL with IAM auth sends: its Authorization header is its SigV4
    signature, which Lambda checks and passes on."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    request = AWSRequest("POST", "https://abc.lambda-url.us-east-1.on.aws/v1/chat/completions",
                         data=json.dumps(GOOD), headers={"Content-Type": "application/json", **(key_header or {})})
    SigV4Auth(Credentials("AKIDEXAMPLE", "secret"), "lambda", "us-east-1").add_auth(request)
    return dict(request.headers.items())


def test_a_caller_that_signs_for_a_function_url_gives_its_key_beside_the_signature(stack, org):
    """deploy.md §2: `FunctionUrls=iam` is for a caller that signs its requests (SigV4), whose
    Authorization header is then the signature: the key had nowhere to go (401 whatever it
    sent). Beside a signature, the key is read from X-Kiln-Authorization, in the same form."""
    org_id, key = org
    response = stack.http.post(CHAT, json=GOOD, headers=_signed({"X-Kiln-Authorization": f"Bearer {key}"}))
    assert response.status_code == 200, response.text
    assert response.headers["X-Neocloud-Generation-Id"] in {event.gen_id for event in stack.events(org_id)}
    for headers in (_signed(), _signed({"X-Kiln-Authorization": "Bearer sk-kiln-" + "A" * 43})):
        response = stack.http.post(CHAT, json=GOOD, headers=headers)
        assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"


def test_beside_a_bearer_token_no_other_header_names_the_key(stack, org):
    """X-Kiln-Authorization is read only beside a signature: a client's own Authorization
    stands, so a header added on the way cannot change whose key a request uses."""
    _, key = org
    other_org, other_key = stack.org()
    response = stack.post(CHAT, GOOD, key, headers={"X-Kiln-Authorization": f"Bearer {other_key}"})
    assert response.status_code == 200 and stack.events(other_org) == []
    response = stack.http.post(CHAT, json=GOOD, headers={"X-Kiln-Authorization": f"Bearer {key}"})
    assert response.status_code == 401 and error_of(response)["code"] == "invalid_api_key"


def test_revoked_key_is_401(stack, org):
    org_id, key = org
    assert stack.post(CHAT, GOOD, key).status_code == 200
    (key_info,) = list_keys(stack.tables, org_id)
    revoke_key(stack.tables, key_info.key_id)
    response = stack.post(CHAT, GOOD, key)
    assert response.status_code == 401
    assert error_of(response)["code"] == "invalid_api_key"


def test_disabled_org_is_403_before_validation(stack, org):
    org_id, key = org
    set_status(stack.tables, org_id, "disabled")
    response = stack.post(CHAT, {"model": "not-a-model", "messages": []}, key)
    assert response.status_code == 403
    assert error_of(response)["code"] == "organization_disabled"
    set_status(stack.tables, org_id, "active")
    assert stack.post(CHAT, GOOD, key).status_code == 200


def test_validation_comes_before_admission(stack):
    org_id, key = stack.org(credits="0")
    # out of credits, but the invalid request is answered by validation and costs no write
    response = stack.post(CHAT, {"model": "not-a-model", "messages": [{"role": "user", "content": "x"}]}, key)
    assert response.status_code == 404
    assert stack.post(CHAT, {"model": "gpt-oss-120b", "messages": []}, key).status_code == 400
    assert stack.events(org_id) == []


def test_a_catalog_that_cannot_be_read_is_answered_after_the_checks_that_need_no_model(stack_factory):
    """§2: the order is the body, the key, then step 4's empty_array before model_not_found. A new
    environment that could not read its catalog answered 503 storage_unavailable to a request
    with no messages, or from a management key, which the catalog has no part in."""
    stack = stack_factory(parameter_first_read_seconds=0.2)
    org_id, key = stack.org()
    manager = stack.key(org_id, role="management")
    stack.faults.fail("GetParameter", code="ThrottlingException",
                      when=lambda payload: payload.get("Name") == stack.settings.catalog_parameter)
    cases = [({"model": "gpt-oss-120b", "messages": []}, key, 400, "empty_array"),
             ({"messages": [{"role": "user", "content": "x"}]}, key, 400, "missing_required_parameter"),
             (GOOD, manager, 403, "management_key"),
             (GOOD, key, 503, "storage_unavailable")]
    for body, secret, status, code in cases:
        response = stack.post(CHAT, body, secret)
        assert (response.status_code, error_of(response)["code"]) == (status, code), response.text
    assert stack.events(org_id) == []


WRITES = ("PutItem", "UpdateItem", "DeleteItem", "TransactWriteItems", "BatchWriteItem")


def writes_since(stack, mark: int, settle: float = 0.3) -> list:
    """The DynamoDB writes the gateway sent since the `mark`-th call (its own bookkeeping, made
    off the request's path, given `settle` seconds to be sent)."""
    time.sleep(settle)
    return [(op, payload.get("TableName")) for op, payload in stack.faults.calls[mark:] if op in WRITES]


def test_invalid_requests_and_reads_cost_no_write_and_an_admitted_request_records_the_keys_use(stack):
    """§2: an invalid request must not cost a DynamoDB write; §10: the self-service endpoints
    are read-only. A key's first use (a key not used for ten minutes) wrote its `last_used_at`
    whatever the request was: a 404, a 400, a model outside its allowlist, `GET /v1/key`. It is
    recorded by requests that write anyway: an admitted request, a key management's change."""
    org_id, key = stack.org()
    narrow = stack.key(org_id, models=["qwen3-32b"])
    manager = stack.key(org_id, role="management")
    mark = len(stack.faults.calls)
    assert stack.post(CHAT, {"model": "not-a-model", "messages": [{"role": "user", "content": "x"}]}, key).status_code == 404
    assert stack.post(CHAT, {"model": "gpt-oss-120b", "messages": []}, key).status_code == 400
    assert stack.post(CHAT, GOOD, narrow).status_code == 404  # outside its allowlist
    assert stack.post(CHAT, GOOD, manager).status_code == 403  # a management key
    for path in ("/v1/models", "/v1/key", "/v1/credits", "/v1/usage", "/v1/generations/gen-0", "/v1/keys"):
        answered = stack.http.get(path, headers={"Authorization": f"Bearer {manager}"})
        assert answered.status_code in (200, 404), (path, answered.text)
    assert writes_since(stack, mark) == []

    def last_used(secret: str) -> str | None:
        deadline = time.monotonic() + 5
        while True:  # written off the request's path
            used = stack.http.get("/v1/key", headers={"Authorization": f"Bearer {secret}"}).json()["last_used_at"]
            if used or time.monotonic() > deadline:
                return used
            time.sleep(0.05)

    assert last_used(narrow) is None and last_used(manager) is None
    assert stack.post(CHAT, GOOD, key).status_code == 200
    assert last_used(key) is not None
    key_id = stack.http.get("/v1/key", headers={"Authorization": f"Bearer {narrow}"}).json()["id"]
    changed = stack.http.patch(f"/v1/keys/{key_id}", json={"label": "narrow"},
                               headers={"Authorization": f"Bearer {manager}"})
    assert changed.status_code == 200, changed.text
    assert last_used(manager) is not None and last_used(narrow) is None


def test_a_key_refused_at_admission_is_used_and_many_requests_at_once_record_it_once(stack):
    """A key whose requests reach admission and are refused (402 out of credits, 429 at its
    limit) is used: admission wrote for it. And concurrent requests of one key, each looking
    it up (no cache), wrote its last use twice or more: a lookup that read it before the
    first write landed made it due again."""
    from concurrent.futures import ThreadPoolExecutor

    keys_table = stack.settings.keys_table

    def touches_since(mark: int) -> int:
        time.sleep(0.3)  # written off the request's path
        return sum(1 for op, payload in stack.faults.calls[mark:]
                   if op == "UpdateItem" and payload.get("TableName") == keys_table)

    def last_used(secret: str):
        return stack.http.get("/v1/key", headers={"Authorization": f"Bearer {secret}"}).json()["last_used_at"]

    _, broke = stack.org(credits="0")
    mark = len(stack.faults.calls)
    assert stack.post(CHAT, GOOD, broke).status_code == 402
    assert touches_since(mark) == 1 and last_used(broke) is not None

    org_id, key = stack.org()
    mark = len(stack.faults.calls)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda i: stack.post(
            CHAT, {**GOOD, "messages": [{"role": "user", "content": f"hi {i}"}]}, key).status_code, range(24)))
    assert set(statuses) <= {200, 429} and 200 in statuses
    assert touches_since(mark) == 1


@pytest.mark.parametrize("path, body, param", [
    (CHAT, {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "tool_choice": 5,
            "response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "x"}], "tool_choice": ["required"],
            "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/responses", {"model": "qwen3-32b", "input": "x", "tool_choice": 5,
                       "text": {"format": {"type": "json_schema", "name": "n", "schema": {}}}}, "text.format"),
], ids=["chat-response-format", "chat-guided", "responses-text-format"])
def test_an_unsupported_parameter_is_answered_before_an_invalid_type(stack, path, body, param):
    """§2 step 4 names unsupported_parameter before invalid_type: a tool_choice of the wrong
    type was refused first, whatever else the request asked the model for."""
    _, key = stack.org()
    response = stack.post(path, body, key)
    assert response.status_code == 400
    assert (error_of(response)["code"], error_of(response)["param"]) == ("unsupported_parameter", param)


def test_out_of_credits_is_answered_before_the_limit(stack):
    """§2 step 5: an org out of credits is 402, even when it also has its limit in flight."""
    org_id, key = stack.org(concurrency=1, credits="1")
    slow = {**GOOD, "stream": True, "mock": {"ttft_ms": 1500}}
    first: dict = {}
    thread = threading.Thread(target=lambda: first.setdefault("r", stack.post(CHAT, slow, key)))
    thread.start()
    stack.mock.wait_for(lambda s: s["in_flight"] >= 1)
    add_credits(stack.tables, org_id, Decimal("-1"))  # the org's one slot held, its credits gone
    response = stack.post(CHAT, GOOD, key)
    thread.join()
    assert first["r"].status_code == 200
    assert response.status_code == 402 and error_of(response)["code"] == "insufficient_credits"


def test_out_of_credits_is_402(stack):
    org_id, key = stack.org(credits="0")
    response = stack.post(CHAT, GOOD, key)
    assert response.status_code == 402
    assert error_of(response)["code"] == "insufficient_credits"
    assert "X-Neocloud-Generation-Id" not in response.headers
    assert stack.events(org_id) == []


def test_credits_run_out_then_402(stack):
    org_id, key = stack.org(credits="0.000001")  # less than two small requests cost
    assert stack.post(CHAT, GOOD, key).status_code == 200
    statuses = [stack.post(CHAT, GOOD, key).status_code for _ in range(3)]
    assert 402 in statuses
    assert stack.org_info(org_id).credits <= 0


def test_limit_reached_is_429_without_rate_limit_headers(stack):
    org_id, key = stack.org(concurrency=1)
    slow = {**GOOD, "stream": True, "mock": {"ttft_ms": 800}}
    first: dict = {}
    thread = threading.Thread(target=lambda: first.setdefault("r", stack.post(CHAT, slow, key)))
    thread.start()
    stack.mock.wait_for(lambda s: s["in_flight"] >= 1)
    response = stack.post(CHAT, GOOD, key)
    thread.join()
    assert first["r"].status_code == 200
    assert_a_plain_429(response)
    assert error_of(response)["code"] == "rate_limit_exceeded"


def test_unknown_routes_and_methods_answer_in_the_error_shape(stack, org):
    _, key = org
    response = stack.http.get("/v1/nope", headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 404
    assert error_of(response)["code"] == "unknown_url"
    response = stack.http.get(CHAT)
    assert response.status_code == 405 and response.headers["Allow"] == "POST"
    assert error_of(response)["code"] == "method_not_allowed"


def test_a_revoked_key_stays_valid_no_longer_than_the_cache(stack_factory):
    stack = stack_factory(auth_cache_seconds=0.5)
    org_id, key = stack.org()
    assert stack.post(CHAT, GOOD, key).status_code == 200
    revoke_key(stack.tables, list_keys(stack.tables, org_id)[0].key_id)
    time.sleep(0.6)
    assert stack.post(CHAT, GOOD, key).status_code == 401
