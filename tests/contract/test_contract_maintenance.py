"""Contract §6: the maintenance switch, on every endpoint, flipped without a deploy."""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime

import pytest

ENDPOINTS = [  # §6: every endpoint
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/responses"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/qwen3-32b"),
    ("GET", "/v1/generations/gen-01a24da9b5b6fe93503a97450d"),
    ("GET", "/v1/credits"),
    ("GET", "/v1/key"),
    ("GET", "/v1/usage"),
    ("GET", "/v1/keys"),
    ("POST", "/v1/keys"),
    ("PATCH", "/v1/keys/key_0123456789abcdef"),
    ("DELETE", "/v1/keys/key_0123456789abcdef"),
]


@pytest.mark.parametrize("method,path", ENDPOINTS)
def test_every_endpoint_answers_503_with_the_until_as_http_date(stack, org, method, path):
    stack.set_maintenance({"enabled": True, "until": "2099-12-01T03:00:00Z", "message": "Upgrading model servers."})
    response = stack.http.request(
        method, path, json={"model": "qwen3-32b", "prompt": "x"}, headers={"Authorization": f"Bearer {org[1]}"}
    )
    assert response.status_code == 503
    assert response.json() == {
        "error": {"message": "Upgrading model servers.", "type": "service_unavailable", "param": None, "code": "maintenance"}
    }
    assert response.headers["Retry-After"] == "Tue, 01 Dec 2099 03:00:00 GMT"
    assert parsedate_to_datetime(response.headers["Retry-After"]).year == 2099


def test_without_until_retry_after_is_seconds(stack, org):
    stack.set_maintenance({"enabled": True})
    response = stack.post("/v1/chat/completions", {"model": "qwen3-32b", "messages": []}, org[1])
    assert response.status_code == 503
    assert response.headers["Retry-After"] == str(stack.settings.maintenance_retry_after_seconds)
    assert response.json()["error"]["message"]


def test_maintenance_admits_nothing_and_bills_nothing(stack, org):
    org_id, key = org
    stack.set_maintenance({"enabled": True})
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}
    assert stack.post("/v1/chat/completions", body, key).status_code == 503
    assert stack.mock.stats["requests"] == 0
    assert stack.events(org_id) == []


def test_flipping_takes_effect_within_the_cache_time_without_a_restart(stack_factory):
    stack = stack_factory(maintenance_cache_seconds=0.3)
    _, key = stack.org()
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}
    assert stack.post("/v1/chat/completions", body, key).status_code == 200
    stack.set_maintenance({"enabled": True})
    time.sleep(0.4)
    assert stack.post("/v1/chat/completions", body, key).status_code == 503
    stack.set_maintenance({"enabled": False})
    time.sleep(0.4)
    assert stack.post("/v1/chat/completions", body, key).status_code == 200


def test_the_switch_is_read_through_the_cache_not_per_request(stack_factory):
    stack = stack_factory(maintenance_cache_seconds=60)
    _, key = stack.org()
    name = stack.settings.maintenance_parameter
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(5):
        assert stack.post("/v1/chat/completions", body, key).status_code == 200
    assert stack.faults.count("GetParameter", lambda payload: payload["Name"] == name) == 1


@pytest.mark.parametrize("method,path", ENDPOINTS)
def test_while_on_a_request_reads_nothing_but_the_switch_even_on_cold_caches(stack_factory, method, path):
    """§6 (docs/design.md, check 1): while on, 503 and no other I/O, before the body is read:
    not the key, its org or the catalog, no key's last-use write; a stalled upload is not waited for."""
    stack = stack_factory(maintenance_cache_seconds=0, auth_cache_seconds=0, catalog_cache_seconds=0)
    _, key = stack.org()
    stack.set_maintenance({"enabled": True})
    stack.faults.calls.clear()
    response = stack.http.request(method, path, json={"model": "qwen3-32b", "prompt": "x"},
                                  headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 503
    assert [operation for operation, _ in stack.faults.calls] == ["GetParameter"]
    assert stack.faults.calls[0][1]["Name"] == stack.settings.maintenance_parameter


def test_while_on_a_stalled_upload_is_answered_at_once(stack_factory):
    import socket

    stack = stack_factory(maintenance_cache_seconds=0)
    _, key = stack.org()
    stack.set_maintenance({"enabled": True})
    host, port = stack.url.split("//", 1)[1].rstrip("/").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as client:
        client.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {key}\r\n"
                       "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"".encode())
        answer = client.recv(4096)  # the rest of the body never comes
    assert answer.startswith(b"HTTP/1.1 503 ")


def _switch_reads(stack):
    return lambda payload: payload.get("Name") == stack.settings.maintenance_parameter


def test_a_throttled_read_of_the_switch_neither_serves_a_request_nor_keeps_the_switch_off(stack_factory):
    """The switch fails open (an unreadable one counts as off): a new environment's first read,
    throttled once (a fleet cold-starting after a deploy, maintenance on), is tried again by
    the AWS client as ever; throttled past that, the next request reads it again at once."""
    stack = stack_factory(maintenance_cache_seconds=60.0)
    _, secret = stack.org()
    stack.set_maintenance({"enabled": True, "message": "Migrating."})
    chat = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}
    stack.faults.fail("GetParameter", code="ThrottlingException", when=_switch_reads(stack), times=1)
    first = stack.post("/v1/chat/completions", chat, secret)
    assert (first.status_code, first.json()["error"]["code"]) == (503, "maintenance")
    other = stack_factory(maintenance_cache_seconds=60.0)
    _, secret = other.org()
    other.set_maintenance({"enabled": True})
    other.faults.fail("GetParameter", code="ThrottlingException", when=_switch_reads(other), times=3)
    assert other.post("/v1/chat/completions", chat, secret).status_code == 200  # unreadable: off
    second = other.post("/v1/chat/completions", chat, secret)  # SSM answers again
    assert (second.status_code, second.json()["error"]["code"]) == (503, "maintenance")


@pytest.mark.parametrize("flag", [{"enabled": True, "until": "9999-12-31T23:59:59-05:00"}, {"enabled": "yes please"}])
def test_a_switch_written_by_hand_that_cannot_be_read_is_never_a_500(stack_factory, flag):
    """An until with no date in UTC (after 9999-12-31 there) once made every endpoint a 500; an
    "enabled" that says neither on nor off is as unreadable. Either is a malformed switch: the
    gateway keeps its last value (here none: off) and answers in the contract's shape."""
    stack = stack_factory()
    _, key = stack.org()
    stack.set_maintenance(flag)
    for method, path in ENDPOINTS:
        response = stack.http.request(method, path, json={"model": "qwen3-32b", "prompt": "x"},
                                      headers={"Authorization": f"Bearer {key}"})
        assert response.status_code != 500, (path, response.text)
        if response.status_code >= 400:  # answered as off: each endpoint's own answer, in the shape
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] != "internal_error", error


def test_a_switch_turned_on_with_a_string_is_on(stack_factory):
    """{"enabled": "true"}, written with aws ssm put-parameter, was read as off."""
    stack = stack_factory()
    _, key = stack.org()
    stack.set_maintenance({"enabled": "true"})
    response = stack.post("/v1/chat/completions", {"model": "qwen3-32b", "messages": []}, key)
    assert response.status_code == 503 and response.json()["error"]["code"] == "maintenance"
