"""Admission and settlement on DynamoDB: one write in, one transaction out, never twice."""

from __future__ import annotations

import asyncio
import json
import time
from decimal import Context, Decimal

import pytest

from kiln.errors import InsufficientCredits, KeySpendLimitExceeded, OrganizationDisabled, RateLimitExceeded
from kiln.store import StorageError, UnstorableValue, UsageEvent
from kiln.store import ledger as ledger_module
from kiln.store.keyspend import KeyLimits
from kiln.store.ledger import with_ledger
from kiln.store.orgs import set_status
from kiln.store.usage import get_event
from support import FaultInjectingHttp, StorageFaults, SyncLedger


def _event(lease, cost: str = "0.25", status: str = "success") -> UsageEvent:
    return UsageEvent(
        gen_id=lease.gen_id, org_id=lease.org_id, created_at="2026-11-30T00:00:00.000Z", key_id=lease.key_id,
        model=lease.model, endpoint=lease.endpoint, streamed=lease.streamed, status=status, cost=Decimal(cost),
        prompt_tokens=3, completion_tokens=4,
    )


def _admit(stack, org_id, ledger=None):
    ledger = ledger or stack.ledger
    return ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions", streamed=False)


def test_admission_is_one_write_and_refusals_need_no_read(stack):
    org_id, _ = stack.org(concurrency=1)
    faults = StorageFaults()  # records every call
    ledger = SyncLedger(stack.settings, faults)
    _admit(stack, org_id, ledger)
    assert [operation for operation, _ in faults.calls] == ["UpdateItem"]
    with pytest.raises(RateLimitExceeded):
        _admit(stack, org_id, ledger)
    assert [operation for operation, _ in faults.calls] == ["UpdateItem", "UpdateItem"]


def test_refusals_tell_402_from_403_from_429(stack):
    org_id, _ = stack.org(credits="0")
    with pytest.raises(InsufficientCredits) as refused:
        _admit(stack, org_id)
    assert refused.value.status == 402
    org_id, _ = stack.org()
    set_status(stack.tables, org_id, "disabled")
    with pytest.raises(OrganizationDisabled) as refused:
        _admit(stack, org_id)
    assert refused.value.status == 403
    org_id, _ = stack.org(concurrency=1)
    _admit(stack, org_id)
    with pytest.raises(RateLimitExceeded) as refused:
        _admit(stack, org_id)
    assert refused.value.status == 429
    # the refused admission took no slot of its own
    assert stack.org_info(org_id).in_flight == 1


def test_settle_releases_debits_and_records_in_one_go(stack):
    org_id, _ = stack.org(credits="1")
    lease = _admit(stack, org_id)
    assert stack.org_info(org_id).in_flight == 1
    faults = StorageFaults()
    assert SyncLedger(stack.settings, faults).settle(lease, _event(lease)) == "settled"
    assert [operation for operation, _ in faults.calls] == ["TransactWriteItems"]
    assert stack.org_info(org_id).in_flight == 0
    assert stack.org_info(org_id).credits == Decimal("0.75")
    stored = get_event(stack.tables, lease.gen_id)
    assert (stored.cost, stored.prompt_tokens, stored.status) == (Decimal("0.25"), 3, "success")


def test_a_retried_settle_never_charges_twice(stack):
    org_id, _ = stack.org(credits="1")
    lease = _admit(stack, org_id)
    assert stack.ledger.settle(lease, _event(lease)) == "settled"
    # the same settle again: DynamoDB answers its ClientRequestToken as it did the first time
    assert stack.ledger.settle(lease, _event(lease)) == "settled"
    # without the token (an operator's replay) the conditions tell it was settled already
    assert stack.ledger.settle(lease, _event(lease), request_token=False) == "already_settled"
    assert stack.org_info(org_id).credits == Decimal("0.75")
    assert len(stack.events(org_id)) == 1


def test_a_late_settle_replaces_the_abandoned_event_and_bills(stack_factory):
    stack = stack_factory(lease_ttl_seconds=0.2)
    org_id, _ = stack.org(credits="1", concurrency=1)
    slow = _admit(stack, org_id)
    time.sleep(0.3)
    other = _admit(stack, org_id)  # reclaims the expired lease
    assert get_event(stack.tables, slow.gen_id).status == "abandoned"
    assert stack.ledger.settle(slow, _event(slow)) == "replaced_abandoned"
    assert get_event(stack.tables, slow.gen_id).status == "success"
    assert stack.ledger.settle(other, _event(other)) == "settled"
    assert stack.org_info(org_id).credits == Decimal("0.5")
    assert len(stack.events(org_id)) == 2


def test_a_late_settle_whose_answer_was_lost_still_says_it_replaced_the_abandoned_event(stack_factory):
    """The late settle's transaction went without a ClientRequestToken: applied, its answer
    lost, its retry met its own write (the event no longer abandoned) and the settle said
    "already_settled", so the gateway's log and metrics said a request was billed twice over
    though it was billed once. Its retry is now recognised as its own; an operator's replay
    (no token) is still told that it was settled already."""
    stack = stack_factory(lease_ttl_seconds=0.2)
    org_id, _ = stack.org(credits="1", concurrency=1)
    slow = _admit(stack, org_id)
    time.sleep(0.3)
    other = _admit(stack, org_id)  # reclaims the expired lease as abandoned
    faults = StorageFaults()
    faults.lose("TransactWriteItems", when=lambda payload: "#leases" not in json.dumps(payload["TransactItems"][0]),
                times=1)
    assert SyncLedger(stack.settings, faults).settle(slow, _event(slow)) == "replaced_abandoned"
    replacing = [payload for op, payload in faults.calls
                 if op == "TransactWriteItems" and "#leases" not in json.dumps(payload["TransactItems"][0])]
    tokens = {payload.get("ClientRequestToken") for payload in replacing}
    assert len(replacing) == 2 and len(tokens) == 1 and None not in tokens  # the lost one and its retry
    assert stack.ledger.settle(slow, _event(slow), request_token=False) == "already_settled"
    assert stack.ledger.settle(other, _event(other)) == "settled"
    assert stack.org_info(org_id).credits == Decimal("0.5") and stack.org_info(org_id).in_flight == 0
    assert sorted(e.status for e in stack.events(org_id)) == ["success", "success"]


def test_only_expired_leases_are_reclaimed(stack_factory):
    stack = stack_factory(lease_ttl_seconds=30)
    org_id, _ = stack.org(concurrency=1)
    _admit(stack, org_id)
    with pytest.raises(RateLimitExceeded):
        _admit(stack, org_id)
    assert stack.events(org_id) == []


# -- idempotent admission -------------------------------------------------------------------


