"""A running request keeps its lease (contract §4: leases live as long as their request).

With a lease far shorter than the request, the gateway's renewals keep it: the org stays at
its limit while the request runs, no `abandoned` event is written for it, and each renewal
records what the request has relayed so far (what an `abandoned` event would bill).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from decimal import Decimal

import httpx
import pytest

from support import LedgerCheck, catalog_for_tests, data_events, wait_for_events

CHAT = "/v1/chat/completions"
LEASE_TTL = 1.0
RENEW = 0.25


def test_a_stream_longer_than_its_lease_keeps_it_and_records_its_progress(stack_factory):
    # a lease of 2 s renewed every 0.5 s: a renewal may be late by a second on a loaded machine
    # (a lease of 1 s once lost its slot so in CI), and the stream still outlives three leases
    stack = stack_factory(lease_ttl_seconds=2 * LEASE_TTL, lease_renew_seconds=2 * RENEW)
    org_id, key = stack.org(concurrency=1)
    ledger = LedgerCheck(stack, org_id)
    # 12 tokens, 500 ms apart: about 6 s, three times the lease's life
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "mock": {"token_delay_ms": 500}}
    answers: list = []
    streaming = threading.Thread(target=lambda: answers.append(ledger.saw(stack.post(CHAT, body, key))))
    streaming.start()
    progress, refused = [], []
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        time.sleep(0.2)
        leases = stack.org_info(org_id).leases
        progress += [int(lease.get("ct", 0)) for lease in leases.values()]
        # the one slot is still taken: the lease was never reclaimed while its request ran
        refused.append(ledger.saw(stack.post(CHAT, {**body, "stream": False, "mock": {}}, key)).status_code)
    streaming.join(timeout=10)
    assert answers and answers[0].status_code == 200
    assert data_events(answers[0].text)[-1] == "[DONE]"
    assert set(refused) == {429}
    assert max(progress) >= 4 and progress == sorted(progress), progress  # renewals record relayed tokens
    (event,) = ledger.check()
    assert event.status == "success" and event.cost > Decimal(0)


def test_a_lease_is_kept_while_its_request_waits_for_the_model_server(stack_factory):
    """§4: never reclaimed while its request runs, failover included: the wait for a buffered
    answer (its whole generation) and a backend that never answers before the next is tried
    are part of the request. A keeper started only once the model server answered let the
    lease expire meanwhile, and the next admission took the org past its limit."""
    stack = stack_factory(lease_ttl_seconds=LEASE_TTL, lease_renew_seconds=RENEW)
    org_id, key = stack.org(concurrency=1)
    ledger = LedgerCheck(stack, org_id)
    slow = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "mock": {"headers_delay_ms": 2500}}
    answers: list = []
    waiting = threading.Thread(target=lambda: answers.append(ledger.saw(stack.post(CHAT, slow, key))))
    waiting.start()
    refused = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        time.sleep(0.2)
        refused.append(ledger.saw(stack.post(CHAT, {**slow, "mock": {}}, key)).status_code)
    waiting.join(timeout=10)
    assert answers and answers[0].status_code == 200
    assert set(refused) == {429}, refused
    (event,) = ledger.check()
    assert event.status == "success"


def test_a_short_request_costs_no_renewal(stack_factory):
    """A request shorter than the renewal interval writes twice: admission and settle."""
    stack = stack_factory(lease_ttl_seconds=60.0, lease_renew_seconds=20.0)
    org_id, key = stack.org()
    stack.faults.calls.clear()
    response = stack.post(CHAT, {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}],
                                 "stream": True}, key)
    assert response.status_code == 200
    # the ledger's writes (the key's last-used time is the authenticator's, not the ledger's)
    writes = [op for op, payload in stack.faults.calls
              if op == "TransactWriteItems" or payload.get("TableName") == stack.settings.orgs_table and op != "GetItem"]
    assert writes == ["UpdateItem", "TransactWriteItems"]


def test_a_client_that_stops_reading_is_bounded_by_the_total_time_and_keeps_its_lease(stack_factory, mock):
    """A client that reads the headers and then nothing: the gateway's writes wait on it. The
    request still ends within the model's total time (plus the keep-alive interval): it settles,
    billed for what it relayed, and its slot is free. It once ran as long as the client held
    the connection, its lease reclaimed as `abandoned` while it ran (the org then over its limit)."""
    import json
    import socket

    from support import catalog_for_tests

    catalog = catalog_for_tests(mock.url)
    for entry in catalog["models"]:
        if entry["id"] == "qwen3-32b":
            entry["timeouts"] = {**entry.get("timeouts", {}), "first_byte": 2, "idle": 2, "total": 2}
    stack = stack_factory(catalog=catalog, lease_ttl_seconds=LEASE_TTL, lease_renew_seconds=RENEW,
                          keepalive_seconds=0.5)
    org_id, key = stack.org(concurrency=1)
    body = json.dumps({"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True,
                       "mock": {"endless": True}}).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect((host, int(port)))
    started = time.monotonic()
    client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
                   + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    assert client.recv(12) == b"HTTP/1.1 200"  # then the client reads nothing more
    try:
        while not stack.events(org_id) and time.monotonic() - started < 8:
            time.sleep(0.1)
        ended = time.monotonic() - started
        events = stack.events(org_id)
        assert len(events) == 1 and events[0].status != "abandoned", [(e.status, e.error) for e in events]
        assert ended < 2 + 0.5 + 2, ended  # the total time, the keep-alive, and the settle's own time
        assert events[0].completion_tokens > 0 and events[0].cost > 0
        assert stack.org_info(org_id).in_flight == 0
    finally:
        client.close()


# the defaults (TTL 60 s, a renewal every 20 s, 10 s of retries a storage call) scaled by 1/30
SCALED = {"lease_ttl_seconds": 2.0, "lease_renew_seconds": 2.0 / 3, "storage_retry_seconds": 1.0 / 3}


def _org_writes_throttled(stack, org_id: str, start: float, seconds: float) -> None:
    """Every write of the org's item (admissions and renewals) throttled for `seconds` from
    `start` on (about 75 s at full scale: an outage longer than a lease's life)."""
    t0 = time.monotonic()
    stack.faults.fail("UpdateItem", when=lambda payload: org_id in str(payload)
                      and start <= time.monotonic() - t0 < start + seconds)


def _others_while(stack, ledger, key: str, org_id: str, running: threading.Thread) -> list[int]:
    """Requests of the same org sent while `running` runs: their statuses."""
    other = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}],
             "mock": {"tag": org_id, "headers_delay_ms": 300}}
    statuses = []
    while running.is_alive():
        time.sleep(0.15)
        statuses.append(ledger.saw(stack.post(CHAT, other, key)).status_code)
    return statuses


