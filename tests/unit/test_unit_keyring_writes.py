"""kiln.store.keyring's writes as DynamoDB may answer them: which are tried again, and how."""

import asyncio

import pytest

from kiln.aws import AwsError
from kiln.store.keyring import Keyring


class Dynamo:
    """UpdateItem applied (an ADD adds), its answer lost on the calls listed."""

    def __init__(self, lose: set[int], refuse: set[int] = frozenset()):
        self.figure, self.calls, self.lose, self.refuse = 0, 0, lose, refuse

    async def dynamodb(self, operation, payload):
        self.calls += 1
        if self.calls in self.refuse:  # throttled: not applied
            raise AwsError("ProvisionedThroughputExceededException", "slow down")
        if payload["UpdateExpression"].startswith("ADD"):
            self.figure += int(payload["ExpressionAttributeValues"][":missing"]["N"])
        if self.calls in self.lose:
            raise AwsError("ConnectionError", "the connection closed before the answer", status=0)
        return {}


def _add(ring: Keyring):
    return ring._org_write("org1", "ADD #f :missing", {"#f": "spend"}, {":missing": {"N": "5"}}, idempotent=False)


def test_an_add_whose_answer_was_lost_is_not_sent_again():
    """Sent again, an ADD applied whose answer was lost is applied twice: the key's figure would
    count its spend twice and its limit be reached early."""
    dynamo = Dynamo(lose={1})
    with pytest.raises(Exception, match="ConnectionError"):
        asyncio.run(_add(Keyring(dynamo, keys_table="k", orgs_table="o")))
    assert (dynamo.calls, dynamo.figure) == (1, 5)


def test_an_add_refused_unapplied_is_tried_again_and_applied_once():
    dynamo = Dynamo(lose=set(), refuse={1, 2})
    assert asyncio.run(_add(Keyring(dynamo, keys_table="k", orgs_table="o"))) is True
    assert (dynamo.calls, dynamo.figure) == (3, 5)


def test_a_write_that_sets_is_sent_again_after_a_lost_answer():
    dynamo = Dynamo(lose={1, 2})
    ring = Keyring(dynamo, keys_table="k", orgs_table="o")
    assert asyncio.run(ring._org_write("org1", "REMOVE #f", {"#f": "spend"})) is True
    assert dynamo.calls == 3