def test_an_admission_whose_answer_was_lost_finds_its_own_lease_even_at_the_last_slot(stack):
    org_id, _ = stack.org(concurrency=1)
    faults = StorageFaults()
    faults.lose("UpdateItem", times=1)  # applied by DynamoDB, the answer reset on the way back
    lease = _admit(stack, org_id, SyncLedger(stack.settings, faults))
    assert faults.count("UpdateItem") == 2  # the retry met its own lease and was admitted
    assert list(stack.org_info(org_id).leases) == [lease.gen_id]
    assert stack.ledger.settle(lease, _event(lease)) == "settled"
    assert stack.org_info(org_id).in_flight == 0 and len(stack.events(org_id)) == 1


def test_a_settle_whose_answer_was_lost_is_not_applied_twice(stack):
    org_id, _ = stack.org(credits="1")
    lease = _admit(stack, org_id)
    faults = StorageFaults()
    faults.lose("TransactWriteItems", times=2)
    assert SyncLedger(stack.settings, faults).settle(lease, _event(lease)) in ("settled", "already_settled")
    assert stack.org_info(org_id).credits == Decimal("0.75")
    assert [e.status for e in stack.events(org_id)] == ["success"]
    tokens = {payload.get("ClientRequestToken") for op, payload in faults.calls if op == "TransactWriteItems"}
    assert len(tokens) == 1 and len(tokens.pop()) <= 36  # one token, the same on every retry


# -- conflicts and throttling are retried, validation is not --------------------------------


@pytest.mark.parametrize("operation, code, reasons", [
    ("UpdateItem", "TransactionConflictException", None),  # the org item is inside another settle
    ("UpdateItem", "ThrottlingException", None),
    ("TransactWriteItems", "TransactionCanceledException", ["TransactionConflict", "None"]),
    ("TransactWriteItems", "InternalServerError", None),
])
def test_transient_refusals_are_retried_until_the_write_lands(stack, operation, code, reasons):
    org_id, _ = stack.org(credits="1")
    faults = StorageFaults()
    refused = faults.fail(operation, code=code, times=6, reasons=reasons)
    ledger = SyncLedger(stack.settings, faults)
    lease = _admit(stack, org_id, ledger)
    assert ledger.settle(lease, _event(lease)) == "settled"
    assert len(refused) == 7  # six refused, the seventh landed
    assert stack.org_info(org_id).credits == Decimal("0.75")
    assert stack.org_info(org_id).in_flight == 0


def test_a_validation_error_is_not_retried(stack):
    org_id, _ = stack.org()
    faults = StorageFaults()
    refused = faults.fail("UpdateItem", code="ValidationException")
    with pytest.raises(StorageError):
        _admit(stack, org_id, SyncLedger(stack.settings, faults))
    assert len(refused) == 1


@pytest.mark.parametrize("code", ["TransactionConflictException", "ThrottlingException"])
def test_the_retry_budget_ends_in_a_storage_error(stack_factory, code):
    """Each of the policy's attempts is one call: the AWS client does not try each again
    itself (a throttled table would get three times the writes that refused it)."""
    stack = stack_factory(storage_retry_attempts=3)
    org_id, _ = stack.org()
    faults = StorageFaults()
    refused = faults.fail("UpdateItem", code=code)
    with pytest.raises(StorageError):
        _admit(stack, org_id, SyncLedger(stack.settings, faults))
    assert len(refused) == 3
    assert stack.org_info(org_id).in_flight == 0


@pytest.mark.parametrize("lost", ["reset", "proxy 504"])
def test_an_admission_whose_answers_were_all_lost_is_taken_back_not_left_to_expire(stack_factory, lost):
    """§1: a request refused with 503 (`storage_unavailable`) writes no usage event. When every
    answer to its admission was lost, the write may have been applied all the same: its lease
    is taken back as soon as storage answers again, not left to be reclaimed as the `abandoned`
    event of a request its client was told was refused, holding a slot until then."""
    stack = stack_factory(storage_retry_attempts=3)
    org_id, _ = stack.org(concurrency=1)
    faults = StorageFaults()
    # applied, and its answer lost on every attempt: cut, or replaced by a proxy's 504 (no AWS error code)
    answer = (504, b"<html><body>504 Gateway Time-out</body></html>") if lost == "proxy 504" else None
    faults.lose("UpdateItem", times=3, answer=answer)
    with pytest.raises(StorageError):
        _admit(stack, org_id, SyncLedger(stack.settings, faults))
    info = stack.org_info(org_id)
    assert info.in_flight == 0, info.leases
    assert not any(name.startswith("key_leases:") for name in stack.key_figures(org_id))
    assert stack.events(org_id) == []
    assert _admit(stack, org_id) is not None  # the org's one slot is free at once


@pytest.mark.parametrize("refusal", ["throttled", "unreachable"])
def test_an_admission_that_cannot_have_been_applied_is_not_taken_back(stack_factory, refusal):
    """Refused (throttling) or never sent (no connection): nothing to take back, and storage
    that is already failing is not sent a write more per refused request."""
    stack = stack_factory(storage_retry_attempts=2)
    org_id, _ = stack.org(concurrency=2)
    running = _admit(stack, org_id)
    faults = StorageFaults()
    if refusal == "throttled":
        faults.fail("UpdateItem", code="ThrottlingException", times=2)
    else:
        faults.unreachable("UpdateItem", times=2)
    with pytest.raises(StorageError):
        _admit(stack, org_id, SyncLedger(stack.settings, faults))
    assert faults.count("UpdateItem") == 2  # the two tries, no take-back
    assert stack.org_info(org_id).in_flight == 1  # the other request's lease is left as it was
    assert stack.ledger.settle(running, _event(running)) == "settled"


# -- leases that follow their request ---------------------------------------------------------


def test_a_renewed_lease_outlives_its_first_expiry(stack_factory):
    stack = stack_factory(lease_ttl_seconds=2.0, lease_renew_seconds=0.5)
    org_id, _ = stack.org(concurrency=1)
    running = _admit(stack, org_id)
    time.sleep(1.2)
    assert stack.ledger.renew(running, (3, 5, Decimal("0.01"))) is not None
    time.sleep(1.2)  # past the first expiry, well before the renewed one
    with pytest.raises(RateLimitExceeded):
        _admit(stack, org_id)
    assert stack.events(org_id) == [] and stack.org_info(org_id).in_flight == 1
    assert stack.ledger.settle(running, _event(running)) == "settled"


def test_a_dead_request_is_billed_for_what_its_last_renewal_recorded(stack_factory):
    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, _ = stack.org(credits="1", concurrency=1)
    dead = _admit(stack, org_id)
    stack.ledger.renew(dead, (11, 40, Decimal("0.0000123")))
    time.sleep(0.4)  # its gateway is gone: no more renewals
    assert stack.org_info(org_id).in_flight == 0  # a dead lease is not counted as in flight
    other = _admit(stack, org_id)  # at the limit: reclaims the dead lease first
    abandoned = get_event(stack.tables, dead.gen_id)
    assert (abandoned.status, abandoned.prompt_tokens, abandoned.completion_tokens, abandoned.cost) == (
        "abandoned", 11, 40, Decimal("0.0000123"))
    assert stack.org_info(org_id).credits == Decimal("1") - Decimal("0.0000123")  # debited in the same write
    assert stack.ledger.settle(other, _event(other)) == "settled"


