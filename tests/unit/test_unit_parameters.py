"""kiln.parameters: the cache in front of SSM (maintenance flag, catalog, upstream key).

The cache is what keeps a fleet of environments under SSM's 40 TPS: these tests pin down
when it reads, when it does not, and what it serves while SSM throttles.
"""

import asyncio
import json
import logging
import time

import pytest

from kiln.aws import AwsError
from kiln.maintenance import MaintenanceFlag, parse_flag
from kiln.parameters import JITTER, RETRY_AFTER, CachedParameter, ParameterUnavailable


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    async def sleep(self, seconds):
        """A pause that takes no real time: the clock moves on, other tasks get to run."""
        self.now += seconds
        await asyncio.sleep(0)


class Source:
    """A fake SSM parameter: counts reads, can be made to fail, can take its time."""

    def __init__(self, value="v1"):
        self.value, self.reads, self.error, self.slow = value, 0, None, False
        self.fail_times = None  # fail only this many more reads, then answer

    async def __call__(self):
        self.reads += 1
        if self.slow:
            await asyncio.sleep(0)  # like a network read: other callers run meanwhile
        if self.error and (self.fail_times is None or self.fail_times > 0):
            if self.fail_times is not None:
                self.fail_times -= 1
            raise self.error
        return self.value


def throttled():
    return AwsError("ThrottlingException", "Rate exceeded", status=400)


def make(source, clock, parse=str.upper, max_age=60.0, rand=lambda: 0.0, first_read_budget=0.0, **options):
    return CachedParameter(
        "/kiln/test", source, parse, max_age=max_age, clock=clock, sleep=clock.sleep, rand=rand,
        first_read_budget=first_read_budget, **options,
    )


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


@pytest.mark.parametrize("rand", [0.0, 0.5, 0.999])
def test_refresh_falls_due_within_the_last_fifth_of_max_age_never_later(rand):
    """Environments started together spread their refreshes; none serves a value older than max_age."""
    source, clock = Source(), Clock()
    param = make(source, clock, max_age=100.0, rand=lambda: rand)
    due = 100.0 * (1 - JITTER * rand)

    async def scenario():
        await param.get()
        source.value = "v2"
        clock.now += due - 0.01
        assert await param.get() == "V1"
        clock.now += 0.02
        assert await param.get() == "V2"

    asyncio.run(scenario())
    assert 80.0 <= due <= 100.0


def test_a_fleet_started_together_refreshes_spread_out():
    """100 environments with the real random jitter: their second reads do not all fall in one second."""
    clock = Clock()
    due_times = []

    async def scenario():
        for _ in range(100):
            source = Source()
            param = CachedParameter("/kiln/test", source, str, max_age=60.0, clock=clock)
            await param.get()
            due_times.append(param._expires - clock.now)

    asyncio.run(scenario())
    assert all(48.0 <= due <= 60.0 for due in due_times)
    assert max(due_times) - min(due_times) > 6.0


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
        source.error = ConnectionError("SSM unreachable")
        clock.now += 61
        with caplog.at_level(logging.WARNING, logger="kiln.parameters"):
            assert await param.get() == "V1"
        assert "/kiln/test" in caplog.text
        source.error, source.value = None, "v3"
        clock.now += 60
        assert await param.get() == "V3"

    asyncio.run(scenario())


def test_throttled_refreshes_back_off_exponentially_while_serving_the_last_value():
    """While SSM throttles, an environment reads after 2, 4, 8 … seconds (capped at max_age),
    never once a second, and every request meanwhile gets the last good value."""
    source, clock = Source(), Clock()
    param = make(source, clock, max_age=60.0, rand=lambda: 0.999)  # the longest back-off of each step

    async def scenario():
        await param.get()
        source.error = throttled()
        clock.now += 61
        reads_at = []
        for _ in range(600):  # ten minutes of requests, one every second
            before = source.reads
            assert await param.get() == "V1"
            if source.reads > before:
                reads_at.append(clock.now)
            clock.now += 1.0
        return reads_at

    reads_at = asyncio.run(scenario())
    gaps = [later - earlier for earlier, later in zip(reads_at, reads_at[1:], strict=False)]
    assert gaps[:5] == pytest.approx([RETRY_AFTER * 2**i for i in range(5)], abs=1.01)
    assert max(gaps) <= 61 and gaps[-1] >= 59  # capped at max_age
    assert len(reads_at) <= 16  # not 540 reads