def _through_an_outage(stack, mock, stream: bool, options: dict, seconds: float = 2.5):
    """An org limited to one sends a request (the mock's `options`) while its item's writes are
    throttled from 0.5 s on for `seconds`, and another request every 0.15 s: the answer, its
    usage event and the others' statuses, once the ledger adds up. The org never had two
    requests at the model server."""
    org_id, key = stack.org(concurrency=1)
    ledger = LedgerCheck(stack, org_id)
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": stream,
            "mock": {**options, "tag": org_id}}
    _org_writes_throttled(stack, org_id, start=0.5, seconds=seconds)
    answers: list = []
    running = threading.Thread(target=lambda: answers.append(ledger.saw(stack.post(CHAT, body, key))))
    running.start()
    statuses = _others_while(stack, ledger, key, org_id, running)
    running.join(timeout=20)
    stack.faults.clear()
    assert mock.stats["max_in_flight_by_tag"][org_id] == 1, "the org went over its limit at the model server"
    (answer,) = answers
    events = ledger.check(timeout=10)
    (event,) = [event for event in events if event.gen_id == answer.headers["x-neocloud-generation-id"]]
    assert stack.org_info(org_id).in_flight == 0
    return answer, event, statuses


def test_a_stream_whose_lease_cannot_be_kept_stops_before_its_org_goes_over_its_limit(stack_factory, mock):
    """§4: a lease is never reclaimed while its request runs, and §2: the org's limit. With its
    org's item throttled for longer than a lease lives, the stream's renewals could not land: its
    lease expired, the first admission after the outage reclaimed it as `abandoned`, and the
    stream ran on without a slot, a second request of an org limited to one at the model server.
    The stream now stops before its lease expires, with the §5 error event, billed what it relayed."""
    answer, stopped, _ = _through_an_outage(stack_factory(**SCALED), mock, True, {"token_delay_ms": 250, "tokens": 30})
    last = data_events(answer.text)[-1]
    assert answer.status_code == 200 and last != "[DONE]"
    assert "concurrency slot" in last["error"]["message"]
    assert stopped.status == "gateway_error" and stopped.completion_tokens > 0 and stopped.cost > 0