def test_expired_leases_are_reclaimed_when_the_org_is_below_its_limit(stack_factory):
    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, _ = stack.org(credits="1", concurrency=8)
    dead = [_admit(stack, org_id) for _ in range(3)]
    stack.ledger.renew(dead[0], (1, 2, Decimal("0.5")))
    time.sleep(0.4)
    assert stack.org_info(org_id).in_flight == 0
    assert stack.org_info(org_id).expired_leases == 3
    live = _admit(stack, org_id)  # 3 of 8: admitted at once, the dead ones reclaimed off its path
    info = stack.org_info(org_id)
    assert list(info.leases) == [live.gen_id] and info.in_flight == 1
    events = {e.gen_id: e for e in stack.events(org_id)}
    assert {events[lease.gen_id].status for lease in dead} == {"abandoned"}
    assert info.credits == Decimal("0.5")
    assert stack.ledger.settle(live, _event(live)) == "settled"


def test_a_lease_its_admission_brought_back_after_its_settle_is_freed_with_the_dead_beside_it(stack_factory):
    """§2 step 5: an admission's write that DynamoDB applies again after its request settled (a
    copy held in the network, its answer lost) brings the settled request's lease back. The
    reclaim wrote its event again, was refused for it, and freed nothing: a crashed request's
    lease beside it was held too, and at the org's limit every admission was 429, for good.
    It is freed billed nothing more; the crashed one is billed as abandoned."""
    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, _ = stack.org(credits="1", concurrency=2)
    faults = StorageFaults()  # records every call
    settled = _admit(stack, org_id, SyncLedger(stack.settings, faults))
    (write,) = [payload for operation, payload in faults.calls if operation == "UpdateItem"]
    assert stack.ledger.settle(settled, _event(settled)) == "settled"
    stack.dynamodb.update_item(**write)  # the same admission, landing late
    crashed = _admit(stack, org_id)
    stack.ledger.renew(crashed, (1, 2, Decimal("0.5")))
    time.sleep(0.4)
    assert stack.org_info(org_id).expired_leases == 2
    live = _admit(stack, org_id)  # both slots held by dead leases: reclaimed, then admitted
    info = stack.org_info(org_id)
    assert list(info.leases) == [live.gen_id]
    events = {event.gen_id: event for event in stack.events(org_id)}
    assert (events[settled.gen_id].status, events[settled.gen_id].cost) == ("success", Decimal("0.25"))
    assert (events[crashed.gen_id].status, events[crashed.gen_id].cost) == ("abandoned", Decimal("0.5"))
    assert info.credits == Decimal("0.25")
    assert stack.ledger.settle(live, _event(live)) == "settled"


def test_a_reclaim_that_lost_its_race_is_not_tried_again(stack_factory):
    """Two environments reclaim the same dead lease at once: DynamoDB cancels the second's
    transaction for the org item's condition (the lease is gone) and for the event's (the first
    wrote it). That is a race lost, not a lease whose request settled (above), where the org
    item's condition holds: the second reads the org item again, finds nothing of its own left
    dead, and sends nothing more. It sent a second transaction, which under contention the
    storage's retry budget must cover too."""
    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, _ = stack.org(credits="1", concurrency=2)
    crashed = [_admit(stack, org_id), _admit(stack, org_id)]
    time.sleep(0.4)
    faults = StorageFaults()  # records every call

    async def two_environments(ledger) -> None:
        item = (await ledger._call("GetItem", {"TableName": stack.settings.orgs_table,
                                               "Key": {"org_id": {"S": org_id}}, "ConsistentRead": True}))["Item"]
        dead = ledger._expired_leases(org_id, item, time.time())
        await ledger._reclaim(org_id, dead, item)  # one takes both
        faults.calls.clear()
        # the other had read the item when one of them was dead (the same read would be the same
        # transaction, which DynamoDB answers as done by its ClientRequestToken)
        await ledger._reclaim(org_id, [lease for lease in dead if lease.gen_id == crashed[0].gen_id], item)

    with_ledger(stack.settings, two_environments, http=FaultInjectingHttp(faults))
    assert [operation for operation, _ in faults.calls] == ["TransactWriteItems", "GetItem"]
    assert sorted((event.gen_id, event.status) for event in stack.events(org_id)) == sorted(
        (lease.gen_id, "abandoned") for lease in crashed)
    assert stack.org_info(org_id).leases == {}


def _refuse_reclaims(faults: StorageFaults, refusal: str, times: int | None) -> None:
    """Storage refusing `times` reclaims (None: every one) for now: a hot org item's conflicts,
    or throttling."""
    def reclaim(payload: dict) -> bool:  # a reclaim's transaction, not a settle's
        return payload.get("ClientRequestToken", "").startswith("r-")

    if refusal == "conflicts":  # its org update and its tally's met another transaction
        faults.fail("TransactWriteItems", code="TransactionCanceledException", times=times, when=reclaim,
                    reasons=["TransactionConflict", "None", "TransactionConflict"])
    elif refusal == "throttled items":  # a cancellation naming the throttling
        faults.fail("TransactWriteItems", code="TransactionCanceledException", times=times, when=reclaim,
                    reasons=["ThrottlingError", "None", "None"])
    else:
        faults.fail("TransactWriteItems", code="ThrottlingException", times=times, when=reclaim)


async def _admissions(ledger, org_id: str, count: int) -> list:
    """`count` admissions one after another: each one's lease, or the refusal (429, 503) it met."""
    answers: list = []
    for _ in range(count):
        try:
            answers.append(await ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                                              streamed=False))
        except (RateLimitExceeded, StorageError) as refused:
            answers.append(refused)
    return answers


def _until_no_lease(stack, org_id: str, seconds: float = 10.0):
    """Wait, on the ledger's own loop, until the org holds no lease (an assertion past `seconds`)."""

    async def wait(_ledger) -> None:
        deadline = time.monotonic() + seconds
        while (info := await asyncio.to_thread(stack.org_info, org_id)).leases:
            assert time.monotonic() < deadline, f"the dead lease is still held: {info.leases}"
            await asyncio.sleep(0.05)

    return wait


def _a_dead_lease_whose_reclaims_are_refused(stack_factory, monkeypatch, refusal: str, concurrency: int):
    """An org of this limit with one dead lease (renewed: 0.5 to bill), its next 3 reclaims (a
    retry budget) refused for now, the rounds' pauses short: (stack, org id, lease, faults)."""
    monkeypatch.setattr(ledger_module, "SETTLE_LATER_PAUSE", 0.05)
    stack = stack_factory(lease_ttl_seconds=1.0, lease_renew_seconds=0.3, storage_retry_attempts=3)
    org_id, _ = stack.org(credits="1", concurrency=concurrency)
    crashed = _admit(stack, org_id)
    stack.ledger.renew(crashed, (1, 2, Decimal("0.5")))
    time.sleep(1.1)
    faults = StorageFaults()
    _refuse_reclaims(faults, refusal, times=3)
    return stack, org_id, crashed, faults


