"""Storage faults: a refused admission costs nothing upstream; a lost settle is never lost."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from decimal import Decimal

import httpx
import pytest

from conftest import involves_org
from kiln.aws import AwsClient
from kiln.gateway import Gateway
from kiln.store import UsageEvent
from kiln.store.keys import create_key
from kiln.store.usage import get_event
from kiln_ops.admin import run_admin
from kiln_ops.cli import build_parser
from support import (
    TELEMETRY,
    FaultInjectingHttp,
    StorageFaults,
    check_key_figures,
    data_events,
    dead_url,
    make_stack,
    observer,
    wait_for_events,
)

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "x"}]}
# A refusal that is no conflict, throttling or outage: the gateway does not go on settling in
# the background, so the replay is what settles it (as when the process that logged it is gone).
REFUSED = "ValidationException"
CANCELLED, CONFLICT_ON_THE_ORG = "TransactionCanceledException", ["TransactionConflict", "None", "None"]


def test_admission_failing_is_a_clear_503_and_no_upstream_call(stack_factory):
    stack = stack_factory(storage_retry_seconds=0.5)  # a short budget, spent on every attempt here
    storage_faults = stack.faults
    org_id, key = stack.org()
    storage_faults.fail("UpdateItem", when=involves_org(org_id))
    for body in (BODY, {**BODY, "stream": True}):
        response = stack.post(CHAT, body, key)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "storage_unavailable"
        assert "X-Neocloud-Generation-Id" not in response.headers
    assert stack.mock.stats["requests"] == 0
    storage_faults.clear()
    assert stack.post(CHAT, BODY, key).status_code == 200


def test_a_key_lookup_throttled_past_the_aws_clients_own_tries_is_tried_on_and_served(stack, storage_faults):
    """A burst of throttling that outlasts the AWS client's three tries (a tenth of a second):
    the admission after the lookup would have ridden it out, the lookup answered 503."""
    _, key = stack.org()
    refused = storage_faults.fail("GetItem", times=4)
    response = stack.post(CHAT, BODY, key)
    assert len(refused) >= 4 and response.status_code == 200, response.text


def test_a_throttled_key_lookup_is_a_503_not_a_401(stack, storage_faults):
    _, key = stack.org()
    storage_faults.fail("GetItem")
    response = stack.post(CHAT, BODY, key)
    assert response.status_code == 503 and response.json()["error"]["code"] == "storage_unavailable"


def test_a_settle_that_fails_a_few_times_is_retried_and_lands_once(stack, storage_faults):
    org_id, key = stack.org(credits="1")
    attempts = storage_faults.fail("TransactWriteItems", when=involves_org(org_id), times=4)
    response = stack.post(CHAT, BODY, key)
    assert response.status_code == 200
    assert len(attempts) == 5  # four refused (the client's retries, then the settle's), the fifth settled
    (event,) = stack.events(org_id)
    assert event.gen_id == response.headers["X-Neocloud-Generation-Id"] and event.status == "success"
    assert stack.org_info(org_id).credits == Decimal(1) - event.cost
    assert stack.org_info(org_id).in_flight == 0


def _unsettled_records(since: int) -> list[dict]:
    """The gateway's usage_unsettled log records (Powertools puts the JSON under "message")."""
    records = [json.loads(line) for line in TELEMETRY.text()[since:].splitlines() if "usage_unsettled" in line]
    return [record["message"] for record in records]


def _replay_logged(stack, since: int, tmp_path, capsys) -> list[str]:
    """`kiln admin replay-usage` of the log since `since`, exported as an operator does: its lines."""
    exported = tmp_path / "unsettled.log"
    exported.write_text(TELEMETRY.text()[since:])
    lines: list[str] = []
    args = build_parser().parse_args(["admin", "replay-usage", str(exported)])
    assert run_admin(args, settings=stack.settings, out=lines.append) == 0, capsys.readouterr().err
    return lines


def test_a_settle_that_keeps_failing_is_logged_whole_and_replayed_by_the_operator(stack_factory, tmp_path, capsys):
    stack = stack_factory(storage_retry_seconds=0.5)  # a short budget, spent on every attempt here
    storage_faults = stack.faults
    org_id, key = stack.org(credits="1")
    mark = len(TELEMETRY.text())
    storage_faults.fail("TransactWriteItems", when=involves_org(org_id), code=REFUSED)
    buffered = stack.post(CHAT, BODY, key)
    streamed = stack.post(CHAT, {**BODY, "stream": True, "stream_options": {"include_usage": True}}, key)
    # the clients got their answers; nothing was written
    assert buffered.status_code == 200 and data_events(streamed.text)[-1] == "[DONE]"
    assert stack.events(org_id) == []
    assert stack.org_info(org_id).in_flight == 2  # the leases are still held
    records = _unsettled_records(mark)
    assert {r["usage"]["gen_id"] for r in records} == {
        buffered.headers["X-Neocloud-Generation-Id"], streamed.headers["X-Neocloud-Generation-Id"]}
    assert all(r["usage"]["cost"] and r["usage"]["completion_tokens"] == 12 for r in records)

    storage_faults.clear()
    exported = tmp_path / "unsettled.log"
    exported.write_text(TELEMETRY.text()[mark:])  # as an operator exports them from the log group

    def replay() -> str:
        args = build_parser().parse_args(["admin", "replay-usage", str(exported)])
        lines: list[str] = []
        assert run_admin(args, settings=stack.settings, out=lines.append) == 0, capsys.readouterr().err
        return lines[0]

    assert replay() == "replayed 2 unsettled usage events: 2 settled"
    events = {e.gen_id: e for e in stack.events(org_id)}
    assert set(events) == {r["usage"]["gen_id"] for r in records}
    assert stack.org_info(org_id).credits == Decimal(1) - sum(e.cost for e in events.values())
    assert stack.org_info(org_id).in_flight == 0
    # replaying the same lines again charges nothing
    assert replay() == "replayed 2 unsettled usage events: 2 already settled"
    assert stack.org_info(org_id).credits == Decimal(1) - sum(e.cost for e in events.values())