def test_a_good_read_after_throttling_restarts_the_back_off():
    source, clock = Source(), Clock()
    param = make(source, clock, max_age=60.0)

    async def scenario():
        await param.get()
        source.error = throttled()
        for _ in range(4):
            clock.now += 61
            await param.get()
        source.error, source.value = None, "v2"
        clock.now += 61
        assert await param.get() == "V2"
        source.error = throttled()
        clock.now += 61
        assert await param.get() == "V2"
        reads = source.reads
        clock.now += RETRY_AFTER / 2 + 0.01  # the first back-off again, not the fifth
        await param.get()
        assert source.reads == reads + 1

    asyncio.run(scenario())


def test_unparsable_refresh_keeps_last_good_value(caplog):
    """And says so under the event a first read that fails logs (operations.md: a switch that
    cannot be read is logged `maintenance_unreadable`): a warm environment logged another line."""
    source, clock = Source('{"enabled": true}'), Clock()
    param = make(source, clock, parse=parse_flag, unreadable_event="maintenance_unreadable")

    async def scenario():
        assert (await param.get()).enabled is True
        source.value = "{broken"
        clock.now += 61
        with caplog.at_level(logging.WARNING, logger="kiln.parameters"):
            assert (await param.get()).enabled is True
        (logged,) = [json.loads(record.getMessage()) for record in caplog.records]
        assert (logged["event"], logged["parameter"], logged["in_a_row"]) == ("maintenance_unreadable", "/kiln/test", 1)

    asyncio.run(scenario())


def test_first_load_failure_raises_then_retries_after_a_back_off():
    """On Lambda no caller waits on another (one request at a time): the requests after a
    failed first read are refused at once for a back-off, not each a read against SSM."""
    source, clock = Source(), Clock()
    source.error = TimeoutError("no route")
    param = make(source, clock, rand=lambda: 1.0)

    async def scenario():
        for _ in range(10):  # ten requests 100 ms apart: one read
            with pytest.raises(ParameterUnavailable, match="no route"):
                await param.get()
            clock.now += 0.1
        assert source.reads == 1
        source.error = None
        assert await param.get() == "V1"  # 1 s after the failure
        assert source.reads == 2

    asyncio.run(scenario())


def test_the_back_off_after_failed_first_reads_doubles_up_to_its_bound():
    source, clock = Source(), Clock()
    source.error = throttled()
    param = make(source, clock, rand=lambda: 1.0, max_age=600.0)
    waits = []

    async def scenario():
        for _ in range(8):
            reads, started = source.reads, clock.now
            while source.reads == reads:
                with pytest.raises(ParameterUnavailable):
                    await param.get()
                clock.now += 0.25
            waits.append(clock.now - started)

    asyncio.run(scenario())
    assert waits[1:] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0], waits  # from one read to the next


def test_a_new_environment_retries_its_first_read_within_the_budget():
    """Throttled at cold start: the first request waits a little and gets the value, not a 503."""
    source, clock = Source(), Clock()
    source.error, source.fail_times = throttled(), 4
    param = make(source, clock, first_read_budget=3.0, rand=lambda: 0.999)
    started = clock.now

    assert asyncio.run(param.get()) == "V1"
    assert source.reads == 5
    assert clock.now - started <= 3.0


def test_a_first_read_gives_up_when_the_budget_is_spent():
    source, clock = Source(), Clock()
    source.error = throttled()
    param = make(source, clock, first_read_budget=3.0, rand=lambda: 0.999)
    started = clock.now

    with pytest.raises(ParameterUnavailable, match="ThrottlingException"):
        asyncio.run(param.get())
    assert clock.now - started <= 3.0
    assert 4 <= source.reads <= 8  # backed off, not a read per millisecond