@pytest.mark.parametrize("refusal", ["conflicts", "throttling", "throttled items"])
def test_a_reclaim_refused_for_now_at_the_limit_goes_on_by_itself(stack_factory, monkeypatch, refusal):
    """An admission at its org's limit reclaims the dead leases first. Where storage refused that
    reclaim past its retry budget, it was dropped: conflicts were taken for a race lost. The
    dead lease stayed, its `abandoned` event unwritten and its tokens unbilled until some later
    admission came, and an org that sent nothing more kept it for good. The reclaim now goes
    on in rounds in the background: the slot comes free and the dead request is billed with no
    request more. The admission is answered as §2 step 5 has it: the org item's conflicts
    (its own requests' writes) are no 503, it is tried again as the item stands (429, the
    slots held); throttling past the budget is 503 `storage_unavailable`."""
    stack, org_id, crashed, faults = _a_dead_lease_whose_reclaims_are_refused(stack_factory, monkeypatch, refusal, 1)

    async def refused_then_freed(ledger) -> None:
        with pytest.raises(RateLimitExceeded if refusal == "conflicts" else StorageError):
            await ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                               streamed=False)
        await _until_no_lease(stack, org_id)(ledger)

    with_ledger(stack.settings, refused_then_freed, http=FaultInjectingHttp(faults))
    assert faults.count("TransactWriteItems") == 4  # the budget's 3 tries refused, and one more that landed
    assert [(e.gen_id, e.status, e.cost) for e in stack.events(org_id)] == [(crashed.gen_id, "abandoned", Decimal("0.5"))]
    assert stack.org_info(org_id).credits == Decimal("0.5")
    live = _admit(stack, org_id)  # the slot is free: nothing to reclaim in its way
    assert stack.ledger.settle(live, _event(live)) == "settled"


@pytest.mark.parametrize("refusal", ["conflicts", "throttling"])
def test_a_background_reclaim_refused_for_now_goes_on_in_rounds(stack_factory, monkeypatch, refusal):
    """Below the limit, the dead leases an admission saw are reclaimed off its path. A reclaim
    refused past its budget was dropped there too, the org's dead requests unbilled until an
    admission at its limit, which an org that stopped sending never makes."""
    stack, org_id, crashed, faults = _a_dead_lease_whose_reclaims_are_refused(stack_factory, monkeypatch, refusal, 8)
    live: list = []

    async def admitted_then_freed(ledger) -> None:
        live.append(await ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                                       streamed=False))
        await ledger.settle(live[0], _event(live[0], cost="0.125"))
        await _until_no_lease(stack, org_id)(ledger)

    with_ledger(stack.settings, admitted_then_freed, http=FaultInjectingHttp(faults))
    assert faults.count("TransactWriteItems") == 5  # the settle, the 3 refused, and one more that landed
    events = {e.gen_id: (e.status, e.cost) for e in stack.events(org_id)}
    assert events == {crashed.gen_id: ("abandoned", Decimal("0.5")), live[0].gen_id: ("success", Decimal("0.125"))}
    assert stack.org_info(org_id).credits == Decimal("0.375")


def test_admissions_of_one_process_at_the_limit_wait_for_its_reclaim_rather_than_send_their_own(stack_factory):
    """After a crash, the org's next requests all meet its limit at once, each seeing the dead
    leases. In a process serving them together (the local server, a runtime with concurrency),
    each sent its own reclaim of them: transactions over the same org item, events and tallies
    that conflicted with one another, and where their reads differed, cancelled each other. The
    first reclaims them; the others wait for it, then are admitted."""
    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, _ = stack.org(credits="1", concurrency=4)
    dead = [_admit(stack, org_id) for _ in range(4)]
    time.sleep(0.4)
    faults = StorageFaults()  # records every call
    admitted: list = []

    async def together(ledger) -> None:
        leases = await asyncio.gather(*[
            ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions", streamed=False)
            for _ in range(4)])
        admitted.extend(leases)
        for lease in leases:
            await ledger.settle(lease, _event(lease, cost="0.125"))

    with_ledger(stack.settings, together, http=FaultInjectingHttp(faults))
    assert faults.count("TransactWriteItems", lambda payload: payload["ClientRequestToken"].startswith("r-")) == 1
    events = {e.gen_id: e.status for e in stack.events(org_id)}
    assert events == {**{lease.gen_id: "abandoned" for lease in dead}, **{lease.gen_id: "success" for lease in admitted}}
    assert stack.org_info(org_id).leases == {}


def test_admissions_at_the_limit_leave_a_reclaim_going_on_in_rounds_to_it(stack_factory, monkeypatch):
    """While a reclaim goes on in rounds, every admission at the limit sent the same reclaim
    again, a whole retry budget each before its client heard anything, and refused, started
    one more round of the same leases: a client retrying its 429s filled the process's bound
    of rounds, and another org's reclaim was dropped for want of room. Each now makes one try
    of it, a single call, and leaves the rest to the rounds."""
    monkeypatch.setattr(ledger_module, "SETTLE_LATER_PAUSE", 30.0)  # the rounds wait: they are counted
    stack = stack_factory(lease_ttl_seconds=1.0, lease_renew_seconds=0.3, storage_retry_attempts=2)
    org_id, _ = stack.org(credits="1", concurrency=1)
    dead = _admit(stack, org_id)
    time.sleep(1.1)
    faults = StorageFaults()
    _refuse_reclaims(faults, "conflicts", times=None)
    seen: dict = {}

    def admission(ledger):
        return ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions", streamed=False)

    async def retried(ledger) -> None:
        for _ in range(4):  # a client trying its 429 again
            with pytest.raises(RateLimitExceeded):
                await admission(ledger)
        seen["rounds"] = sorted(ledger._in_rounds)
        seen["tasks"] = len(ledger._reclaiming_later)

    with_ledger(stack.settings, retried, http=FaultInjectingHttp(faults))
    assert seen["tasks"] == 1 and seen["rounds"] == [dead.gen_id]
    assert faults.count("TransactWriteItems") == 2 + 3  # the first admission's budget; one call of each other


