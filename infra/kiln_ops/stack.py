"""`kiln admin --stack NAME`: the settings of a deployed stack, read from its outputs.

Region and credentials come from the usual AWS configuration (environment, profile, SSO).
"""

from __future__ import annotations

import os
from dataclasses import fields, replace
from typing import Any

from kiln.settings import Settings, SettingsError, variable

from .provision import client_config

__all__ = ["OUTPUTS", "PARAMETERS", "StackNotFound", "settings_from_stack"]

# template.yaml output → the settings field it fills
OUTPUTS = {
    "KeysTableName": "keys_table",
    "OrgsTableName": "orgs_table",
    "UsageTableName": "usage_table",
    "MaintenanceParameterName": "maintenance_parameter",
    "CatalogParameterName": "catalog_parameter",
}
# outputs that stacks made before them lack
OPTIONAL_OUTPUTS = {"UpstreamApiKeyParameterName": "upstream_api_key_parameter"}
# template.yaml parameter → the settings field it fills, as the stack's functions read it (a
# usage event replayed by `kiln admin` expires as the functions' own do)
PARAMETERS = {"UsageRetentionDays": "usage_retention_days"}


class StackNotFound(Exception):
    pass


def settings_from_stack(stack_name: str, base: Settings, session: Any = None) -> Settings:
    import botocore.session
    from botocore.exceptions import ClientError

    session = session or botocore.session.get_session()
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or session.get_config_variable("region")
    region = region or base.region
    client = session.create_client("cloudformation", region_name=region, endpoint_url=base.aws_endpoint_url,
                                   config=client_config())
    try:
        stacks = client.describe_stacks(StackName=stack_name)["Stacks"]
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") == "ValidationError":  # how CloudFormation says "no such stack"
            raise StackNotFound(f"stack {stack_name!r} not found in {region}") from None
        raise
    outputs = {output["OutputKey"]: output["OutputValue"] for output in stacks[0].get("Outputs", [])}
    missing = [name for name in OUTPUTS if name not in outputs]
    if missing:
        raise StackNotFound(f"stack {stack_name!r} has no output {missing[0]}: is it a Kiln stack?")
    parameters = {parameter["ParameterKey"]: parameter.get("ParameterValue")
                  for parameter in stacks[0].get("Parameters", [])}
    return replace(
        base,
        region=outputs.get("Region", region),
        **{field: outputs[output] for output, field in OUTPUTS.items()},
        **{field: outputs[output] for output, field in OPTIONAL_OUTPUTS.items() if output in outputs},
        **{field: _as_setting(stack_name, name, field, parameters[name])
           for name, field in PARAMETERS.items() if parameters.get(name)},
    )


def _as_setting(stack_name: str, name: str, field: str, value: str) -> Any:
    """A stack parameter's value read as the functions read the variable it sets."""
    try:
        declared = next(declared for declared in fields(Settings) if declared.name == field)
        return getattr(Settings.from_env({variable(declared): value}), field)
    except SettingsError as exc:
        raise SettingsError(f"stack {stack_name!r}: its parameter {name}: {exc}") from None
