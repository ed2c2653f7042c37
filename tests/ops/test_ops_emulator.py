"""The embedded AWS: atomic under concurrency, transactions that cost what they touch, exact numbers."""

from __future__ import annotations

import copy
import secrets
import threading
import time
from decimal import Decimal

import pytest

from kiln.store import UsageEvent
from kiln.store.codec import to_item
from kiln.store.errors import (
    StorageError,
    TransactionCancelled,
    TransientStorageError,
    is_transient,
    translate_storage_error,
)
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
    # the org item twice: the admission's UpdateItem (to undo it if refused) and the settle's
    # transaction; the usage event and the key's tally are new, nothing to back up
    assert empty_table_copies == 2

    _fill_usage_table(stack, 3000)
    counted_backups.clear()
    for _ in range(10):
        _admit_and_settle(stack, org_id)
    # and from then on the key's tally of the month (kiln.store.tally), once a settle
    assert len(counted_backups) == 10 * (empty_table_copies + 1)
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


# DynamoDB's numbers: 38 significant digits, magnitudes 1E-130 to 9.99…E+125; anything else,
# anywhere in a request or as the result of its arithmetic, is a ValidationException.
_LARGEST = "9." + "9" * 37 + "E+125"
_REFUSED = {
    "1E+126": "Number overflow", "-1E+126": "Number overflow", "1e200": "Number overflow",
    "1e1000000": "Number overflow", "1E+999999999": "Number overflow",
    "9E-131": "Number underflow", "1e-1000000": "Number underflow",
    "1" * 39: "more than 38 significant digits", "0." + "1" * 39: "more than 38 significant digits",
}


def _validation_error(call) -> str:
    from botocore.exceptions import ClientError

    with pytest.raises(ClientError) as refused:
        call()
    assert refused.value.response["Error"]["Code"] == "ValidationException", refused.value.response
    return refused.value.response["Error"]["Message"]


@pytest.mark.parametrize("value", list(_REFUSED))
def test_a_number_dynamodb_refuses_is_refused_in_an_item_and_in_an_update(stack, value):
    org_id, _ = stack.org(credits="1")
    client, table = stack.tables.client, stack.settings.orgs_table
    put = _validation_error(lambda: client.put_item(
        TableName=table, Item={"org_id": {"S": f"n-{secrets.token_hex(4)}"}, "credits": {"N": value}}))
    assert _REFUSED[value] in put
    for update in ("SET credits = :v", "SET credits = credits + :v", "ADD credits :v"):
        message = _validation_error(lambda update=update: client.update_item(
            TableName=table, Key={"org_id": {"S": org_id}}, UpdateExpression=update,
            ExpressionAttributeValues={":v": {"N": value}}))
        assert _REFUSED[value] in message, (update, message)
    assert stack.org_info(org_id).credits == Decimal(1)  # nothing was written


def test_arithmetic_whose_result_dynamodb_cannot_hold_is_refused(stack):
    org_id, _ = stack.org(credits="1")
    client, table = stack.tables.client, stack.settings.orgs_table
    key = {"org_id": {"S": org_id}}
    client.update_item(TableName=table, Key=key, UpdateExpression="SET credits = :v",
                       ExpressionAttributeValues={":v": {"N": _LARGEST}})
    for update in ("SET credits = credits + :one", "ADD credits :one"):
        message = _validation_error(lambda update=update: client.update_item(
            TableName=table, Key=key, UpdateExpression=update, ExpressionAttributeValues={":one": {"N": "1E+125"}}))
        assert "Number overflow" in message
    assert stack.org_info(org_id).credits == Decimal(_LARGEST)