def test_dead_leases_past_those_a_reclaim_going_on_holds_are_reclaimed_at_the_limit(stack_factory, monkeypatch):
    """A reclaim takes the oldest 49 dead leases at most. Once rounds held those, an admission
    at the limit took the same 49 and left them to the rounds, and the org's other dead leases,
    its slots too, were tried by no one until a round landed."""
    monkeypatch.setattr(ledger_module, "SETTLE_LATER_PAUSE", 30.0)  # the rounds wait
    stack = stack_factory(lease_ttl_seconds=4.0, lease_renew_seconds=1.0, storage_retry_attempts=2)
    org_id, _ = stack.org(credits="10", concurrency=60)
    with_ledger(stack.settings, lambda ledger: asyncio.gather(*[
        ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions", streamed=False)
        for _ in range(60)]))
    assert len(stack.org_info(org_id).leases) == 60
    time.sleep(4.1)
    faults = StorageFaults()
    _refuse_reclaims(faults, "conflicts", times=2)  # the first reclaim's budget: it goes on in rounds
    answers = with_ledger(stack.settings, lambda ledger: _admissions(ledger, org_id, 2), http=FaultInjectingHttp(faults))
    assert isinstance(answers[0], RateLimitExceeded)  # the 49 oldest left to the rounds
    assert not isinstance(answers[1], RateLimitExceeded)  # the 11 others reclaimed, a slot for it
    assert len(stack.org_info(org_id).leases) == 49 + 1


def test_an_admission_at_the_limit_tries_once_itself_the_reclaim_rounds_are_waiting_to_make(stack_factory, monkeypatch):
    """Rounds pause between tries, up to 16 s. An admission at the limit left the dead leases to
    them, and was told 429 at once: storage answering again, the org's clients were refused for
    up to a pause more, with no request of theirs in flight. It now tries the reclaim once
    itself (one call, not a budget: storage that still refuses is not sent a budget more per
    request), and is admitted where it lands."""
    monkeypatch.setattr(ledger_module, "SETTLE_LATER_PAUSE", 30.0)  # the rounds wait
    stack = stack_factory(lease_ttl_seconds=4.0, lease_renew_seconds=1.0, storage_retry_attempts=2)
    org_id, _ = stack.org(credits="1", concurrency=1)
    dead = _admit(stack, org_id)
    time.sleep(4.1)
    faults = StorageFaults()
    _refuse_reclaims(faults, "throttling", times=3)  # the first admission's budget, then one more call
    answers = with_ledger(stack.settings, lambda ledger: _admissions(ledger, org_id, 3), http=FaultInjectingHttp(faults))
    # throttled past its budget; then its one try throttled
    assert isinstance(answers[0], StorageError) and isinstance(answers[1], RateLimitExceeded)
    assert answers[2].gen_id in stack.org_info(org_id).leases  # storage answers: reclaimed, admitted
    assert [(e.gen_id, e.status) for e in stack.events(org_id)] == [(dead.gen_id, "abandoned")]


def test_a_lease_admitted_after_a_reclaim_lives_its_whole_time(stack_factory):
    """An admission at the limit waits for the reclaim of the dead leases, then writes its lease:
    the expiry it wrote was counted from before the wait, and a slow reclaim left the request a
    lease that had nearly run out, its keeper giving it up before its first renewal."""
    stack = stack_factory(lease_ttl_seconds=2.0, lease_renew_seconds=0.5)
    org_id, _ = stack.org(credits="1", concurrency=1)
    _admit(stack, org_id)
    time.sleep(2.1)
    faults = StorageFaults()
    faults.slow("TransactWriteItems", 1.5, when=lambda payload: payload.get("ClientRequestToken", "").startswith("r-"))
    lease = SyncLedger(stack.settings, faults).admit(org_id=org_id, key_id="key_1", model="qwen3-32b",
                                                     endpoint="completions", streamed=False)
    admitted_at = time.time()
    assert lease.expires >= admitted_at + 2.0 - 0.3
    assert float(stack.org_info(org_id).leases[lease.gen_id]["exp"]) == round(lease.expires, 3)


def _reclaims(payload: dict) -> bool:
    return payload.get("ClientRequestToken", "").startswith("r-")


def _admissions_of(org_id: str):
    return lambda payload: (payload.get("Key", {}).get("org_id", {}).get("S") == org_id
                            and payload.get("UpdateExpression", "").startswith("SET #leases.#gen"))


def test_admissions_at_the_limit_together_each_get_a_slot_the_rounds_free(stack_factory, monkeypatch):
    """Two dead leases held by rounds, storage answering again, two admissions at once: the first
    made its one try; the second, finding those leases in that try, neither waited for it nor
    made its own, and was told 429 while both slots came free a moment later."""
    monkeypatch.setattr(ledger_module, "SETTLE_LATER_PAUSE", 30.0)  # the rounds wait
    stack = stack_factory(lease_ttl_seconds=1.0, lease_renew_seconds=0.3, storage_retry_attempts=2)
    org_id, _ = stack.org(credits="1", concurrency=2)
    _admit(stack, org_id)
    _admit(stack, org_id)
    time.sleep(1.1)
    faults = StorageFaults()
    faults.fail("TransactWriteItems", code="ThrottlingException", times=2, when=_reclaims)
    answers: list = []

    async def one(ledger):
        try:
            return await ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                                      streamed=False)
        except (RateLimitExceeded, StorageError) as refused:
            return refused

    async def together(ledger) -> None:
        answers.append(await one(ledger))  # throttled past its budget (503): the rounds hold both
        answers.extend(await asyncio.gather(one(ledger), one(ledger)))

    with_ledger(stack.settings, together, http=FaultInjectingHttp(faults))
    assert isinstance(answers[0], StorageError)
    assert sorted(stack.org_info(org_id).leases) == sorted(answer.gen_id for answer in answers[1:])


def test_the_one_try_at_the_limit_is_one_call_whatever_it_meets(stack_factory, monkeypatch):
    """Its transaction cancelled for the org item changed since, the one try read the item again
    and reclaimed on within whole budgets: storage still refusing got a budget more per request."""
    monkeypatch.setattr(ledger_module, "SETTLE_LATER_PAUSE", 30.0)  # the rounds wait
    stack, org_id, _, faults = _a_dead_lease_whose_reclaims_are_refused(stack_factory, monkeypatch, "throttling", 1)
    faults.fail("TransactWriteItems", code="TransactionCanceledException", times=1, when=_reclaims,
                reasons=["ConditionalCheckFailed", "None", "None"])
    answers = with_ledger(stack.settings, lambda ledger: _admissions(ledger, org_id, 2), http=FaultInjectingHttp(faults))
    assert isinstance(answers[0], StorageError) and isinstance(answers[1], RateLimitExceeded)
    # the budget throttled, then the one try: no read, no budget
    assert (faults.count("TransactWriteItems"), faults.count("GetItem")) == (3 + 1, 0)


