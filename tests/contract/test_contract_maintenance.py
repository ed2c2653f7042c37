"""Contract §6: the maintenance switch, on every endpoint, flipped without a deploy."""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime

import pytest

ENDPOINTS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/qwen3-32b"),
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
