"""Reads `template.yaml`, so the local stack and the tests build exactly what is deployed."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

__all__ = ["TABLES", "PARAMETERS", "create_table_kwargs", "load_template", "repo_root", "table_properties"]

# Logical id in template.yaml → the settings field that names the table or parameter.
TABLES = {"KeysTable": "keys_table", "OrgsTable": "orgs_table", "UsageTable": "usage_table"}
PARAMETERS = {"MaintenanceParameter": "maintenance_parameter", "CatalogParameter": "catalog_parameter"}

# What CreateTable accepts of a CloudFormation table's properties.
_CREATE_TABLE_KEYS = ("AttributeDefinitions", "KeySchema", "GlobalSecondaryIndexes", "BillingMode", "SSESpecification")


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


class _CfnLoader(yaml.SafeLoader):
    """YAML with CloudFormation's short tags (!Ref, !Sub, !GetAtt …) read as their long form."""


def _intrinsic(loader: yaml.SafeLoader, tag_suffix: str, node: yaml.Node) -> Any:
    name = "Ref" if tag_suffix == "Ref" else f"Fn::{tag_suffix}"
    if isinstance(node, yaml.ScalarNode):
        value: Any = loader.construct_scalar(node)
        if tag_suffix == "GetAtt" and isinstance(value, str):
            value = value.split(".", 1)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    return {name: value}


_CfnLoader.add_multi_constructor("!", _intrinsic)


@lru_cache(maxsize=4)
def load_template(path: str | None = None) -> dict[str, Any]:
    with open(path or repo_root() / "template.yaml", encoding="utf-8") as handle:
        return yaml.load(handle, Loader=_CfnLoader)  # noqa: S506 - a safe loader with CFN tags


def table_properties(logical_id: str, template: dict[str, Any] | None = None) -> dict[str, Any]:
    template = template or load_template()
    resource = template["Resources"][logical_id]
    if resource["Type"] != "AWS::DynamoDB::Table":
        raise ValueError(f"{logical_id} is not a DynamoDB table")
    return resource["Properties"]


def create_table_kwargs(logical_id: str, table_name: str, template: dict[str, Any] | None = None) -> dict[str, Any]:
    """CreateTable arguments for one of the template's tables, under a given name."""
    properties = table_properties(logical_id, template)
    kwargs = {key: properties[key] for key in _CREATE_TABLE_KEYS if key in properties}
    if "SSESpecification" in kwargs:
        kwargs["SSESpecification"] = {"Enabled": bool(kwargs["SSESpecification"].get("SSEEnabled"))}
    kwargs["TableName"] = table_name
    return kwargs