def test_callers_waiting_on_a_failed_first_read_fail_with_it_not_one_after_the_other():
    source, clock = Source(), Clock()
    source.error = throttled()
    param = make(source, clock, first_read_budget=3.0)
    started = clock.now

    async def scenario():
        return await asyncio.gather(*(param.get() for _ in range(10)), return_exceptions=True)

    results = asyncio.run(scenario())
    assert all(isinstance(result, ParameterUnavailable) for result in results)
    assert clock.now - started <= 3.0  # one budget in all, not ten
    reads = source.reads
    source.error = None
    clock.now += 1
    assert asyncio.run(param.get()) == "V1"  # a later request tries again
    assert source.reads == reads + 1


def test_first_load_parse_failure_raises_without_retrying():
    source = Source("{broken")
    param = make(source, Clock(), parse=parse_flag, first_read_budget=3.0)
    with pytest.raises(ParameterUnavailable):
        asyncio.run(param.get())
    assert source.reads == 1


def test_missing_parameter_reaches_parse_as_none():
    absent = Source(value=None)
    param = CachedParameter("/kiln/maintenance", absent, parse_flag, max_age=5, clock=Clock())
    assert asyncio.run(param.get()) == MaintenanceFlag()


# -- through a gateway, against the embedded AWS ----------------------------------------------

CHAT = {"model": "qwen3-32b", "messages": [{"role": "user", "content": "hi"}]}


def _catalog_reads(stack):
    return lambda payload: payload.get("Name") == stack.settings.catalog_parameter


def test_a_new_environment_throttled_at_its_first_catalog_read_answers_after_retrying_not_503(stack_factory):
    stack = stack_factory(parameter_first_read_seconds=3.0)
    _, secret = stack.org()
    # more refusals than the AWS client's own attempts: only the cache's retry gets through
    hits = stack.faults.fail("GetParameter", code="ThrottlingException", when=_catalog_reads(stack), times=5)
    response = stack.post("/v1/chat/completions", CHAT, secret)
    assert response.status_code == 200, response.text
    assert len(hits) >= 6  # five refused, then read


def test_a_new_environment_that_cannot_read_the_catalog_within_its_budget_answers_503(stack_factory):
    import time

    stack = stack_factory(parameter_first_read_seconds=0.5)
    _, secret = stack.org()
    stack.faults.fail("GetParameter", code="ThrottlingException", when=_catalog_reads(stack))
    started = time.monotonic()
    response = stack.post("/v1/chat/completions", CHAT, secret)
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "storage_unavailable"
    assert time.monotonic() - started < 3.0  # the budget, plus one attempt of the AWS client
    reads = stack.faults.count("GetParameter", _catalog_reads(stack))
    assert 3 <= reads <= 40  # retried with back-off, not in a tight loop


def test_a_warm_environment_answers_from_its_last_values_while_ssm_holds_its_answers(stack_factory):
    """An SSM that takes the connection and does not answer: every request that came while a
    refresh of the switch or the catalog was under way waited for it, the switch's read tried
    three times at 5 s each, so requests took 15 to 20 s. They are answered from the last good
    values while the refresh goes on (its bound, set long here, is not what answers them)."""
    import time

    stack = stack_factory(parameter_first_read_seconds=60.0, maintenance_cache_seconds=0.2, catalog_cache_seconds=0.2)
    _, secret = stack.org()
    assert stack.post("/v1/chat/completions", CHAT, secret).status_code == 200  # every value read
    stack.faults.slow("GetParameter", 60.0)
    time.sleep(0.3)  # both stale: the next request starts their refreshes
    for _ in range(3):
        response = stack.http.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {secret}"},
                                   timeout=10.0)
        assert response.status_code == 200, response.text
    assert stack.faults.count("GetParameter") >= 2  # the refreshes were sent, and are held


