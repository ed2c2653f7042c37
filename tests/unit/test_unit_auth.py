"""The key cache: a hit costs no read; a key forgotten here is read again, even when a lookup
that began before was still under way."""

from __future__ import annotations

import asyncio

import pytest

from kiln.auth import Authenticator
from kiln.errors import InvalidApiKey
from kiln.store.keys import hash_secret
from kiln.store.keyspend import KeyLimits
from kiln.store.storage import KeyEntry

SECRET = "sk-kiln-" + "a" * 43


class SlowStorage:
    """Keys read from a dict, each read waiting for `gate` when one is set."""

    def __init__(self) -> None:
        self.keys = {hash_secret(SECRET): KeyEntry("key_1", "acme", True, "2099-01-01T00:00:00.000Z")}
        self.reads = 0
        self.gate: asyncio.Event | None = None

    async def find_key(self, key_hash: str) -> KeyEntry | None:
        self.reads += 1
        entry = self.keys.get(key_hash)
        if self.gate is not None:
            await self.gate.wait()
        return entry

    async def org_active(self, org_id: str) -> bool:
        return True

    async def touch_key(self, key_hash: str, when: str) -> None:
        pass


def test_a_cached_key_costs_no_read_and_a_forgotten_one_is_read_again():
    storage = SlowStorage()
    auth = Authenticator(storage, cache_seconds=60)

    async def scenario():
        await auth.authenticate(f"Bearer {SECRET}")
        await auth.authenticate(f"Bearer {SECRET}")
        assert storage.reads == 1
        storage.keys[hash_secret(SECRET)] = KeyEntry("key_1", "acme", True, "2099-01-01T00:00:00.000Z",
                                                     limits=KeyLimits(concurrency=1))
        auth.forget_key("key_1")
        principal = await auth.authenticate(f"Bearer {SECRET}")
        assert storage.reads == 2 and principal.limits.concurrency == 1

    asyncio.run(scenario())


def test_a_lookup_under_way_when_the_key_is_revoked_does_not_cache_what_it_read():
    storage = SlowStorage()
    auth = Authenticator(storage, cache_seconds=60)

    async def scenario():
        storage.gate = asyncio.Event()
        early = asyncio.create_task(auth.authenticate(f"Bearer {SECRET}"))  # reads the key while active
        await asyncio.sleep(0)
        storage.keys[hash_secret(SECRET)] = KeyEntry("key_1", "acme", False, "")  # revoked meanwhile
        auth.forget_key("key_1")
        late = asyncio.create_task(auth.authenticate(f"Bearer {SECRET}"))  # after the revoke: its own read
        await asyncio.sleep(0)
        storage.gate.set()
        assert (await early).key_id == "key_1"  # began before the revoke: may still pass
        with pytest.raises(InvalidApiKey):
            await late
        storage.gate = None
        with pytest.raises(InvalidApiKey):  # and the early read was not cached over the revoke
            await auth.authenticate(f"Bearer {SECRET}")

    asyncio.run(scenario())