def test_a_stream_waiting_on_a_silent_model_server_is_stopped_in_its_wait(stack_factory, mock):
    """The same outage while the model server is silent (a reasoning model thinking) and the
    keep-alive interval longer than the outage: the relay is stopped in its wait, not at its
    next piece, and the org never has a second request at the model server."""
    stack = stack_factory(**SCALED, keepalive_seconds=30.0)
    answer, stopped, _ = _through_an_outage(stack, mock, True, {"ttft_ms": 8000})
    assert "concurrency slot" in data_events(answer.text)[-1]["error"]["message"]
    assert stopped.status == "gateway_error" and stopped.duration_ms < 3000


def test_a_buffered_request_whose_lease_cannot_be_kept_is_answered_503(stack_factory, mock):
    """The same outage while a buffered request waits for its whole answer: it is stopped (its
    request to the model server closed) and answered 503 `storage_unavailable`: the gateway's
    failure before any answer, billed nothing (the SDKs retry a 503: each try would pay for it)."""
    answer, stopped, _ = _through_an_outage(stack_factory(**SCALED), mock, False, {"headers_delay_ms": 7000})
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "storage_unavailable"
    assert (stopped.status, stopped.http_status, stopped.cost) == ("gateway_error", 503, 0)


def test_renewals_failing_for_less_than_a_lease_lives_keep_the_stream(stack_factory, mock):
    """An outage of the org's writes shorter than a lease's life (1.2 s: 36 s at full scale) from
    the first renewal on: the renewals, tried again sooner after a failure, keep the lease; the
    stream ends with [DONE] and the org's other requests are refused all along."""
    answer, event, statuses = _through_an_outage(stack_factory(**SCALED), mock, True,
                                                 {"token_delay_ms": 250, "tokens": 16}, seconds=1.2)
    assert data_events(answer.text)[-1] == "[DONE]" and event.status == "success"
    assert set(statuses[:-1]) <= {429, 503}, statuses  # the last may be sent after the stream's settle


