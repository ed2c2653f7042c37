"""The org's limit of requests in flight (contract §2 step 5), leases that expire, the ledger."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from decimal import Decimal

import httpx

from support import data_events

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "Hello!"}]}


async def _burst(base_url: str, key: str, count: int, body: dict) -> list[int]:
    async with httpx.AsyncClient(base_url=base_url, timeout=30, limits=httpx.Limits(max_connections=count)) as client:

        async def one() -> int:
            response = await client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
            return response.status_code

        return await asyncio.gather(*(one() for _ in range(count)))


def test_32_concurrent_streams_exactly_8_admitted_and_no_lease_left(stack):
    org_id, key = stack.org()
    body = {**BODY, "stream": True, "mock": {"token_delay_ms": 100}}
    statuses = asyncio.run(_burst(stack.url, key, 32, body))
    assert Counter(statuses) == {200: 8, 429: 24}
    assert stack.mock.stats["max_in_flight"] == 8
    assert stack.org_info(org_id).in_flight == 0
    assert len(stack.events(org_id)) == 8


def test_two_orgs_never_share_slots(stack):
    a_id, a_key = stack.org(concurrency=2)
    b_id, b_key = stack.org(concurrency=3)
    body = {**BODY, "stream": True, "mock": {"token_delay_ms": 100}}

    async def both():
        return await asyncio.gather(_burst(stack.url, a_key, 6, body), _burst(stack.url, b_key, 6, body))

    a, b = asyncio.run(both())
    assert Counter(a) == {200: 2, 429: 4}
    assert Counter(b) == {200: 3, 429: 3}


def test_an_expired_lease_is_reclaimed_by_the_next_admission(stack_factory):
    """A request whose gateway died never settles; its slot comes back once the lease expires."""
    stack = stack_factory(lease_ttl_seconds=0.5)
    org_id, key = stack.org(concurrency=2)
    crashed = [
        stack.ledger.admit(org_id=org_id, key_id="key_x", model="qwen3-32b", endpoint="chat.completions", streamed=True)
        for _ in range(2)
    ]
    assert stack.post(CHAT, BODY, key).status_code == 429
    time.sleep(0.6)
    response = stack.post(CHAT, BODY, key)
    assert response.status_code == 200
    events = {e.gen_id: e for e in stack.events(org_id)}
    assert {events[lease.gen_id].status for lease in crashed} == {"abandoned"}
    assert events[response.headers["X-Neocloud-Generation-Id"]].status == "success"
    assert stack.org_info(org_id).in_flight == 0


def test_ledger_sum_of_event_costs_equals_credits_debited(stack):
    org_id, key = stack.org(credits="5", concurrency=4)
    mix = [
        (BODY, "/v1/chat/completions"),
        ({**BODY, "stream": True}, CHAT),
        ({**BODY, "stream": True, "stream_options": {"include_usage": True}}, CHAT),
        ({"model": "gpt-oss-120b", "prompt": "The capital of France is"}, "/v1/completions"),
        ({**BODY, "mock": {"status": 400}}, CHAT),
        ({**BODY, "mock": {"status": 500}}, CHAT),
        ({**BODY, "stream": True, "mock": {"cut_after": 4}}, CHAT),
        ({**BODY, "stream": True, "mock": {"no_usage": True}}, CHAT),
        ({**BODY, "mock": {"no_usage": True, "tokens": 40}}, CHAT),
        ({**BODY, "model": "no-backend-model"}, CHAT),
        ({**BODY, "mock": {"cached_tokens": 3}}, CHAT),
    ]
    statuses = []
    for _ in range(3):
        for body, path in mix:
            response = stack.post(path, body, key)
            statuses.append(response.status_code)
            if body.get("stream"):
                data_events(response.text)
    burst = asyncio.run(_burst(stack.url, key, 10, {**BODY, "stream": True, "mock": {"token_delay_ms": 50}}))
    events = stack.events(org_id)
    admitted = [s for s in statuses if s != 429] + [s for s in burst if s == 200]
    assert len(events) == len(admitted)
    assert 429 in burst
    debited = Decimal("5") - stack.org_info(org_id).credits
    assert sum(e.cost for e in events) == debited
    assert debited > 0
    assert stack.org_info(org_id).in_flight == 0


def test_a_refusal_after_the_limit_was_lowered_says_how_many_run_and_the_limit(stack):
    """An operator lowers an org's limit below what it runs: the next request's 429 says how
    many are in flight and what the limit is, not the limit as if it were the count."""
    from kiln.store.orgs import set_limit

    org_id, key = stack.org(concurrency=3)
    body = {**BODY, "stream": True, "mock": {"tokens": 12, "token_delay_ms": 100}}

    async def lowered_under_three_streams() -> tuple[list[int], httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            async def one() -> int:
                response = await client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
                return response.status_code

            running = [asyncio.ensure_future(one()) for _ in range(3)]
            while stack.org_info(org_id).in_flight < 3:
                await asyncio.sleep(0.02)
            await asyncio.to_thread(set_limit, stack.tables, org_id, 1)
            refused = await client.post(CHAT, json=BODY, headers={"Authorization": f"Bearer {key}"})
            return await asyncio.gather(*running), refused

    statuses, refused = asyncio.run(lowered_under_three_streams())
    assert statuses == [200, 200, 200]
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    message = refused.json()["error"]["message"]
    assert "3 requests in flight" in message and "limit of 1" in message, message
    assert stack.org_info(org_id).in_flight == 0
    assert len(stack.events(org_id)) == 3
