"""Clients that leave: the upstream request is closed, the slot released, the tokens seen billed."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from conftest import involves_org
from support import wait_for_events

CHAT = "/v1/chat/completions"


def test_a_client_leaving_while_the_upstream_is_still_silent(stack):
    """Gone before the first token: noticed at once (not at the next write), no completion billed."""
    org_id, key = stack.org()
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True, "mock": {"ttft_ms": 3000}}
    with stack.http.stream("POST", CHAT, json=body, headers={"Authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200  # the upstream answered; its first token is 3 s away
    stack.mock.wait_for(lambda s: s["disconnects"] == 1, timeout=2.5)  # well before that token
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.status == "client_disconnected" and event.completion_tokens == 0
    assert stack.org_info(org_id).in_flight == 0


@pytest.mark.parametrize("path, body", [
    (CHAT, {"model": "qwen3-32b", "messages": [{"role": "user", "content": "word " * 400}]}),
    ("/v1/responses", {"model": "qwen3-32b", "input": "word " * 400}),
], ids=["chat", "responses"])
def test_a_stream_whose_client_leaves_before_the_model_server_answers_frees_its_slot_at_once(stack, path, body):
    """§7: a client that leaves is noticed and its slot released. Before the model server's
    headers nothing listened: the slot stayed held until they came (up to the model's first-byte
    time, for each backend tried), so the same client's next request, its only one open, was
    a 429 (§4)."""
    stream = True
    org_id, key = stack.org(concurrency=1)
    auth = {"Authorization": f"Bearer {key}"}
    slow = {**body, "stream": stream, "mock": {"headers_delay_ms": 20_000}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        stack.http.post(path, json=slow, headers=auth, timeout=httpx.Timeout(30, read=0.5))
    (event,) = wait_for_events(stack, org_id, 1)  # long before the model server answers
    assert event.status == "client_disconnected" and event.http_status is None
    # the prompt the model server was sent is billed (as a renewal of its lease records it), no completion
    assert event.prompt_tokens > 100 and event.completion_tokens == 0 and event.cost > 0
    assert stack.org_info(org_id).in_flight == 0
    stack.mock.wait_for(lambda s: s["disconnects"] == 1 and s["in_flight"] == 0)  # its request closed
    again = stack.http.post(path, json={**body, "stream": stream}, headers=auth)
    assert again.status_code == 200, again.text
    events = wait_for_events(stack, org_id, 2)
    assert sorted(e.status for e in events) == ["client_disconnected", "success"]
    assert stack.org_info(org_id).credits == 10 - sum(e.cost for e in events)


def test_a_stream_whose_client_left_before_it_went_upstream_is_billed_nothing(stack):
    """The client leaves while its admission is slow (a hot org item): the gateway learns of it
    before any backend is sent the request, which then never goes. The prompt was billed as if
    a model server had read it."""
    org_id, key = stack.org()
    stack.faults.slow("UpdateItem", 1.0, when=involves_org(org_id), times=1)
    body = {"model": "gpt-oss-120b", "stream": True, "messages": [{"role": "user", "content": "word " * 400}]}
    with pytest.raises(httpx.ReadTimeout):
        stack.http.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"},
                        timeout=httpx.Timeout(30, read=0.3))
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.status == "client_disconnected" and event.cost == 0 and event.prompt_tokens is None
    assert stack.mock.stats["requests"] == 0  # the model server never got it
    assert stack.org_info(org_id).in_flight == 0 and stack.org_info(org_id).credits == 10


def test_a_buffered_request_whose_client_leaves_runs_to_its_answer_and_is_billed_for_it(stack):
    """docs/design.md: a buffered answer's usage comes only at its end, so closing its upstream
    request early would leave what the model generated unbilled; it runs on (within the model's
    total time) and settles as a success, the model server's request never closed."""
    org_id, key = stack.org()
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "mock": {"headers_delay_ms": 1500}}
    with pytest.raises(httpx.ReadTimeout):
        stack.http.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=httpx.Timeout(30, read=0.3))
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.status == "success" and event.completion_tokens == 12 and event.usage_source == "upstream"
    assert stack.mock.stats["disconnects"] == 0 and stack.org_info(org_id).in_flight == 0


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
