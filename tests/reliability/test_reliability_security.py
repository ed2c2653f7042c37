"""Keys are never kept or logged in clear; revocation is prompt; one org never sees another's."""

from __future__ import annotations

import hashlib
import json
import time

from kiln.store.keys import list_keys, revoke_key
from support import TELEMETRY

CHAT = "/v1/chat/completions"
BODY = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "Tell me the launch codes."}]}


def _all_items(stack) -> str:
    dump = []
    for table in (stack.settings.keys_table, stack.settings.orgs_table, stack.settings.usage_table):
        for page in stack.dynamodb.get_paginator("scan").paginate(TableName=table):
            dump += page["Items"]
    return json.dumps(dump)


def test_keys_are_stored_only_as_hashes_and_never_logged(stack):
    org_id, key = stack.org()
    mark = len(TELEMETRY.text())
    stack.post(CHAT, BODY, key)  # admitted, settled
    stack.post(CHAT, BODY, key[:-1] + ("A" if key[-1] != "A" else "B"))  # a near miss: 401
    stack.post(CHAT, {**BODY, "mock": {"status": 500}}, key)  # an upstream failure: logged loudly
    stored = _all_items(stack)
    assert key not in stored and key[len("sk-kiln-"):] not in stored
    assert hashlib.sha256(key.encode()).hexdigest() in stored
    logged = TELEMETRY.text()[mark:]
    assert logged and key not in logged and key[len("sk-kiln-"):] not in logged
    assert "launch codes" not in logged and "launch codes" not in stored  # nor the prompt


def test_a_revoked_key_is_refused_within_the_cache_time(stack_factory):
    stack = stack_factory(auth_cache_seconds=1.0)
    org_id, key = stack.org()
    assert stack.post(CHAT, BODY, key).status_code == 200  # now cached
    revoke_key(stack.tables, list_keys(stack.tables, org_id)[0].key_id)
    revoked_at = time.monotonic()
    while stack.post(CHAT, BODY, key).status_code == 200:
        assert time.monotonic() - revoked_at <= 1.0 + 0.5, "a revoked key outlived the auth cache time"
        time.sleep(0.05)
    assert stack.post(CHAT, BODY, key).status_code == 401


def test_nothing_in_a_request_can_bill_or_read_another_org(stack):
    mine, my_key = stack.org(credits="1")
    theirs, their_key = stack.org(credits="1")
    their_gen = stack.post(CHAT, BODY, their_key).headers["X-Neocloud-Generation-Id"]
    their_credits = stack.org_info(theirs).credits
    spoofed = stack.post(
        CHAT,
        {**BODY, "user": theirs, "org_id": theirs, "organization": theirs},
        my_key,
        headers={"OpenAI-Organization": theirs, "OpenAI-Project": theirs, "X-Org-Id": theirs},
    )
    assert spoofed.status_code == 200
    assert stack.org_info(theirs).credits == their_credits  # the key decides who pays, nothing else
    assert {e.gen_id for e in stack.events(mine)} == {spoofed.headers["X-Neocloud-Generation-Id"]}
    # reading: their generation is not mine to see, however I ask
    for headers in ({}, {"OpenAI-Organization": theirs}):
        response = stack.http.get(f"/v1/generations/{their_gen}", headers={"Authorization": f"Bearer {my_key}", **headers})
        assert response.status_code == 404
    # the catalog is the same for everyone and holds no org's data
    listing = stack.http.get("/v1/models", headers={"Authorization": f"Bearer {my_key}"}).text
    assert theirs not in listing and mine not in listing