def test_arithmetic_whose_exact_result_needs_more_than_38_digits_is_refused_not_rounded(stack):
    """The sum and difference were worked out in 38 digits, so a balance of 23 digits before the
    point debited a cost of 15 decimal places was silently rounded: the org debited 1E-15 for a
    bill of 4E-15, and the ledger's invariant (credits down by the events' costs) broken."""
    org_id, _ = stack.org(credits="1")
    client, table = stack.tables.client, stack.settings.orgs_table
    key = {"org_id": {"S": org_id}}
    balance = "-99999999999999999999999.999999999999999"  # 38 digits
    client.update_item(TableName=table, Key=key, UpdateExpression="SET credits = :v",
                       ExpressionAttributeValues={":v": {"N": balance}})
    for update, value in (("SET credits = credits - :v", "0.000000000000004"), ("ADD credits :v", "-4E-15"),
                          ("SET credits = credits + :v", "0.0000000000000001")):
        message = _validation_error(lambda update=update, value=value: client.update_item(
            TableName=table, Key=key, UpdateExpression=update, ExpressionAttributeValues={":v": {"N": value}}))
        assert "more than 38 significant digits" in message, (update, message)
    assert stack.org_info(org_id).credits == Decimal(balance)
    # a result that fits, however its operands are spelt, is written exactly
    client.update_item(TableName=table, Key=key, UpdateExpression="SET credits = credits + :v",
                       ExpressionAttributeValues={":v": {"N": "0.999999999999999E0"}})
    assert stack.org_info(org_id).credits == Decimal("-99999999999999999999999")


@pytest.mark.parametrize("value", [_LARGEST, "-" + _LARGEST, "1E-130", "-1E-130", "1" * 38, "0", "0E-999999999"])
def test_the_numbers_at_dynamodbs_limits_are_stored_exactly(stack, value):
    org_id = f"n-{secrets.token_hex(4)}"
    client, table = stack.tables.client, stack.settings.orgs_table
    client.put_item(TableName=table, Item={"org_id": {"S": org_id}, "credits": {"N": value}})
    stored = client.get_item(TableName=table, Key={"org_id": {"S": org_id}})["Item"]["credits"]["N"]
    assert Decimal(stored) == Decimal(value)


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
    with pytest.raises(client.exceptions.ClientError) as caught:
        client.transact_write_items(TransactItems=[put, bad_update])
    assert "Item" not in client.get_item(TableName=stack.settings.usage_table, Key={"gen_id": {"S": "gen-y"}})
    assert stack.org_info(org_id).status == "active"
    # as DynamoDB answers a write its item refuses inside a transaction: a cancellation whose
    # reason for that item is ValidationError, which is no failed condition and no conflict
    error = caught.value.response
    assert error["Error"]["Code"] == "TransactionCanceledException"
    assert [reason["Code"] for reason in error["CancellationReasons"]] == ["None", "ValidationError"]
    mapped = translate_storage_error(caught.value)
    assert isinstance(mapped, StorageError) and not is_transient(mapped)
    assert "ValidationError" in str(mapped)


# -- the fault mode: DynamoDB under contention ----------------------------------------------------


TABLE = f"faults-{secrets.token_hex(4)}"


@pytest.fixture
def faulty():
    """start(spec) → (the emulator's fault layer, a gateway-side client call, a botocore client)."""
    import asyncio

    import botocore.session

    from kiln.aws import AwsClient

    started = []

    def start(spec: str):
        aws = emulator.EmbeddedAws(faults=emulator.Faults.parse(spec)).start()
        started.append(aws)
        session = botocore.session.get_session()
        session.set_credentials("testing", "testing")
        client = session.create_client("dynamodb", region_name="us-east-1", endpoint_url=aws.url)
        if TABLE not in client.list_tables()["TableNames"]:  # moto's tables live as long as the process
            client.create_table(
                TableName=TABLE, KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
                AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"}], BillingMode="PAY_PER_REQUEST",
            )
        client.delete_item(TableName=TABLE, Key={"id": {"S": "org"}})
        client.put_item(TableName=TABLE, Item={"id": {"S": "org"}, "n": {"N": "10"}})

        def call(operation: str, payload: dict):
            async def main():
                gateway_client = AwsClient(region="us-east-1", endpoint_url=aws.url, max_attempts=1)
                try:
                    return await gateway_client.dynamodb(operation, payload)
                except Exception as exc:  # noqa: BLE001 - the test looks at it
                    return translate_storage_error(exc)
                finally:
                    await gateway_client.aclose()

            return asyncio.run(main())

        return aws.faults_layer, call, client

    yield start
    for aws in started:
        aws.stop()


