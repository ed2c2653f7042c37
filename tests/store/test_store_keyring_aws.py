"""Per-key limits and key management with DynamoDB as AWS serves it where the embedded AWS
does not (contract §2 step 3, §10): indexes and plain reads eventually consistent, a write
landing while another call is between its read and its write, an answer lost after the
write was made.
"""

from __future__ import annotations

import json
import time
from decimal import Decimal

import pytest

import kiln.store.keyring as keyring_module
from kiln.http1 import Response
from kiln.store.clock import epoch_of, iso_ms
from kiln.store.keys import create_key, revoke_key
from kiln.store.keyspend import KeyLimits, period_kind, period_name

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-oss-120b", "messages": [{"role": "user", "content": "hi"}]}


def call(stack, method: str, path: str, key: str, body=None):
    return stack.http.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})


def management_org(stack, **org) -> tuple[str, str]:
    org_id, _ = stack.org(**org)
    return org_id, create_key(stack.tables, org_id, role="management", label="console").secret


def key_figures(stack, org_id: str, key_id: str) -> dict[str, Decimal]:
    return {name: value for name, value in stack.key_figures(org_id).items()
            if name.startswith(f"key_spend:{key_id}:")}


def key_spent_in(stack, org_id: str, key_id: str, figure: str) -> Decimal:
    """What the key's events admitted in the figure's period cost."""
    period = figure.rpartition(":")[2]
    kind = period_kind(period)
    return sum((event.cost for event in stack.events(org_id) if event.key_id == key_id
                and period_name(kind, epoch_of(event.created_at)) == period), Decimal(0))


def lagging_index(monkeypatch, lag: float = 1.0) -> None:
    """The `by_org_time` GSI as DynamoDB serves it: eventually consistent, a write reaching it a
    moment after it is acknowledged (a GSI Query cannot ask for ConsistentRead). Modelled
    conservatively: an event whose request was admitted less than `lag` seconds ago (so was
    written less than `lag` seconds ago) is not yet on the index."""
    real = keyring_module.key_costs

    def key_costs(aws, usage_table, org_id, since, *, key_id=None):
        cut = iso_ms(time.time() - lag)

        async def rows():
            async for row in real(aws, usage_table, org_id, since, key_id=key_id):
                if row[1] < cut:
                    yield row

        return rows()

    monkeypatch.setattr(keyring_module, "key_costs", key_costs)


# -- 1. a limit set right after the key spent is seeded from an index that lags ----------------


def test_a_limit_set_just_after_the_key_spent_counts_what_it_spent(stack, monkeypatch):
    """A key without a limit spends c; its org then gives it a daily limit of c. The key has
    spent its limit: its next request must be 402 (§10: soft only by requests in flight, and
    none is). Summed from the `by_org_time` GSI, which on AWS does not yet show an event
    settled a moment ago, the new figure started at 0 and the key got its whole limit again:
    it is read from the key's tally, written with the event and read consistently."""
    org_id, admin = management_org(stack)
    key = call(stack, "POST", "/v1/keys", admin, {"spend_period": "day"}).json()
    assert stack.post(CHAT, BODY, key["secret"]).status_code == 200
    (event,) = stack.events(org_id)
    lagging_index(monkeypatch)
    changed = call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, {"spend_limit": str(event.cost)})
    assert changed.status_code == 200, changed.text
    monkeypatch.undo()
    figure = KeyLimits(None, event.cost, "day").figure(key["id"], time.time())
    figures = key_figures(stack, org_id, key["id"])
    refused = stack.post(CHAT, BODY, key["secret"])
    assert refused.status_code == 402, (refused.status_code, "a key at its spend limit was admitted again", figures)
    assert figures.get(figure, Decimal(0)) == event.cost, ("the figure misses what the key spent before", figures)


def test_a_new_spend_period_counts_what_the_key_spent_just_before(stack, monkeypatch):
    """The same through a change of period: a key with a $c total limit that spent c/2 gets
    `spend_period: month`. Seeded from the lagging index, its month figure lost c/2 (the old
    figure that held it is removed) and the key could spend c more this month."""
    org_id, admin = management_org(stack)
    key = call(stack, "POST", "/v1/keys", admin, {"spend_limit": 5}).json()
    assert stack.post(CHAT, BODY, key["secret"]).status_code == 200
    (event,) = stack.events(org_id)
    lagging_index(monkeypatch)
    changed = call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, {"spend_period": "month"})
    assert changed.status_code == 200, changed.text
    monkeypatch.undo()
    month = KeyLimits(None, Decimal(5), "month").figure(key["id"], time.time())
    assert key_figures(stack, org_id, key["id"]) == {month: event.cost}, key_figures(stack, org_id, key["id"])


