"""One schema for the three items: the operators' pynamodb models, the request path's encoding
and template.yaml all agree with `kiln.store.schema`, and each item written by one side reads
back the same on the other."""

from __future__ import annotations

import asyncio
import dataclasses
from decimal import Decimal

import pytest
from pynamodb.attributes import BooleanAttribute, MapAttribute, NumberAttribute, UnicodeAttribute, UnicodeSetAttribute

from kiln.settings import Settings
from kiln.store import Lease, UsageEvent, bind
from kiln.store.records import DecimalAttribute
from kiln.store.schema import KEY, LEASE, ORG, USAGE
from kiln.store.storage import DynamoStorage, KeyEntry
from kiln_ops.template import load_template

TABLES = bind(Settings())
KINDS = {UnicodeAttribute: "S", NumberAttribute: "N", BooleanAttribute: "BOOL", MapAttribute: "M", UnicodeSetAttribute: "SS",
         DecimalAttribute: "money"}


@pytest.mark.parametrize("model, schema", [(TABLES.keys, KEY), (TABLES.orgs, ORG), (TABLES.usage, USAGE)],
                         ids=["key", "org", "usage"])
def test_each_pynamodb_model_is_its_schema(model, schema):
    attributes = model.get_attributes()
    assert sorted(attributes) == sorted(schema.names)
    for declared in schema.attributes:
        attribute = attributes[declared.name]
        assert KINDS[type(attribute)] == declared.kind, declared.name
        assert attribute.null == declared.null, declared.name
        assert attribute.is_hash_key == (declared.name == schema.hash_key), declared.name
    indexes = {name: index for name, index in vars(model).items() if hasattr(index, "Meta") and name != "Meta"}
    assert sorted(indexes) == sorted(index.name for index in schema.indexes)


def test_a_usage_event_has_exactly_the_usage_items_attributes_but_the_ledgers_tally_mark():
    assert (*(field.name for field in dataclasses.fields(UsageEvent)), USAGE.tallied) == USAGE.names


@pytest.mark.parametrize("schema, table", [(KEY, "KeysTable"), (ORG, "OrgsTable"), (USAGE, "UsageTable")])
def test_template_tables_have_the_schemas_keys_and_indexes(schema, table):
    properties = load_template()["Resources"][table]["Properties"]
    assert properties["KeySchema"] == [{"AttributeName": schema.hash_key, "KeyType": "HASH"}]
    indexes = {index["IndexName"]: [key["AttributeName"] for key in index["KeySchema"]]
               for index in properties.get("GlobalSecondaryIndexes", [])}
    assert indexes == {index.name: [index.hash_key, *([index.range_key] if index.range_key else [])]
                       for index in schema.indexes}


class OneItem:
    """An AWS client stand-in that answers every GetItem with one item."""

    def __init__(self, item):
        self.item = item

    async def dynamodb(self, operation, payload):
        assert operation == "GetItem"
        return {"Item": self.item}


def storage_over(item, ledger=None) -> DynamoStorage:
    return DynamoStorage(OneItem(item), keys_table="k", orgs_table="o", usage_table="u", ledger=ledger)


def test_a_key_written_by_the_operators_tools_is_read_by_the_request_path():
    record = TABLES.keys(key_hash="h", key_id="key_1", org_id="acme", status="active", prefix="sk-kiln-ab",
                         created_at="2026-12-01T00:00:00.000Z", last_used_at="2026-12-01T01:00:00.000Z")
    entry = asyncio.run(storage_over(record.serialize()).find_key("h"))
    assert entry == KeyEntry("key_1", "acme", True, "2026-12-01T01:00:00.000Z")
    revoked = TABLES.keys(key_hash="h", key_id="key_2", org_id="acme", status="revoked", prefix="p", created_at="t")
    assert asyncio.run(storage_over(revoked.serialize()).find_key("h")) == KeyEntry("key_2", "acme", False, "")


def test_an_org_and_its_leases_read_the_same_on_both_sides():
    lease = Lease("gen-1", "acme", "key_1", "m", "chat.completions", True, 1000.5, 1060.5)
    renewed = dataclasses.replace(lease, gen_id="gen-2", prompt_tokens=9, completion_tokens=4, cost=Decimal("0.000001"))
    leases = {"gen-1": lease.to_attribute()}
    record = TABLES.orgs(org_id="acme", status="disabled", concurrency_limit=3, credits=Decimal("12.5"),
                         created_at="t")
    item = record.serialize()
    item[ORG.leases] = {"M": leases}
    # the request path reads what the operators wrote: a disabled org, holding a dead lease, whose
    # leases the ledger is then asked to reclaim
    from kiln.store.ledger import Ledger

    ledger = Ledger(None, orgs_table="o", usage_table="u", lease_ttl=60.0)
    looked: list[str] = []
    ledger.reclaim_refused = looked.append
    assert asyncio.run(storage_over(item, ledger).org_active("acme")) is False
    assert looked == ["acme"]
    # and the operators read the leases the request path wrote
    read = TABLES.orgs.from_raw_data(item)
    assert read.credits == Decimal("12.5") and read.concurrency_limit == 3
    assert float(read.leases.as_dict()["gen-1"][LEASE.exp]) == 1060.5
    assert Lease.from_attribute("gen-1", "acme", leases["gen-1"]) == lease
    renewed_attribute = renewed.to_attribute()
    renewed_attribute["M"].update({LEASE.pt: {"N": "9"}, LEASE.ct: {"N": "4"}, LEASE.cost: {"N": "0.000001"}})
    assert Lease.from_attribute("gen-2", "acme", renewed_attribute) == renewed
