"""kiln.parameters: the short cache in front of SSM (maintenance flag, catalog)."""

import asyncio
import logging

import pytest

from kiln.maintenance import MaintenanceFlag, parse_flag
from kiln.parameters import CachedParameter, ParameterUnavailable


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Source:
    """A fake SSM parameter: counts reads, can be made to fail, can take its time."""

    def __init__(self, value="v1"):
        self.value, self.reads, self.error, self.slow = value, 0, None, False

    async def __call__(self):
        self.reads += 1
        if self.slow:
            await asyncio.sleep(0)  # like a network read: other callers run meanwhile
        if self.error:
            raise self.error
        return self.value


def make(source, clock, parse=str.upper, max_age=60.0):
    return CachedParameter("/kiln/test", source, parse, max_age=max_age, clock=clock)


def test_fresh_value_served_without_fetching():
    source, clock = Source(), Clock()
    param = make(source, clock)

    async def scenario():
        assert await param.get() == "V1"
        source.value = "v2"
        clock.now += 59
        assert await param.get() == "V1"

    asyncio.run(scenario())
    assert source.reads == 1


def test_stale_value_refreshed_once():
    source, clock = Source(), Clock()
    param = make(source, clock)

    async def scenario():
        await param.get()
        source.value = "v2"
        clock.now += 61
        assert await param.get() == "V2"
        assert await param.get() == "V2"

    asyncio.run(scenario())
    assert source.reads == 2


@pytest.mark.parametrize("warm", [False, True])
def test_concurrent_callers_share_one_fetch(warm):
    source, clock = Source(), Clock()
    source.slow = True
    param = make(source, clock)

    async def scenario():
        if warm:
            await param.get()
            source.value = "v2"
            clock.now += 61
        return await asyncio.gather(*(param.get() for _ in range(20)))

    results = asyncio.run(scenario())
    assert results == ["V2" if warm else "V1"] * 20
    assert source.reads == (2 if warm else 1)


def test_failed_refresh_keeps_last_good_value_and_recovers(caplog):
    source, clock = Source(), Clock()
    param = make(source, clock)

    async def scenario():
        await param.get()
        source.error = ConnectionError("SSM throttled")
        clock.now += 61
        with caplog.at_level(logging.WARNING, logger="kiln.parameters"):
            assert await param.get() == "V1"
        assert "/kiln/test" in caplog.text
        source.error, source.value = None, "v3"
        clock.now += 60
        assert await param.get() == "V3"

    asyncio.run(scenario())


def test_unparsable_refresh_keeps_last_good_value():
    source, clock = Source('{"enabled": true}'), Clock()
    param = make(source, clock, parse=parse_flag)

    async def scenario():
        assert (await param.get()).enabled is True
        source.value = "{broken"
        clock.now += 61
        assert (await param.get()).enabled is True

    asyncio.run(scenario())


def test_first_load_failure_raises_then_retries():
    source, clock = Source(), Clock()
    source.error = TimeoutError("no route")
    param = make(source, clock)

    async def scenario():
        with pytest.raises(ParameterUnavailable, match="/kiln/test"):
            await param.get()
        source.error = None
        assert await param.get() == "V1"

    asyncio.run(scenario())


def test_first_load_parse_failure_raises():
    param = make(Source("{broken"), Clock(), parse=parse_flag)
    with pytest.raises(ParameterUnavailable):
        asyncio.run(param.get())


def test_missing_parameter_reaches_parse_as_none():
    absent = Source(value=None)
    param = CachedParameter("/kiln/maintenance", absent, parse_flag, max_age=5, clock=Clock())
    assert asyncio.run(param.get()) == MaintenanceFlag()