def test_a_settle_refused_by_conflicts_past_its_budget_goes_on_in_the_background(stack_factory, tmp_path, capsys):
    """Conflicts on the org and the key's tally spent a settle's whole retry budget (the
    emulator's own example fault mode did so 2 times in 5 300): its lease stayed held until it
    expired, the org's well-behaved clients got 429s meanwhile, and the reclaim billed the
    request nothing. The settle now goes on in the background: the slot comes back and the
    request is billed, with no operator; the logged line, replayed, charges nothing more."""
    stack = stack_factory(storage_retry_seconds=0.3)
    org_id, key = stack.org(credits="1", concurrency=1)
    mark = len(TELEMETRY.text())
    # as DynamoDB says it to a transaction: cancelled, the org item's reason a conflict
    stack.faults.fail("TransactWriteItems", when=involves_org(org_id), code=CANCELLED, reasons=CONFLICT_ON_THE_ORG)
    served = stack.post(CHAT, BODY, key)
    assert served.status_code == 200 and stack.events(org_id) == []  # the budget is spent: logged
    (record,) = _unsettled_records(mark)
    stack.faults.clear()  # the conflicts pass
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.gen_id == served.headers["X-Neocloud-Generation-Id"] and event.status == "success"
    assert event.cost == Decimal(record["usage"]["cost"]) > 0
    assert stack.org_info(org_id).in_flight == 0
    assert stack.post(CHAT, BODY, key).status_code == 200  # its one slot is free again
    assert _replay_logged(stack, mark, tmp_path, capsys) == ["replayed 1 unsettled usage events: 1 already settled"]
    events = wait_for_events(stack, org_id, 2)
    assert stack.org_info(org_id).credits == Decimal(1) - sum(e.cost for e in events)
    assert "usage_settled_late" in TELEMETRY.text()[mark:]


def test_a_background_settle_replaces_the_abandoned_event_through_conflicts(stack_factory):
    """The lease expired and was reclaimed (`abandoned`, billed nothing) while the settle went
    on in the background; the late settle that replaces that event met conflicts too, and the
    background settle gave up on it at once: the request stayed billed nothing."""
    stack = stack_factory(lease_ttl_seconds=3.0, storage_retry_seconds=0.3)
    org_id, key = stack.org(credits="1", concurrency=1)
    in_org = involves_org(org_id)
    settles = lambda payload: in_org(payload) and '":cost"' in json.dumps(payload)  # noqa: E731
    replaces = lambda payload: in_org(payload) and '":difference"' in json.dumps(payload)  # noqa: E731
    stack.faults.fail("TransactWriteItems", when=settles, code=CANCELLED, reasons=CONFLICT_ON_THE_ORG)
    served = stack.post(CHAT, BODY, key)
    gen_id = served.headers["X-Neocloud-Generation-Id"]
    time.sleep(3.2)  # its lease expires: nothing renews a request that has answered
    stack.faults.fail("TransactWriteItems", when=replaces, code=CANCELLED, reasons=CONFLICT_ON_THE_ORG)
    assert stack.post(CHAT, BODY, key).status_code == 200  # reclaims the lease as abandoned
    assert get_event(stack.tables, gen_id).status == "abandoned"
    time.sleep(0.5)
    stack.faults.clear()  # the conflicts pass, within twice the lease time
    deadline = time.monotonic() + 8
    while get_event(stack.tables, gen_id).status != "success" and time.monotonic() < deadline:
        time.sleep(0.1)
    event = get_event(stack.tables, gen_id)
    assert event.status == "success" and event.cost > 0
    events = stack.events(org_id)
    assert stack.org_info(org_id).credits == Decimal(1) - sum(e.cost for e in events)
    assert stack.org_info(org_id).in_flight == 0


def test_a_replayed_settle_counts_in_its_keys_spend_figure_and_tally_for_the_day_it_was_admitted(
        stack_factory, tmp_path, capsys):
    """A key with a daily limit: its request's settle is logged and replayed. The replay once
    rebuilt the lease admitted at the epoch and naming no figure, so the key's spend figure
    never got the cost (the key could spend its limit again) and its tally went to 1970."""
    stack = stack_factory(storage_retry_seconds=0.5)
    org_id, _ = stack.org(credits="1")
    key = stack.key(org_id, spend_limit=Decimal("5"), spend_period="day")
    mark = len(TELEMETRY.text())
    stack.faults.fail("TransactWriteItems", when=involves_org(org_id), code=REFUSED)
    assert stack.post(CHAT, BODY, key).status_code == 200
    stack.faults.clear()
    (record,) = _unsettled_records(mark)
    assert record["spend_figure"].startswith("key_spend:")  # the lease's figure, in the log
    assert _replay_logged(stack, mark, tmp_path, capsys) == ["replayed 1 unsettled usage events: 1 settled"]
    events = stack.events(org_id)
    assert [event.cost for event in events] == [Decimal(record["usage"]["cost"])]
    assert stack.key_figures(org_id) == {record["spend_figure"]: events[0].cost}
    check_key_figures(stack, org_id, events)  # and the tally: its month and day