# -- 2. a reclaim adds an abandoned request's cost to the figure an old read of the org says ---------


def test_a_reclaim_landing_after_a_period_change_counts_in_the_keys_figure(stack_factory):
    """A gateway died with a request of a key (daily limit $5) that had relayed $0.10. The next
    admission reclaims its lease in the background, from the org item it read (marker absent:
    the lease's day figure). A change of the key's period to `month` lands before that reclaim's
    transaction (a slow answer, or conflicts it retries through). Conditioned only on the
    lease's expiry, it added $0.10 to the day figure the change removed, and the month figure
    the key counts in never got it (§10: settling — or reclaiming — adds the cost to the key's
    spend for the period). Conditioned on the marker as read, it races, and the next
    admission reclaims the lease into the month figure."""
    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, admin = management_org(stack)
    key = call(stack, "POST", "/v1/keys", admin, {"spend_limit": 5, "spend_period": "day"}).json()
    day_limits = KeyLimits(None, Decimal(5), "day")
    dead = stack.ledger.admit(org_id=org_id, key_id=key["id"], model="gpt-oss-120b", endpoint="chat.completions",
                              streamed=False, limits=day_limits)
    assert stack.ledger.renew(dead, (3, 2, Decimal("0.1"))) is not None
    time.sleep(0.45)  # the gateway that held it is gone: the lease expires
    reclaim = stack.faults.slow("TransactWriteItems", 1.5, when=lambda payload: '"abandoned"' in json.dumps(payload),
                                times=1)
    assert stack.post(CHAT, BODY, key["secret"]).status_code == 200  # admits, and reclaims the dead lease later
    changed = call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, {"spend_period": "month"})
    assert changed.status_code == 200, changed.text
    assert reclaim, "the reclaim never ran"
    time.sleep(1.6)  # the slowed reclaim meets the change: it raced, and leaves the lease be
    stack.faults.clear()
    assert stack.post(CHAT, BODY, key["secret"]).status_code == 200  # the next admission reclaims it
    deadline = time.monotonic() + 5
    while stack.org_info(org_id).leases and time.monotonic() < deadline:  # the dead lease is reclaimed
        time.sleep(0.05)
    time.sleep(0.2)
    stack.faults.clear()
    statuses = sorted(event.status for event in stack.events(org_id))
    assert statuses == ["abandoned", "success", "success"], statuses
    month = KeyLimits(None, Decimal(5), "month").figure(key["id"], time.time())
    figures = key_figures(stack, org_id, key["id"])
    assert figures.get(month) == key_spent_in(stack, org_id, key["id"], month), figures
    assert set(figures) == {month}, figures


# -- 3. a revoked key read back from a replica that has not seen the revocation ----------------------


def test_a_revoked_key_is_refused_once_the_auth_cache_time_has_passed(stack_factory):
    """§10: DELETE revokes, 401 for the key within the auth cache time. Another gateway's
    cache entry expires and it reads the key again with an eventually consistent GetItem
    (no ConsistentRead, as it once did): on AWS that read may come from a replica that has not
    seen the revocation a moment ago, and its answer is cached for a whole cache time more, so
    the revoked key was served for up to twice the cache time."""
    cache = 0.6
    stack = stack_factory(auth_cache_seconds=cache)
    org_id, _ = stack.org()
    issued = create_key(stack.tables, org_id, label="to revoke")
    assert stack.post(CHAT, BODY, issued.secret).status_code == 200  # cached by this gateway
    keys_table = stack.settings.keys_table
    (item,) = stack.dynamodb.scan(TableName=keys_table, FilterExpression="key_id = :k",
                                  ExpressionAttributeValues={":k": {"S": issued.key_id}})["Items"]
    revoke_key(stack.tables, issued.key_id)  # by another process (the CLI, another gateway)
    revoked_at = time.monotonic()

    # AWS: an eventually consistent read within a second of a write may return the item as it was
    faults = stack.faults
    answer = faults.answer

    def replica(operation, payload):
        stale = (operation == "GetItem" and payload.get("TableName") == keys_table
                 and not payload.get("ConsistentRead") and time.monotonic() - revoked_at < 1.0)
        if stale:
            faults.calls.append((operation, payload))
            wanted = payload.get("ExpressionAttributeNames", {}).values()
            shown = {name: value for name, value in item.items() if not wanted or name in wanted}
            return Response.complete(200, json.dumps({"Item": shown}).encode())
        return answer(operation, payload)

    faults.answer = replica
    try:
        time.sleep(cache + 0.1)  # this gateway's entry has expired: the next request reads the key again
        stack.post(CHAT, BODY, issued.secret)
        time.sleep(max(0.0, revoked_at + cache + 0.3 - time.monotonic()))
        late = stack.post(CHAT, BODY, issued.secret)  # well past the cache time since the revocation
    finally:
        faults.answer = answer
    assert late.status_code == 401, (late.status_code, f"revoked key served {time.monotonic() - revoked_at:.2f} s "
                                                       f"after its revocation, the cache time being {cache} s")