def _decrement(key: str = "org") -> dict:
    return {"TableName": TABLE, "Key": {"id": {"S": key}}, "UpdateExpression": "SET n = n - :one",
            "ExpressionAttributeValues": {":one": {"N": "1"}}}


def _transaction(key: str = "org", token: str | None = None, amount: str = "1") -> dict:
    payload = {"TransactItems": [{"Update": {**_decrement(key), "ExpressionAttributeValues": {":one": {"N": amount}}}}]}
    if token:
        payload["ClientRequestToken"] = token
    return payload


def _n(client, key: str = "org") -> str:
    return client.get_item(TableName=TABLE, Key={"id": {"S": key}}, ConsistentRead=True)["Item"]["n"]["N"]


def test_a_write_meeting_a_transaction_in_flight_conflicts_as_in_dynamodb(faulty):
    layer, call, client = faulty("txn_ms=1500,scope=gateway")
    slow = threading.Thread(target=call, args=("TransactWriteItems", _transaction()))
    slow.start()
    while not layer.holding():
        pass
    plain = call("UpdateItem", _decrement())
    other = call("TransactWriteItems", _transaction())
    slow.join()
    assert isinstance(plain, TransientStorageError) and plain.code == "TransactionConflictException"
    assert isinstance(other, TransactionCancelled) and other.reasons == ["TransactionConflict"] and other.transient
    assert _n(client) == "9"  # only the transaction that held the item was applied
    assert not isinstance(call("UpdateItem", _decrement()), Exception) and _n(client) == "8"  # the item is free again


def test_a_transaction_waiting_its_turn_at_moto_holds_nothing(faulty):
    """A transaction holds its items for txn_ms, as DynamoDB's runs; it held them too while it
    waited for moto's lock, which DynamoDB has no counterpart of: under a storm's load one org's
    item was held for seconds on end, and its admissions spent their whole retry budget on
    conflicts (503s no DynamoDB would give)."""
    layer, call, client = faulty("txn_ms=50,scope=gateway")
    moto = layer._app.app._lock  # moto's own turn: one call at a time
    moto.acquire()
    try:
        queued = threading.Thread(target=call, args=("TransactWriteItems", _transaction()))
        queued.start()
        time.sleep(0.3)  # its txn_ms are over: it waits for moto alone
        assert not layer.holding()
        plain = {}
        writer = threading.Thread(target=lambda: plain.setdefault("answer", call("UpdateItem", _decrement())))
        writer.start()
        time.sleep(0.1)
    finally:
        moto.release()
    queued.join()
    writer.join()
    assert not isinstance(plain["answer"], Exception), plain["answer"]
    assert _n(client) == "8"  # both applied


def test_conflicts_at_a_rate_hit_only_items_that_transactions_write(faulty):
    layer, call, client = faulty("conflict=1,seed=7,scope=gateway")
    assert not isinstance(call("UpdateItem", _decrement()), Exception)  # no transaction ever wrote it
    assert not isinstance(call("TransactWriteItems", _transaction()), Exception)
    refused = call("UpdateItem", _decrement())
    assert isinstance(refused, TransientStorageError) and refused.code == "TransactionConflictException"
    cancelled = call("TransactWriteItems", _transaction())
    assert isinstance(cancelled, TransactionCancelled) and cancelled.reasons == ["TransactionConflict"]
    client.update_item(**_decrement())  # scope=gateway: operators' tools (botocore) are not faulted
    assert _n(client) == "7"


