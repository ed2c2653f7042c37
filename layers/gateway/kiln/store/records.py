"""The DynamoDB items, as pynamodb models bound to this deployment's tables.

Table names differ per stack (and per test), so the model classes are made by `bind`,
once per process, from the settings; their attributes and indexes are those declared in
`kiln.store.schema` (which `template.yaml` must match: a test compares the two).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from pynamodb.attributes import (
    Attribute,
    BooleanAttribute,
    MapAttribute,
    NumberAttribute,
    UnicodeAttribute,
    UnicodeSetAttribute,
)
from pynamodb.constants import NUMBER
from pynamodb.indexes import AllProjection, GlobalSecondaryIndex
from pynamodb.models import Model

from ..jsonio import decimal_text
from ..settings import Settings
from .schema import KEY, ORG, USAGE, ItemSchema

__all__ = ["DecimalAttribute", "Tables", "bind"]


class DecimalAttribute(Attribute[Decimal]):
    """A DynamoDB number read and written as an exact Decimal (money)."""

    attr_type = NUMBER

    def serialize(self, value: Any) -> str:
        return decimal_text(Decimal(value))

    def deserialize(self, value: str) -> Decimal:
        return Decimal(value)


@dataclass(frozen=True)
class Tables:
    """The three bound models and the low-level client the hot path shares with them."""

    keys: type[Model]
    orgs: type[Model]
    usage: type[Model]

    @property
    def client(self) -> Any:
        # pynamodb's own botocore client: one connection pool, one set of credentials.
        return self.orgs._get_connection().connection.client

    @property
    def session(self) -> Any:
        """The botocore session behind the client (to make other AWS clients cheaply)."""
        return self.orgs._get_connection().connection.session

    @property
    def orgs_table(self) -> str:
        return self.orgs.Meta.table_name

    @property
    def usage_table(self) -> str:
        return self.usage.Meta.table_name


def _meta(settings: Settings, table_name: str) -> type:
    attributes: dict[str, Any] = {
        "table_name": table_name,
        "region": settings.region,
        "host": settings.aws_endpoint_url,
        "connect_timeout_seconds": 3,
        "read_timeout_seconds": 10,
        "max_retry_attempts": 3,
        "max_pool_connections": 64,
    }
    if settings.aws_endpoint_url and not os.environ.get("AWS_ACCESS_KEY_ID"):
        # an emulator checks no signature; without this, botocore refuses to send at all
        attributes.update(aws_access_key_id="emulator", aws_secret_access_key="emulator")
    return type("Meta", (), attributes)


def _index_meta(name: str) -> type:
    return type("Meta", (), {"index_name": name, "projection": AllProjection()})


_KINDS = {"S": UnicodeAttribute, "N": NumberAttribute, "BOOL": BooleanAttribute, "M": MapAttribute,
          "SS": UnicodeSetAttribute, "money": DecimalAttribute}


def _model(name: str, doc: str, schema: ItemSchema, meta: type, defaults: dict[str, Any]) -> type[Model]:
    """A pynamodb model of one item of `kiln.store.schema`, with its indexes."""
    body: dict[str, Any] = {"__doc__": doc, "Meta": meta}
    for attribute in schema.attributes:
        options: dict[str, Any] = {"null": True} if attribute.null else {}
        if attribute.name == schema.hash_key:
            options["hash_key"] = True
        if attribute.name in defaults:
            options["default"] = defaults[attribute.name]
        body[attribute.name] = _KINDS[attribute.kind](**options)
    for index in schema.indexes:
        keys: dict[str, Any] = {index.hash_key: UnicodeAttribute(hash_key=True)}
        if index.range_key:
            keys[index.range_key] = UnicodeAttribute(range_key=True)
        body[index.name] = type(f"{name}_{index.name}", (GlobalSecondaryIndex,), {"Meta": _index_meta(index.name), **keys})()
    return type(name, (Model,), body)


def bind(settings: Settings) -> Tables:
    """Model classes for the tables these settings name, built from `kiln.store.schema`."""
    keys = _model("KeyRecord", "An API key, found by the SHA-256 of its secret.", KEY,
                  _meta(settings, settings.keys_table), {KEY.status: "active"})
    orgs = _model("OrgRecord", "An organisation: its limit, prepaid credits and requests in flight.", ORG,
                  _meta(settings, settings.orgs_table),
                  {ORG.status: "active", ORG.concurrency_limit: settings.default_concurrency, ORG.credits: Decimal,
                   ORG.leases: dict})
    usage = _model("UsageRecord", "One admitted request, written once when it settles (or is reclaimed).", USAGE,
                   _meta(settings, settings.usage_table), {})
    _share_one_client(keys, orgs, usage)
    return Tables(keys=keys, orgs=orgs, usage=usage)


def _share_one_client(*models: type[Model]) -> None:
    """pynamodb gives every model its own botocore session and client (~80 ms each to make,
    paid at every cold start); all tables of a stack share one here."""
    shared = models[0]._get_connection().connection
    for model in models[1:]:
        table = model._get_connection()
        shared.add_meta_table(table.get_meta_table())
        table.connection = shared
