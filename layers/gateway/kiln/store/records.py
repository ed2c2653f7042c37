"""The DynamoDB items, as pynamodb models bound to this deployment's tables.

Table names differ per stack (and per test), so the model classes are made by `bind`,
once per process, from the settings. The key schema here must match `template.yaml`;
a test compares the two.
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
)
from pynamodb.constants import NUMBER
from pynamodb.indexes import AllProjection, GlobalSecondaryIndex
from pynamodb.models import Model

from ..jsonio import decimal_text
from ..settings import Settings

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


def bind(settings: Settings) -> Tables:
    """Model classes for the tables these settings name."""

    class KeysByKeyId(GlobalSecondaryIndex):
        Meta = _index_meta("by_key_id")
        key_id = UnicodeAttribute(hash_key=True)

    class KeysByOrg(GlobalSecondaryIndex):
        Meta = _index_meta("by_org")
        org_id = UnicodeAttribute(hash_key=True)
        created_at = UnicodeAttribute(range_key=True)

    class KeyRecord(Model):
        """An API key, found by the SHA-256 of its secret; the secret itself is never stored."""

        Meta = _meta(settings, settings.keys_table)
        key_hash = UnicodeAttribute(hash_key=True)
        key_id = UnicodeAttribute()
        org_id = UnicodeAttribute()
        status = UnicodeAttribute(default="active")  # active | revoked
        prefix = UnicodeAttribute()  # the first characters, to recognise a key in listings
        created_at = UnicodeAttribute()
        revoked_at = UnicodeAttribute(null=True)
        last_used_at = UnicodeAttribute(null=True)  # to within LAST_USED_RESOLUTION_SECONDS
        by_key_id = KeysByKeyId()
        by_org = KeysByOrg()

    class OrgRecord(Model):
        """An organisation: its limit, its prepaid credits and its requests in flight (leases)."""

        Meta = _meta(settings, settings.orgs_table)
        org_id = UnicodeAttribute(hash_key=True)
        status = UnicodeAttribute(default="active")  # active | disabled
        concurrency_limit = NumberAttribute(default=settings.default_concurrency)
        credits = DecimalAttribute(default=Decimal)
        # generation id -> {exp, key, model, endpoint, streamed, started}
        leases = MapAttribute(default=dict)
        created_at = UnicodeAttribute()

    class UsageByOrg(GlobalSecondaryIndex):
        Meta = _index_meta("by_org_time")
        org_id = UnicodeAttribute(hash_key=True)
        created_at = UnicodeAttribute(range_key=True)

    class UsageRecord(Model):
        """One admitted request, written once when it settles (or is reclaimed)."""

        Meta = _meta(settings, settings.usage_table)
        gen_id = UnicodeAttribute(hash_key=True)
        org_id = UnicodeAttribute()
        created_at = UnicodeAttribute()  # ISO 8601, UTC, milliseconds: sorts as time
        key_id = UnicodeAttribute()
        model = UnicodeAttribute()
        endpoint = UnicodeAttribute()
        streamed = BooleanAttribute()
        status = UnicodeAttribute()
        http_status = NumberAttribute(null=True)
        prompt_tokens = NumberAttribute(null=True)
        completion_tokens = NumberAttribute(null=True)
        cached_tokens = NumberAttribute(null=True)
        cost = DecimalAttribute()
        usage_source = UnicodeAttribute(null=True)  # upstream | estimated
        finish_reason = UnicodeAttribute(null=True)
        ttfb_ms = NumberAttribute(null=True)
        duration_ms = NumberAttribute(null=True)
        upstream = UnicodeAttribute(null=True)
        error = UnicodeAttribute(null=True)
        expires_at = NumberAttribute(null=True)  # epoch seconds, DynamoDB's TTL attribute
        by_org_time = UsageByOrg()

    _share_one_client(KeyRecord, OrgRecord, UsageRecord)
    return Tables(keys=KeyRecord, orgs=OrgRecord, usage=UsageRecord)


def _share_one_client(*models: type[Model]) -> None:
    """pynamodb gives every model its own botocore session and client (~80 ms each to make,
    paid at every cold start); all tables of a stack share one here."""
    shared = models[0]._get_connection().connection
    for model in models[1:]:
        table = model._get_connection()
        shared.add_meta_table(table.get_meta_table())
        table.connection = shared
