"""The deadline of the requests that call no model (kiln.deadline)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from starlette.requests import Request
from starlette.responses import Response

from kiln.deadline import LAMBDA_MARGIN_SECONDS, bounded, deadline_of
from kiln.errors import RequestTimeout, StorageUnavailable


def lambda_context(remaining):
    return SimpleNamespace(get_remaining_time_in_millis=remaining)


@pytest.mark.parametrize("scope, expected", [
    ({}, 25.0),  # not on Lambda (uvicorn, the Web Adapter): the setting
    ({"aws.context": None}, 25.0),
    ({"aws.context": lambda_context(lambda: 29_000)}, 25.0),  # more is left than the setting asks
    ({"aws.context": lambda_context(lambda: 10_000)}, 10.0 - LAMBDA_MARGIN_SECONDS),
    ({"aws.context": lambda_context(lambda: 2_000)}, 0.001),  # less than the margin: at once
    ({"aws.context": lambda_context(lambda: "soon")}, 25.0),  # no context Lambda makes: the setting
])
def test_the_deadline_is_the_setting_or_what_lambda_leaves_less_its_margin(scope, expected):
    assert deadline_of(scope, 25.0) == pytest.approx(expected)


def request(method: str = "GET", path: str = "/v1/usage", deadline: float = 0.05) -> Request:
    app = SimpleNamespace(state=SimpleNamespace(gateway=SimpleNamespace(
        settings=SimpleNamespace(answer_deadline_seconds=deadline))))
    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    return Request({"type": "http", "method": method, "path": path, "query_string": b"", "headers": [], "app": app},
                   receive)


@pytest.mark.parametrize("method, path, said", [
    ("GET", "/v1/usage", "Nothing was changed"),
    ("POST", "/v1/keys", "revoke one you did not get"),
    ("PATCH", "/v1/keys/key_0123", "read the key (GET /v1/keys/key_0123)"),
    ("DELETE", "/v1/keys/key_0123", "The change may have been made"),
])
def test_work_past_its_deadline_is_a_503_that_says_what_may_have_been_written(method, path, said):
    async def slow(request: Request) -> Response:
        if method in ("POST", "PATCH"):
            await request.body()  # as every handler reads its body before it calls storage
        await asyncio.sleep(5)
        return Response(b"late")

    with pytest.raises(StorageUnavailable) as raised:
        asyncio.run(bounded(slow)(request(method, path)))
    assert said in str(raised.value) and "(0.05 s)" in str(raised.value)


def test_a_timeout_of_the_work_itself_is_not_taken_for_the_deadline():
    async def times_out(request: Request) -> Response:
        raise TimeoutError("its own")

    with pytest.raises(TimeoutError, match="its own"):
        asyncio.run(bounded(times_out)(request(deadline=10)))


def test_work_within_its_deadline_is_answered_as_it_was():
    async def quick(request: Request) -> Response:
        return Response(b"ok")

    assert asyncio.run(bounded(quick)(request())).body == b"ok"


@pytest.mark.parametrize("method", ["POST", "PATCH"])
def test_a_body_still_arriving_at_the_deadline_is_a_408_not_storages_503(method):
    """A client that sends its body slowly: a key's change cut at the deadline while its body
    was still coming was answered 503 storage_unavailable, "a key may have been made", with
    nothing asked of storage, nothing written. It is 408 request_timeout, as the server answers
    a body that does not arrive on the model endpoints."""
    async def receive():
        await asyncio.sleep(5)
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def handler(request: Request) -> Response:
        return Response(await request.body())

    app = SimpleNamespace(state=SimpleNamespace(gateway=SimpleNamespace(
        settings=SimpleNamespace(answer_deadline_seconds=0.05))))
    slow = Request({"type": "http", "method": method, "path": "/v1/keys", "query_string": b"", "headers": [],
                    "app": app}, receive)
    with pytest.raises(RequestTimeout) as raised:
        asyncio.run(bounded(handler)(slow))
    assert raised.value.status == 408 and raised.value.code == "request_timeout"


def test_storage_slow_before_the_body_is_read_is_storages_503_not_the_clients_408():
    """The maintenance switch is read before the body: a slow read of it cut at the deadline
    is storage's, whether the body, there whole all along, was read or not."""
    async def handler(request: Request) -> Response:
        await asyncio.sleep(5)  # the switch's read
        return Response(await request.body())

    with pytest.raises(StorageUnavailable):
        asyncio.run(bounded(handler)(request("POST", "/v1/keys")))


def test_work_past_the_deadline_after_its_body_arrived_is_still_storages_503():
    async def handler(request: Request) -> Response:
        await request.body()
        await asyncio.sleep(5)
        return Response(b"late")

    with pytest.raises(StorageUnavailable):
        asyncio.run(bounded(handler)(request("POST", "/v1/keys")))
