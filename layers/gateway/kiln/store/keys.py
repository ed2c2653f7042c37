"""API keys: issued once, stored only as a SHA-256 hash, revoked by key id."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .clock import iso_ms, now
from .errors import AlreadyRevoked, RecordNotFound

if TYPE_CHECKING:
    from .records import Tables

__all__ = ["KEY_PREFIX", "IssuedKey", "KeyInfo", "create_key", "hash_secret", "list_keys", "looks_like_key", "revoke_key"]

KEY_PREFIX = "sk-kiln-"
# sk-kiln- + 32 random bytes, URL-safe base64 without padding (43 characters)
_KEY_SHAPE = re.compile(r"sk-kiln-[A-Za-z0-9_-]{43}")
_SHOWN_PREFIX = len(KEY_PREFIX) + 4


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


@dataclass(frozen=True)
class IssuedKey(KeyInfo):
    # Shown once, at creation; never stored.
    secret: str = ""


def _info(record) -> KeyInfo:
    return KeyInfo(
        record.key_id, record.org_id, record.status, record.prefix, record.created_at, record.revoked_at,
        record.last_used_at,
    )


def create_key(tables: Tables, org_id: str) -> IssuedKey:
    if tables.orgs.count(org_id) == 0:
        raise RecordNotFound("org", org_id)
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    record = tables.keys(
        key_hash=hash_secret(secret),
        key_id=f"key_{secrets.token_hex(8)}",
        org_id=org_id,
        status="active",
        prefix=secret[:_SHOWN_PREFIX],
        created_at=iso_ms(now()),
    )
    record.save(condition=tables.keys.key_hash.does_not_exist())
    return IssuedKey(**_info(record).__dict__, secret=secret)


def _find_by_id(tables: Tables, key_id: str):
    for record in tables.keys.by_key_id.query(key_id):
        return record
    raise RecordNotFound("key", key_id)


def revoke_key(tables: Tables, key_id: str) -> KeyInfo:
    """Refuse the key from now on (within the gateway's auth cache time)."""
    record = _find_by_id(tables, key_id)
    if record.status == "revoked":
        raise AlreadyRevoked(key_id, record.revoked_at)
    record.update(actions=[tables.keys.status.set("revoked"), tables.keys.revoked_at.set(iso_ms(now()))])
    return _info(record)


def list_keys(tables: Tables, org_id: str) -> list[KeyInfo]:
    return [_info(record) for record in tables.keys.by_org.query(org_id)]
