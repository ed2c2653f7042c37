"""Operators' writes (kiln.store.orgs, kiln.store.keys) against DynamoDB as the emulator
serves it, its faults included."""

from __future__ import annotations

import secrets
from dataclasses import replace
from decimal import Decimal

import pytest

from kiln.settings import Settings
from kiln.store import keys, orgs
from kiln.store.errors import AlreadyRevoked, RecordExists, RecordNotFound, StorageError
from kiln.store.records import bind
from kiln_ops import emulator
from kiln_ops.provision import aws_clients, provision


@pytest.fixture
def tables_on():
    """start(faults) → the tables of this test, reached through an emulator with those faults
    (emulators in one process share moto's tables)."""
    started = []
    suffix = secrets.token_hex(4)

    def start(faults: str):
        aws = emulator.EmbeddedAws(faults=emulator.Faults.parse(faults)).start()
        started.append(aws)
        settings = replace(Settings.from_env(), aws_endpoint_url=aws.url, orgs_table=f"orgs-{suffix}",
                           keys_table=f"keys-{suffix}", usage_table=f"usage-{suffix}",
                           catalog_parameter=f"/kiln-{suffix}/catalog", maintenance_parameter=f"/kiln-{suffix}/maintenance")
        dynamodb, ssm = aws_clients(settings)
        provision(settings, catalog_json='{"models": []}', dynamodb=dynamodb, ssm=ssm)
        return bind(settings)

    yield start
    for aws in started:
        aws.stop()


def test_a_top_up_whose_answers_are_lost_is_applied_once(tables_on):
    """Every write's answer lost (applied, the connection cut before its answer): the AWS
    client sends it again, and an ADD sent again was applied again, $1 added as $4. As a
    transaction with one token, it is applied once however often it is sent, and the resend
    is answered as the first would have been."""
    clean = tables_on("")
    orgs.create_org(clean, "acme", concurrency=8, credits=Decimal("10"))
    lossy = tables_on("lost=1,scope=all")
    assert orgs.add_credits(lossy, "acme", Decimal("1")).credits == Decimal("11")
    assert orgs.add_credits(lossy, "acme", Decimal("-0.5")).credits == Decimal("10.5")
    assert orgs.get_org(clean, "acme").credits == Decimal("10.5")


def test_a_top_up_is_added_and_an_org_that_is_not_there_is_named(tables_on):
    tables = tables_on("")
    orgs.create_org(tables, "acme", concurrency=8, credits=Decimal("10"))
    assert orgs.add_credits(tables, "acme", Decimal("0.000000665")).credits == Decimal("10.000000665")
    assert orgs.add_credits(tables, "acme", Decimal("-2.5")).credits == Decimal("7.500000665")
    with pytest.raises(RecordNotFound):
        orgs.add_credits(tables, "nobody", Decimal("1"))


def test_an_operators_key_is_made_though_every_call_of_the_gateways_fails(tables_on):
    """`scope=gateway` spares operators' tools and set-up: kiln admin's key commands (and
    kiln dev's demo keys) go through the gateway's own client, which the emulator faulted as
    the gateway's, so `kiln dev --faults …` stopped in its own set-up with a traceback."""
    tables = tables_on("conflict=1,throttle=1,lost=1,txn_ms=5,seed=7,scope=gateway")
    orgs.create_org(tables, "acme", concurrency=8, credits=Decimal("1"))
    made = keys.create_key(tables, "acme", label="ops")
    assert [key.key_id for key in keys.list_keys(tables, "acme")] == [made.key_id]


def test_an_operators_writes_are_tried_again_over_conflicts_and_applied_once(tables_on):
    """The org item is inside the settles of its requests: half of the writes to it conflict
    (a plain write is refused, a transaction cancelled). Each top-up and limit change is tried
    again until it lands, and the balance is exactly what was added."""
    clean = tables_on("")
    orgs.create_org(clean, "acme", concurrency=8, credits=Decimal("10"))
    busy = tables_on("conflict=0.5,seed=7,scope=all")
    for _ in range(10):
        orgs.add_credits(busy, "acme", Decimal("1"))
    assert orgs.set_limit(busy, "acme", 12).concurrency_limit == 12
    assert orgs.set_status(busy, "acme", "disabled").status == "disabled"
    org = orgs.get_org(clean, "acme")
    assert (org.credits, org.concurrency_limit, org.status) == (Decimal("20"), 12, "disabled")


