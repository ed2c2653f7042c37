"""Admission and settlement on DynamoDB: one write in, one transaction out, never twice."""

from __future__ import annotations

import time
from decimal import Decimal

import pytest

from kiln.errors import InsufficientCredits, OrganizationDisabled, RateLimitExceeded
from kiln.store import UsageEvent
from kiln.store.orgs import set_status
from kiln.store.usage import get_event
from support import StorageFaults, SyncLedger


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
    with pytest.raises(InsufficientCredits):
        _admit(stack, org_id)
    org_id, _ = stack.org()
    set_status(stack.tables, org_id, "disabled")
    with pytest.raises(OrganizationDisabled):
        _admit(stack, org_id)


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
    assert stack.ledger.settle(lease, _event(lease)) == "already_settled"
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


def test_only_expired_leases_are_reclaimed(stack_factory):
    stack = stack_factory(lease_ttl_seconds=30)
    org_id, _ = stack.org(concurrency=1)
    _admit(stack, org_id)
    with pytest.raises(RateLimitExceeded):
        _admit(stack, org_id)
    assert stack.events(org_id) == []