def test_a_late_settle_landing_after_a_period_change_counts_in_the_keys_figure(stack_factory):
    """The same race in `_settle_late`: a request whose lease was reclaimed as `abandoned`
    ($0.10) settles after all ($0.25). It reads the org item (no marker: the lease's day figure),
    then sends the transaction that replaces the event and adds the difference. A change of the
    key's period to `month` lands in between: conditioned only on the org existing, the $0.15
    went to the removed day figure, and the month figure the key counts in missed it."""
    import threading

    from kiln.store import UsageEvent
    from support import StorageFaults, SyncLedger

    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, admin = management_org(stack)
    key = call(stack, "POST", "/v1/keys", admin, {"spend_limit": 5, "spend_period": "day"}).json()
    day_limits = KeyLimits(None, Decimal(5), "day")
    admit = dict(org_id=org_id, key_id=key["id"], model="gpt-oss-120b", endpoint="chat.completions", streamed=False,
                 limits=day_limits)
    slow = stack.ledger.admit(**admit)
    assert stack.ledger.renew(slow, (3, 2, Decimal("0.1"))) is not None
    time.sleep(0.45)
    other = stack.ledger.admit(**admit)  # reclaims `slow` (in the background; drained before it returns)
    event = lambda lease, cost: UsageEvent(gen_id=lease.gen_id, org_id=org_id, created_at=iso_ms(lease.started),  # noqa: E731
                                           key_id=key["id"], model=lease.model, endpoint=lease.endpoint,
                                           streamed=False, status="success", cost=Decimal(cost), prompt_tokens=3,
                                           completion_tokens=4)
    assert stack.ledger.settle(other, event(other, "0.5")) == "settled"
    assert sorted(e.status for e in stack.events(org_id)) == ["abandoned", "success"]

    faults = StorageFaults()
    held = faults.slow("TransactWriteItems", 1.5, when=lambda payload: ":difference" in json.dumps(payload), times=1)
    outcome = []
    late = threading.Thread(target=lambda: outcome.append(SyncLedger(stack.settings, faults).settle(slow, event(slow, "0.25"))))
    late.start()
    deadline = time.monotonic() + 5
    while not held and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held, "the late settle never reached its transaction"
    changed = call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, {"spend_period": "month"})
    assert changed.status_code == 200, changed.text
    late.join(10)
    assert outcome == ["replaced_abandoned"], outcome
    month = KeyLimits(None, Decimal(5), "month").figure(key["id"], time.time())
    figures = key_figures(stack, org_id, key["id"])
    assert figures.get(month) == key_spent_in(stack, org_id, key["id"], month) == Decimal("0.75"), figures
    assert set(figures) == {month}, figures


def _revoking(stack):
    def matches(payload: dict) -> bool:
        updates = [item["Update"] for item in payload.get("TransactItems", []) if "Update" in item] or [payload]
        return any(update.get("TableName") == stack.settings.keys_table
                   and '"revoked"' in json.dumps(update.get("ExpressionAttributeValues", {})) for update in updates)
    return matches


