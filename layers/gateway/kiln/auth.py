"""Bearer-key authentication with a short in-memory cache (contract §2 step 3).

A hit costs no I/O. A miss reads the key (by the SHA-256 of the secret), then its org;
concurrent misses for the same key share those reads. Revocation and org status changes
take effect within `auth_cache_seconds`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from functools import partial
from typing import Callable

from .errors import InvalidApiKey, OrganizationDisabled
from .store.clock import iso_ms
from .store.keys import hash_secret, looks_like_key
from .store.keyspend import KeyLimits
from .store.storage import Storage

__all__ = ["LAST_USED_RESOLUTION_SECONDS", "Authenticator", "Principal"]

log = logging.getLogger("kiln.auth")
# A key's last_used_at is written at most this often, off the request path, and only by a
# request that writes anyway (an admission, a key's change): an invalid request, or a read,
# costs no write (contract §2, §10).
LAST_USED_RESOLUTION_SECONDS = 600


class Principal:
    """Who a key belongs to and what it may do, as cached (never changed once made)."""

    __slots__ = ("key_id", "org_id", "key_active", "org_active", "role", "models", "limits")

    def __init__(self, key_id: str, org_id: str, key_active: bool, org_active: bool, *, role: str = "inference",
                 models: frozenset[str] | None = None, limits: KeyLimits | None = None) -> None:
        self.key_id = key_id
        self.org_id = org_id
        self.key_active = key_active
        self.org_active = org_active
        self.role = role
        self.models = models  # the key's allowlist; None: every model of the catalog
        self.limits = limits or KeyLimits()

    @property
    def management(self) -> bool:
        return self.role == "management"

    def may_use(self, model_id: str) -> bool:
        return self.models is None or model_id in self.models


class Authenticator:
    def __init__(
        self,
        storage: Storage,
        *,
        cache_seconds: float,
        max_entries: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._storage = storage
        self._ttl = cache_seconds
        self._max_entries = max_entries
        self._clock = clock
        self._cache: OrderedDict[str, tuple[float, Principal | None]] = OrderedDict()
        self._pending: dict[str, _Lookup] = {}
        self._touches: set[asyncio.Task] = set()
        # keys whose last_used_at is due for an update, by id: their hash, until they are `used`
        self._due: OrderedDict[str, str] = OrderedDict()
        # when this process last wrote a key's last_used_at, by id: a lookup that read it before
        # that write landed does not make it due again
        self._touched: OrderedDict[str, float] = OrderedDict()
        # bumped by forget_key: a lookup that began before a key was forgotten may have read
        # it as it was, and must not put that back in the cache
        self._forgets = 0

    async def authenticate(self, authorization: str | None) -> Principal:
        key_hash = _key_hash(authorization)
        if key_hash is None:
            raise InvalidApiKey()
        principal = await self._principal(key_hash)
        if principal is None or not principal.key_active:
            raise InvalidApiKey()
        if not principal.org_active:
            raise OrganizationDisabled("Your organization is disabled. Contact support.")
        return principal

    def answers_at_once(self, authorization: str | None) -> bool:
        """`authenticate` would answer from memory: a credential that is no key, or a key
        whose lookup is cached."""
        key_hash = _key_hash(authorization)
        return key_hash is None or self._cached(key_hash) is not None

    def _cached(self, key_hash: str) -> tuple[float, Principal | None] | None:
        """The key's cache entry while it is fresh."""
        cached = self._cache.get(key_hash)
        return cached if cached is not None and cached[0] > self._clock() else None

    async def _principal(self, key_hash: str) -> Principal | None:
        cached = self._cached(key_hash)
        if cached is not None:
            return cached[1]
        lookup = self._pending.get(key_hash)
        if lookup is None:
            # one lookup per key at a time, in a task of its own: the requests awaiting it share
            # its outcome, and none of them ending (its deadline, its client gone) ends it for
            # the others, whose outcome would then be that cancellation
            lookup = _Lookup(asyncio.ensure_future(self._lookup(key_hash, self._forgets)))
            self._pending[key_hash] = lookup
            lookup.task.add_done_callback(partial(self._looked_up, key_hash, lookup))
        lookup.waiting += 1
        try:
            return await asyncio.shield(lookup.task)
        finally:
            lookup.waiting -= 1
            if not lookup.waiting:  # no request waits for it any more: it stops, as theirs did,
                if self._pending.get(key_hash) is lookup:  # and a request coming next reads anew
                    del self._pending[key_hash]  # (joining it, it would get its cancellation)
                lookup.task.cancel()

    async def _lookup(self, key_hash: str, forgets: int) -> Principal | None:
        principal, stale_last_used = await self._load(key_hash)
        if forgets == self._forgets:  # no key was forgotten meanwhile: what was read is current
            self._remember(key_hash, principal)
        if stale_last_used and principal is not None:
            touched = self._touched.get(principal.key_id)
            if touched is None or self._clock() - touched >= LAST_USED_RESOLUTION_SECONDS:
                self._due[principal.key_id] = key_hash
                while len(self._due) > self._max_entries:
                    self._due.popitem(last=False)
        return principal

    def used(self, principal: Principal) -> None:
        """The key does what writes anyway (its request goes to admission, it changes a key):
        its last_used_at, if due, is written in a task of its own, never on the request's path."""
        key_hash = self._due.pop(principal.key_id, None)
        if key_hash is not None:
            self._touched[principal.key_id] = self._clock()
            self._touched.move_to_end(principal.key_id)
            while len(self._touched) > self._max_entries:
                self._touched.popitem(last=False)
            task = asyncio.ensure_future(self._touch(key_hash))
            self._touches.add(task)  # held until done, and not awaited
            task.add_done_callback(self._touches.discard)

    def _looked_up(self, key_hash: str, lookup: "_Lookup", task: asyncio.Future) -> None:
        if self._pending.get(key_hash) is lookup:
            del self._pending[key_hash]
        if not task.cancelled():
            task.exception()  # retrieved: its requests, if any are left, raise it

    async def _touch(self, key_hash: str) -> None:
        try:
            await self._storage.touch_key(key_hash, iso_ms(time.time()))
        except Exception as exc:  # noqa: BLE001 - bookkeeping only; the request is not concerned
            log.warning("could not record a key's last use: %s", type(exc).__name__)

    def forget_key(self, key_id: str) -> None:
        """Drop a key from this process's cache at once (it was revoked or changed here)."""
        self._forgets += 1
        for key_hash in list(self._pending):
            del self._pending[key_hash]  # a lookup already under way is not shared with later ones
        for key_hash, (_, principal) in list(self._cache.items()):
            if principal is not None and principal.key_id == key_id:
                del self._cache[key_hash]

    def _remember(self, key_hash: str, principal: Principal | None) -> None:
        if principal is None:
            return  # unknown keys are not cached: a key created a moment ago must work at once
        self._cache[key_hash] = (self._clock() + self._ttl, principal)
        self._cache.move_to_end(key_hash)
        while len(self._cache) > self._max_entries:
            self._cache.popitem(last=False)

    async def _load(self, key_hash: str) -> tuple[Principal | None, bool]:
        """The key's principal, and whether its last_used_at is due for an update."""
        key = await self._storage.find_key(key_hash)
        if key is None:
            return None, False
        org_active = await self._storage.org_active(key.org_id)
        if org_active is None:
            return None, False
        principal = Principal(key.key_id, key.org_id, key.active, org_active, role=key.role, models=key.models,
                              limits=key.limits)
        due = iso_ms(time.time() - LAST_USED_RESOLUTION_SECONDS)
        return principal, key.active and key.last_used_at < due


def _key_hash(authorization: str | None) -> str | None:
    """The hash a key is stored by, if the header carries something shaped like a key."""
    secret = bearer_token(authorization)
    return hash_secret(secret) if secret is not None and looks_like_key(secret) else None


def bearer_token(authorization: str | None) -> str | None:
    """The token of a `Bearer` Authorization header; None for any other."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


class _Lookup:
    """A key's lookup under way, and how many requests wait for it."""

    __slots__ = ("task", "waiting")

    def __init__(self, task: asyncio.Future) -> None:
        self.task = task
        self.waiting = 0