def test_a_refresh_under_way_is_waited_for_only_briefly_then_the_last_value_is_served():
    clock, started, answer = Clock(), [], asyncio.Event()

    async def held():
        started.append(clock.now)
        await answer.wait()
        return "v2"

    param = CachedParameter("/kiln/test", held, str.upper, max_age=60.0, clock=clock, refresh_wait=0.05)

    async def scenario():
        param._store("V1")
        clock.now += 61
        assert await param.get() == "V1"  # waited 0.05 s for the refresh, then the last value
        assert len(started) == 1 and param.fresh  # a failed refresh: kept for a back-off, no wait
        assert await param.get() == "V1" and len(started) == 1
        clock.now += 3  # past the back-off (2 s at most): the refresh given up on, a new one beside it
        assert await param.get() == "V1" and len(started) == 2
        answer.set()
        await asyncio.sleep(0.01)  # both end
        assert param.fresh and await param.get() == "V2"

    asyncio.run(scenario())


def test_a_read_that_outlasts_its_timeout_fails_as_any_failed_read():
    clock = Clock()

    async def never():
        await asyncio.sleep(60)

    param = CachedParameter("/kiln/test", never, str.upper, max_age=60.0, clock=clock, refresh_timeout=0.05,
                            refresh_wait=1.0)
    first = CachedParameter("/kiln/test", never, str.upper, max_age=60.0, read_timeout=0.05, first_read_budget=0.1)

    async def scenario():
        param._store("V1")
        clock.now += 61
        assert await param.get() == "V1"  # the refresh gave up in 0.05 s, within the wait
        assert param.fresh  # kept for a back-off
        with pytest.raises(ParameterUnavailable, match="TimeoutError"):
            await first.get()  # its budget spent on attempts each bounded, not one attempt for ever

    asyncio.run(scenario())


# -- an environment frozen between invocations (Lambda), a refresh left under way -------------


def slow_switch(value, **options):
    """A switch whose SSM answers what it held when asked, after `ssm["delay"]` seconds."""
    ssm = {"value": value, "delay": 0.0}

    async def fetch():
        seen = ssm["value"]
        await asyncio.sleep(ssm["delay"])
        return seen

    return ssm, CachedParameter("/kiln/switch", fetch, str.upper, refresh_wait=0.05, **options)


@pytest.mark.parametrize("thawed_first", [False, True], ids=["asked-first", "refresh-resumes-first"])
@pytest.mark.parametrize("delay", [0.2, 10.0], ids=["answered-before-the-freeze", "never-answered"])
def test_a_refresh_frozen_with_its_environment_does_not_serve_an_old_value_after_the_thaw(thawed_first, delay):
    """One loop run only during an invocation, as Mangum runs it (uvicorn's process is frozen
    alike). A refresh that outlasted its request was frozen with the environment; after the
    thaw its old answer was kept as fresh, or its timeout counted as SSM failing and the old
    value kept for a back-off: a switch flipped during the freeze was not seen for minutes."""
    ssm, param = slow_switch("off", max_age=0.1, read_timeout=3.0)

    async def invocation():
        if thawed_first:  # the frozen refresh's timers run before this request asks
            await asyncio.sleep(0.01)
        return await param.get()

    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(invocation()) == "OFF"
        time.sleep(0.15)
        ssm["delay"] = delay  # this refresh outlasts its request's wait
        assert loop.run_until_complete(invocation()) == "OFF"
        ssm.update(value="on", delay=0.0)
        time.sleep(1.5)  # frozen, a few seconds as Lambda freezes: shorter than any read's bound
        assert loop.run_until_complete(invocation()) == "ON"
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()