def test_replay_after_the_lease_was_reclaimed_replaces_the_abandoned_event(stack_factory, tmp_path, capsys):
    stack = stack_factory(lease_ttl_seconds=0.5)
    org_id, key = stack.org(credits="1", concurrency=1)
    faults = stack.faults
    mark = len(TELEMETRY.text())
    faults.fail("TransactWriteItems", when=involves_org(org_id), code=REFUSED)
    lost = stack.post(CHAT, BODY, key).headers["X-Neocloud-Generation-Id"]
    faults.clear()
    import time

    time.sleep(0.6)
    assert stack.post(CHAT, BODY, key).status_code == 200  # reclaims the expired lease as abandoned
    assert get_event(stack.tables, lost).status == "abandoned"
    assert _replay_logged(stack, mark, tmp_path, capsys) == ["replayed 1 unsettled usage events: 1 replaced abandoned"]
    assert get_event(stack.tables, lost).status == "success"
    events = stack.events(org_id)
    assert len(events) == 2
    assert stack.org_info(org_id).credits == Decimal(1) - sum(e.cost for e in events)
    # the reclaim took the lease out of its key's requests in flight, and the replay added
    # the difference to the key's spend: the key's figures are its events' costs too
    check_key_figures(stack, org_id, events)


# -- DynamoDB under contention, and answers lost on the way back ---------------------------------


def test_half_of_all_org_writes_conflicting_every_request_still_answers_200(faulty_aws, mock):
    """The emulator's fault mode: half of all writes to the org item meet another transaction."""
    stack = make_stack(faulty_aws.url, mock)
    try:
        org_id, key = stack.org(credits="10", concurrency=8)
        bodies = [{**BODY, "stream": index % 2 == 1, "mock": {"tokens": 3, "token_delay_ms": 5}} for index in range(48)]

        async def run() -> list[httpx.Response]:
            gate = asyncio.Semaphore(4)
            async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
                async def one(body: dict) -> httpx.Response:
                    async with gate:
                        return await client.post(CHAT, json=body, headers={"Authorization": f"Bearer {key}"})

                return await asyncio.gather(*(one(body) for body in bodies))

        responses = asyncio.run(run())
        assert [response.status_code for response in responses] == [200] * 48
        admissions = stack.faults.count("UpdateItem", involves_org(org_id))
        settles = stack.faults.count("TransactWriteItems", involves_org(org_id))
        assert admissions > 48  # conflicts happened, and were retried
        print(f"\n48 requests at 50 % conflicts: {admissions / 48:.2f} admission and {settles / 48:.2f} settle calls each")
        gen_ids = {response.headers["X-Neocloud-Generation-Id"] for response in responses}
        events = wait_for_events(stack, org_id, 48)
        assert sorted(e.gen_id for e in events) == sorted(gen_ids)  # one event each
        assert all(e.status == "success" for e in events)
        info = stack.org_info(org_id)
        assert info.leases == {}  # nothing left in flight
        assert Decimal(10) - info.credits == sum(e.cost for e in events)  # the ledger is exact
        check_key_figures(stack, org_id, events)  # and so is the key's spend, retried writes and all
    finally:
        stack.close()


