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
    """A fake SSM parameter: counts reads, can be made to fail."""

    def __init__(self, value="v1"):
        self.value, self.reads, self.error = value, 0, None

    def __call__(self):
        self.reads += 1
        if self.error:
            raise self.error
        return self.value


async def direct(fn):
    return fn()


async def yielding(fn):
    await asyncio.sleep(0)  # like a thread pool: other callers run meanwhile
    return fn()


def make(source, clock, parse=str.upper, max_age=60.0):
    return CachedParameter("/kiln/test", source, parse, max_age=max_age, clock=clock)


def test_fresh_value_served_without_fetching():
    source, clock = Source(), Clock()
    param = make(source, clock)

    async def scenario():
        assert await param.get(direct) == "V1"
        source.value = "v2"
        clock.now += 59
        assert await param.get(direct) == "V1"

    asyncio.run(scenario())
    assert source.reads == 1


def test_stale_value_refreshed_once():
    source, clock = Source(), Clock()
    param = make(source, clock)

    async def scenario():
        await param.get(direct)
        source.value = "v2"
        clock.now += 61
        assert await param.get(direct) == "V2"
        assert await param.get(direct) == "V2"

    asyncio.run(scenario())
    assert source.reads == 2


@pytest.mark.parametrize("warm", [False, True])
def test_concurrent_callers_share_one_fetch(warm):
    source, clock = Source(), Clock()
    param = make(source, clock)

    async def scenario():
        if warm:
            await param.get(direct)
            source.value = "v2"
            clock.now += 61
        return await asyncio.gather(*(param.get(yielding) for _ in range(20)))

    results = asyncio.run(scenario())
    assert results == ["V2" if warm else "V1"] * 20
    assert source.reads == (2 if warm else 1)


def test_failed_refresh_keeps_last_good_value_and_recovers(caplog):
    source, clock = Source(), Clock()
    param = make(source, clock)

    async def scenario():
        await param.get(direct)
        source.error = ConnectionError("SSM throttled")
        clock.now += 61
        with caplog.at_level(logging.WARNING, logger="kiln.parameters"):
            assert await param.get(direct) == "V1"
        assert "/kiln/test" in caplog.text
        source.error, source.value = None, "v3"
        clock.now += 60
        assert await param.get(direct) == "V3"

    asyncio.run(scenario())


def test_unparsable_refresh_keeps_last_good_value():
    source, clock = Source('{"enabled": true}'), Clock()
    param = make(source, clock, parse=parse_flag)

    async def scenario():
        assert (await param.get(direct)).enabled is True
        source.value = "{broken"
        clock.now += 61
        assert (await param.get(direct)).enabled is True

    asyncio.run(scenario())


def test_first_load_failure_raises_then_retries():
    source, clock = Source(), Clock()
    source.error = TimeoutError("no route")
    param = make(source, clock)

    async def scenario():
        with pytest.raises(ParameterUnavailable, match="/kiln/test"):
            await param.get(direct)
        source.error = None
        assert await param.get(direct) == "V1"

    asyncio.run(scenario())


def test_first_load_parse_failure_raises():
    param = make(Source("{broken"), Clock(), parse=parse_flag)
    with pytest.raises(ParameterUnavailable):
        asyncio.run(param.get(direct))


def test_missing_parameter_reaches_parse_as_none():
    param = CachedParameter("/kiln/maintenance", lambda: None, parse_flag, max_age=5, clock=Clock())
    assert asyncio.run(param.get(direct)) == MaintenanceFlag()
