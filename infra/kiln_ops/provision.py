"""Creates what a stack needs and does not have yet: tables, parameters, the catalog.

Used by the local stack and the tests (against the emulator); idempotent, so running it
twice against the same endpoint changes nothing.
"""

from __future__ import annotations

import os
from typing import Any

from kiln.settings import Settings

from .template import TABLES, create_table_kwargs

# What SSM Parameter Store holds in one value, by tier (the catalog is an advanced parameter).
PARAMETER_VALUE_LIMITS = {"Standard": 4096, "Advanced": 8192}

__all__ = ["aws_clients", "client_config", "provision"]


def client_config() -> Any:
    """How long kiln admin's botocore clients wait, as its table models do (kiln.store.records):
    an endpoint that takes a connection and never answers fails a command in well under a
    minute, not after botocore's 60 s read timeout on each of its tries."""
    from botocore.config import Config

    return Config(connect_timeout=3, read_timeout=10, retries={"total_max_attempts": 3, "mode": "standard"})


def aws_clients(settings: Settings, session: Any = None) -> tuple[Any, Any]:
    """DynamoDB and SSM clients for these settings (the emulator when an endpoint is set)."""
    import botocore.session

    session = session or botocore.session.get_session()
    if settings.aws_endpoint_url and not os.environ.get("AWS_ACCESS_KEY_ID"):
        session.set_credentials("emulator", "emulator")  # an emulator checks no signature
    make = lambda service: session.create_client(  # noqa: E731
        service, region_name=settings.region, endpoint_url=settings.aws_endpoint_url, config=client_config()
    )
    return make("dynamodb"), make("ssm")


def provision(settings: Settings, *, catalog_json: str, dynamodb: Any, ssm: Any, replace_catalog: bool = False) -> list[str]:
    """Create missing tables and parameters; returns what it did ("created table …", "replaced parameter …")."""
    created: list[str] = []
    existing = set()
    for page in dynamodb.get_paginator("list_tables").paginate():
        existing.update(page.get("TableNames", []))
    for logical_id, field in TABLES.items():
        name = getattr(settings, field)
        if name not in existing:
            dynamodb.create_table(**create_table_kwargs(logical_id, name))
            dynamodb.get_waiter("table_exists").wait(TableName=name, WaiterConfig={"Delay": 1, "MaxAttempts": 60})
            created.append(f"created table {name}")
    # In AWS these are written by operators, never by the stack (template.yaml): here, by the local stack.
    initial = {"maintenance_parameter": '{"enabled": false}', "catalog_parameter": catalog_json}
    for field, value in initial.items():
        name = getattr(settings, field)
        there = _parameter_exists(ssm, name)
        if not there or (replace_catalog and field == "catalog_parameter"):
            ssm.put_parameter(Name=name, Value=value, Type="String", Overwrite=True, Tier="Advanced")
            # one that was there is replaced (the local catalog, pointed at this start's model server)
            created.append(f"{'replaced' if there else 'created'} parameter {name}")
    return created


def _parameter_exists(ssm: Any, name: str) -> bool:
    try:
        ssm.get_parameter(Name=name)
        return True
    except ssm.exceptions.ParameterNotFound:
        return False