def test_an_admission_answer_lost_at_7_of_8_in_flight_still_serves_the_request(stack, storage_faults):
    org_id, key = stack.org(credits="10", concurrency=8)
    slow = {**BODY, "stream": True, "mock": {"tokens": 10, "token_delay_ms": 150}}

    async def run() -> tuple[list[httpx.Response], httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as client:
            headers = {"Authorization": f"Bearer {key}"}
            running = [asyncio.create_task(client.post(CHAT, json=slow, headers=headers)) for _ in range(7)]
            while stack.mock.stats["in_flight"] < 7:
                await asyncio.sleep(0.02)
            lost = storage_faults.lose("UpdateItem", when=involves_org(org_id), times=1)
            last = await client.post(CHAT, json=BODY, headers=headers)  # the eighth, at the last free slot
            assert len(lost) == 2  # the first answer lost, the retry's received
            return list(await asyncio.gather(*running)), last

    running, last = asyncio.run(run())
    assert last.status_code == 200  # admitted by its retry, which found its own lease
    assert [response.status_code for response in running] == [200] * 7
    gen_ids = {r.headers["X-Neocloud-Generation-Id"] for r in running + [last]}
    events = wait_for_events(stack, org_id, 8)
    assert sorted(e.gen_id for e in events) == sorted(gen_ids)
    assert {e.status for e in events} == {"success"}  # nothing abandoned, nothing leaked
    info = stack.org_info(org_id)
    assert info.leases == {} and Decimal(10) - info.credits == sum(e.cost for e in events)


def test_a_lost_admission_answer_counts_once_against_the_keys_own_limit(stack, storage_faults):
    org_id, _ = stack.org(credits="10", concurrency=8)
    key = stack.key(org_id, concurrency=1, spend_limit="5", spend_period="month")
    lost = storage_faults.lose("UpdateItem", when=involves_org(org_id), times=1)
    first = stack.post(CHAT, BODY, key)
    assert first.status_code == 200 and len(lost) == 2  # the retry found its own lease
    second = stack.post(CHAT, BODY, key)
    assert second.status_code == 200  # the key's one slot was not taken twice
    events = wait_for_events(stack, org_id, 2)
    check_key_figures(stack, org_id, events)


def test_the_unsettled_record_keeps_its_cost_exact_through_the_log_and_the_replay(stack, tmp_path, capsys):
    """The replay record goes through Powertools' formatter, which parses the message as JSON."""
    org_id, _ = stack.org(credits="1")
    cost = Decimal("123.123456789012345")  # 18 significant digits (beyond a float), a cost's 15 decimal places
    faults = StorageFaults()
    faults.fail("TransactWriteItems", code=REFUSED)
    settings = replace(stack.settings, storage_retry_attempts=2)
    observer()  # the gateway's log handler and formatter, as in production
    mark = len(TELEMETRY.text())

    async def settle_with_storage_down() -> str:
        gateway = Gateway(settings, aws=AwsClient(region=settings.region, endpoint_url=settings.aws_endpoint_url,
                                                  http=FaultInjectingHttp(faults)))
        try:
            lease = await gateway.ledger.admit(org_id=org_id, key_id="k", model="gpt-oss-120b",
                                               endpoint="chat.completions", streamed=False)
            event = UsageEvent(gen_id=lease.gen_id, org_id=org_id, created_at="2026-12-01T00:00:00.000Z", key_id="k",
                               model="gpt-oss-120b", endpoint="chat.completions", streamed=False, status="success",
                               cost=cost, prompt_tokens=5, completion_tokens=7)
            return await gateway.settle(lease, event)
        finally:
            await gateway.aclose()

    assert asyncio.run(settle_with_storage_down()) == "unsettled"
    (record,) = _unsettled_records(mark)
    assert Decimal(str(record["usage"]["cost"])) == cost  # exactly as computed, not a float's 17 digits
    exported = tmp_path / "unsettled.log"
    exported.write_text(TELEMETRY.text()[mark:])
    lines: list[str] = []
    args = build_parser().parse_args(["admin", "replay-usage", str(exported)])
    assert run_admin(args, settings=stack.settings, out=lines.append) == 0, capsys.readouterr().err
    assert lines == ["replayed 1 unsettled usage events: 1 settled"]
    (event,) = stack.events(org_id)
    assert event.cost == cost
    assert stack.org_info(org_id).credits == Decimal(1) - cost


def test_a_replay_settles_every_event_it_can_and_names_those_it_cannot(stack_factory, tmp_path, capsys):
    """One logged event that cannot be settled (a cost DynamoDB cannot store) or read (a cost
    that is no number) once stopped the replay where it stood, the events after it unsettled.
    Each is now said on its own line, the others are settled, and the exit status is 1. (A cost
    no bill can be, such as 1E+200, is unreadable before anything is sent.)"""
    stack = stack_factory(storage_retry_seconds=0.5)
    org_id, key = stack.org(credits="1")
    mark = len(TELEMETRY.text())
    stack.faults.fail("TransactWriteItems", when=involves_org(org_id), code=REFUSED)
    first = stack.post(CHAT, BODY, key)
    second = stack.post(CHAT, BODY, key)
    stack.faults.clear()
    good = [line for line in TELEMETRY.text()[mark:].splitlines() if "usage_unsettled" in line]
    assert len(good) == 2
    unstorable, unreadable = json.loads(good[0]), json.loads(good[0])
    unstorable["message"]["usage"].update(gen_id="gen-unstorable", cost="1e200")
    unreadable["message"]["usage"].update(gen_id="gen-unreadable", cost="lots")
    exported = tmp_path / "unsettled.log"
    # as aws logs' text output may export them: a page's messages joined with tabs on one line,
    # and a line cut short
    exported.write_text("\n".join([json.dumps(unstorable), json.dumps(unreadable), good[0][:150],
                                    "\t".join(good)]) + "\n")
    lines: list[str] = []
    args = build_parser().parse_args(["admin", "replay-usage", str(exported)])
    assert run_admin(args, settings=stack.settings, out=lines.append) == 1
    err = capsys.readouterr().err
    assert "line 1: its cost 1E+200 is no bill" in err and "line 2" in err and "line 3" in err, err
    assert lines == ["replayed 2 unsettled usage events: 2 settled, 3 unreadable"]
    settled = {event.gen_id for event in stack.events(org_id)}
    assert settled == {first.headers["X-Neocloud-Generation-Id"], second.headers["X-Neocloud-Generation-Id"]}
    assert stack.org_info(org_id).in_flight == 0


def test_a_replay_while_storage_still_fails_stops_instead_of_waiting_out_every_event(stack_factory, tmp_path, capsys):
    """Each event waits out the settle's retries before it is given up: with storage still down,
    a thousand lines took hours in silence. After three events in a row refused so, the rest
    are not tried, and the operator is told to run it again later."""
    stack = stack_factory(storage_retry_seconds=0.3)
    org_id, key = stack.org(credits="1")
    mark = len(TELEMETRY.text())
    stack.faults.fail("TransactWriteItems", when=involves_org(org_id), code=REFUSED)
    for _ in range(5):
        assert stack.post(CHAT, BODY, key).status_code == 200
    stack.faults.clear()
    exported = tmp_path / "unsettled.log"
    exported.write_text(TELEMETRY.text()[mark:])
    lines: list[str] = []
    args = build_parser().parse_args(["admin", "replay-usage", str(exported)])
    down = replace(stack.settings, aws_endpoint_url=dead_url())  # the operator's storage, still unreachable
    assert run_admin(args, settings=down, out=lines.append) == 1
    assert lines == ["replayed 5 unsettled usage events: 3 not settled, 2 not tried"]
    assert "storage still failing, 2 not tried" in capsys.readouterr().err
    lines.clear()
    assert run_admin(args, settings=stack.settings, out=lines.append) == 0
    assert lines == ["replayed 5 unsettled usage events: 5 settled"]
    assert stack.org_info(org_id).in_flight == 0


def test_a_key_change_on_storage_too_slow_to_finish_it_is_a_503_before_the_functions_timeout(stack_factory):
    """§10 on a DynamoDB answering every call, slowly: a change of a key's limit makes a dozen
    calls one after the other, and at 3 s a call took 42 s. Deployed, Lambda ends the function
    at its 29 s (a function error, and API Gateway's answer, not the gateway's). It is answered
    503 `storage_unavailable` at the gateway's deadline instead, saying the change may have been
    made; the key is whole either way, and the same change made again lands."""
    stack = stack_factory(answer_deadline_seconds=1.5)
    org_id, _ = stack.org()
    admin = create_key(stack.tables, org_id, role="management", label="console").secret
    headers = {"Authorization": f"Bearer {admin}"}
    created = stack.http.post("/v1/keys", json={"label": "agent"}, headers=headers).json()
    key_id, key = created["id"], created["secret"]
    for operation in ("GetItem", "Query", "UpdateItem", "TransactWriteItems", "PutItem", "BatchGetItem"):
        stack.faults.slow(operation, 0.4)
    began = time.monotonic()
    change = stack.http.patch(f"/v1/keys/{key_id}", json={"spend_limit": "5", "spend_period": "day"},
                              headers=headers, timeout=60)
    took = time.monotonic() - began
    assert change.status_code == 503, change.text
    error = change.json()["error"]
    assert error["code"] == "storage_unavailable" and error["type"] == "service_unavailable"
    assert "may have been made" in error["message"] and f"/v1/keys/{key_id}" in error["message"]
    assert 1.5 <= took < 3.0  # the deadline, and the one call under way when it passed
    began = time.monotonic()
    read = stack.http.get("/v1/usage", headers=headers, timeout=60)
    assert read.status_code in (200, 503) and time.monotonic() - began < 3.0
    stack.faults.clear()
    time.sleep(0.5)  # a call sent before the deadline may still land
    shown = stack.http.get(f"/v1/keys/{key_id}", headers=headers).json()
    assert shown["spend_limit"] in (None, 5)
    changed = stack.http.patch(f"/v1/keys/{key_id}", json={"spend_limit": "5", "spend_period": "day"}, headers=headers)
    assert changed.status_code == 200 and changed.json()["spend_limit"] == 5, changed.text
    assert stack.post(CHAT, BODY, key).status_code == 200
    check_key_figures(stack, org_id, stack.events(org_id))


def test_a_key_change_cut_short_after_it_landed_is_applied_at_once_by_this_process(stack_factory):
    """The change's write landed and the reads that show the key back were too slow: the answer
    is the deadline's 503, and this process no longer serves the key from what it had cached."""
    stack = stack_factory(answer_deadline_seconds=1.0, auth_cache_seconds=60.0)
    org_id, _ = stack.org()
    admin = create_key(stack.tables, org_id, role="management", label="console").secret
    headers = {"Authorization": f"Bearer {admin}"}
    created = stack.http.post("/v1/keys", json={"label": "agent"}, headers=headers).json()
    assert stack.post(CHAT, BODY, created["secret"]).status_code == 200  # the key is cached as it was
    mark = len(stack.faults.calls)
    landed = lambda payload: any(op == "UpdateItem" for op, _ in stack.faults.calls[mark:])  # noqa: E731
    for operation in ("GetItem", "Query", "BatchGetItem"):
        stack.faults.slow(operation, 3.0, when=landed)
    change = stack.http.patch(f"/v1/keys/{created['id']}", json={"models": ["qwen3-32b"]}, headers=headers, timeout=30)
    assert change.status_code == 503 and "may have been made" in change.json()["error"]["message"], change.text
    stack.faults.clear()
    refused = stack.post(CHAT, BODY, created["secret"])
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found", refused.text


def test_a_request_cut_at_its_deadline_does_not_fail_another_waiting_on_the_same_key_lookup(stack_factory):
    """Two requests of one key at once share its lookup: a credits read cut at its deadline
    ended that lookup with its cancellation, and a chat completion waiting on it answered a bare
    500 (no JSON, no contract shape). The chat is served."""
    import threading

    stack = stack_factory(answer_deadline_seconds=0.5)
    org_id, key = stack.org()
    keys_table = stack.settings.keys_table
    stack.faults.slow("GetItem", 1.0, when=lambda payload: payload.get("TableName") == keys_table, times=1)
    answers = {}
    credits = threading.Thread(target=lambda: answers.setdefault(
        "credits", stack.http.get("/v1/credits", headers={"Authorization": f"Bearer {key}"}, timeout=30)))
    credits.start()
    time.sleep(0.25)
    chat = stack.post(CHAT, BODY, key)
    credits.join()
    assert answers["credits"].status_code == 503 and answers["credits"].json()["error"]["code"] == "storage_unavailable"
    assert chat.status_code == 200, chat.text
    assert wait_for_events(stack, org_id, 1)[0].status == "success"
    assert stack.org_info(org_id).in_flight == 0


def test_an_admission_answered_503_after_a_lost_answer_is_taken_back_once_storage_answers_again(stack_factory):
    """§1: a request refused at admission (503) writes no usage event. Its one admission whose
    answer was lost had written its lease; storage then refused every write for longer than the
    take-back's own retry budget, and the take-back gave up: the lease held the org's slot until
    it expired, then a reclaim billed it as the `abandoned` event of a generation id no client
    ever saw, counted in /v1/usage as a request and an error. The take-back goes on, in rounds,
    as a late settle does: once storage answers, the slot is free and there is no event."""
    stack = stack_factory(storage_retry_attempts=3, lease_ttl_seconds=60.0)
    org_id, key = stack.org(concurrency=1)
    admissions = lambda payload: involves_org(org_id)(payload) and "#leases.#gen = :lease" in json.dumps(payload)  # noqa: E731
    lost = stack.faults.lose("UpdateItem", when=admissions, times=1)  # written, its answer lost
    # then refused: the admission's two tries left, the take-back's three at once and its first round
    throttled = stack.faults.fail("UpdateItem", when=lambda payload: bool(lost) and involves_org(org_id)(payload),
                                  code="ThrottlingException", times=6)
    refused = stack.post(CHAT, BODY, key)
    assert refused.status_code == 503 and "X-Neocloud-Generation-Id" not in refused.headers
    deadline = time.monotonic() + 10
    while stack.org_info(org_id).in_flight and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stack.org_info(org_id).in_flight == 0 and len(throttled) >= 6  # well before the lease's 60 s
    assert stack.events(org_id) == []
    served = stack.post(CHAT, BODY, key)  # the org's one slot
    assert served.status_code == 200
    (event,) = wait_for_events(stack, org_id, 1)
    assert event.gen_id == served.headers["X-Neocloud-Generation-Id"]


def test_a_replay_of_what_was_never_held_is_not_called_settled(stack_factory, tmp_path, capsys):
    """A logged line edited by hand, or from another stack: an unknown generation, an unknown
    org. Neither its lease nor its event is there; the replay said "already settled", and the
    operator believed it billed. Each is now named as not found, and a line whose generation id
    or time is no string is unreadable (it was sent, and the emulator answered 500 fifty times)."""
    stack = stack_factory(storage_retry_seconds=0.5)
    org_id, key = stack.org(credits="1")
    mark = len(TELEMETRY.text())
    stack.faults.fail("TransactWriteItems", when=involves_org(org_id), code=REFUSED)
    logged = stack.post(CHAT, BODY, key)
    stack.faults.clear()
    (line,) = [line for line in TELEMETRY.text()[mark:].splitlines() if "usage_unsettled" in line]
    unknown_generation, unknown_org, no_id, no_time = (json.loads(line) for _ in range(4))
    unknown_generation["message"]["usage"]["gen_id"] = "gen-nowhere"
    unknown_org["message"]["usage"].update(gen_id="gen-elsewhere", org_id="org-nowhere")
    no_id["message"]["usage"]["gen_id"] = None
    no_time["message"]["usage"]["created_at"] = 123
    exported = tmp_path / "unsettled.log"
    exported.write_text("\n".join(json.dumps(record) for record in (unknown_generation, unknown_org, no_id, no_time))
                        + "\n" + line + "\n")
    lines: list[str] = []
    args = build_parser().parse_args(["admin", "replay-usage", str(exported)])
    assert run_admin(args, settings=stack.settings, out=lines.append) == 1
    err = capsys.readouterr().err
    assert "not found: gen-nowhere" in err and "not found: gen-elsewhere" in err, err
    assert "line 3: its gen_id is NoneType" in err and "line 4: its created_at is int" in err, err
    assert "a replay cannot settle those" in err
    assert lines == ["replayed 3 unsettled usage events: 2 not found, 1 settled, 2 unreadable"]
    (event,) = stack.events(org_id)
    assert event.gen_id == logged.headers["X-Neocloud-Generation-Id"]
    assert stack.org_info(org_id).credits == Decimal(1) - event.cost

    # settled, then its event expired (the usage retention): replayed again, nothing is billed,
    # and the operator is told it may be that, not only an unknown generation
    stack.dynamodb.delete_item(TableName=stack.settings.usage_table, Key={"gen_id": {"S": event.gen_id}})
    exported.write_text(line + "\n")
    again: list[str] = []
    assert run_admin(args, settings=stack.settings, out=again.append) == 1
    assert "past the usage retention" in capsys.readouterr().err
    assert again == ["replayed 1 unsettled usage events: 1 not found"]
    assert stack.org_info(org_id).credits == Decimal(1) - event.cost


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/responses", {"input": "hi"}),
], ids=["chat", "responses"])
@pytest.mark.parametrize("tokens, ends", [(5, "done"), (1000, "error")], ids=["ended-well", "ran-into-total"])
def test_a_stream_whose_settle_is_slow_near_its_deadline_still_ends_in_its_last_event(stack_factory, mock, path,
                                                                                         body, tokens, ends):
    """§4: a stream ends with its last event or the error event, never a cut connection. Its
    client's deadline (the model's total time, and a keep-alive interval) once cut it in the
    middle of its settle, slow on storage but well within its budget: the client got an
    incomplete body (an SDK retrying it pays twice), though the usage was recorded. The
    deadline now cuts only a client that does not read."""
    from support import LedgerCheck, catalog_for_tests, sse_events

    catalog = catalog_for_tests(mock.url)
    catalog["models"].append({"id": "short-total", "owned_by": "t", "created": 1, "context_length": 4096,
                              "pricing": {"input": "1", "output": "2"}, "timeouts": {"total": 2},
                              "backends": [{"name": "b", "url": mock.url}]})
    stack = stack_factory(catalog=catalog, keepalive_seconds=1)
    org_id, key = stack.org()
    ledger = LedgerCheck(stack, org_id)
    stack.faults.slow("TransactWriteItems", 3.5, when=involves_org(org_id), times=1)  # the settle
    request = {**body, "model": "short-total", "stream": True, "mock": {"tokens": tokens, "token_delay_ms": 100}}
    with stack.http.stream("POST", path, json=request, headers={"Authorization": f"Bearer {key}"}) as response:
        ledger.gen_ids.append(response.headers["X-Neocloud-Generation-Id"])
        text = "".join(response.iter_text())  # raises if the body is cut short
    last = [block for block in sse_events(text) if not block.startswith(":")][-1]
    if ends == "done":
        assert last in ("data: [DONE]",) or last.startswith("event: response.completed"), last[:200]
    else:
        assert "upstream_error" in last, last[:200]
    (event,) = ledger.check(timeout=10)
    assert event.status == ("success" if ends == "done" else "stream_interrupted")


