"""API keys: issued once, stored only as a SHA-256 hash, revoked by key id.

The secret's shape and hash live here (authentication checks them on every request); key
management itself is `kiln.store.keyring`, for the API and the CLI alike. The functions
below are its synchronous form for operators' tools and tests: each call runs on a fresh
event loop and client, against the tables a bound `Tables` names.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Collection, TypeVar

if TYPE_CHECKING:
    from .keyring import Keyring
    from .records import Tables

__all__ = [
    "KEY_PREFIX",
    "IssuedKey",
    "KeyInfo",
    "create_key",
    "hash_secret",
    "list_keys",
    "looks_like_key",
    "revoke_key",
    "update_key",
    "with_keyring",
]

KEY_PREFIX = "sk-kiln-"
# sk-kiln- + 32 random bytes, URL-safe base64 without padding (43 characters)
_KEY_SHAPE = re.compile(r"sk-kiln-[A-Za-z0-9_-]{43}")
_SHOWN_PREFIX = len(KEY_PREFIX) + 4
T = TypeVar("T")


def looks_like_key(secret: str) -> bool:
    return _KEY_SHAPE.fullmatch(secret) is not None


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class KeyInfo:
    key_id: str
    org_id: str
    status: str
    prefix: str
    created_at: str
    revoked_at: str | None = None
    last_used_at: str | None = None
    # the key's own attributes (contract §10)
    label: str | None = None
    role: str = "inference"
    models: tuple[str, ...] | None = None  # the allowlist; None: every model
    concurrency: int | None = None  # None: the org's limit
    spend_limit: Decimal | None = None  # USD per spend_period; None: no limit
    spend_period: str = "total"
    tallied: bool = False  # its spend is tallied (kiln.store.tally); else summed from its events


@dataclass(frozen=True)
class IssuedKey(KeyInfo):
    # Shown once, at creation; never stored.
    secret: str = ""


# what an operator's tool (kiln admin, kiln dev's set-up) calls DynamoDB as: not the gateway
OPERATOR_AGENT = "kiln-admin"


def with_keyring(tables: Tables, use: Callable[[Keyring], Awaitable[T]]) -> T:
    """`use(keyring)` on a fresh loop and client, over the tables `tables` names (the usage
    events included: a key's spend without a limit, and a new limit's figure, come from them)."""
    from ..aws import AwsClient
    from .keyring import Keyring

    meta = tables.keys.Meta

    async def main() -> T:
        aws = AwsClient(region=meta.region, endpoint_url=meta.host, user_agent=OPERATOR_AGENT)
        try:
            return await use(Keyring(aws, keys_table=meta.table_name, orgs_table=tables.orgs.Meta.table_name,
                                     usage_table=tables.usage.Meta.table_name))
        finally:
            await aws.aclose()

    # a loop of its own, never made the thread's current one: asyncio.run would leave the
    # thread without one, which a caller's own event loop code (Mangum's) may then miss
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def create_key(tables: Tables, org_id: str, *, known_models: Collection[str] | None = None,
               **attributes: Any) -> IssuedKey:
    """A new key of the org; `attributes` are those of keyring.EDITABLE (None: left out)."""
    given = {name: value for name, value in attributes.items() if value is not None}
    return with_keyring(tables, lambda keyring: keyring.create(org_id, given, known_models=known_models))


def update_key(tables: Tables, key_id: str, *, known_models: Collection[str] | None = None,
               **changes: Any) -> KeyInfo:
    """Set the given attributes of a key; one given as None is cleared (back to its default)."""
    return with_keyring(tables, lambda keyring: keyring.update(key_id, changes, known_models=known_models))


def revoke_key(tables: Tables, key_id: str) -> KeyInfo:
    """Refuse the key from now on (within the gateway's auth cache time)."""
    return with_keyring(tables, lambda keyring: keyring.revoke(key_id))


def list_keys(tables: Tables, org_id: str) -> list[KeyInfo]:
    return with_keyring(tables, lambda keyring: keyring.list(org_id))
