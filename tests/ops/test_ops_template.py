"""template.yaml is the schema: the pynamodb models and the emulator's tables come from it."""

from __future__ import annotations

from kiln.settings import Settings
from kiln.store import bind
from kiln_ops.template import TABLES, create_table_kwargs, load_template, table_properties


def _keys(schema):
    return {entry["KeyType"]: entry["AttributeName"] for entry in schema}


def test_models_match_the_template_key_schema():
    tables = bind(Settings())
    models = {"KeysTable": tables.keys, "OrgsTable": tables.orgs, "UsageTable": tables.usage}
    for logical_id, model in models.items():
        properties = table_properties(logical_id)
        hash_key = next(name for name, attr in model.get_attributes().items() if attr.is_hash_key)
        assert _keys(properties["KeySchema"]) == {"HASH": hash_key}, logical_id
        template_indexes = {
            index["IndexName"]: _keys(index["KeySchema"]) for index in properties.get("GlobalSecondaryIndexes", [])
        }
        schemas = [index._get_schema() for index in model._indexes.values()]
        model_indexes = {schema["index_name"]: _keys(schema["key_schema"]) for schema in schemas}
        assert template_indexes == model_indexes, logical_id


def test_tables_are_on_demand_encrypted_and_recoverable():
    for logical_id in TABLES:
        properties = table_properties(logical_id)
        assert properties["BillingMode"] == "PAY_PER_REQUEST"
        assert properties["SSESpecification"]["SSEEnabled"] is True
        assert properties["PointInTimeRecoverySpecification"]["PointInTimeRecoveryEnabled"] is True


def test_the_emulator_tables_are_created_from_the_template(stack):
    for logical_id, field in TABLES.items():
        name = getattr(stack.settings, field)
        described = stack.dynamodb.describe_table(TableName=name)["Table"]
        expected = create_table_kwargs(logical_id, name)
        assert described["KeySchema"] == expected["KeySchema"]
        assert sorted(i["IndexName"] for i in described.get("GlobalSecondaryIndexes", [])) == sorted(
            i["IndexName"] for i in expected.get("GlobalSecondaryIndexes", [])
        )


def test_short_intrinsic_tags_are_read():
    template = load_template()
    assert template["Resources"]["ApiAccessLogGroup"]["Properties"]["LogGroupName"] == {"Fn::Sub": "/${AWS::StackName}/api-access"}
    assert template["Outputs"]["KeysTableName"]["Value"] == {"Ref": "KeysTable"}
