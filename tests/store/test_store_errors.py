"""Storage refusals told apart: one request's write meeting another's, or storage's own refusal."""

from __future__ import annotations

import pytest

from kiln.aws import AwsError
from kiln.store.errors import TransactionCancelled, is_transient, met_another_write, translate_storage_error


@pytest.mark.parametrize(("reasons", "another_write"), [
    (["TransactionConflict", None, "TransactionConflict"], True),
    (["ConditionalCheckFailed", "TransactionConflict"], True),
    (["TransactionConflict", "ThrottlingError"], False),  # throttled too: storage's own refusal
    (["ProvisionedThroughputExceeded", None], False),
    (["ConditionalCheckFailed", None], False),  # no refusal for now at all: a condition's answer
])
def test_a_cancelled_transaction_met_another_write_only_where_conflicts_are_all_that_refused_it(reasons, another_write):
    assert met_another_write(TransactionCancelled(reasons)) is another_write


@pytest.mark.parametrize(("code", "status", "another_write"), [
    ("TransactionConflictException", 400, True),  # a plain write met a transaction in flight
    ("TransactionInProgressException", 400, True),  # the same ClientRequestToken still being applied
    ("ThrottlingException", 400, False),
    ("ProvisionedThroughputExceededException", 400, False),
    ("InternalServerError", 500, False),
])
def test_a_refused_call_met_another_write_only_for_a_conflict(code, status, another_write):
    refusal = translate_storage_error(AwsError(code, "refused", status=status, body={"__type": code}))
    assert is_transient(refusal)
    assert met_another_write(refusal) is another_write
