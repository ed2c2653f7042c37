"""Clients that leave: the upstream request is closed, the slot released, the tokens seen billed."""

from __future__ import annotations

import asyncio
import random

import httpx

from support import wait_for_events

CHAT = "/v1/chat/completions"


def test_a_client_leaving_while_the_upstream_is_still_silent(stack):
    """Gone before the first token: noticed at once (not at the next write), nothing billed."""
    org_id, key = stack.org()
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True, "mock": {"ttft_ms": 3000}}
    with stack.http.stream("POST", CHAT, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200  # the upstream answered; its first token is 3 s away
    stack.mock.wait_for(lambda s: s["disconnects"] == 1, timeout=2.5)  # well before that token
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.status == "client_disconnected" and event.completion_tokens == 0
    assert stack.org_info(org_id).in_flight == 0


def test_many_clients_leaving_at_random_points_leave_no_lease_and_no_gap(stack):
    org_id, key = stack.org(concurrency=8)
    rng = random.Random(7)
    body = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "mock": {"token_delay_ms": 25}}

    async def one(client: httpx.AsyncClient, leave_after: int) -> str:
        async with client.stream("POST", CHAT, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
            gen_id = response.headers["X-Neocloud-Generation-Id"]
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= leave_after:
                    break
        return gen_id

    async def run() -> list[str]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
            ids = []
            for _ in range(3):
                ids += await asyncio.gather(*(one(client, rng.randint(1, 16)) for _ in range(8)))
            return ids

    gen_ids = asyncio.run(run())
    events = wait_for_events(stack, org_id, len(gen_ids), timeout=10)
    assert sorted(e.gen_id for e in events) == sorted(gen_ids)  # one event each, none lost
    stack.mock.wait_for(lambda s: s["in_flight"] == 0)
    assert stack.org_info(org_id).in_flight == 0
    statuses = {e.status for e in events}
    assert statuses <= {"success", "client_disconnected"} and "client_disconnected" in statuses
    left = [e for e in events if e.status == "client_disconnected"]
    assert all(e.completion_tokens <= 12 for e in left)  # billed for what was generated, no more
    # the model server saw its request closed for every client that left while it still generated
    assert 0 < stack.mock.stats["disconnects"] <= len(left)
