"""A server that stops: requests it cancels while they settle still settle (§4)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import involves_org
from support import wait_for_events

CHAT = "/v1/chat/completions"


def _cancel_every_request(stack) -> int:
    """What uvicorn does to the requests still running when its graceful shutdown times out:
    a native cancel of each request's task."""
    tasks = list(stack.server.server.server_state.tasks)
    for task in tasks:
        task.get_loop().call_soon_threadsafe(task.cancel, "Task cancelled, timeout graceful shutdown exceeded")
    return len(tasks)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "buffered"])
def test_a_request_cancelled_by_the_server_during_its_settle_still_settles(stack_factory, stream):
    stack = stack_factory()
    org_id, key = stack.org()
    held = stack.faults.slow("TransactWriteItems", 1.0, when=involves_org(org_id), times=1)  # the settle, in flight
    body = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "x"}], "stream": stream}
    outcome: list[object] = []

    def call() -> None:
        try:
            with httpx.Client(base_url=stack.url, timeout=10) as client:
                outcome.append(client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"}).status_code)
        except httpx.HTTPError as exc:  # the server stops this request: it may cut the answer
            outcome.append(type(exc).__name__)

    client = threading.Thread(target=call)
    client.start()
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held, "the request never began to settle"
    assert _cancel_every_request(stack) == 1
    client.join(timeout=10)
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.status == "success" and event.completion_tokens > 0  # the settle ran to its end
    assert stack.org_info(org_id).in_flight == 0  # its slot is free, not left for the lease's TTL