def test_throttling_and_lost_answers(faulty):
    _, call, client = faulty("throttle=1,scope=gateway")
    throttled = call("GetItem", {"TableName": TABLE, "Key": {"id": {"S": "org"}}})
    assert isinstance(throttled, TransientStorageError) and throttled.code == "ProvisionedThroughputExceededException"

    _, call, client = faulty("lost=1,scope=gateway")
    lost = call("UpdateItem", _decrement())
    assert isinstance(lost, TransientStorageError) and lost.code == "ConnectionError"  # no answer…
    assert _n(client) == "9"  # …but the write was applied


def test_a_client_request_token_makes_a_transaction_idempotent(faulty):
    _, call, client = faulty("")
    assert not isinstance(call("TransactWriteItems", _transaction(token="tok-1")), Exception)
    assert not isinstance(call("TransactWriteItems", _transaction(token="tok-1")), Exception)  # answered, not applied
    assert _n(client) == "9"
    mismatch = call("TransactWriteItems", _transaction(token="tok-1", amount="2"))
    assert isinstance(mismatch, StorageError) and mismatch.code == "IdempotentParameterMismatchException"
    assert not isinstance(mismatch, TransientStorageError)
    assert _n(client) == "9"


@pytest.mark.parametrize("spec, error", [
    ("conflict=1.5", "between 0 and 1"), ("storm=1", "unknown fault"), ("seed=x", "needs a number"),
    ("scope=some", "scope is all or gateway"), ("conflict", "unknown fault"),
])
def test_a_bad_fault_spec_is_refused_with_a_reason(spec, error):
    with pytest.raises(ValueError, match=error):
        emulator.Faults.parse(spec)


def test_a_fault_spec_reads_back_the_same():
    faults = emulator.Faults.parse("conflict=0.5, throttle=0.05,lost=0.05,txn_ms=5,seed=7,scope=gateway")
    assert emulator.Faults.parse(faults.describe()) == faults
    assert emulator.Faults.from_env({emulator.FAULTS_ENV: "lost=0.1"}).lost == 0.1
    assert not emulator.Faults.parse("").enabled


def test_kiln_emulator_and_kiln_dev_take_the_fault_mode_and_document_it(capsys):
    from kiln_ops.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["dev", "--faults", "conflict=0.5,seed=3"]).faults == emulator.Faults(conflict=0.5, seed=3)
    assert parser.parse_args(["emulator", "--faults", "lost=0.1"]).faults.lost == 0.1
    with pytest.raises(SystemExit):
        parser.parse_args(["emulator", "--faults", "conflict=2"])
    assert "between 0 and 1" in capsys.readouterr().err
    for command in ("emulator", "dev"):
        with pytest.raises(SystemExit):
            parser.parse_args([command, "--help"])
        assert "KILN_EMULATOR_FAULTS" in capsys.readouterr().out


def test_an_operators_top_up_is_retried_past_the_settles_it_conflicts_with(faulty, tmp_path):
    """`kiln admin credits add` on a busy org: half its writes meet a settle transaction."""
    from kiln.settings import Settings
    from kiln.store import bind
    from kiln.store.orgs import add_credits, create_org, get_org

    layer, call, client = faulty("conflict=0.5,seed=11")  # scope=all: operators' tools too
    settings = Settings(orgs_table=f"{TABLE}-orgs", keys_table=f"{TABLE}-keys", usage_table=f"{TABLE}-usage",
                        aws_endpoint_url=client.meta.endpoint_url)
    client.create_table(
        TableName=settings.orgs_table, KeySchema=[{"AttributeName": "org_id", "KeyType": "HASH"}],
        AttributeDefinitions=[{"AttributeName": "org_id", "AttributeType": "S"}], BillingMode="PAY_PER_REQUEST",
    )
    tables = bind(settings)
    create_org(tables, "busy", concurrency=8, credits=Decimal("1"))
    settle = {"TransactItems": [{"Update": {"TableName": settings.orgs_table, "Key": {"org_id": {"S": "busy"}},
                                            "UpdateExpression": "SET credits = credits - :c",
                                            "ExpressionAttributeValues": {":c": {"N": "0.5"}}}}]}
    while isinstance(call("TransactWriteItems", settle), Exception):
        pass  # a settle lands: from now on the org item is one that transactions write
    for _ in range(10):
        add_credits(tables, "busy", Decimal("0.1"))
    assert get_org(tables, "busy").credits == Decimal("1.5")  # each top-up applied exactly once