def test_a_replay_reads_a_log_with_bytes_that_are_no_utf8_and_calls_what_it_settled_settled(
        stack_factory, tmp_path, capsys, monkeypatch):
    """Two operators' surprises. A log export with one byte that is no UTF-8 anywhere (another
    program's line) made replay-usage settle nothing: one line, the codec's error, no file or
    line named. And under lost answers, the replay's own retry found its first try applied and
    called the event "already settled", as if someone else had settled it."""
    from kiln.store import with_ledger
    from kiln_ops.replay import replay, unsettled_records

    stack = stack_factory(storage_retry_seconds=0.5)
    org_id, key = stack.org(credits="1")
    mark = len(TELEMETRY.text())
    stack.faults.fail("TransactWriteItems", when=involves_org(org_id), code=REFUSED)
    logged = [stack.post(CHAT, BODY, key) for _ in range(3)]
    stack.faults.clear()
    unsettled = [line for line in TELEMETRY.text()[mark:].splitlines() if "usage_unsettled" in line]
    assert len(unsettled) == 3
    exported = tmp_path / "unsettled.log"
    exported.write_bytes(unsettled[0].encode() + b"\nSTART RequestId: caf\xe9 Version: $LATEST\n"
                         + unsettled[1].encode() + b"\n")
    lines: list[str] = []
    args = build_parser().parse_args(["admin", "replay-usage", "--progress", str(exported)])
    assert run_admin(args, settings=stack.settings, out=lines.append) == 0, capsys.readouterr().err
    assert lines == ["replayed 2 unsettled usage events: 2 settled"]
    assert "kiln admin: 2 of 2 usage events replayed…" in capsys.readouterr().err  # --progress, at the end

    faults = StorageFaults()
    faults.lose("TransactWriteItems", times=1)  # the third's settle applied, its answer lost
    records = list(unsettled_records(unsettled))
    outcomes = with_ledger(stack.settings, lambda ledger: replay(ledger, records[2:]), http=FaultInjectingHttp(faults))
    assert faults.count("TransactWriteItems") >= 2 and outcomes == {"settled": 1}, outcomes
    events = stack.events(org_id)
    assert {event.gen_id for event in events} == {r.headers["X-Neocloud-Generation-Id"] for r in logged}
    assert stack.org_info(org_id).credits == Decimal(1) - sum(event.cost for event in events)
    assert stack.org_info(org_id).in_flight == 0
    told: list[tuple[int, int]] = []
    monkeypatch.setattr("kiln_ops.replay.PROGRESS_EVERY", 1)
    again = with_ledger(stack.settings, lambda ledger: replay(ledger, records, progress=lambda *done: told.append(done)))
    assert again == {"already_settled": 3}  # another run
    assert told == [(1, 3), (2, 3), (3, 3)]  # how far it got, as it goes