def test_a_late_copy_of_an_admission_does_not_set_its_lease_back(stack_factory):
    """An admission's write held in the network lands after its retry was applied and its request
    renewed the lease: it wrote the lease again as admitted, its expiry set back (another
    environment could reclaim a running request's lease) and what the renewal recorded gone."""
    stack = stack_factory(lease_ttl_seconds=5.0, lease_renew_seconds=1.0)
    org_id, _ = stack.org(credits="1", concurrency=2)
    faults = StorageFaults()
    faults.late("UpdateItem", 1.0, times=1, when=_admissions_of(org_id))
    seen: dict = {}

    async def renewed_then_landed(ledger) -> None:
        lease = await ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                                   streamed=False)
        await asyncio.sleep(0.3)
        seen["renewed"] = await ledger.renew(lease, (3, 4, Decimal("0.01")))
        await asyncio.sleep(1.2)  # the first try lands meanwhile
        seen["stored"] = (await asyncio.to_thread(stack.org_info, org_id)).leases[lease.gen_id]
        await ledger.settle(lease, _event(lease))

    with_ledger(stack.settings, renewed_then_landed, http=FaultInjectingHttp(faults))
    assert float(seen["stored"]["exp"]) == round(seen["renewed"], 3)
    assert (seen["stored"].get("pt"), seen["stored"].get("ct")) == (3, 4)


def test_an_admission_answered_503_while_the_process_closes_still_takes_its_lease_back(stack_factory):
    """drain() stops background writes that a later admission makes again; it stopped the take-back
    of an admission answered 503 too, and that lease stayed, to be reclaimed as the `abandoned`
    event of a request its client was told was refused."""
    stack = stack_factory(lease_ttl_seconds=1.0, lease_renew_seconds=0.3, storage_retry_attempts=2)
    org_a, _ = stack.org(credits="1", concurrency=8)
    org_b, _ = stack.org(credits="1", concurrency=8)
    _admit(stack, org_a)
    time.sleep(1.1)  # org A: a dead lease, reclaimed off the path of A's next admission
    faults = StorageFaults()
    faults.slow("TransactWriteItems", 1.5, when=_reclaims)  # drain() waits for it
    faults.lose("UpdateItem", when=_admissions_of(org_b))  # every answer to B's admission lost

    async def closing(ledger) -> None:
        await ledger.admit(org_id=org_a, key_id="key_1", model="qwen3-32b", endpoint="completions", streamed=False)
        refused = asyncio.ensure_future(ledger.admit(org_id=org_b, key_id="key_1", model="qwen3-32b",
                                                     endpoint="completions", streamed=False))
        await asyncio.sleep(0)
        await ledger.drain()
        with pytest.raises(StorageError):
            await refused

    with_ledger(stack.settings, closing, http=FaultInjectingHttp(faults))
    assert stack.org_info(org_b).leases == {}


async def _admitted_while_closing(ledger, org_id: str):
    """An admission whose write is in flight when the ledger closes (drain), then its outcome:
    its lease, or the refusal it met."""
    admission = asyncio.ensure_future(_admissions(ledger, org_id, 1))
    await asyncio.sleep(0)  # its write in flight
    await ledger.drain()
    return (await admission)[0]


def test_no_round_starts_once_the_ledger_is_closing(stack_factory, monkeypatch):
    """An admission in flight when its process closes (drain) whose reclaim is then refused for
    now started rounds after drain() had stopped the others: they went on against a client
    about to be closed. The next admission reclaims those leases instead."""
    monkeypatch.setattr(ledger_module, "SETTLE_LATER_PAUSE", 0.05)
    stack = stack_factory(lease_ttl_seconds=1.0, lease_renew_seconds=0.3, storage_retry_attempts=2)
    org_id, _ = stack.org(credits="1", concurrency=1)
    _admit(stack, org_id)
    time.sleep(1.1)
    faults = StorageFaults()
    _refuse_reclaims(faults, "conflicts", times=None)
    seen: dict = {}

    async def closed_meanwhile(ledger) -> None:
        assert isinstance(await _admitted_while_closing(ledger, org_id), RateLimitExceeded)
        seen["rounds"] = len(ledger._reclaiming_later)

    with_ledger(stack.settings, closed_meanwhile, http=FaultInjectingHttp(faults))
    assert seen["rounds"] == 0


def test_no_background_reclaim_starts_once_the_ledger_is_closing(stack_factory):
    """Below the limit alike: an admission in flight when drain() ran, seeing a dead lease, started
    its background reclaim after drain() had returned, against a client about to be closed."""
    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, _ = stack.org(credits="1", concurrency=8)
    _admit(stack, org_id)
    time.sleep(0.4)
    seen: dict = {}

    async def closed_meanwhile(ledger) -> None:
        assert not isinstance(await _admitted_while_closing(ledger, org_id), Exception)
        seen["after"] = (len(ledger._background), dict(ledger._reclaiming))

    with_ledger(stack.settings, closed_meanwhile)
    assert seen["after"] == (0, {})


def test_a_reclaim_that_meets_part_of_its_leases_reclaimed_elsewhere_still_frees_the_rest(stack_factory):
    """Two environments read the org item at different moments and reclaim what each saw dead:
    one took lease A, then the other's transaction for A and B was cancelled for A, and B was
    left: its slot held, its `abandoned` event unwritten, until some later admission, which an
    org that stopped sending never makes. A reclaim whose org item changed since its read
    reads it again and reclaims those of its leases still dead."""
    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, _ = stack.org(credits="1", concurrency=8)
    first, second = _admit(stack, org_id), _admit(stack, org_id)
    stack.ledger.renew(first, (1, 2, Decimal("0.25")))
    stack.ledger.renew(second, (1, 2, Decimal("0.125")))
    time.sleep(0.4)

    async def two_environments(ledger) -> None:
        item = (await ledger._call("GetItem", {"TableName": stack.settings.orgs_table,
                                               "Key": {"org_id": {"S": org_id}}, "ConsistentRead": True}))["Item"]
        dead = ledger._expired_leases(org_id, item, time.time())
        assert sorted(lease.gen_id for lease in dead) == sorted([first.gen_id, second.gen_id])
        await ledger._reclaim(org_id, [lease for lease in dead if lease.gen_id == first.gen_id], item)
        await ledger._reclaim(org_id, dead, item)  # read before the first reclaim landed

    with_ledger(stack.settings, two_environments)
    assert stack.org_info(org_id).leases == {}
    events = {e.gen_id: (e.status, e.cost) for e in stack.events(org_id)}
    assert events == {first.gen_id: ("abandoned", Decimal("0.25")), second.gen_id: ("abandoned", Decimal("0.125"))}
    assert stack.org_info(org_id).credits == Decimal("0.625")


