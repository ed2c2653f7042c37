"""A server that stops: requests it cancels while they settle still settle (§4)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from decimal import Decimal

import httpx
import pytest

from conftest import involves_org
from kiln.aws import AwsClient
from kiln.gateway import UNSETTLED, Gateway
from kiln.store import UsageEvent
from kiln.store.clock import iso_ms
from kiln_ops.app import combined_app
from kiln_ops.serve import ServerThread
from support import TELEMETRY, FaultInjectingHttp, StorageFaults, observer, wait_for_events

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


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "buffered"])
def test_a_server_that_stops_with_a_settle_in_flight_finishes_it_before_closing(stack_factory, stream):
    """uvicorn with a graceful-shutdown timeout (`--timeout-graceful-shutdown`) cancels the
    requests still running, then closes the app, whose gateway closes; its loop then ends,
    cancelling every task left. A settle still waiting for DynamoDB then was lost: no event, no
    `usage_unsettled` line to replay, the lease left to be reclaimed as `abandoned` (billed
    nothing). Closing the gateway now waits for the settles in flight (§4: settled on every path)."""
    stack = stack_factory()
    faults = StorageFaults()
    server = _server_owning_its_gateway(stack, faults)
    org_id, key = stack.org()
    held = faults.slow("TransactWriteItems", 1.0, when=involves_org(org_id), times=1)  # the settle
    body = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "x"}], "stream": stream}
    client = threading.Thread(target=_post_ignoring_a_cut, args=(server.url, key, body))
    client.start()
    deadline = time.monotonic() + 10
    while not held and time.monotonic() < deadline:
        time.sleep(0.005)
    assert held, "the request never began to settle"
    server.stop()  # SIGTERM
    client.join(timeout=10)
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.status == "success" and event.completion_tokens > 0
    assert stack.org_info(org_id).leases == {}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "buffered"])
def test_a_request_still_waiting_when_the_server_stops_is_settled_before_it_closes(stack_factory, stream):
    """uvicorn cancels the requests still running and closes the app at once: a request waiting
    for the model server then began its settle only after the gateway had looked for settles
    to wait for, found none and closed its clients: no event, the lease left. Closing now waits
    for every request admitted to settle."""
    stack = stack_factory()
    faults = StorageFaults()
    server = _server_owning_its_gateway(stack, faults)
    org_id, key = stack.org()
    faults.slow("TransactWriteItems", 1.0, when=involves_org(org_id), times=1)  # its settle, once it begins
    waiting = {"token_delay_ms": 300, "tokens": 40} if stream else {"headers_delay_ms": 8000}
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": stream, "mock": waiting}
    client = threading.Thread(target=_post_ignoring_a_cut, args=(server.url, key, body))
    client.start()
    deadline = time.monotonic() + 10
    while not stack.org_info(org_id).leases and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.5)  # the model server still working on it
    server.stop()  # SIGTERM
    client.join(timeout=15)
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.status == "client_disconnected"  # the server cut it: billed as a client gone
    assert stack.org_info(org_id).leases == {}


def test_a_settle_cancelled_all_the_same_leaves_its_event_in_the_log(stack_factory):
    """Should a settle be cancelled after all (a loop torn down with it in flight), its event goes
    to the log as `usage_unsettled`, which `kiln admin replay-usage` settles: never lost."""
    stack = stack_factory()
    faults = StorageFaults()
    settings = stack.settings
    org_id, _ = stack.org()

    async def cancelled_mid_settle() -> str:
        gateway = Gateway(settings, aws=AwsClient(region=settings.region, endpoint_url=settings.aws_endpoint_url,
                                                  http=FaultInjectingHttp(faults)))
        lease = await gateway.ledger.admit(org_id=org_id, key_id="key-1", model="gpt-oss-120b", endpoint="chat",
                                           streamed=False)
        held = faults.slow("TransactWriteItems", 5.0, when=involves_org(org_id), times=1)
        event = UsageEvent(gen_id=lease.gen_id, org_id=org_id, created_at=iso_ms(lease.started), key_id="key-1",
                           model="gpt-oss-120b", endpoint="chat", streamed=False, status="success",
                           cost=Decimal("0.000001"), http_status=200)
        settle = asyncio.get_running_loop().create_task(gateway.settle(lease, event))
        while not held:
            await asyncio.sleep(0.01)
        settle.cancel()
        with pytest.raises(asyncio.CancelledError):
            await settle
        await gateway.aclose()
        return lease.gen_id

    mark = len(TELEMETRY.text())
    gen_id = asyncio.run(cancelled_mid_settle())
    (line,) = [json.loads(line) for line in TELEMETRY.text()[mark:].splitlines() if UNSETTLED in line]
    usage = line["message"]["usage"]  # Powertools puts the record's JSON under "message"
    assert usage["gen_id"] == gen_id and usage["cost"] == "0.000001"


def _server_owning_its_gateway(stack, faults: StorageFaults) -> ServerThread:
    """A server whose app makes its gateway (its storage calls through `faults`) and closes it at
    the server's lifespan shutdown, as a function does; it gives its requests 0.2 s to end."""
    settings = stack.settings

    def owned_gateway() -> Gateway:
        http = FaultInjectingHttp(faults)
        return Gateway(settings, aws=AwsClient(region=settings.region, endpoint_url=settings.aws_endpoint_url, http=http))

    return ServerThread(combined_app(owned_gateway, observer()), timeout_graceful_shutdown=0.2).start()


def _post_ignoring_a_cut(url: str, key: str, body: dict) -> None:
    try:
        with httpx.Client(base_url=url, timeout=10) as client:
            client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})
    except httpx.HTTPError:  # the server stops this request: it may cut the answer
        pass
