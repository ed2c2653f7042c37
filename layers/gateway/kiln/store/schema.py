"""The DynamoDB items, declared once: tables' keys, attribute names and types, indexes.

Everything that reads or writes an item takes its names from here: the request path's
storage (`kiln.store.storage`, the ledger, the codec) and the operators' pynamodb models,
which `kiln.store.records` builds from these declarations. `template.yaml` declares the
same keys and indexes; a test compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KEY", "LEASE", "ORG", "TALLY", "USAGE", "Attribute", "Index", "ItemSchema"]


@dataclass(frozen=True)
class Attribute:
    name: str
    kind: str  # S, N, BOOL, M, SS; "money" is an N read and written as an exact Decimal
    null: bool = False  # may be absent


@dataclass(frozen=True)
class Index:
    name: str
    hash_key: str
    range_key: str | None = None


@dataclass(frozen=True)
class ItemSchema:
    hash_key: str
    attributes: tuple[Attribute, ...]
    indexes: tuple[Index, ...] = ()

    def __getattr__(self, name: str) -> str:
        """`ORG.credits` is "credits": a name that is not declared is an error, not a typo stored."""
        for attribute in object.__getattribute__(self, "attributes"):
            if attribute.name == name:
                object.__setattr__(self, name, name)  # found once: later reads are plain attributes
                return name
        raise AttributeError(f"no attribute {name!r} in this item")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(attribute.name for attribute in self.attributes)


KEY = ItemSchema(
    hash_key="key_hash",  # the SHA-256 of the secret; the secret itself is never stored
    attributes=(
        Attribute("key_hash", "S"),
        Attribute("key_id", "S"),
        Attribute("org_id", "S"),
        Attribute("status", "S"),  # active | revoked
        Attribute("prefix", "S"),  # the first characters, to recognise a key in listings
        Attribute("created_at", "S"),
        Attribute("revoked_at", "S", null=True),
        Attribute("last_used_at", "S", null=True),
        # the key's own attributes (contract §10); absent: none
        Attribute("label", "S", null=True),
        Attribute("role", "S", null=True),  # inference (when absent) | management
        Attribute("models", "SS", null=True),  # the allowlist of catalog ids; absent: every model
        Attribute("concurrency", "N", null=True),  # its own limit of requests in flight
        Attribute("spend_limit", "money", null=True),  # USD per spend_period
        Attribute("spend_period", "S", null=True),  # day | week | month | total (when absent)
        # its spend is tallied month by month (kiln.store.tally); absent: a key made before
        # tallies were kept, whose spend is summed from its usage events
        Attribute("tallied", "BOOL", null=True),
    ),
    indexes=(Index("by_key_id", "key_id"), Index("by_org", "org_id", "created_at")),
)

ORG = ItemSchema(
    hash_key="org_id",
    attributes=(
        Attribute("org_id", "S"),
        Attribute("status", "S"),  # active | disabled
        Attribute("concurrency_limit", "N"),
        Attribute("credits", "money"),
        Attribute("leases", "M"),  # generation id -> a LEASE map: the org's requests in flight
        Attribute("created_at", "S"),
    ),
    # and top-level attributes of their own, per key with requests in flight (key_leases:<key id>)
    # or with a spend limit (key_spend:<key id>:<period>): see kiln.store.keyspend
)

# The fields of one entry of an org's `leases` map.
LEASE = ItemSchema(
    hash_key="",
    attributes=(
        Attribute("exp", "N"),  # epoch seconds: the lease expires then unless renewed
        Attribute("started", "N"),
        Attribute("key", "S"),
        Attribute("model", "S"),
        Attribute("endpoint", "S"),
        Attribute("streamed", "BOOL"),
        Attribute("pt", "N", null=True),  # prompt tokens, completion tokens and cost
        Attribute("ct", "N", null=True),  # as of the last renewal
        Attribute("cost", "money", null=True),
        Attribute("sf", "S", null=True),  # the key's spend figure this request counts in (kiln.store.keyspend)
    ),
)

USAGE = ItemSchema(
    hash_key="gen_id",
    attributes=(
        Attribute("gen_id", "S"),
        Attribute("org_id", "S"),
        Attribute("created_at", "S"),  # ISO 8601, UTC, milliseconds: sorts as time
        Attribute("key_id", "S"),
        Attribute("model", "S"),
        Attribute("endpoint", "S"),
        Attribute("streamed", "BOOL"),
        Attribute("status", "S"),
        Attribute("cost", "money"),
        Attribute("http_status", "N", null=True),
        Attribute("prompt_tokens", "N", null=True),
        Attribute("completion_tokens", "N", null=True),
        Attribute("cached_tokens", "N", null=True),
        Attribute("usage_source", "S", null=True),  # upstream | estimated | capped
        Attribute("finish_reason", "S", null=True),
        Attribute("ttfb_ms", "N", null=True),
        Attribute("duration_ms", "N", null=True),
        Attribute("upstream", "S", null=True),
        Attribute("error", "S", null=True),
        Attribute("expires_at", "N", null=True),  # epoch seconds, DynamoDB's TTL attribute
        # its cost is in its key's tally (kiln.store.tally): every event the ledger writes;
        # absent: an event of a version that kept no tallies, until `kiln admin keys tally`
        Attribute("tallied", "BOOL", null=True),
    ),
    indexes=(Index("by_org_time", "org_id", "created_at"),),
)

# A key's spend in one UTC month, in the usage table beside its events (kiln.store.tally):
# its id is no generation id, and it has no org_id or created_at, so by_org_time never holds it.
TALLY = ItemSchema(
    hash_key="gen_id",  # "tally:<key id>:<YYYY-MM>"
    attributes=(
        Attribute("gen_id", "S"),
        Attribute("month", "money"),  # the month's sum
        *(Attribute(f"d{day:02d}", "money", null=True) for day in range(1, 32)),  # each day's
    ),
)