def test_a_late_settle_after_a_billed_reclaim_is_charged_the_difference_only(stack_factory):
    stack = stack_factory(lease_ttl_seconds=0.3, lease_renew_seconds=0.1)
    org_id, _ = stack.org(credits="1", concurrency=1)
    slow = _admit(stack, org_id)
    stack.ledger.renew(slow, (3, 2, Decimal("0.1")))
    time.sleep(0.4)
    other = _admit(stack, org_id)  # reclaims it, billed 0.1
    assert stack.org_info(org_id).credits == Decimal("0.9")
    assert stack.ledger.settle(slow, _event(slow, cost="0.25")) == "replaced_abandoned"
    assert stack.ledger.settle(slow, _event(slow, cost="0.25")) == "already_settled"
    assert get_event(stack.tables, slow.gen_id).cost == Decimal("0.25")
    assert stack.org_info(org_id).credits == Decimal("0.75")  # 0.25 in all, never 0.35
    stack.ledger.settle(other, _event(other, cost="0"))


def test_renewing_a_lease_that_is_gone_says_so_and_brings_nothing_back(stack):
    org_id, _ = stack.org()
    lease = _admit(stack, org_id)
    assert stack.ledger.settle(lease, _event(lease)) == "settled"
    assert stack.ledger.renew(lease, (1, 1, Decimal("1"))) is None
    assert stack.org_info(org_id).leases == {}


# -- exact numbers ----------------------------------------------------------------------------


def test_a_cost_is_stored_exactly_to_38_digits(stack):
    """(No cost the gateway makes has more than 15 decimal places: this one is made here. Its
    key is the org's own, so that its tally, which the settle adds it to, starts from 0: added to
    another test's sum of key_1's costs, the exact result needs more than DynamoDB's 38 digits.)"""
    org_id, _ = stack.org(credits="1")
    lease = stack.ledger.admit(org_id=org_id, key_id=f"key_{org_id}", model="qwen3-32b", endpoint="completions",
                               streamed=False)
    cost = Decimal("0.123456789012345678901234567890123456789")  # 39 significant digits
    assert stack.ledger.settle(lease, _event(lease, cost=str(cost))) == "settled"
    stored = get_event(stack.tables, lease.gen_id).cost
    assert stored == Decimal("0.12345678901234567890123456789012345679")  # rounded to 38, not to a float
    exact = Context(prec=38)
    assert stack.org_info(org_id).credits == exact.subtract(Decimal(1), stored)  # the debit is the event's cost


def test_a_number_dynamodb_cannot_store_is_refused_before_any_write(stack):
    org_id, _ = stack.org(credits="1")
    lease = _admit(stack, org_id)
    faults = StorageFaults()
    with pytest.raises(UnstorableValue):
        SyncLedger(stack.settings, faults).settle(lease, _event(lease, cost="1E+200"))
    assert faults.calls == []


# -- a key changed after its request was admitted ----------------------------------------


def _org_attribute(stack, org_id: str, name: str):
    item = stack.dynamodb.get_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                   ConsistentRead=True)["Item"]
    return item.get(name)


def _figure(stack, org_id: str, name: str) -> Decimal | None:
    value = _org_attribute(stack, org_id, name)
    return Decimal(value["N"]) if value is not None else None


def _change_key(stack, org_id: str, marker: str, **figures: str) -> None:
    """What key management writes on the org item: the key's marker, and figures (name=value)."""
    names = {"#m": "key_period:key_1", **{f"#f{i}": name for i, name in enumerate(figures)}}
    values = {":m": {"S": marker}, **{f":f{i}": {"N": value} for i, value in enumerate(figures.values())}}
    sets = ["#m = :m", *(f"#f{i} = :f{i}" for i in range(len(figures)))]
    stack.dynamodb.update_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                               UpdateExpression="SET " + ", ".join(sets), ExpressionAttributeNames=names,
                               ExpressionAttributeValues=values)


def _admit_with(stack, org_id, limits):
    return stack.ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                              streamed=False, limits=limits)


def test_a_settle_that_finds_a_limit_set_since_its_admission_adds_to_its_figure_once(stack):
    org_id, _ = stack.org(credits="1")
    lease = _admit(stack, org_id)  # a gateway that knew no limit of key_1: its lease names no figure
    assert lease.spend_figure is None
    week = KeyLimits(None, Decimal(5), "week").figure("key_1", lease.started)
    _change_key(stack, org_id, "week", **{week: "2"})  # key management set a weekly limit meanwhile
    faults = StorageFaults()
    faults.lose("TransactWriteItems", times=1, when=lambda payload: "ClientRequestToken" in payload
                and payload["ClientRequestToken"] != faults.calls[0][1]["ClientRequestToken"])
    assert SyncLedger(stack.settings, faults).settle(lease, _event(lease)) == "settled"
    operations = [operation for operation, _ in faults.calls]
    # refused (the marker is not what the lease assumed), the marker read, then settled, its
    # answer lost and sent again
    assert operations == ["TransactWriteItems", "GetItem", "TransactWriteItems", "TransactWriteItems"]
    tokens = [payload["ClientRequestToken"] for operation, payload in faults.calls if operation == "TransactWriteItems"]
    assert tokens[0] != tokens[1] == tokens[2]
    assert _figure(stack, org_id, week) == Decimal("2.25")
    assert stack.org_info(org_id).credits == Decimal("0.75") and stack.org_info(org_id).in_flight == 0
    assert get_event(stack.tables, lease.gen_id).cost == Decimal("0.25")


def test_a_settle_whose_marker_keeps_changing_still_bills_and_counts_what_it_read_last(stack):
    org_id, _ = stack.org(credits="1")
    lease = _admit(stack, org_id)
    month = KeyLimits(None, Decimal(5), "month").figure("key_1", lease.started)
    _change_key(stack, org_id, "month", **{month: "0"})
    faults = StorageFaults()
    guarded = faults.fail("TransactWriteItems", code="TransactionCanceledException",
                          reasons=["ConditionalCheckFailed", "None"],
                          when=lambda payload: "#marker" in payload["TransactItems"][0]["Update"]["ConditionExpression"])
    assert SyncLedger(stack.settings, faults).settle(lease, _event(lease)) == "settled"
    assert len(guarded) == 3  # the first try and two after reading the marker, each refused
    assert [operation for operation, _ in faults.calls].count("GetItem") == 3  # then read once more, unguarded
    assert _figure(stack, org_id, month) == Decimal("0.25")
    assert stack.org_info(org_id).credits == Decimal("0.75")


def test_a_request_admitted_in_the_old_period_counts_in_the_new_one_and_leaves_no_old_figure(stack):
    org_id, _ = stack.org(credits="1")
    lease = _admit_with(stack, org_id, KeyLimits(None, Decimal(5), "day"))
    month = KeyLimits(None, Decimal(5), "month").figure("key_1", lease.started)
    _change_key(stack, org_id, "month", **{month: "1"})  # the day's figure was removed with the change
    assert stack.ledger.settle(lease, _event(lease)) == "settled"
    assert _figure(stack, org_id, month) == Decimal("1.25")
    assert _figure(stack, org_id, lease.spend_figure) is None


