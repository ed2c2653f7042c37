"""GET /v1/generations/{id}: an org reads its own usage events, and only its own."""

from __future__ import annotations

import pytest

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-oss-120b", "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello!"}]}


def lookup(stack, gen_id: str, key: str):
    return stack.http.get(f"/v1/generations/{gen_id}", headers={"Authorization": f"Bearer {key}"})


def test_the_generation_id_of_a_response_finds_its_usage_event(stack, org):
    org_id, key = org
    response = stack.post(CHAT, {**BODY, "mock": {"cached_tokens": 2}}, key)
    gen_id = response.headers["X-Neocloud-Generation-Id"]
    found = lookup(stack, gen_id, key)
    assert found.status_code == 200
    generation = found.json()
    assert generation["id"] == gen_id and generation["object"] == "generation"
    assert (generation["model"], generation["endpoint"], generation["streamed"]) == ("gpt-oss-120b", "chat.completions", False)
    assert (generation["status"], generation["http_status"], generation["finish_reason"]) == ("success", 200, "stop")
    assert generation["usage"]["prompt_tokens"] == 9 and generation["usage"]["completion_tokens"] == 12
    assert generation["usage"]["total_tokens"] == 21
    assert generation["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    assert generation["usage"]["cost"] == response.json()["usage"]["cost"]
    assert generation["usage_source"] == "upstream" and generation["duration_ms"] >= generation["ttfb_ms"] >= 0
    assert "upstream" not in generation and "error" not in generation  # no backend names, no internal detail


def test_failed_requests_have_generations_too(stack, org):
    _, key = org
    response = stack.post(CHAT, {**BODY, "mock": {"status": 500}}, key)
    assert response.status_code == 502
    generation = lookup(stack, response.headers["X-Neocloud-Generation-Id"], key).json()
    assert (generation["status"], generation["http_status"], generation["usage"]["cost"]) == ("upstream_error", 502, 0)


def test_another_orgs_generation_is_404_exactly_as_an_unknown_one(stack, org):
    _, key = org
    _, other_key = stack.org()
    theirs = stack.post(CHAT, BODY, other_key).headers["X-Neocloud-Generation-Id"]
    assert lookup(stack, theirs, other_key).status_code == 200

    refused = lookup(stack, theirs, key)
    unknown_id = "gen-" + "0" * 26
    unknown = lookup(stack, unknown_id, key)
    assert refused.status_code == unknown.status_code == 404
    assert refused.json()["error"]["code"] == unknown.json()["error"]["code"] == "generation_not_found"
    # the bodies differ only by the id echoed back
    assert refused.text.replace(theirs, "ID") == unknown.text.replace(unknown_id, "ID")


@pytest.mark.parametrize("bad", ["nope", "gen-" + "z" * 26, "gen-" + "0" * 300, "%00", "gen-0"])
def test_malformed_ids_are_404_too(stack, org, bad):
    response = lookup(stack, bad, org[1])
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "generation_not_found"


def test_lookups_need_a_key_and_follow_maintenance(stack, org):
    gen_id = stack.post(CHAT, BODY, org[1]).headers["X-Neocloud-Generation-Id"]
    assert stack.http.get(f"/v1/generations/{gen_id}").status_code == 401
    stack.set_maintenance({"enabled": True})
    assert lookup(stack, gen_id, org[1]).status_code == 503


def test_a_lookup_is_not_billed_and_writes_no_usage(stack, org):
    org_id, key = org
    gen_id = stack.post(CHAT, BODY, key).headers["X-Neocloud-Generation-Id"]
    credits = stack.org_info(org_id).credits
    response = lookup(stack, gen_id, key)
    assert "X-Neocloud-Generation-Id" not in response.headers
    assert stack.org_info(org_id).credits == credits
    assert len(stack.events(org_id)) == 1