class _AnswerLost:
    """pynamodb's TransactWrite whose commit is applied, then its answer lost `times` times (the
    AWS client's own resends spent): what an operator sees on a connection cut after the write."""

    def __init__(self, times: int | None):
        self.left = times
        self.tokens: list[str] = []

    def __call__(self, *args, **kwargs):
        from pynamodb.exceptions import TransactWriteError
        from pynamodb.transactions import TransactWrite

        faults = self
        faults.tokens.append(kwargs.get("client_request_token"))

        class Lossy(TransactWrite):
            def __exit__(self, *exc_info):
                super().__exit__(*exc_info)  # applied (once per token, as DynamoDB does)
                if faults.left is None or faults.left > 0:
                    if faults.left is not None:
                        faults.left -= 1
                    reset = ConnectionError("the connection was reset before the answer")
                    raise TransactWriteError("Failed to write transaction items", cause=reset) from reset

        return Lossy(*args, **kwargs)


def test_a_top_up_whose_answers_stay_lost_a_while_is_sent_again_with_its_token_and_applied_once(tables_on, monkeypatch):
    tables = tables_on("")
    orgs.create_org(tables, "acme", concurrency=8, credits=Decimal("10"))
    lost = _AnswerLost(times=2)
    monkeypatch.setattr(orgs, "TransactWrite", lost)
    assert orgs.add_credits(tables, "acme", Decimal("1")).credits == Decimal("11")
    assert len(lost.tokens) == 3 and len(set(lost.tokens)) == 1  # the same top-up, sent again


def test_a_top_up_whose_answer_never_comes_says_it_may_have_been_applied(tables_on, monkeypatch):
    """Retrying it would add it again: the operator is told to look at the balance first."""
    tables = tables_on("")
    orgs.create_org(tables, "acme", concurrency=8, credits=Decimal("10"))
    monkeypatch.setattr(orgs, "TransactWrite", _AnswerLost(times=None))
    with pytest.raises(StorageError, match="may have been applied") as failed:
        orgs.add_credits(tables, "acme", Decimal("1"))
    assert "credits show acme" in str(failed.value)
    assert orgs.get_org(tables, "acme").credits == Decimal("11")


def test_an_org_made_by_a_create_whose_answer_was_lost_is_made_not_already_there(tables_on, monkeypatch):
    """The AWS client sends the create again after a lost answer; its condition (no such org)
    then fails on the org this very call made: that is this call's success. An org made before
    by another call is still 'already exists'."""
    from botocore.exceptions import ClientError
    from pynamodb.exceptions import PutError

    tables = tables_on("")
    real_save = type(tables.orgs(org_id="x")).save

    def applied_then_refused(record, *args, **kwargs):  # the first send applied, the resend's condition failed
        real_save(record, *args, **kwargs)
        refusal = ClientError({"Error": {"Code": "ConditionalCheckFailedException", "Message": "failed"}}, "PutItem")
        raise PutError("Failed to put item", cause=refusal)

    monkeypatch.setattr(type(tables.orgs(org_id="x")), "save", applied_then_refused)
    made = orgs.create_org(tables, "fresh", concurrency=4, credits=Decimal("3"))
    assert (made.org_id, made.concurrency_limit, made.credits) == ("fresh", 4, Decimal("3"))
    monkeypatch.undo()
    with pytest.raises(RecordExists):
        orgs.create_org(tables, "fresh", concurrency=4, credits=Decimal("3"))


def _org_with_a_key(tables_on):
    """Clean tables, org acme, one key of it; and the AWS client's real dynamodb, to wrap."""
    from kiln.aws import AwsClient

    tables = tables_on("")
    orgs.create_org(tables, "acme", concurrency=8, credits=Decimal("1"))
    return tables, keys.create_key(tables, "acme", label="ops"), AwsClient.dynamodb


def test_a_key_revoked_by_a_call_whose_answer_was_lost_is_revoked_not_already_revoked(tables_on, monkeypatch):
    """The revoking write applied, its answer lost, its resend refused (the key is revoked now):
    this call revoked it, and says so; a second revocation is 'already revoked'."""
    from kiln.aws import AwsClient, AwsError

    tables, made, real = _org_with_a_key(tables_on)
    lost = []

    async def answer_lost_once(self, operation, payload, **options):
        answer = await real(self, operation, payload, **options)
        if operation == "UpdateItem" and payload.get("TableName") == tables.keys.Meta.table_name and not lost:
            lost.append(payload)
            raise AwsError("ConnectionError", "the connection closed before the answer")
        return answer

    monkeypatch.setattr(AwsClient, "dynamodb", answer_lost_once)
    assert keys.revoke_key(tables, made.key_id).status == "revoked"
    assert lost
    with pytest.raises(AlreadyRevoked):
        keys.revoke_key(tables, made.key_id)


