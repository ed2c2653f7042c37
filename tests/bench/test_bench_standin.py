"""The bench's storage stand-in: DynamoDB's answers for the gateway's own writes, and its bill."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest
from bench.standin import Store, StoreError, condition, item_size, read_units, update, write_units

from kiln.aws import AwsError
from kiln.errors import KeySpendLimitExceeded, RateLimitExceeded
from kiln.store.keyspend import KeyLimits
from kiln.store.ledger import Ledger
from kiln.store.usage import UsageEvent

ORGS, USAGE = "orgs", "usage"


def store(limit: int = 2, credits: str = "10") -> Store:
    s = Store({ORGS: ["org_id"], USAGE: ["gen_id"]})
    s.put_seed(ORGS, {"org_id": {"S": "o"}, "status": {"S": "active"}, "credits": {"N": credits},
                      "concurrency_limit": {"N": str(limit)}, "leases": {"M": {}}})
    return s


class StoreAws:
    """The gateway's AwsClient, answered by a Store in process (errors as kiln.aws raises them)."""

    def __init__(self, s: Store) -> None:
        self.store = s

    async def dynamodb(self, operation: str, payload: dict) -> dict:
        try:
            return self.store.handle(f"DynamoDB_20120810.{operation}", payload)
        except StoreError as exc:
            body = exc.body()
            raise AwsError(body["__type"].rsplit("#", 1)[-1], exc.message, body) from None


def ledger(s: Store) -> Ledger:
    return Ledger(StoreAws(s), orgs_table=ORGS, usage_table=USAGE, lease_ttl=60)


def org(s: Store) -> dict:
    return s.items[ORGS][s._key(ORGS, {"org_id": {"S": "o"}})]


def test_the_ledger_admits_up_to_the_limit_and_settles_through_the_stand_in():
    s = store(limit=2)
    book = ledger(s)

    async def scenario():
        first = await book.admit(org_id="o", key_id="k", model="m", endpoint="chat", streamed=False)
        await book.admit(org_id="o", key_id="k", model="m", endpoint="chat", streamed=False)
        with pytest.raises(RateLimitExceeded):
            await book.admit(org_id="o", key_id="k", model="m", endpoint="chat", streamed=False)
        event = UsageEvent(gen_id=first.gen_id, org_id="o", created_at="2026-12-01T00:00:00.000Z", key_id="k", model="m",
                           endpoint="chat", streamed=False, status="completed", cost=Decimal("0.25"),
                           prompt_tokens=9, completion_tokens=12)
        assert await book.settle(first, event) == "settled"
        # the same settle again (its answer lost): the token makes it a no-op, nothing debited twice
        assert await book.settle(first, event) in ("settled", "already_settled")
        await book.admit(org_id="o", key_id="k", model="m", endpoint="chat", streamed=False)
        return first

    first = asyncio.run(scenario())
    assert org(s)["credits"] == {"N": "9.75"}
    assert len(org(s)["leases"]["M"]) == 2
    assert s.items[USAGE][s._key(USAGE, {"gen_id": {"S": first.gen_id}})]["status"] == {"S": "completed"}


def test_a_keys_own_limits_hold_through_the_stand_in_as_through_dynamodb():
    s = store(limit=4)
    book = ledger(s)
    limits = KeyLimits(concurrency=1, spend_limit=Decimal("0.3"), spend_period="day")

    async def scenario():
        first = await book.admit(org_id="o", key_id="k", model="m", endpoint="chat", streamed=False, limits=limits)
        with pytest.raises(RateLimitExceeded, match="This key"):
            await book.admit(org_id="o", key_id="k", model="m", endpoint="chat", streamed=False, limits=limits)
        event = UsageEvent(gen_id=first.gen_id, org_id="o", created_at="2026-12-01T00:00:00.000Z", key_id="k", model="m",
                           endpoint="chat", streamed=False, status="completed", cost=Decimal("0.3"))
        assert await book.settle(first, event) == "settled"
        with pytest.raises(KeySpendLimitExceeded):
            await book.admit(org_id="o", key_id="k", model="m", endpoint="chat", streamed=False, limits=limits)
        return first

    first = asyncio.run(scenario())
    item = org(s)
    assert "key_leases:k" not in item  # the set, emptied by the settle, is gone
    figure = limits.figure("k", first.started)
    assert [name for name in item if name.startswith("key_spend:k:")] == [figure] == [first.spend_figure]
    assert item[figure] == {"N": "0.3"}


