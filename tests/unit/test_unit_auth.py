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
        while storage.reads < 1:
            await asyncio.sleep(0)
        storage.keys[hash_secret(SECRET)] = KeyEntry("key_1", "acme", False, "")  # revoked meanwhile
        auth.forget_key("key_1")
        late = asyncio.create_task(auth.authenticate(f"Bearer {SECRET}"))  # after the revoke: its own read
        while storage.reads < 2:
            await asyncio.sleep(0)
        storage.gate.set()
        assert (await early).key_id == "key_1"  # began before the revoke: may still pass
        with pytest.raises(InvalidApiKey):
            await late
        storage.gate = None
        with pytest.raises(InvalidApiKey):  # and the early read was not cached over the revoke
            await auth.authenticate(f"Bearer {SECRET}")

    asyncio.run(scenario())


def test_a_lookup_shared_by_two_requests_outlives_the_first_ones_end():
    """Two requests of one key at once share its lookup. The first was cut short (its deadline,
    a client gone): its cancellation became the lookup's outcome, and the second request, a chat
    completion, got CancelledError, a bare 500. The lookup now runs on its own: the second gets
    the key, and the key is cached."""
    storage = SlowStorage()
    storage.gate = asyncio.Event()
    auth = Authenticator(storage, cache_seconds=60)

    async def scenario():
        first = asyncio.ensure_future(auth.authenticate(f"Bearer {SECRET}"))
        await asyncio.sleep(0.01)
        second = asyncio.ensure_future(auth.authenticate(f"Bearer {SECRET}"))
        await asyncio.sleep(0.01)
        first.cancel()  # the first request is cut while the read is under way
        with pytest.raises(asyncio.CancelledError):
            await first
        storage.gate.set()
        principal = await second
        assert principal.key_id == "key_1" and storage.reads == 1
        await auth.authenticate(f"Bearer {SECRET}")
        assert storage.reads == 1  # cached by the lookup, though its first requester was gone

    asyncio.run(scenario())


def test_a_failed_shared_lookup_fails_each_of_its_requests_and_the_next_reads_again():
    storage = SlowStorage()
    storage.gate = asyncio.Event()
    auth = Authenticator(storage, cache_seconds=60)
    failing = True

    async def org_active(org_id):
        if failing:
            raise ConnectionError("storage down")
        return True

    storage.org_active = org_active

    async def scenario():
        nonlocal failing
        waiting = [asyncio.ensure_future(auth.authenticate(f"Bearer {SECRET}")) for _ in range(3)]
        await asyncio.sleep(0.01)
        storage.gate.set()
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        assert [type(outcome) for outcome in outcomes] == [ConnectionError] * 3 and storage.reads == 1
        failing = False
        assert (await auth.authenticate(f"Bearer {SECRET}")).key_id == "key_1" and storage.reads == 2

    asyncio.run(scenario())


def test_a_lookup_no_request_waits_for_any_more_stops():
    """Requests of unknown keys cut short (their deadline, a client gone) each left their
    lookup running on a slow storage: 2 000 of them, 2 000 reads going on. A lookup stops when
    the last request waiting for it has."""
    storage = SlowStorage()
    storage.gate = asyncio.Event()  # never set: storage does not answer
    auth = Authenticator(storage, cache_seconds=60)

    async def scenario():
        async def gives_up(secret):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.05):
                    await auth.authenticate(f"Bearer {secret}")

        await asyncio.gather(*[gives_up("sk-kiln-" + f"{index:043d}") for index in range(200)])
        await asyncio.sleep(0.01)
        assert storage.reads == 200 and not auth._pending
        assert not [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]

    asyncio.run(scenario())


def test_a_request_coming_as_the_last_one_leaves_reads_anew_not_its_cancellation():
    """The last request waiting for a lookup left and stopped it; the lookup stayed shared for
    a loop turn, and a request of the same key coming then got its cancellation: a bare 500."""
    storage = SlowStorage()
    storage.gate = asyncio.Event()
    auth = Authenticator(storage, cache_seconds=60)

    async def scenario():
        first = asyncio.ensure_future(auth.authenticate(f"Bearer {SECRET}"))
        while storage.reads < 1:
            await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)  # the first has left; its lookup's end is not reported yet
        second = asyncio.ensure_future(auth.authenticate(f"Bearer {SECRET}"))
        await asyncio.sleep(0.01)
        storage.gate.set()
        assert (await second).key_id == "key_1" and storage.reads == 2

    asyncio.run(scenario())


def test_a_keys_last_use_is_written_once_though_lookups_read_it_stale_before_the_write_lands():
    """Each lookup that read a last use older than ten minutes made the key due again, and the
    write, made only once the request goes to admission, had not landed yet: two lookups (a
    cache entry that expired, another environment's, no cache) made two writes. This process
    writes it once in ten minutes."""
    storage = SlowStorage()
    storage.keys[hash_secret(SECRET)] = KeyEntry("key_1", "acme", True, "2020-01-01T00:00:00.000Z")  # stale
    touches: list[str] = []

    async def touch_key(key_hash: str, when: str) -> None:
        touches.append(key_hash)
        await asyncio.sleep(0.05)  # not landed yet: the next lookup still reads it stale

    storage.touch_key = touch_key
    auth = Authenticator(storage, cache_seconds=0)  # every request looks its key up

    async def scenario():
        for _ in range(3):
            auth.used(await auth.authenticate(f"Bearer {SECRET}"))
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)

    asyncio.run(scenario())
    assert len(touches) == 1