def test_streams_stopped_for_their_leases_take_no_model_server_out_of_service(stack_factory, mock):
    """A lost lease is storage's failure: the streams it stopped were counted as their backend's
    failures (by rate, across orgs), and a DynamoDB outage on a busy gateway took a healthy model
    server out of service."""
    catalog = catalog_for_tests(mock.url)
    base = mock.url.rsplit("/v1", 1)[0]
    catalog["models"].append({
        "id": "two-backends", "owned_by": "kiln-tests", "created": 1, "context_length": 4096,
        "pricing": {"input": "1", "output": "2"},
        "backends": [{"name": "a", "url": f"{base}/x/token_delay_ms=250/v1"},
                     {"name": "b", "url": f"{base}/x/token_delay_ms=251/v1"}],
    })
    stack = stack_factory(catalog=catalog, **SCALED, backend_error_min_requests=4, backend_error_min_clients=2)
    orgs = [stack.org(concurrency=1) for _ in range(6)]
    _org_writes_throttled_for_all(stack, start=0.5, seconds=2.5)
    body = {"model": "two-backends", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "mock": {"tokens": 30}}
    answers: list = []
    streams = [threading.Thread(target=lambda k=k: answers.append(stack.post(CHAT, body, k))) for _, k in orgs]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.join(timeout=20)
    stack.faults.clear()
    stopped = [answer for answer in answers if "concurrency slot" in str(data_events(answer.text)[-1])]
    assert len(stopped) >= 4, [data_events(answer.text)[-1] for answer in answers]
    assert all(row["state"] == "in_service" for row in stack.gateway.upstream.health.snapshot())


def test_an_admission_that_lands_after_its_request_settled_does_not_hold_a_slot_for_good(stack_factory, mock):
    """§2 step 5, §4: an admission's write lands after its retry was admitted, served and
    settled (DynamoDB applied it late, its answer lost). Its lease, written again, belongs to a
    request whose usage event exists: the reclaim that would free it wrote that event again,
    was refused, and freed nothing, the org's other dead leases with it, each time. At its
    limit of 1 the org was answered 429 for good. Such a lease is freed, billed nothing more."""
    stack = stack_factory(**SCALED)
    org_id, key = stack.org(credits="1", concurrency=1)
    ledger = LedgerCheck(stack, org_id)
    stack.faults.late("UpdateItem", 0.5, times=1,
                      when=lambda payload: org_id in str(payload) and "#leases.#gen = :lease" in str(payload))
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}]}
    first = ledger.saw(stack.post(CHAT, body, key))
    assert first.status_code == 200
    time.sleep(1.0)  # the late write has landed: the settled request's lease is back
    assert first.headers["X-Neocloud-Generation-Id"] in stack.org_info(org_id).leases
    time.sleep(SCALED["lease_ttl_seconds"])  # and it has expired
    statuses = []
    for _ in range(10):
        statuses.append(ledger.saw(stack.post(CHAT, body, key)).status_code)
        if statuses[-1] == 200:
            break
        time.sleep(0.3)
    assert statuses[-1] == 200, statuses
    events = ledger.check()  # one event a generation, credits down by exactly their costs
    assert [event.status for event in events] == ["success"] * 2
    assert stack.org_info(org_id).in_flight == 0 and not stack.org_info(org_id).leases


def test_a_stream_its_client_does_not_read_is_closed_for_its_lease_as_the_gateways_failure(stack_factory, mock):
    """A stream blocked writing to a client that reads nothing, when its lease cannot be kept: it
    is closed as if the client had left, but its usage event says what happened (gateway_error,
    the lease), not that the client disconnected."""
    stack = stack_factory(**SCALED, keepalive_seconds=0.5)
    org_id, key = stack.org(concurrency=1)
    t0 = time.monotonic()
    stack.faults.fail("UpdateItem", when=lambda payload: org_id in str(payload) and 4.0 <= time.monotonic() - t0 < 7.0)
    body = json.dumps({"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True,
                       "mock": {"endless": True, "token_delay_ms": 0, "tag": org_id}}).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((host, int(port)))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
                       + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert client.recv(12) == b"HTTP/1.1 200"  # then it reads nothing more
        (event,) = wait_for_events(stack, org_id, 1, timeout=14)
    assert (event.status, event.error) == ("gateway_error", "its lease could not be kept: storage unavailable")
    assert event.completion_tokens > 0 and stack.org_info(org_id).in_flight == 0