@pytest.mark.parametrize("refused", ["overflow", "too-large"])
def test_an_update_dynamodb_refuses_writes_none_of_its_actions(stack, refused):
    """An UpdateItem is atomic: when one of its actions is refused (a sum DynamoDB cannot
    hold, an item over 400 KB), the actions before it are not applied either. The emulator
    once applied them: a refused admission left its lease behind, a slot AWS never takes."""
    org_id, _ = stack.org(credits="1")
    client, table = stack.tables.client, stack.settings.orgs_table
    key = {"org_id": {"S": org_id}}
    client.update_item(TableName=table, Key=key, UpdateExpression="SET big = :v",
                       ExpressionAttributeValues={":v": {"N": _LARGEST}})
    before = client.get_item(TableName=table, Key=key, ConsistentRead=True)["Item"]
    if refused == "overflow":
        update, values = "SET marker = :m ADD big :one", {":m": {"S": "x"}, ":one": {"N": "1E+125"}}
    else:
        update, values = "SET marker = :m, filler = :f", {":m": {"S": "x"}, ":f": {"S": "y" * 410_000}}
    _validation_error(lambda: client.update_item(TableName=table, Key=key, UpdateExpression=update,
                                                 ExpressionAttributeValues=values))
    assert client.get_item(TableName=table, Key=key, ConsistentRead=True)["Item"] == before


def test_a_write_reaches_an_index_only_after_index_ms_as_in_dynamodb(faulty):
    """A global secondary index is eventually consistent: a Query of it a moment after a write
    does not find the item yet, the table does (consistently) at once, and after index_ms the
    index does too. Operators' tools (scope=gateway) see it at once."""
    layer, call, client = faulty("index_ms=400,scope=gateway")
    indexed = f"{TABLE}-indexed"
    if indexed not in client.list_tables()["TableNames"]:
        client.create_table(
            TableName=indexed, KeySchema=[{"AttributeName": "id", "KeyType": "HASH"}],
            AttributeDefinitions=[{"AttributeName": "id", "AttributeType": "S"},
                                  {"AttributeName": "g", "AttributeType": "S"}],
            GlobalSecondaryIndexes=[{"IndexName": "by_g", "KeySchema": [{"AttributeName": "g", "KeyType": "HASH"}],
                                     "Projection": {"ProjectionType": "ALL"}}],
            BillingMode="PAY_PER_REQUEST",
        )
    group = secrets.token_hex(4)
    query = {"TableName": indexed, "IndexName": "by_g", "KeyConditionExpression": "g = :g",
             "ExpressionAttributeValues": {":g": {"S": group}}}
    assert call("Query", query)["Items"] == []
    written = time.monotonic()
    call("PutItem", {"TableName": indexed, "Item": {"id": {"S": "a"}, "g": {"S": group}}})
    behind = call("Query", query)
    table = call("GetItem", {"TableName": indexed, "Key": {"id": {"S": "a"}}, "ConsistentRead": True})
    tools = client.query(**query)
    assert time.monotonic() - written < 0.4  # all of it within the index's lag
    assert (behind["Items"], behind["Count"]) == ([], 0)
    assert table["Item"]["g"]["S"] == group and tools["Count"] == 1
    time.sleep(0.45)
    caught_up = call("Query", query)
    assert caught_up["Count"] == 1 and caught_up["Items"][0]["id"]["S"] == "a"