@pytest.mark.parametrize("operation", ["UpdateItem", "TransactWriteItems"])
def test_a_revocation_whose_answer_was_lost_still_takes_the_keys_figures_off(stack, operation):
    """DELETE /v1/keys/{id}: DynamoDB applies the revocation and its answer is lost; the client
    sends it again, whose condition (not revoked) now fails: taken for a revocation made
    before, it once left the key's marker and spend figure on the org item that every
    admission and settle writes (keyring: "a revocation ... takes them off"). A key with a
    limit is revoked in a transaction that counts it off its org (its revoking UpdateItem
    inside), the one without by an UpdateItem of its own; that count is taken off once."""
    org_id, admin = management_org(stack)
    key = call(stack, "POST", "/v1/keys", admin, {"spend_limit": 5, "spend_period": "day"}).json()
    if operation == "UpdateItem":  # a limit taken off after the count was made, then figures made again
        assert call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, {"spend_limit": None}).status_code == 200
    assert stack.post(CHAT, BODY, key["secret"]).status_code == 200
    before = _limited_keys(stack, org_id)
    lost = stack.faults.lose(operation, when=_revoking(stack), times=1)
    try:
        revoked = call(stack, "DELETE", f"/v1/keys/{key['id']}", admin)
    finally:
        stack.faults.clear()
    assert lost, "the fault was never injected"
    assert revoked.status_code == 200 and revoked.json()["status"] == "revoked", revoked.text
    item = stack.dynamodb.get_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                   ConsistentRead=True)["Item"]
    left = sorted(name for name in item if key["id"] in name)
    assert left == [], left
    assert _limited_keys(stack, org_id) == before - (operation == "TransactWriteItems")


def _limited_keys(stack, org_id: str) -> int:
    item = stack.dynamodb.get_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                   ConsistentRead=True)["Item"]
    return int(item["limited_keys"]["N"])