def test_a_key_change_whose_answers_stay_lost_is_told_as_perhaps_made(tables_on, monkeypatch):
    """Every answer lost: the change may have been made. 'cannot reach AWS' said nothing was
    done, and the operator would not look before trying again."""
    from kiln.aws import AwsClient, AwsError
    from kiln.store import retry
    from kiln_ops.admin import _describe

    tables, made, real = _org_with_a_key(tables_on)

    async def answers_lost(self, operation, payload, **options):
        answer = await real(self, operation, payload, **options)
        if operation == "UpdateItem":
            raise AwsError("ConnectionError", "the connection closed before the answer")
        return answer

    monkeypatch.setattr(AwsClient, "dynamodb", answers_lost)
    monkeypatch.setattr("kiln.store.keyring._WRITES", retry.RetryPolicy(attempts=3, base_seconds=0))
    with pytest.raises(Exception) as failed:
        keys.update_key(tables, made.key_id, label="renamed")
    told = _describe(failed.value, writes=True)
    assert "may have been made" in told and "cannot reach" not in told


def test_a_key_change_whose_answer_was_lost_then_aws_unreachable_is_told_it_may_have_been_made(tables_on, monkeypatch):
    """The first try applied and its answer lost, the next ones finding AWS unreachable: the
    client tells only of its last try ('cannot reach AWS'), which alone says nothing was done."""
    from kiln.aws import AwsClient, AwsError
    from kiln.http1 import ConnectFailed
    from kiln.store import retry
    from kiln_ops.admin import _describe

    tables, made, real = _org_with_a_key(tables_on)
    tries = []

    async def lost_then_unreachable(self, operation, payload, **options):
        if operation != "UpdateItem":
            return await real(self, operation, payload, **options)
        tries.append(1)
        if len(tries) == 1:
            await real(self, operation, payload, **options)
            raise AwsError("ConnectionError", "ProtocolFailure: the connection closed before the answer", status=0)
        refused = ConnectFailed("connection refused")
        raise AwsError("ConnectionError", f"ConnectFailed: {refused}", status=0) from refused

    monkeypatch.setattr(AwsClient, "dynamodb", lost_then_unreachable)
    monkeypatch.setattr("kiln.store.keyring._WRITES", retry.RetryPolicy(attempts=3, base_seconds=0))
    with pytest.raises(Exception) as failed:
        keys.update_key(tables, made.key_id, label="renamed")
    assert "may have been made" in _describe(failed.value, writes=True)
    assert "may have been made" not in _describe(failed.value, writes=False)  # a read did nothing
    assert keys.list_keys(tables, "acme")[0].label == "renamed"  # and it was made


def test_a_top_up_whose_resend_meets_its_first_send_in_progress_is_sent_again_with_its_token(tables_on, monkeypatch):
    """The first send applied (its answer lost) and still in progress when the resend comes:
    TransactionInProgressException. A new try with a new token would add it twice; the same
    token is sent again, and the top-up is applied once."""
    from botocore.exceptions import ClientError
    from pynamodb.exceptions import TransactWriteError
    from pynamodb.transactions import TransactWrite

    tables = tables_on("")
    orgs.create_org(tables, "acme", concurrency=8, credits=Decimal("10"))
    tokens: list[str] = []

    def sends(*args, **kwargs):
        tokens.append(kwargs.get("client_request_token"))

        class Sent(TransactWrite):
            def __exit__(self, *exc_info):
                if len(tokens) == 2:  # the resend, while the first is still being applied
                    busy = ClientError({"Error": {"Code": "TransactionInProgressException", "Message": "busy"},
                                        "ResponseMetadata": {"HTTPStatusCode": 400}}, "TransactWriteItems")
                    raise TransactWriteError("Failed to write transaction items", cause=busy) from busy
                super().__exit__(*exc_info)
                if len(tokens) == 1:
                    reset = ConnectionError("reset before the answer")
                    raise TransactWriteError("Failed to write transaction items", cause=reset) from reset

        return Sent(*args, **kwargs)

    monkeypatch.setattr(orgs, "TransactWrite", sends)
    assert orgs.add_credits(tables, "acme", Decimal("1")).credits == Decimal("11")
    assert len(tokens) == 3 and len(set(tokens)) == 1