def test_index_ms_is_parsed_and_bounded():
    assert emulator.Faults.parse("index_ms=500").index_ms == 500 and emulator.Faults.parse("index_ms=500").enabled
    assert "index_ms=500" in emulator.Faults.parse("index_ms=500").describe()
    with pytest.raises(ValueError, match="index_ms is between 0 and 60000"):
        emulator.Faults.parse("index_ms=-1")


@pytest.mark.parametrize("tier, limit", [(None, 4096), ("Standard", 4096), ("Advanced", 8192)])
def test_a_parameter_value_beyond_its_tiers_size_is_refused_as_ssm_refuses_it(stack, tier, limit):
    """moto stores a value of any length; SSM holds 4 KB in a standard parameter and 8 KB in an
    advanced one. A catalog or a switch that fits locally must fit in AWS."""
    import botocore.exceptions

    name = f"/t{secrets.token_hex(5)}/size"
    extra = {"Tier": tier} if tier else {}
    stack.ssm.put_parameter(Name=name, Value="x" * limit, Type="String", **extra)
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        stack.ssm.put_parameter(Name=name, Value="x" * (limit + 1), Type="String", Overwrite=True, **extra)
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    assert f"{limit} characters" in refused.value.response["Error"]["Message"]
    assert stack.ssm.get_parameter(Name=name)["Parameter"]["Value"] == "x" * limit


def test_a_transaction_with_a_value_no_expression_uses_is_refused_as_dynamodb_refuses_it(stack):
    """moto checks a transaction's attribute names, not its values: a write the gateway sent with
    a value left over would pass locally and be refused by DynamoDB."""
    org_id, _ = stack.org(credits="1")
    client = stack.tables.client
    update = {"Update": {"TableName": stack.settings.orgs_table, "Key": {"org_id": {"S": org_id}},
                         "UpdateExpression": "SET credits = :two",
                         "ExpressionAttributeValues": {":two": {"N": "2"}, ":unused": {"N": "3"}}}}
    with pytest.raises(client.exceptions.ClientError) as refused:
        client.transact_write_items(TransactItems=[update])
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    assert ":unused" in refused.value.response["Error"]["Message"]
    assert stack.org_info(org_id).credits == 1


def test_a_transaction_putting_an_item_without_its_key_is_refused_as_dynamodb_refuses_it(stack):
    """The emulator answered HTTP 500 (a KeyError), which every client retries as DynamoDB's own
    failure: fifty times over for a replayed event with no generation id."""
    client = stack.tables.client
    put = {"Put": {"TableName": stack.settings.usage_table, "Item": {"org_id": {"S": "org-x"}}}}
    with pytest.raises(client.exceptions.ClientError) as refused:
        client.transact_write_items(TransactItems=[put])
    assert refused.value.response["Error"]["Code"] == "ValidationException"
    assert "Missing the key gen_id" in refused.value.response["Error"]["Message"]


def test_parameter_reads_beyond_ssm_tps_in_a_second_are_throttled_as_parameter_store_throttles_them():
    """Parameter Store answers GetParameter at 40 per second per account and Region by default,
    and ThrottlingException ("Rate exceeded") beyond: `ssm_tps` makes the local SSM do the same,
    so that what the gateway does when throttled can be tried on the local stack."""
    import asyncio

    from kiln.aws import AwsClient, AwsError

    aws = emulator.EmbeddedAws(faults=emulator.Faults.parse("ssm_tps=5,scope=gateway")).start()
    try:
        import boto3

        boto3.client("ssm", region_name="us-east-1", endpoint_url=aws.url, aws_access_key_id="testing",
                     aws_secret_access_key="testing").put_parameter(Name="/tps/flag", Value="{}", Type="String",
                                                                    Overwrite=True)

        async def burst() -> list[str]:
            client = AwsClient(region="us-east-1", endpoint_url=aws.url, max_attempts=1)
            outcomes = []
            try:
                for _ in range(12):
                    try:
                        await client.ssm("GetParameter", {"Name": "/tps/flag"})
                        outcomes.append("ok")
                    except AwsError as exc:
                        outcomes.append(exc.code)
            finally:
                await client.aclose()
            return outcomes

        outcomes = asyncio.run(burst())
        assert outcomes.count("ok") == 5 and set(outcomes) == {"ok", "ThrottlingException"}, outcomes
        time.sleep(1.1)
        assert asyncio.run(burst())[:5] == ["ok"] * 5  # a second later, 5 more
    finally:
        aws.stop()