def _one_unsettled_line(stack, org_id: str, key: str) -> tuple[str, str]:
    """A request whose settle storage refused: its generation id and its logged line."""
    mark = len(TELEMETRY.text())
    stack.faults.fail("TransactWriteItems", when=involves_org(org_id), code=REFUSED)
    gen_id = stack.post(CHAT, BODY, key).headers["X-Neocloud-Generation-Id"]
    stack.faults.clear()
    (line,) = [line for line in TELEMETRY.text()[mark:].splitlines() if "usage_unsettled" in line]
    return gen_id, line


def _replayed(stack, tmp_path, records: list[dict]) -> tuple[int, list[str]]:
    exported = tmp_path / "edited.log"
    exported.write_text("\n".join(json.dumps(record) for record in records) + "\n")
    lines: list[str] = []
    code = run_admin(build_parser().parse_args(["admin", "replay-usage", str(exported)]), settings=stack.settings,
                     out=lines.append)
    return code, lines


def test_a_line_edited_to_name_another_org_is_not_found_and_moves_no_event(stack_factory, tmp_path, capsys):
    """An `usage_unsettled` line whose org was edited to another's, replayed after its lease was
    reclaimed as abandoned: the replay replaced the first org's abandoned event with one of the
    other org, debited that org the difference, and left the first debited for an event it no
    longer had. Both ledgers stopped adding up. A stored event of another org or key is now
    not this line's: not found, nothing written."""
    stack = stack_factory(lease_ttl_seconds=0.5, storage_retry_seconds=0.5)
    org_id, key = stack.org(credits="1", concurrency=1)
    other_org, _ = stack.org(credits="1")
    gen_id, line = _one_unsettled_line(stack, org_id, key)
    time.sleep(0.6)
    assert stack.post(CHAT, BODY, key).status_code == 200  # reclaims the lease as abandoned
    assert get_event(stack.tables, gen_id).status == "abandoned"
    before = {org: (stack.org_info(org).credits, stack.events(org)) for org in (org_id, other_org)}
    edited = json.loads(line)
    edited["message"]["usage"]["org_id"] = other_org
    code, lines = _replayed(stack, tmp_path, [edited])
    assert code == 1 and lines == ["replayed 1 unsettled usage events: 1 not found"], lines
    assert f"not found: {gen_id}" in capsys.readouterr().err
    assert {org: (stack.org_info(org).credits, stack.events(org)) for org in (org_id, other_org)} == before


