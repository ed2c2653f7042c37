"""Reads `template.yaml`, so the local stack and the tests build exactly what is deployed.

`translate()` gives the template as CloudFormation receives it: SAM's own translator, run
offline, then the template's conditions and parameters resolved for one set of parameter
values. SAM CLI's local view of a template differs from what SAM deploys (it merges API
events into an inline OpenAPI body that the deployed API never gets): checks of the
deployed shape read this, not the source text.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "PSEUDO_PARAMETERS",
    "TABLES",
    "create_table_kwargs",
    "load_template",
    "repo_root",
    "resolve",
    "table_properties",
    "translate",
]

# Logical id in template.yaml → the settings field that names the table.
TABLES = {"KeysTable": "keys_table", "OrgsTable": "orgs_table", "UsageTable": "usage_table"}

# What a deploy of stack "kiln" in us-east-1 would substitute.
PSEUDO_PARAMETERS = {
    "AWS::Region": "us-east-1",
    "AWS::AccountId": "123456789012",
    "AWS::Partition": "aws",
    "AWS::StackName": "kiln",
    "AWS::URLSuffix": "amazonaws.com",
}

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


class _NoManagedPolicies:
    """SAM asks IAM for managed policy ARNs only for `Policies` on a function; the template
    gives every function its own role, so nothing may be looked up (and nothing goes online)."""

    def load(self) -> dict[str, str]:
        return {}


def translate(parameters: dict[str, Any] | None = None, template: dict[str, Any] | None = None) -> dict[str, Any]:
    """The CloudFormation template a deploy with these parameter values creates: SAM's
    transform, offline, then conditions, parameters and pseudo parameters resolved."""
    import copy

    import boto3
    from samtranslator.parser.parser import Parser
    from samtranslator.translator.translator import Translator

    source = copy.deepcopy(template or load_template())
    for resource in source["Resources"].values():  # what `sam package` does: code lives in S3
        properties = resource.get("Properties", {})
        for key in ("CodeUri", "ContentUri"):
            if isinstance(properties.get(key), str):
                properties[key] = f"s3://kiln-artifacts/{properties[key]}"
    values = {**PSEUDO_PARAMETERS, **(parameters or {})}
    translator = Translator(None, Parser(), boto_session=boto3.session.Session(region_name=values["AWS::Region"]))
    policies = _NoManagedPolicies()
    translated = translator.translate(source, parameter_values=dict(values), get_managed_policy_map=policies.load)
    return resolve(translated, parameters)


_NO_VALUE = object()


def _parameter_values(template: dict[str, Any], parameters: dict[str, Any] | None) -> dict[str, Any]:
    values: dict[str, Any] = {**PSEUDO_PARAMETERS, **{name: value for name, value in (parameters or {}).items()
                                                     if name in PSEUDO_PARAMETERS}}
    for name, spec in template.get("Parameters", {}).items():
        raw = (parameters or {}).get(name, spec.get("Default"))
        if spec["Type"] == "Number":
            raw = int(raw) if float(raw).is_integer() else float(raw)
        elif spec["Type"] == "CommaDelimitedList" and isinstance(raw, str):
            raw = raw.split(",")
        elif isinstance(raw, str) and spec.get("AllowedValues") and raw not in spec["AllowedValues"]:
            raise ValueError(f"{name}={raw!r} is not one of {spec['AllowedValues']}")
        values[name] = raw
    return values


def resolve(template: dict[str, Any], parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    """A CloudFormation template with its conditions decided: resources and outputs whose
    condition is false are gone, `Fn::If` and `AWS::NoValue` are resolved, and `Ref`s to
    parameters and `${...}` of parameters in `Fn::Sub` are replaced by their values."""
    values = _parameter_values(template, parameters)
    conditions: dict[str, bool] = {}

    def condition(name: str) -> bool:
        if name not in conditions:
            conditions[name] = bool(evaluate(template["Conditions"][name]))
        return conditions[name]

    def evaluate(node: Any) -> Any:
        if isinstance(node, dict) and len(node) == 1:
            (key, arg), = node.items()
            if key == "Ref" and arg in values:
                return values[arg]
            if key == "Condition":
                return condition(arg)
            if key == "Fn::Equals":
                return evaluate(arg[0]) == evaluate(arg[1])
            if key == "Fn::Not":
                return not evaluate(arg[0])
            if key == "Fn::And":
                return all(evaluate(item) for item in arg)
            if key == "Fn::Or":
                return any(evaluate(item) for item in arg)
            if key == "Fn::Join":
                return arg[0].join(str(item) for item in evaluate(arg[1]))
        if isinstance(node, list):
            return [evaluate(item) for item in node]
        return node

    def substitute(text: str) -> str:
        import re

        return re.sub(r"\$\{([^}!.]+)\}", lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), text)

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if len(node) == 1:
                (key, arg), = node.items()
                if key == "Fn::If":
                    name, when_true, when_false = arg
                    return walk(when_true if condition(name) else when_false)
                if key == "Ref" and arg == "AWS::NoValue":
                    return _NO_VALUE
                if key == "Ref" and arg in values:
                    return values[arg]
                if key == "Fn::Sub" and isinstance(arg, str):
                    text = substitute(arg)
                    return text if "${" not in text else {"Fn::Sub": text}
            resolved = {key: walk(value) for key, value in node.items()}
            return {key: value for key, value in resolved.items() if value is not _NO_VALUE}
        if isinstance(node, list):
            return [item for item in (walk(item) for item in node) if item is not _NO_VALUE]
        return node

    out = dict(template)
    for section in ("Resources", "Outputs"):
        kept = {name: entry for name, entry in template.get(section, {}).items()
                if "Condition" not in entry or condition(entry["Condition"])}
        out[section] = walk(kept)
    return out
