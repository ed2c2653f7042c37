"""A key's own limits, enforced inside the org's writes (contract §10, §2 steps 3-5).

Spend limits per period, an allowlist of models, a concurrency of its own and the
management role, through the official SDK and raw HTTP, with the ledger's invariants
checked after each case (one event per admitted request, debits and each key's spend equal
to the events' costs, no request left in flight).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from decimal import Context, Decimal

import httpx
import openai
import pytest

from kiln.store.keys import list_keys, update_key
from kiln.store.keyspend import period_name, resets_at
from support import LedgerCheck, assert_a_plain_429, check_key_figures

CHAT = "/v1/chat/completions"
BODY = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x y z"}]}


def _org_writes(stack) -> int:
    """Writes to the orgs table and transactions so far (a key's last use is written apart)."""
    orgs = stack.settings.orgs_table
    return stack.faults.count("UpdateItem", lambda payload: payload["TableName"] == orgs) + stack.faults.count(
        "TransactWriteItems")


def _sdk(stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0)


def _ask(client: openai.OpenAI, ledger: LedgerCheck | None = None):
    """One chat completion through the SDK; the generation id it was given is told to `ledger`."""
    raw = client.chat.completions.with_raw_response.create(
        model="qwen3-32b", messages=[{"role": "user", "content": "x y z"}])
    if ledger is not None:
        ledger.saw(httpx.Response(raw.status_code, headers=raw.headers))
    return raw.parse()


def test_a_key_over_its_spend_limit_gets_402_while_another_key_of_the_org_is_served(stack, org):
    org_id, other_key = org
    ledger = LedgerCheck(stack, org_id)
    probe = _ask(_sdk(stack, other_key), ledger)
    cost = Decimal(str(probe.usage.model_extra["cost"]))
    assert cost > 0
    limited = stack.key(org_id, spend_limit=cost * Decimal("2.5"), spend_period="day", label="agent")
    client = _sdk(stack, limited)
    for _ in range(3):  # the 3rd crosses the limit: it was admitted below it, and settles above
        assert _ask(client, ledger).choices[0].message.content
    with pytest.raises(openai.APIStatusError) as refused:
        _ask(client, ledger)
    assert refused.value.status_code == 402
    error = refused.value.body
    assert (error["type"], error["code"]) == ("billing_error", "key_spend_limit_exceeded")
    resets = resets_at("day", time.time()).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert resets in error["message"]  # the message says when the period resets
    # the same org, another key: served, and the org's credits were never the limit
    assert _ask(_sdk(stack, other_key), ledger).choices[0].message.content
    events = ledger.check()
    assert len(events) == 5  # the refused request left no event and cost nothing
    by_key = Counter(event.key_id for event in events)
    limited_id = next(key_id for key_id, count in by_key.items() if count == 3)
    spend = stack.key_figures(org_id)
    assert spend[f"key_spend:{limited_id}:{period_name('day', time.time())}"] == 3 * cost


def test_a_total_limit_says_it_does_not_reset_and_a_zero_limit_admits_nothing(stack, org):
    org_id, _ = org
    ledger = LedgerCheck(stack, org_id)
    writes = _org_writes(stack)
    response = stack.post(CHAT, BODY, stack.key(org_id, spend_limit="0"))
    assert response.status_code == 402
    body = response.json()["error"]
    assert body["code"] == "key_spend_limit_exceeded" and "does not reset" in body["message"]
    assert _org_writes(stack) == writes + 1  # refused by the admission's one write
    ledger.check()


def test_the_refusal_names_the_limit_and_the_spend_to_their_last_digit(stack, org):
    """38 significant digits are a limit DynamoDB keeps: the message rounds neither figure."""
    org_id, _ = org
    ledger = LedgerCheck(stack, org_id)
    limit = "0.00000000000000000000000000000012345678901234567890123456789012345678"
    key = stack.key(org_id, spend_limit=limit, spend_period="month")
    assert ledger.saw(stack.post(CHAT, BODY, key)).status_code == 200  # admitted below the limit, settles above
    (event,) = ledger.check()
    refused = ledger.saw(stack.post(CHAT, BODY, key))
    assert refused.status_code == 402, refused.text
    message = refused.json()["error"]["message"]
    assert f"its limit of ${limit}." in message
    assert f"has spent ${event.cost.normalize(Context(prec=60)):f} this month" in message
    ledger.check()


def test_the_orgs_own_refusals_come_before_the_keys(stack):
    org_id, _ = stack.org(credits="0")
    response = stack.post(CHAT, BODY, stack.key(org_id, spend_limit="0"))
    assert (response.status_code, response.json()["error"]["code"]) == (402, "insufficient_credits")


def test_a_model_outside_the_keys_allowlist_is_not_found_with_the_exact_body_and_no_write(stack, org):
    org_id, _ = org
    key = stack.key(org_id, models=["qwen3-32b"])
    writes = _org_writes(stack)
    response = stack.post(CHAT, {**BODY, "model": "gpt-oss-120b"}, key)
    assert response.status_code == 404
    assert response.content == (
        b'{"error":{"message":"The model `gpt-oss-120b` does not exist or you do not have access to it.",'
        b'"type":"invalid_request_error","param":"model","code":"model_not_found"}}'
    )
    assert _org_writes(stack) == writes
    # the same refusal through the SDK, and the allowed model is served
    client = _sdk(stack, key)
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-oss-120b", prompt="x")
    assert missing.value.body["code"] == "model_not_found"
    assert _ask(client).choices[0].message.content
    # a key sees only the models it may use
    assert [model.id for model in client.models.list()] == ["qwen3-32b"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-oss-120b")
    assert [event.model for event in stack.events(org_id)] == ["qwen3-32b"]


def test_a_key_concurrency_of_2_refuses_exactly_one_of_3_while_the_org_has_slots(stack, org):
    org_id, _ = org
    ledger = LedgerCheck(stack, org_id)
    key = stack.key(org_id, concurrency=2)
    body = {**BODY, "stream": True, "mock": {"tokens": 4, "token_delay_ms": 150}}

    async def three() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            async def one() -> httpx.Response:
                response = await client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
                ledger.saw(response)
                return response

            return await asyncio.gather(one(), one(), one())

    responses = asyncio.run(three())
    assert sorted(response.status_code for response in responses) == [200, 200, 429]
    refused_response = next(response for response in responses if response.status_code == 429)
    assert_a_plain_429(refused_response)
    refused = refused_response.json()["error"]
    assert refused["code"] == "rate_limit_exceeded" and "its limit" in refused["message"]
    assert "This key already has 2 requests in flight" in refused["message"]
    assert stack.org_info(org_id).concurrency_limit == 8  # the org had slots left
    ledger.check()


def test_a_management_key_cannot_call_a_model(stack, org):
    org_id, _ = org
    key = stack.key(org_id, role="management")
    with pytest.raises(openai.PermissionDeniedError) as denied:
        _ask(_sdk(stack, key))
    assert (denied.value.body["type"], denied.value.body["code"]) == ("permission_error", "management_key")
    for path, body in (("/v1/completions", {"model": "qwen3-32b", "prompt": "x"}),
                       ("/v1/responses", {"model": "qwen3-32b", "input": "x"})):
        response = stack.post(path, body, key)
        assert (response.status_code, response.json()["error"]["code"]) == (403, "management_key")
    assert stack.events(org_id) == []


def test_only_a_key_with_a_spend_limit_keeps_a_figure_on_its_org_and_it_is_exact(stack, org):
    org_id, free_key = org
    ledger = LedgerCheck(stack, org_id)
    weekly = stack.key(org_id, spend_limit="1", spend_period="week")
    for key in (free_key, weekly):
        for stream in (False, True):
            ledger.saw(stack.post(CHAT, {**BODY, "stream": stream, "stream_options": {"include_usage": True}}, key))
    events = ledger.check()
    by_key: dict[str, Decimal] = {}
    for event in events:
        by_key[event.key_id] = by_key.get(event.key_id, Decimal(0)) + event.cost
    figures = {name: value for name, value in stack.key_figures(org_id).items() if name.startswith("key_spend:")}
    assert len(figures) == 1  # the org item does not grow with keys that have no limit
    ((name, spent),) = figures.items()
    _, key_id, period = name.split(":")
    assert period == period_name("week", time.time()) and spent == by_key[key_id]
    check_key_figures(stack, org_id, events)


def test_past_periods_figures_are_removed_after_an_admission_sees_them(stack, org):
    org_id, _ = org
    key = stack.key(org_id, spend_limit="1", spend_period="day")
    stack.dynamodb.update_item(
        TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
        UpdateExpression="SET #old = :spent",
        ExpressionAttributeNames={"#old": "key_spend:key_0123456789abcdef:2020-01-01"},
        ExpressionAttributeValues={":spent": {"N": "1.5"}},
    )
    assert stack.post(CHAT, BODY, key).status_code == 200
    deadline = time.monotonic() + 5
    while "key_spend:key_0123456789abcdef:2020-01-01" in stack.key_figures(org_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    figures = stack.key_figures(org_id)
    assert "key_spend:key_0123456789abcdef:2020-01-01" not in figures
    assert [name.rpartition(":")[2] for name in figures if name.startswith("key_spend:")] == [
        period_name("day", time.time())]  # the current one stays


def test_a_key_with_every_limit_still_costs_one_admission_write_and_one_settle_transaction(stack_factory):
    stack = stack_factory(auth_cache_seconds=60)  # as deployed: the key and its limits cached
    org_id, _ = stack.org()
    key = stack.key(org_id, concurrency=2, spend_limit="1", spend_period="week", models=["qwen3-32b"])
    assert stack.post(CHAT, BODY, key).status_code == 200  # the key's first use: its last use is written apart
    orgs = stack.settings.orgs_table
    for stream in (False, True):
        before = (stack.faults.count("UpdateItem", lambda p: p["TableName"] == orgs),
                  stack.faults.count("TransactWriteItems"), stack.faults.count("GetItem"))
        assert stack.post(CHAT, {**BODY, "stream": stream}, key).status_code == 200
        after = (stack.faults.count("UpdateItem", lambda p: p["TableName"] == orgs),
                 stack.faults.count("TransactWriteItems"), stack.faults.count("GetItem"))
        assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 0]  # and no read: the key is cached


def test_a_keys_refusal_after_its_concurrency_was_lowered_says_how_many_run(stack, org):
    """A key's concurrency lowered below what it runs: its 429 names both figures."""
    org_id, _ = org
    ledger = LedgerCheck(stack, org_id)
    key = stack.key(org_id, concurrency=3)
    key_id = next(k.key_id for k in list_keys(stack.tables, org_id) if k.concurrency == 3)
    body = {**BODY, "stream": True, "mock": {"tokens": 12, "token_delay_ms": 100}}

    async def lowered_under_three_streams() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            async def one() -> httpx.Response:
                response = await client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
                ledger.saw(response)
                return response

            running = [asyncio.ensure_future(one()) for _ in range(3)]
            while stack.org_info(org_id).in_flight < 3:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(update_key, stack.tables, key_id, concurrency=1)
            refused = await client.post(CHAT, json=BODY, headers={"Authorization": f"Bearer {key}"})
            return await asyncio.gather(*running), refused

    served, refused = asyncio.run(lowered_under_three_streams())
    assert [response.status_code for response in served] == [200, 200, 200]
    assert refused.status_code == 429
    message = refused.json()["error"]["message"]
    assert "This key already has 3 requests in flight, over its limit of 1" in message, message
    ledger.check()