def _org_writes_throttled_for_all(stack, start: float, seconds: float) -> None:
    t0 = time.monotonic()
    stack.faults.fail("UpdateItem", when=lambda payload: "#exp" in str(payload)
                      and start <= time.monotonic() - t0 < start + seconds)


def test_a_stream_whose_start_is_held_when_its_lease_is_lost_says_so(stack_factory, mock, monkeypatch):
    """The response's start held (writing paused: a pipelined client that has not read its
    earlier answer) when the lease is lost: the stream's body never ran, and it was settled as
    a client that left before the stream began. It says what happened."""
    from kiln import responses

    send_body = responses.RelayResponse._send_body

    async def held(self, send):
        async def paused(message):
            if message["type"] == "http.response.start":
                await asyncio.sleep(4)  # the transport's writing paused
            await send(message)
        await send_body(self, paused)

    monkeypatch.setattr(responses.RelayResponse, "_send_body", held)
    stack = stack_factory(**SCALED)
    org_id, key = stack.org(concurrency=1)
    _org_writes_throttled(stack, org_id, start=0.2, seconds=4.0)
    body = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "mock": {"token_delay_ms": 100, "tokens": 60}}
    try:
        stack.post(CHAT, body, key)
    except httpx.HTTPError:  # the stream is closed before it began
        pass
    (event,) = wait_for_events(stack, org_id, 1, timeout=14)
    stack.faults.clear()
    assert (event.status, event.error) == ("gateway_error", "its lease could not be kept: storage unavailable")


@pytest.mark.parametrize("refused", ["out of credits", "disabled"])
def test_a_refused_orgs_dead_requests_get_their_events_through_the_gateway(stack_factory, refused):
    """A gateway died with a request of the org in flight; the org is then refused: out of
    credits (402, at admission) or disabled (403, at authentication, where no admission reads
    its item). Its dead request kept no usage event and its relayed tokens stayed unbilled for as
    long as it stayed refused; each refused request now has the dead leases reclaimed."""
    from kiln.store.orgs import set_status

    stack = stack_factory(lease_ttl_seconds=1.0, lease_renew_seconds=0.3)
    org_id, secret = stack.org(credits="1", concurrency=4)
    crashed = stack.ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                                 streamed=False)
    stack.ledger.renew(crashed, (1, 2, Decimal("0.5")))
    if refused == "out of credits":
        stack.dynamodb.update_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                   UpdateExpression="SET credits = :none", ExpressionAttributeValues={":none": {"N": "0"}})
    else:
        set_status(stack.tables, org_id, "disabled")
    time.sleep(1.2)  # the lease is dead
    answer = stack.post("/v1/chat/completions", {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]},
                        secret)
    assert answer.status_code == (402 if refused == "out of credits" else 403), answer.text
    deadline = time.monotonic() + 10
    while stack.org_info(org_id).leases and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [(event.gen_id, event.status, event.cost) for event in stack.events(org_id)] == [
        (crashed.gen_id, "abandoned", Decimal("0.5"))]
    assert stack.org_info(org_id).credits == (Decimal("-0.5") if refused == "out of credits" else Decimal("0.5"))


def test_a_disabled_org_holding_no_dead_lease_costs_its_lookup_no_second_read(stack):
    """The lookup that finds an org disabled reads its leases with its status: only one that holds
    a dead lease has its item read again, for the reclaim."""
    from kiln.store.orgs import set_status

    org_id, secret = stack.org(credits="1")
    live = stack.ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                              streamed=False)  # in flight, alive
    set_status(stack.tables, org_id, "disabled")
    reads = lambda: stack.faults.count("GetItem", lambda payload: payload["TableName"] == stack.settings.orgs_table)  # noqa: E731
    before = reads()
    answer = stack.post("/v1/chat/completions", {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]},
                        secret)
    assert answer.status_code == 403, answer.text
    time.sleep(0.3)  # what a background look would have read by now
    assert reads() - before == 1
    assert list(stack.org_info(org_id).leases) == [live.gen_id]