@pytest.mark.parametrize("field, value, said", [
    ("prompt_tokens", "abc", "its prompt_tokens is 'abc', not a whole number"),
    ("completion_tokens", -3, "its completion_tokens is '-3', not a whole number"),
    ("cached_tokens", True, "its cached_tokens is 'True', not a whole number"),
    ("cost", "-50", "its cost -50 is no bill: from 0 to 2E+12, at most 15 decimal places"),
    ("cost", "1E+30", "its cost 1E+30 is no bill"),
    ("cost", "0.0000000000000001", "its cost 1E-16 is no bill"),
    ("status", "bogus", "its status 'bogus' is none of a settled request's"),
    ("status", "abandoned", "its status 'abandoned' is none of a settled request's"),
    ("endpoint", "x", "its endpoint 'x' is none of chat.completions, completions, responses"),
    ("created_at", "garbage", "its created_at 'garbage' is no time as the gateway writes one"),
    ("created_at", "20261207T190229Z", "its created_at '20261207T190229Z' is no time as the gateway writes one"),
    ("created_at", "2026-12-08T09:02:29.593000+14:00", "is no time as the gateway writes one"),
    ("http_status", 10**30, "its http_status 1000000000000000000000000000000 is not from 100 to 599"),
    ("prompt_tokens", 10**29, "is not from 0 to 1000000000000"),
    ("streamed", "yes", "its streamed is str, not true or false"),
    ("model", "", "its model is empty, not a string"),
    ("error", 5, "its error is int, not a string"),
    ("spend_figure", "concurrency_limit", "its spend_figure 'concurrency_limit' is no spend figure of its key"),
    ("spend_figure", "key_spend:key_other:total", "its spend_figure 'key_spend:key_other:total' is no spend figure"),
    ("spend_figure", "key_spend:{key_id}:credits", "its spend_figure 'key_spend:{key_id}:credits' is no spend figure"),
    ("spend_figure", "key_spend:{key_id}:2020-01-01", "is no spend figure of its key when it was made"),
])
def test_a_line_edited_into_what_no_event_can_be_is_unreadable_and_writes_nothing(stack_factory, tmp_path, capsys,
                                                                                   field, value, said):
    """Lines edited by hand were settled as they said: token counts that are text (stored as such,
    after which every usage report of the org failed: 503 on /v1/usage, 500 on the generation), a
    negative cost (credits added), a status or endpoint no event has, a time that is none, and a
    spend figure naming any number of the org item (`concurrency_limit`, raised by the cost: one
    more request admitted). Each is now unreadable, named with its line, and nothing is written."""
    stack = stack_factory(storage_retry_seconds=0.5)
    org_id, key = stack.org(credits="1")
    gen_id, line = _one_unsettled_line(stack, org_id, key)
    record = json.loads(line)
    key_id = record["message"]["usage"]["key_id"]
    if field == "spend_figure":
        record["message"]["spend_figure"] = value.format(key_id=key_id)
    else:
        record["message"]["usage"][field] = value
    org_before = stack.dynamodb.get_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                         ConsistentRead=True)["Item"]
    code, lines = _replayed(stack, tmp_path, [record])
    assert code == 1 and lines == ["replayed 0 unsettled usage events: 1 unreadable"], lines
    err = capsys.readouterr().err
    assert "line 1: its " in err and said.format(key_id=key_id) in err, err
    assert stack.events(org_id) == []
    assert stack.dynamodb.get_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                   ConsistentRead=True)["Item"] == org_before
    # the line as logged is still settled, as ever
    code, lines = _replayed(stack, tmp_path, [json.loads(line)])
    assert code == 0 and lines == ["replayed 1 unsettled usage events: 1 settled"], lines
    (event,) = stack.events(org_id)
    assert event.gen_id == gen_id and stack.org_info(org_id).credits == Decimal(1) - event.cost


