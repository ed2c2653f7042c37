"""Storage faults: a refused admission costs nothing upstream; a lost settle is never lost."""

from __future__ import annotations

import json
from decimal import Decimal

from conftest import involves_org
from kiln.store.usage import get_event
from kiln_ops.admin import run_admin
from kiln_ops.cli import build_parser
from support import TELEMETRY, data_events

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "x"}]}


def test_admission_failing_is_a_clear_503_and_no_upstream_call(stack, storage_faults):
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


def test_a_settle_that_keeps_failing_is_logged_whole_and_replayed_by_the_operator(stack, storage_faults, tmp_path, capsys):
    org_id, key = stack.org(credits="1")
    mark = len(TELEMETRY.text())
    storage_faults.fail("TransactWriteItems", when=involves_org(org_id))
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


def test_replay_after_the_lease_was_reclaimed_replaces_the_abandoned_event(stack_factory, tmp_path, capsys):
    stack = stack_factory(lease_ttl_seconds=0.5)
    org_id, key = stack.org(credits="1", concurrency=1)
    faults = stack.faults
    mark = len(TELEMETRY.text())
    faults.fail("TransactWriteItems", when=involves_org(org_id))
    lost = stack.post(CHAT, BODY, key).headers["X-Neocloud-Generation-Id"]
    faults.clear()
    import time

    time.sleep(0.6)
    assert stack.post(CHAT, BODY, key).status_code == 200  # reclaims the expired lease as abandoned
    assert get_event(stack.tables, lost).status == "abandoned"

    exported = tmp_path / "unsettled.log"
    exported.write_text(TELEMETRY.text()[mark:])
    lines: list[str] = []
    args = build_parser().parse_args(["admin", "replay-usage", str(exported)])
    assert run_admin(args, settings=stack.settings, out=lines.append) == 0, capsys.readouterr().err
    assert lines == ["replayed 1 unsettled usage events: 1 replaced abandoned"]
    assert get_event(stack.tables, lost).status == "success"
    events = stack.events(org_id)
    assert len(events) == 2
    assert stack.org_info(org_id).credits == Decimal(1) - sum(e.cost for e in events)