class _IndexAndTable:
    """The keys table of one org, its by_org index holding only what `indexed` names; counts
    the consistent reads of items and how many were in flight at once."""

    def __init__(self, org_id: str, items: dict[str, dict], indexed: set[str]) -> None:
        self.org_id, self.items, self.indexed = org_id, items, indexed
        self.reads, self.in_flight, self.most_at_once = 0, 0, 0

    async def dynamodb(self, operation: str, payload: dict) -> dict:
        import asyncio

        if operation == "Query":
            return {"Items": [self.items[h] for h in sorted(self.indexed)]}
        assert operation == "GetItem" and payload["ConsistentRead"] is True
        self.reads += 1
        self.in_flight += 1
        self.most_at_once = max(self.most_at_once, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return {"Item": self.items.get(payload["Key"]["key_hash"]["S"])}


def _item(org_id: str, index: int) -> dict:
    return {"key_hash": {"S": f"hash-{index}"}, "key_id": {"S": f"key_{index:016x}"}, "org_id": {"S": org_id},
            "status": {"S": "active"}, "prefix": {"S": "sk-kiln-x"}, "created_at": {"S": f"2026-12-06T00:00:{index:02d}.000Z"}}


def test_a_list_reads_at_once_only_the_keys_the_index_may_show_otherwise(monkeypatch):
    """Of the keys this process wrote lately, a list reads from the table those the index may
    show otherwise (changed ones, and new ones it does not hold yet), all at once: a burst of
    keys made costs no read once the index has them."""
    import asyncio

    monkeypatch.setattr(keyring_module, "_recent_writes", {})
    org_id = "org-list"
    items = {f"hash-{i}": _item(org_id, i) for i in range(30)}
    table = _IndexAndTable(org_id, items, indexed={f"hash-{i}" for i in range(20)})
    ring = keyring_module.Keyring(table, keys_table="keys-list", orgs_table="orgs-list")
    for i in range(30):
        ring._wrote(org_id, f"hash-{i}", changed=False)  # made: 20 in the index already, 10 not yet
    ring._wrote(org_id, "hash-3")  # and one of those changed since
    listed = asyncio.run(ring.list(org_id))
    assert [key.key_id for key in listed] == [f"key_{i:016x}" for i in range(30)]  # oldest first
    assert table.reads == 11 and table.most_at_once == 11


def test_the_writes_of_an_org_never_listed_again_are_forgotten(monkeypatch):
    recent: dict = {}
    monkeypatch.setattr(keyring_module, "_recent_writes", recent)
    ring = keyring_module.Keyring(None, keys_table="keys-forget", orgs_table="orgs-forget")
    for i in range(1000):
        ring._wrote(f"org-{i}", f"hash-{i}")
    later = time.monotonic() + keyring_module._RECENT_WRITE_SECONDS + 1
    monkeypatch.setattr(keyring_module.time, "monotonic", lambda: later)
    ring._wrote("org-last", "hash-last")
    assert list(recent) == [("keys-forget", "org-last")]


def _keys_table(stack):
    return lambda payload: payload.get("TableName") == stack.settings.keys_table


@pytest.mark.parametrize("limit", [None, 5], ids=["no limit: PutItem", "a limit: a transaction counting it"])
def test_a_key_made_while_dynamodb_throttles_and_loses_an_answer_is_made_once_and_answered(stack, limit):
    """POST /v1/keys: the write is applied and its answer lost, then throttled more times than
    the AWS client's own tries. Answering 503 then (as once) left a key whose secret no one
    had, and the client's retry made a second one: the write is tried on, and the answer is the
    key made, once (and counted once on its org, for a key with a limit)."""
    org_id, admin = management_org(stack)
    before = len(call(stack, "GET", "/v1/keys", admin).json()["data"])
    if limit is None:
        operation, put = "PutItem", _keys_table(stack)
    else:
        operation = "TransactWriteItems"

        def put(payload: dict) -> bool:
            return any(item.get("Put", {}).get("TableName") == stack.settings.keys_table
                       for item in payload.get("TransactItems", []))
    lost = stack.faults.lose(operation, when=put, times=1)
    throttled = stack.faults.fail(operation, when=lambda payload: put(payload) and bool(lost), times=6)
    try:
        made = call(stack, "POST", "/v1/keys", admin, {"label": "made once", "spend_limit": limit})
    finally:
        stack.faults.clear()
    assert lost and len(throttled) >= 6, "the faults were never injected"
    assert made.status_code == 201, made.text
    keys = call(stack, "GET", "/v1/keys", admin).json()["data"]
    assert len(keys) == before + 1 and [k["id"] for k in keys if k["label"] == "made once"] == [made.json()["id"]]
    assert stack.post(CHAT, BODY, made.json()["secret"]).status_code == 200
    if limit is not None:
        assert _limited_keys(stack, org_id) == 1


def test_a_key_changed_while_dynamodb_throttles_is_changed_not_503(stack):
    org_id, admin = management_org(stack)
    key = call(stack, "POST", "/v1/keys", admin, {"label": "before"}).json()
    throttled = stack.faults.fail("UpdateItem", when=_keys_table(stack), times=6)
    try:
        changed = call(stack, "PATCH", f"/v1/keys/{key['id']}", admin, {"label": "after"})
    finally:
        stack.faults.clear()
    assert len(throttled) >= 6
    assert changed.status_code == 200 and changed.json()["label"] == "after", changed.text


def test_a_key_changed_by_a_clock_behind_the_turn_of_its_period_keeps_the_new_periods_figure(stack):
    """A gateway (or an operator's `kiln admin keys update`) whose clock is a moment behind
    midnight changed a key's limit: it removed every figure of the key but the one its clock
    named, the new day's too, that a gateway ahead had already settled into. What the key had
    spent since midnight was gone, and it was admitted past its limit (contract §10)."""
    import asyncio
    from datetime import datetime, timedelta, timezone

    from kiln.aws import AwsClient

    org_id, admin = management_org(stack)
    key = call(stack, "POST", "/v1/keys", admin, {"spend_limit": "0.00001", "spend_period": "day"}).json()
    today = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0, microsecond=0)
    turn = (today + timedelta(days=1)).timestamp()
    new_day = KeyLimits(None, Decimal("0.00001"), "day").figure(key["id"], turn + 1)
    stack.dynamodb.update_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                               UpdateExpression="SET #f = :spent", ExpressionAttributeNames={"#f": new_day},
                               ExpressionAttributeValues={":spent": {"N": "0.00002"}})  # settled by a gateway ahead

    async def change_behind():
        aws = AwsClient(region=stack.settings.region, endpoint_url=stack.settings.aws_endpoint_url)
        try:
            ring = keyring_module.Keyring(aws, keys_table=stack.settings.keys_table,
                                          orgs_table=stack.settings.orgs_table, usage_table=stack.settings.usage_table,
                                          clock=lambda: turn - 0.05)
            await ring.update(key["id"], {"spend_limit": Decimal("0.00002"), "label": "behind"}, org_id=org_id)
        finally:
            await aws.aclose()

    asyncio.run(change_behind())
    assert key_figures(stack, org_id, key["id"]).get(new_day) == Decimal("0.00002"), key_figures(stack, org_id, key["id"])