def test_a_line_edited_to_name_another_key_settles_nothing_of_the_lease_it_names(stack_factory, tmp_path, capsys):
    """The lease still held (nothing reclaimed it yet), a line whose key was edited to another of
    the org was settled: the lease's generation left the other key's set, its cost went to that
    key's spend and tally, and the real key kept the generation in its set for good (a key of
    concurrency 1: 429 on every later request). The settle now holds the lease to its own key."""
    stack = stack_factory(storage_retry_seconds=0.5)
    org_id, key = stack.org(credits="1")
    other = create_key(stack.tables, org_id, label="other")
    gen_id, line = _one_unsettled_line(stack, org_id, key)
    before = stack.dynamodb.get_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                     ConsistentRead=True)["Item"]
    assert gen_id in before["leases"]["M"]
    edited = json.loads(line)
    edited["message"]["usage"]["key_id"] = other.key_id
    code, lines = _replayed(stack, tmp_path, [edited])
    assert code == 1 and lines == ["replayed 1 unsettled usage events: 1 not found"], lines
    assert "the lease held for it is another key's" in capsys.readouterr().err
    assert stack.events(org_id) == []
    assert stack.dynamodb.get_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                   ConsistentRead=True)["Item"] == before
    code, lines = _replayed(stack, tmp_path, [json.loads(line)])  # the line as logged
    assert code == 0 and lines == ["replayed 1 unsettled usage events: 1 settled"], lines
    assert stack.org_info(org_id).leases == {}