def test_an_update_that_grows_an_item_past_400_kb_is_refused_in_a_transaction_too(stack):
    """moto checked an item's size on a plain update's top-level values only, by its own count
    (no map overhead), and a transaction's update not at all: settles and key changes grew an
    org item to 600 KB locally, where DynamoDB refuses it. Both are refused now, by DynamoDB's
    count, and nothing of the refused write stays."""
    from botocore.exceptions import ClientError

    from kiln_ops.emulator import MAX_ITEM_BYTES, item_size

    org_id, _ = stack.org(credits="1")
    client, table = stack.tables.client, stack.settings.orgs_table
    key = {"org_id": {"S": org_id}}
    entry = {"M": {"x": {"S": "y" * 1000}}}  # 1 000 bytes, and a map's overhead beside each

    def grow(count: int, *, start: int = 0, transaction: bool = False) -> None:
        names = {f"#g{i}": f"g{start + i:06d}" for i in range(count)}
        values = {":entry": entry}
        update = {"TableName": table, "Key": key, "UpdateExpression": "SET " + ", ".join(
            f"#leases.{name} = :entry" for name in names), "ExpressionAttributeNames": {**names, "#leases": "leases"},
            "ExpressionAttributeValues": values}
        if transaction:
            client.transact_write_items(TransactItems=[{"Update": update}])
        else:
            client.update_item(**update)

    client.update_item(TableName=table, Key=key, UpdateExpression="SET leases = :none",
                       ExpressionAttributeValues={":none": {"M": {}}})
    for start in range(0, 390, 30):
        grow(30, start=start)
    stored = lambda: client.get_item(TableName=table, Key=key, ConsistentRead=True)["Item"]  # noqa: E731
    before = stored()
    assert MAX_ITEM_BYTES - 20 * 1020 < item_size(before) <= MAX_ITEM_BYTES
    with pytest.raises(ClientError) as refused:
        grow(20, start=1000, transaction=True)
    reasons = refused.value.response.get("CancellationReasons")
    assert reasons and reasons[0]["Code"] == "ValidationError", refused.value.response
    assert "exceeded the maximum allowed size" in reasons[0]["Message"]
    assert stored() == before
    message = _validation_error(lambda: grow(20, start=2000))
    assert "exceeded the maximum allowed size" in message
    assert stored() == before


def test_an_items_size_counts_a_numbers_significant_digits_and_a_shrinking_update_is_never_refused(stack):
    """Numbers were counted with their trailing zeros and an exponent's letters (1000000000000:
    8 bytes, where DynamoDB's guide counts 2), and an item over 400 KB by that count refused every
    update, one that shrank it too."""
    from kiln_ops.emulator import MAX_ITEM_BYTES, item_size, value_size

    assert [value_size({"N": raw}) for raw in ("1000000000000", "1E+12", "0.00100", "-123.450")] == [2, 2, 2, 4]
    org_id, _ = stack.org(credits="1")
    client, table = stack.tables.client, stack.settings.orgs_table
    key = {"org_id": {"S": org_id}}
    big = {f"a{index:05d}": {"S": "x" * 1000} for index in range(400)}
    client.update_item(TableName=table, Key=key, UpdateExpression="SET m = :big",
                       ExpressionAttributeValues={":big": {"M": dict(list(big.items())[:380])}})
    item = client.get_item(TableName=table, Key=key, ConsistentRead=True)["Item"]
    assert item_size(item) <= MAX_ITEM_BYTES
    client.update_item(TableName=table, Key=key, UpdateExpression="REMOVE m.a00000")  # shrinks it: always taken