def test_a_refresh_not_answered_in_its_wait_is_a_failed_one_logged_and_backed_off(caplog):
    """On Lambda a refresh that outlives its request's wait is frozen before its read's own
    timeout: taken after the thaw for frozen (or cancelled as stuck), an SSM that never answers
    was never logged and never backed off, each request after each expiry waiting again."""
    reads = []

    async def fetch():
        reads.append(time.monotonic())
        if len(reads) == 1:
            return "v1"
        await asyncio.Event().wait()  # SSM took the connection and never answers

    param = CachedParameter("/kiln/maintenance", fetch, str.upper, max_age=1.0, read_timeout=3.0, refresh_wait=0.05,
                            unreadable_event="maintenance_unreadable")
    loop = asyncio.new_event_loop()
    try:
        assert loop.run_until_complete(param.get()) == "V1"
        with caplog.at_level(logging.ERROR, logger="kiln.parameters"):
            for _ in range(3):
                time.sleep(1.5)  # between invocations
                assert loop.run_until_complete(param.get()) == "V1"
                assert param.fresh  # kept for a back-off: the requests after it do not wait
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    logged = [json.loads(record.getMessage()) for record in caplog.records]
    assert [line["in_a_row"] for line in logged] == [1, 2, 3], logged
    assert all(line["event"] == "maintenance_unreadable" for line in logged)


def test_a_slow_ssm_s_answer_still_gets_through_to_a_refresh():
    """An SSM answering in more than the first read's bound: each refresh was cut at it and sent
    again, so a switch turned off was never seen and the gateway answered 503 for as long as SSM
    stayed slow. A refresh's read, waited for by no request past its wait, may take its time."""
    ssm, param = slow_switch("on", max_age=0.2, read_timeout=0.1)

    async def scenario():
        assert await param.get() == "ON"
        ssm.update(value="off", delay=0.3)  # slower than the first read's bound
        await asyncio.sleep(0.25)
        assert await param.get() == "ON"  # the last value while the refresh goes on
        await asyncio.sleep(0.4)
        return await param.get()

    assert asyncio.run(scenario()) == "OFF"


def answered_by_hand(clock, refresh_wait):
    """A switch held as "V1", gone stale, whose reads each wait for an answer the test gives
    (`answers`, in the order the reads were sent)."""
    answers = []

    async def fetch():
        answer = asyncio.get_running_loop().create_future()
        answers.append(answer)
        return await answer

    param = CachedParameter("/kiln/switch", fetch, str.upper, max_age=60.0, clock=clock, refresh_wait=refresh_wait)
    param._store("V1")
    clock.now += 61
    return param, answers


def test_a_refresh_given_up_on_that_ends_last_does_not_replace_the_answer_asked_for_later():
    clock = Clock()
    param, answers = answered_by_hand(clock, 0.01)

    async def scenario():
        assert await param.get() == "V1"  # refresh A, given up on: backed off
        clock.now += 5
        assert await param.get() == "V1"  # past the back-off: refresh B, beside A
        answers[1].set_result("new")
        await asyncio.sleep(0.01)
        assert await param.get() == "NEW"
        answers[0].set_result("old")  # A, asked for first, answers last
        await asyncio.sleep(0.01)
        return await param.get()

    assert asyncio.run(scenario()) == "NEW"


def test_a_refresh_given_up_on_after_another_brought_a_fresh_value_leaves_it_fresh(caplog):
    """Refresh A given up on; past the back-off B starts beside it; A's answer comes during B's
    wait and is fresh for the cache time, then B's wait ended: its failure cut the fresh value to
    a back-off and logged, and the next request read SSM again."""
    clock = Clock()
    param, answers = answered_by_hand(clock, 0.05)

    async def scenario():
        assert await param.get() == "V1"  # A given up on
        clock.now += 5
        asyncio.get_running_loop().call_later(0.01, answers[0].set_result, "v2")  # A answers in B's wait
        assert await param.get() == "V2"

    with caplog.at_level(logging.ERROR, logger="kiln.parameters"):
        asyncio.run(scenario())
    assert param.fresh and len(answers) == 2
    assert [json.loads(record.getMessage())["in_a_row"] for record in caplog.records] == [1]  # A's alone