def test_a_refused_admission_returns_the_item_as_it_was():
    s = store(limit=0)
    payload = {"TableName": ORGS, "Key": {"org_id": {"S": "o"}}, "UpdateExpression": "SET #l.#g = :v",
               "ConditionExpression": "size(#l) < #lim", "ExpressionAttributeNames": {"#l": "leases", "#g": "x",
                                                                                       "#lim": "concurrency_limit"},
               "ExpressionAttributeValues": {":v": {"S": "lease"}}, "ReturnValuesOnConditionCheckFailure": "ALL_OLD"}
    with pytest.raises(StoreError) as refused:
        s.handle("DynamoDB_20120810.UpdateItem", payload)
    assert refused.value.code.endswith("ConditionalCheckFailedException")
    assert refused.value.body()["Item"]["credits"] == {"N": "10"}
    assert org(s)["leases"] == {"M": {}}


def test_a_transaction_applies_all_or_nothing_and_says_which_condition_failed():
    s = store()
    debit = {"Update": {"TableName": ORGS, "Key": {"org_id": {"S": "o"}}, "UpdateExpression": "SET #c = #c - :d",
                        "ExpressionAttributeNames": {"#c": "credits"}, "ExpressionAttributeValues": {":d": {"N": "1"}}}}
    put = {"Put": {"TableName": USAGE, "Item": {"gen_id": {"S": "g"}}, "ConditionExpression": "attribute_not_exists(gen_id)"}}
    s.handle("DynamoDB_20120810.TransactWriteItems", {"TransactItems": [debit, put]})
    with pytest.raises(StoreError) as cancelled:
        s.handle("DynamoDB_20120810.TransactWriteItems", {"TransactItems": [debit, put]})
    assert [r["Code"] for r in cancelled.value.body()["CancellationReasons"]] == ["None", "ConditionalCheckFailed"]
    assert org(s)["credits"] == {"N": "9"}  # the debit of the cancelled one was not applied


def test_a_client_request_token_is_idempotent_and_refuses_other_parameters():
    s = store()
    debit = {"Update": {"TableName": ORGS, "Key": {"org_id": {"S": "o"}}, "UpdateExpression": "SET #c = #c - :d",
                        "ExpressionAttributeNames": {"#c": "credits"}, "ExpressionAttributeValues": {":d": {"N": "1"}}}}
    for _ in range(2):
        s.handle("DynamoDB_20120810.TransactWriteItems", {"TransactItems": [debit], "ClientRequestToken": "t"})
    assert org(s)["credits"] == {"N": "9"}
    other = {"Update": {**debit["Update"], "ExpressionAttributeValues": {":d": {"N": "2"}}}}
    with pytest.raises(StoreError) as mismatch:
        s.handle("DynamoDB_20120810.TransactWriteItems", {"TransactItems": [other], "ClientRequestToken": "t"})
    assert mismatch.value.code.endswith("IdempotentParameterMismatchException")


def test_expressions():
    item = {"a": {"N": "3"}, "m": {"M": {"x": {"S": "y"}}}, "s": {"S": "active"}}
    assert condition("attribute_exists(#m.#x) AND NOT attribute_not_exists(a)")(item, {"#m": "m", "#x": "x"}, {})
    assert condition("#s = :v OR (a > :big)")(item, {"#s": "s"}, {":v": {"S": "no"}, ":big": {"N": "2"}})
    assert not condition("size(#m) >= :two")(item, {"#m": "m"}, {":two": {"N": "2"}})
    assert not condition("missing = :v")(item, {}, {":v": {"S": "x"}})
    assert [(a, p) for a, p, _ in update("SET a = a + :one, #m.#x = :v REMOVE b, c")] == [
        ("SET", ("a",)), ("SET", ("#m", "#x")), ("REMOVE", ("b",)), ("REMOVE", ("c",))]
    with pytest.raises(StoreError):
        condition("a BETWEEN :x AND :y")


def test_units_are_counted_as_dynamodb_bills_them():
    small = {"id": {"S": "x" * 10}}
    big = {"id": {"S": "x" * 1500}}
    assert item_size(small) == 2 + 10
    assert write_units(None, small) == 1 and write_units(small, big) == 2
    assert write_units(small, small, transactional=True) == 2
    assert read_units(None, consistent=True) == 1 and read_units(big, consistent=False) == 0.5
    s = store()
    s.handle("DynamoDB_20120810.GetItem", {"TableName": ORGS, "Key": {"org_id": {"S": "o"}}, "ConsistentRead": True})
    s.handle("DynamoDB_20120810.PutItem", {"TableName": USAGE, "Item": {"gen_id": {"S": "g"}}})
    assert (s.read_units, s.write_units) == (1, 1)
