"""Concurrency storm: never more than the limit at the upstream, no lease left, no borrowing."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx

from conftest import STORM_CONCURRENCY, STORM_ROUNDS, sized
from support import check_key_figures

CHAT = "/v1/chat/completions"


async def _round(client: httpx.AsyncClient, key: str, count: int, body: dict) -> list[int]:
    async def one() -> int:
        response = await client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
        return response.status_code

    return await asyncio.gather(*(one() for _ in range(count)))


def test_storm_of_concurrent_requests_from_one_org(storage, storage_stack_factory):
    stack = storage_stack_factory(auth_cache_seconds=60)  # as in production: key lookups cached
    org_id, key = stack.org(credits="1000", concurrency=8)
    # each request holds its slot long enough for the round's others to be admitted meanwhile on a
    # busy machine; under faults an admission may take several tries, with pauses, before it lands
    hold_ms = 50 if storage == "plain" else 250
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "mock": {"tokens": 3, "token_delay_ms": hold_ms}}

    async def storm() -> Counter:
        statuses: Counter = Counter()
        limits = httpx.Limits(max_connections=STORM_CONCURRENCY)
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=limits) as client:
            for _ in range(sized(storage, STORM_ROUNDS)):
                statuses.update(await _round(client, key, STORM_CONCURRENCY, body))
        return statuses

    statuses = asyncio.run(storm())
    assert set(statuses) == {200, 429}  # under faults too: no 503 from the org's own settles
    stats = stack.mock.stats
    assert stats["max_in_flight"] == 8  # the limit was reached, and never passed, at the upstream
    assert stats["requests"] == statuses[200]
    assert stack.org_info(org_id).in_flight == 0
    assert len(stack.events(org_id)) == statuses[200]
    # no connection leaked: once the storm is over, every connection the gateway keeps open
    # (to the model server and to storage) is back in its pool, idle
    http = stack.gateway.http
    deadline = time.monotonic() + 5
    while http.open_connections != http.idle_connections and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 0 < http.open_connections == http.idle_connections <= 2 * STORM_CONCURRENCY


def test_two_orgs_at_once_never_borrow_each_others_slots(storage, storage_stack_factory):
    stack = storage_stack_factory()
    a_id, a_key = stack.org(credits="1000", concurrency=3)
    b_id, b_key = stack.org(credits="1000", concurrency=5)
    rounds = max(3, sized(storage, STORM_ROUNDS) // 10)

    def body(tag: str) -> dict:
        return {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True,
                "mock": {"tokens": 4, "token_delay_ms": 40, "tag": tag}}

    async def storm() -> tuple[Counter, Counter]:
        a, b = Counter(), Counter()
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            for _ in range(rounds):
                ra, rb = await asyncio.gather(_round(client, a_key, 12, body("a")), _round(client, b_key, 12, body("b")))
                a.update(ra)
                b.update(rb)
        return a, b

    a, b = asyncio.run(storm())
    # at the upstream each org had exactly its own limit in flight at most, whatever the other did
    assert stack.mock.stats["max_in_flight_by_tag"] == {"a": 3, "b": 5}
    assert a[429] and b[429]
    assert set(a) | set(b) == {200, 429}
    assert stack.org_info(a_id).in_flight == stack.org_info(b_id).in_flight == 0
    assert (len(stack.events(a_id)), len(stack.events(b_id))) == (a[200], b[200])


def test_keys_with_their_own_limits_hold_them_and_the_org_its_own(storage, storage_stack_factory):
    """Contract §10: a key's concurrency, inside the org's; every key's spend = its events' costs."""
    stack = storage_stack_factory(auth_cache_seconds=60)
    org_id, free_key = stack.org(credits="1000", concurrency=6)
    keys = {"two": stack.key(org_id, concurrency=2), "three": stack.key(org_id, concurrency=3, spend_limit="100"),
            "free": free_key}
    rounds = max(3, sized(storage, STORM_ROUNDS) // 10)

    def body(tag: str) -> dict:
        return {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True,
                "mock": {"tokens": 4, "token_delay_ms": 40, "tag": tag}}

    async def storm() -> Counter:
        statuses: Counter = Counter()
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            for _ in range(rounds):
                results = await asyncio.gather(*(_round(client, key, 8, body(tag)) for tag, key in keys.items()))
                for result in results:
                    statuses.update(result)
        return statuses

    async def alone(tag: str, limit: int) -> Counter:
        # One key by itself, round after round until its own limit is reached at the upstream: in
        # the storm the org's six slots may all go to the other keys, so reaching it there is luck.
        statuses: Counter = Counter()
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=httpx.Limits(max_connections=64)) as client:
            for _ in range(10):
                statuses.update(await _round(client, keys[tag], 8, body(tag)))
                if stack.mock.stats["max_in_flight_by_tag"][tag] >= limit:
                    break
        return statuses

    statuses = asyncio.run(storm())
    assert set(statuses) == {200, 429}
    by_tag = stack.mock.stats["max_in_flight_by_tag"]
    assert by_tag["two"] <= 2 and by_tag["three"] <= 3  # no key above its own limit
    assert stack.mock.stats["max_in_flight"] <= 6  # and all of them within the org's
    for tag, limit in (("two", 2), ("three", 3)):
        statuses.update(asyncio.run(alone(tag, limit)))
    assert set(statuses) == {200, 429}
    by_tag = stack.mock.stats["max_in_flight_by_tag"]
    assert (by_tag["two"], by_tag["three"]) == (2, 3)  # each key reached its own limit, never more
    events = stack.events(org_id)
    assert len(events) == statuses[200] and stack.org_info(org_id).in_flight == 0
    check_key_figures(stack, org_id, events)
