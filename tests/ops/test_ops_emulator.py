"""The embedded AWS: atomic under concurrency, transactions that cost what they touch, exact numbers."""

from __future__ import annotations

import copy
import threading
from decimal import Decimal

import pytest

from kiln.store import UsageEvent
from kiln.store.codec import to_item
from kiln.store.errors import TransactionCancelled, translate_storage_error
from kiln_ops import emulator


@pytest.fixture(scope="module")
def stack(inprocess_aws, mock):
    """These tests look inside the emulator: it must run in this process."""
    from support import make_stack

    stack = make_stack(inprocess_aws.url, mock)
    yield stack
    stack.close()


@pytest.fixture
def counted_backups(monkeypatch):
    """Counts the items the emulator copies as transaction backups."""
    copies = []

    def deepcopy(value, memo=None):
        copies.append(value)
        return copy.deepcopy(value, memo)

    monkeypatch.setattr(emulator, "copy", type("CountingCopy", (), {"deepcopy": staticmethod(deepcopy)}))
    return copies


def _fill_usage_table(stack, count: int) -> None:
    client = stack.tables.client
    for start in range(0, count, 25):
        items = []
        for index in range(start, min(start + 25, count)):
            event = UsageEvent(
                gen_id=f"gen-fill-{index:06d}", org_id="filler", created_at="2026-01-01T00:00:00.000Z", key_id="k",
                model="m", endpoint="chat.completions", streamed=False, status="success", cost=Decimal("0.001"),
            )
            items.append({"PutRequest": {"Item": to_item(event)}})
        client.batch_write_item(RequestItems={stack.settings.usage_table: items})


def _admit_and_settle(stack, org_id: str) -> None:
    ledger = stack.ledger
    lease = ledger.admit(org_id=org_id, key_id="k", model="m", endpoint="chat.completions", streamed=False)
    event = UsageEvent(
        gen_id=lease.gen_id, org_id=org_id, created_at="2026-01-01T00:00:00.000Z", key_id="k", model="m",
        endpoint="chat.completions", streamed=False, status="success", cost=Decimal("0.000000665"),
    )
    assert ledger.settle(lease, event) == "settled"


def test_a_settle_backs_up_only_the_items_it_writes_however_full_the_tables(stack, counted_backups):
    org_id, _ = stack.org()
    _admit_and_settle(stack, org_id)
    empty_table_copies = len(counted_backups)
    assert empty_table_copies == 1  # the org item; the usage event is new, nothing to back up

    _fill_usage_table(stack, 3000)
    counted_backups.clear()
    for _ in range(10):
        _admit_and_settle(stack, org_id)
    assert len(counted_backups) == 10 * empty_table_copies
    assert all(not isinstance(value, dict) or len(value) < 50 for value in counted_backups)


def test_conditional_writes_are_atomic_under_concurrency(stack):
    org_id, _ = stack.org(concurrency=8)
    admitted, refused = [], []

    def admit():
        try:
            admitted.append(
                stack.ledger.admit(org_id=org_id, key_id="k", model="m", endpoint="e", streamed=False)
            )
        except Exception as exc:  # noqa: BLE001
            refused.append(type(exc).__name__)

    threads = [threading.Thread(target=admit) for _ in range(32)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 8
    assert set(refused) == {"RateLimitExceeded"}
    assert stack.org_info(org_id).in_flight == 8


def test_arithmetic_is_exact_whatever_the_spelling(stack):
    org_id, _ = stack.org(credits="0.0000002")
    client, table = stack.tables.client, stack.settings.orgs_table

    def subtract(amount: str) -> None:
        client.update_item(
            TableName=table, Key={"org_id": {"S": org_id}}, UpdateExpression="SET credits = credits - :c",
            ExpressionAttributeValues={":c": {"N": amount}},
        )

    subtract("0.0000001")  # leaves 1E-7, which plain moto then fails to read back as a number
    subtract("0.00000001")
    assert stack.org_info(org_id).credits == Decimal("0.00000009")
    raw = client.get_item(TableName=table, Key={"org_id": {"S": org_id}})["Item"]["credits"]["N"]
    assert raw == "0.00000009"  # no exponent, as DynamoDB writes it
    for _ in range(200):
        subtract("0.000000665")
    assert stack.org_info(org_id).credits == Decimal("0.00000009") - 200 * Decimal("0.000000665")


def test_a_cancelled_transaction_writes_nothing(stack):
    org_id, _ = stack.org(credits="1")
    client = stack.tables.client
    put = {"Put": {"TableName": stack.settings.usage_table, "Item": {"gen_id": {"S": "gen-x"}, "org_id": {"S": org_id}}}}
    failing_check = {
        "ConditionCheck": {
            "TableName": stack.settings.orgs_table,
            "Key": {"org_id": {"S": org_id}},
            "ConditionExpression": "credits > :much",
            "ExpressionAttributeValues": {":much": {"N": "100"}},
        }
    }
    with pytest.raises(Exception) as caught:
        client.transact_write_items(TransactItems=[put, failing_check])
    conflict = translate_storage_error(caught.value)
    assert isinstance(conflict, TransactionCancelled)
    assert conflict.reasons == [None, "ConditionalCheckFailed"]
    assert "Item" not in client.get_item(TableName=stack.settings.usage_table, Key={"gen_id": {"S": "gen-x"}})


def test_a_write_that_fails_half_way_is_rolled_back(stack):
    org_id, _ = stack.org(credits="1")
    client = stack.tables.client
    put = {"Put": {"TableName": stack.settings.usage_table, "Item": {"gen_id": {"S": "gen-y"}, "org_id": {"S": org_id}}}}
    bad_update = {
        "Update": {
            "TableName": stack.settings.orgs_table,
            "Key": {"org_id": {"S": org_id}},
            "UpdateExpression": "SET #s = #s + :one",  # status is a string: fails when applied
            "ExpressionAttributeNames": {"#s": "status"},
            "ExpressionAttributeValues": {":one": {"N": "1"}},
        }
    }
    with pytest.raises(client.exceptions.ClientError):
        client.transact_write_items(TransactItems=[put, bad_update])
    assert "Item" not in client.get_item(TableName=stack.settings.usage_table, Key={"gen_id": {"S": "gen-y"}})
    assert stack.org_info(org_id).status == "active"