def test_a_request_in_flight_when_the_limit_is_removed_costs_later_settles_nothing(stack):
    """Key management takes the marker off with the limit: a request in flight across it
    makes its figure again (no admission reads it), and the key's settles stay one write."""
    org_id, _ = stack.org(credits="1")
    in_flight = _admit_with(stack, org_id, KeyLimits(None, Decimal(5), "total"))
    assert stack.ledger.settle(in_flight, _event(in_flight)) == "settled"
    assert _figure(stack, org_id, in_flight.spend_figure) == Decimal("0.25")
    faults = StorageFaults()
    later = _admit(stack, org_id)  # a gateway that knows: no limit
    assert SyncLedger(stack.settings, faults).settle(later, _event(later)) == "settled"
    assert [operation for operation, _ in faults.calls] == ["TransactWriteItems"]
    assert stack.org_info(org_id).credits == Decimal("0.5")


def test_a_figure_left_beside_the_keys_own_does_not_keep_its_period_from_starting(stack):
    """Any figure of the key there besides its own (left by a failed tidy, say): the first
    settle of a new day still makes the day's figure, which admission then holds to the limit."""
    org_id, _ = stack.org(credits="10")
    daily = KeyLimits(None, Decimal("0.3"), "day")
    lease = _admit_with(stack, org_id, daily)
    total = KeyLimits(None, Decimal(5), "total").figure("key_1", lease.started)
    _change_key(stack, org_id, "day", **{total: "7"})
    faults = StorageFaults()
    assert SyncLedger(stack.settings, faults).settle(lease, _event(lease)) == "settled"
    assert [operation for operation, _ in faults.calls] == ["TransactWriteItems"]
    assert _figure(stack, org_id, lease.spend_figure) == Decimal("0.25")
    assert _figure(stack, org_id, total) == Decimal("7")
    second = _admit_with(stack, org_id, daily)
    assert stack.ledger.settle(second, _event(second)) == "settled"
    with pytest.raises(KeySpendLimitExceeded):
        _admit_with(stack, org_id, daily)


def test_a_lease_read_back_counts_in_the_period_it_was_admitted_in_to_its_last_instant():
    """A lease's start is stored to the millisecond, cut as its usage event's `created_at` is,
    never rounded up: one admitted in the last half millisecond of a day and reclaimed counts
    in that day, as its event does, not in the next."""
    from datetime import datetime, timezone

    from kiln.store.clock import iso_ms
    from kiln.store.keyspend import period_name
    from kiln.store.ledger import Lease

    midnight = datetime(2026, 12, 3, tzinfo=timezone.utc).timestamp()
    started = midnight - 0.0004
    lease = Lease("gen-1", "org-1", "key_1", "m", "completions", False, started, started + 60)
    read_back = Lease.from_attribute("gen-1", "org-1", lease.to_attribute())
    assert period_name("day", read_back.started) == period_name("day", started) == "2026-12-02"
    assert iso_ms(read_back.started) == iso_ms(started) == "2026-12-02T23:59:59.999Z"


@pytest.mark.parametrize("period, turn", [("day", (2026, 12, 8)), ("week", (2026, 12, 14)), ("month", (2027, 1, 1))])
def test_a_gateway_whose_clock_is_behind_the_turn_of_a_period_leaves_the_new_periods_figure(stack, period, turn):
    """Two gateways 50 ms apart at midnight: the one ahead settled the key's first request of the
    new period and refused its next (over its limit). The one behind, still in the old period, took
    the new period's figure for a stale one and removed it at its next admission: the key was
    admitted again, past its limit, and its spend there shown as 0 (contract §10)."""
    from datetime import datetime, timezone

    from support import with_clocked_ledger

    org_id, _ = stack.org(credits="10")
    limits = KeyLimits(None, Decimal("0.00001"), period)
    midnight = datetime(*turn, tzinfo=timezone.utc).timestamp()

    async def admit(ledger):
        return await ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                                  streamed=False, limits=limits)

    async def ahead_spends(ledger):
        lease = await admit(ledger)
        await ledger.settle(lease, _event(lease, cost="0.00002"))
        with pytest.raises(KeySpendLimitExceeded):
            await admit(ledger)
        return lease.spend_figure

    async def behind_admits(ledger):
        lease = await admit(ledger)
        await ledger.settle(lease, _event(lease, cost="0"))

    figure = with_clocked_ledger(stack.settings, lambda: midnight + 1, ahead_spends)
    with_clocked_ledger(stack.settings, lambda: midnight - 0.05, behind_admits)  # drains its prune
    assert _figure(stack, org_id, figure) == Decimal("0.00002")

    async def ahead_again(ledger):
        with pytest.raises(KeySpendLimitExceeded):
            await admit(ledger)

    with_clocked_ledger(stack.settings, lambda: midnight + 2, ahead_again)


@pytest.mark.parametrize("refused", ["out of credits", "disabled", "key over its spend limit"])
def test_an_admission_refused_402_or_403_still_has_the_dead_leases_it_saw_reclaimed(stack_factory, refused):
    """A gateway died with a request of the org in flight; the org's next admission was refused
    for its credits, its status or its key's spend, not its limit. Only a 429 reclaimed the dead
    leases the refusal showed: the dead request kept no usage event (its generation id 404, the
    usage report short), its relayed tokens unbilled, for as long as the org stayed refused
    (contract §4: one event per admitted request; an abandoned one billed as of its last renewal)."""
    stack = stack_factory(lease_ttl_seconds=1.0, lease_renew_seconds=0.3)
    org_id, _ = stack.org(credits="1", concurrency=4)
    crashed = _admit(stack, org_id)
    stack.ledger.renew(crashed, (1, 2, Decimal("0.5")))
    limits = None
    if refused == "out of credits":
        stack.dynamodb.update_item(TableName=stack.settings.orgs_table, Key={"org_id": {"S": org_id}},
                                   UpdateExpression="SET credits = :none", ExpressionAttributeValues={":none": {"N": "0"}})
        expected, credits_after = InsufficientCredits, Decimal("-0.5")
    elif refused == "disabled":
        set_status(stack.tables, org_id, "disabled")
        expected, credits_after = OrganizationDisabled, Decimal("0.5")
    else:
        limits = KeyLimits(None, Decimal("0.25"), "total")
        _change_key(stack, org_id, "total", **{limits.figure("key_1", time.time()): "0.25"})
        expected, credits_after = KeySpendLimitExceeded, Decimal("0.5")
    time.sleep(1.1)

    async def refused_then_reclaimed(ledger) -> None:
        with pytest.raises(expected):
            await ledger.admit(org_id=org_id, key_id="key_1", model="qwen3-32b", endpoint="completions",
                               streamed=False, limits=limits)
        await _until_no_lease(stack, org_id)(ledger)

    with_ledger(stack.settings, refused_then_reclaimed)
    assert [(e.gen_id, e.status, e.cost) for e in stack.events(org_id)] == [(crashed.gen_id, "abandoned", Decimal("0.5"))]
    assert stack.org_info(org_id).credits == credits_after
