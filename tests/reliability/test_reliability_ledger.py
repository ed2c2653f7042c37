"""The ledger after a thousand mixed requests: Σ event costs = Σ debits, one event per admission."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from decimal import Decimal

import httpx

from conftest import LEDGER_REQUESTS, sized
from kiln.store.keys import hash_secret
from support import check_key_figures, key_totals, wait_for_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


KINDS = {"ok": 20, "stream": 20, "usage": 8, "completion": 8, "4xx": 6, "5xx": 6, "plain500": 3, "timeout": 3, "cut": 6,
         "silent": 6, "disconnect": 6, "no_backend": 3, "cached": 5}


def _mix(rng: random.Random) -> tuple[str, dict, str]:
    """(path, body, how the client behaves): successes and every way a request can go wrong."""
    return _request(rng, rng.choices(list(KINDS), weights=list(KINDS.values()))[0])


def _request(rng: random.Random, kind: str) -> tuple[str, dict, str]:
    chat = {"model": rng.choice(["gpt-oss-120b", "qwen3-32b"]), "messages": [{"role": "user", "content": "x y z"}]}
    if kind == "ok":
        return CHAT, chat, "read"
    if kind == "stream":
        return CHAT, {**chat, "stream": True}, "read"
    if kind == "usage":
        return CHAT, {**chat, "stream": True, "stream_options": {"include_usage": True}}, "read"
    if kind == "completion":
        return COMPLETIONS, {"model": chat["model"], "prompt": "The capital of France is", "stream": rng.random() < 0.5}, "read"
    if kind == "4xx":
        return CHAT, {**chat, "mock": {"status": rng.choice([400, 404, 422])}}, "read"
    if kind == "5xx":
        return CHAT, {**chat, "stream": rng.random() < 0.5, "mock": {"status": 503}}, "read"
    if kind == "plain500":
        return CHAT, {**chat, "mock": {"status": 500, "plain_text": True}}, "read"
    if kind == "timeout":
        return CHAT, {**chat, "model": "hung-model", "stream": True}, "read"
    if kind == "cut":
        return CHAT, {**chat, "stream": True, "mock": {"cut_after": rng.randint(1, 6)}}, "read"
    if kind == "silent":
        return CHAT, {**chat, "stream": rng.random() < 0.5, "mock": {"no_usage": True}}, "read"
    if kind == "disconnect":
        return CHAT, {**chat, "stream": True, "mock": {"token_delay_ms": 30}}, "disconnect"
    if kind == "no_backend":
        return CHAT, {**chat, "model": "no-backend-model"}, "read"
    return CHAT, {**chat, "mock": {"cached_tokens": 2}}, "read"


async def _one(client: httpx.AsyncClient, key: str, path: str, body: dict, behaviour: str) -> tuple[int, str | None]:
    headers = {"Authorization": f"Bearer {key}"}
    async with client.stream("POST", path, json=body, headers=headers) as response:
        gen_id = response.headers.get("X-Neocloud-Generation-Id")
        if behaviour == "disconnect" and response.status_code == 200:
            async for line in response.aiter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    break  # leave after the first token: the context manager closes the connection
        else:
            await response.aread()
        return response.status_code, gen_id


def test_a_thousand_mixed_requests_balance_to_the_last_decimal(storage, storage_stack_factory):
    stack = storage_stack_factory()
    rng = random.Random(20261130)
    rich_id, rich_key = stack.org(credits="50", concurrency=3)
    # a key of the same org with limits of its own (contract §10): its spend runs out, it has 2 slots
    budget = Decimal("0.00003")
    limited_key = stack.key(rich_id, concurrency=2, spend_limit=budget, spend_period="day")
    poor_id, poor_key = stack.org(credits="0.00002", concurrency=3)  # runs out of credits: 402s
    plan = [(_mix(rng), rng.choices(["rich", "limited", "poor"], weights=[60, 25, 15])[0])
            for _ in range(sized(storage, LEDGER_REQUESTS))]
    keys = {"rich": (rich_id, rich_key), "limited": (rich_id, limited_key), "poor": (poor_id, poor_key)}

    async def run() -> list[tuple[str, int, str | None]]:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=stack.url, timeout=60, limits=limits) as client:
            gate = asyncio.Semaphore(10)  # above the orgs' limits: some 429s

            async def guarded(item):
                (path, body, behaviour), who = item
                async with gate:
                    org, key = keys[who]
                    status, gen_id = await _one(client, key, path, body, behaviour)
                    return org, status, gen_id

            results = await asyncio.gather(*(guarded(item) for item in plan))
            # Then, one at a time, what the storm may have refused every time (a full org: 429, a
            # spent key: 402), so that the ledger checked below holds each way a request ends:
            # each kind once on a free slot, and the limited key used until its budget is spent.
            rich_id, rich_key = keys["rich"]
            for kind in ("ok", "4xx", "5xx", "cut", "disconnect", "no_backend"):
                results.append((rich_id, *await _one(client, rich_key, *_request(rng, kind))))
            for _ in range(200):
                results.append((rich_id, *await _one(client, limited_key, *_request(rng, "ok"))))
                if results[-1][1] == 402:
                    break
            return results

    results = asyncio.run(run())
    statuses = Counter(status for _, status, _ in results)
    assert statuses[200] and statuses[429] and statuses[402] and statuses[502] and statuses[503]
    # every 503 is the model's (no backend, after admission): never storage_unavailable, faults or not
    assert all(gen_id for _, status, gen_id in results if status == 503)
    for org_id, initial in ((rich_id, Decimal("50")), (poor_id, Decimal("0.00002"))):
        admitted = {gen_id for org, _, gen_id in results if org == org_id and gen_id}
        events = wait_for_events(stack, org_id, len(admitted), timeout=15)  # disconnects settle after the client left
        assert sorted(e.gen_id for e in events) == sorted(admitted)  # exactly one event per admitted request
        debited = initial - stack.org_info(org_id).credits
        assert sum(e.cost for e in events) == debited  # to the last decimal
        assert stack.org_info(org_id).in_flight == 0
        check_key_figures(stack, org_id, events)  # each key's spend: its events' costs, to the last decimal
    rich_statuses = Counter(e.status for e in stack.events(rich_id))
    assert {"success", "upstream_rejected", "upstream_error", "stream_interrupted", "client_disconnected",
            "no_backend_available"} <= set(rich_statuses)
    # the limited key spent its budget and was held to it, soft by at most the 2 requests it
    # could have in flight when it crossed
    limited_id = stack.tables.keys.get(hash_secret(limited_key)).key_id
    costs = [e.cost for e in stack.events(rich_id) if e.key_id == limited_id]
    spent = key_totals(stack.key_figures(rich_id))[limited_id]
    assert budget <= spent <= budget + 2 * max(costs)
    # a refused request (429, 402) is never charged and leaves no event
    assert all(gen_id is None for _, status, gen_id in results if status in (402, 429))
