"""kiln.upstream with an injected HTTP client: what each failure costs, and what it reports."""

from __future__ import annotations

import asyncio
from decimal import Decimal

import pytest

from kiln.catalog import Backend, ModelEntry, Pricing, Timeouts
from kiln.errors import UpstreamFailed
from kiln.health import IN_SERVICE, OUT_OF_SERVICE, PROBING, BackendHealth, HealthPolicy
from kiln.http1 import ConnectFailed, ConnectTimeout, ProtocolFailure, Response, ResponseTooLarge, Timeout
from kiln.upstream import UpstreamClient

A, B = Backend("a", "http://a/v1"), Backend("b", "http://b/v1")


def model(*backends, **timeouts):
    return ModelEntry("m", "kiln", 0, 4096, Pricing(Decimal(1), Decimal(1)), timeouts=Timeouts(**timeouts),
                      backends=backends)


class FakeHttp:
    """Each backend's answer: an exception to raise, or (status, body)."""

    def __init__(self, answers):
        self.answers, self.calls = answers, []

    async def request(self, method, url, **options):
        self.calls.append((url, options))
        answer = self.answers[url.split("/v1")[0]]
        if isinstance(answer, BaseException):
            raise answer
        if callable(answer):  # an answer that depends on the request's body
            answer = answer(options["body"])
        if isinstance(answer, BaseException):
            raise answer
        if answer == "hang":  # sent, and no answer
            options["on_sending"]()
            await asyncio.sleep(60)
        if answer == "no connection":  # a connection never made (its SYNs dropped)
            await asyncio.sleep(options["connect_timeout"])
            raise ConnectTimeout("no connection in time")
        if len(answer) == 3:  # (seconds to answer, status, body)
            options["on_sending"]()
            await asyncio.sleep(answer[0])
            answer = answer[1:]
        return Response.complete(*answer)

    async def aclose(self):
        pass


def client(answers, **policy):
    ended = []
    health = BackendHealth(HealthPolicy(**policy), on_change=lambda *change: None)
    upstream = UpstreamClient(http=FakeHttp(answers), health=health, timed_out=lambda m, kind: ended.append(kind))
    return upstream, health, ended


def test_a_connect_timeout_that_ends_a_request_is_counted_as_connect():
    upstream, _, ended = client({"http://a": ConnectTimeout("no")})
    with pytest.raises(UpstreamFailed):
        asyncio.run(upstream.open(model(A), "/chat/completions", {}, stream=True))
    assert ended == ["connect"]


def test_headers_over_their_bound_count_as_a_bad_answer_not_as_the_backend_being_down():
    upstream, health, _ = client({"http://a": ResponseTooLarge("big"), "http://b": (200, b"{}")}, failure_threshold=1)
    for _ in range(3):
        exchange = asyncio.run(upstream.open(model(A, B), "/chat/completions", {"n": 1}, stream=False))
        assert exchange.backend == B
    assert health.state_of(A) == IN_SERVICE  # one request's answer, three times: never a rate


def test_every_backend_shares_the_requests_total_time():
    upstream, _, ended = client({"http://a": "hang", "http://b": "hang"})
    with pytest.raises(UpstreamFailed) as failed:
        asyncio.run(upstream.open(model(A, B, first_byte=10, total=0.2), "/chat/completions", {}, stream=False))
    assert "b: not tried" in failed.value.detail
    assert ended == ["total"]


def test_the_model_bounds_and_timeouts_reach_the_http_client():
    upstream, _, _ = client({"http://a": (200, b"{}")})
    asyncio.run(upstream.open(model(A, connect=1.5, idle=7), "/chat/completions", {}, stream=True))
    ((_, options),) = upstream.http.calls
    assert options["connect_timeout"] == 1.5 and options["read_timeout"] == 7
    assert options["max_header_bytes"] == 64 * 1024


def test_refusals_take_a_backend_out_only_while_another_is_in_service():
    upstream, health, _ = client({"http://a": ConnectFailed("refused"), "http://b": (200, b"{}")})
    for _ in range(3):
        asyncio.run(upstream.open(model(A, B), "/chat/completions", {}, stream=True))
    assert health.state_of(A) == OUT_OF_SERVICE
    assert [url for url, _ in upstream.http.calls] == ["http://a/v1/chat/completions", "http://b/v1/chat/completions"] * 3
    asyncio.run(upstream.open(model(A, B), "/chat/completions", {}, stream=True))
    assert upstream.http.calls[-1][0] == "http://b/v1/chat/completions"  # skipped now
    for _ in range(5):  # b refuses too: it is the model's last backend in service, so it stays
        upstream.http.answers["http://b"] = ConnectFailed("refused")
        with pytest.raises(UpstreamFailed):
            asyncio.run(upstream.open(model(A, B), "/chat/completions", {}, stream=True))
    assert health.state_of(B) == IN_SERVICE


C = Backend("c", "http://c/v1")
HEALTH = {"error_min_requests": 4, "error_rate": 0.5, "error_min_clients": 2}


def poisoned(body: bytes):
    """What every model server answers: 500 to a request whose content crashes it."""
    return (500, b"{}") if b"poison" in body else (200, b"{}")


def opened(upstream, backends, i: int, text: str):
    return asyncio.run(upstream.open(model(*backends), "/chat/completions", {"text": f"{text} {i}"}, stream=True,
                                     client=f"org{i % 2}"))


def test_requests_every_backend_answers_500_count_on_none_so_the_failover_stays():
    """§5: b, the failover, is tried only by the requests a failed. Two orgs' requests that
    every model server answers 500 (their content's fault) count on neither backend, whatever
    their number; a's own failures, which b serves, still count on a."""
    upstream, health, _ = client({"http://a": poisoned, "http://b": poisoned}, **HEALTH)
    for i in range(12):
        with pytest.raises(UpstreamFailed):
            opened(upstream, (A, B), i, "poison")
    assert (health.state_of(A), health.state_of(B)) == (IN_SERVICE, IN_SERVICE)
    assert [row["recent_failures"] for row in health.snapshot()] == [0, 0]
    upstream.http.answers["http://a"] = (503, b"{}")  # a sick: b serves what a fails
    for i in range(4):
        assert opened(upstream, (A, B), i, "fine").backend is B
    assert (health.state_of(A), health.state_of(B)) == (OUT_OF_SERVICE, IN_SERVICE)


def test_two_broken_backends_of_three_go_out_while_the_third_serves_every_request():
    """a and b answer 500 to everything, c serves every request: each failure is its backend's
    (another backend served the request), so both go out, and requests go straight to c."""
    upstream, health, _ = client({"http://a": (500, b"{}"), "http://b": (500, b"{}"), "http://c": (200, b"{}")},
                                 **HEALTH)
    for i in range(4):
        assert opened(upstream, (A, B, C), i, "q").backend is C
    assert (health.state_of(A), health.state_of(B), health.state_of(C)) == (OUT_OF_SERVICE, OUT_OF_SERVICE,
                                                                             IN_SERVICE)
    before = len(upstream.http.calls)
    opened(upstream, (A, B, C), 9, "q")
    assert [url for url, _ in upstream.http.calls[before:]] == ["http://c/v1/chat/completions"]


def test_requests_a_fails_and_the_failover_cuts_after_its_2xx_do_not_take_the_failover_out():
    """Two orgs' requests whose content makes a answer 500 and b cut its stream after the 2xx
    (the exchange's `broke`), among the requests a serves: b sees only them, so its cuts do not
    count on it; a's failures count (another backend took the request), under its rate."""
    upstream, health, _ = client({"http://a": poisoned, "http://b": (200, b"{}")}, **HEALTH)
    for i in range(60):
        assert opened(upstream, (A, B), i, "fine").backend is A
    for i in range(20):
        opened(upstream, (A, B), i, "poison").broke()
    assert (health.state_of(A), health.state_of(B)) == (IN_SERVICE, IN_SERVICE)
    assert [row["recent_failures"] for row in health.snapshot()] == [20, 0]


def test_a_backend_failing_everything_and_a_failover_cutting_everything_both_go_out_for_the_third():
    """a answers 500 to every request, b cuts every stream after its 2xx, c serves: a's
    failures count (b took the requests), a goes out; then b is tried first and its cuts
    count as any first backend's; b goes out, and c serves."""
    upstream, health, _ = client({"http://a": (500, b"{}"), "http://b": (200, b"{}"), "http://c": (200, b"{}")},
                                 **HEALTH)
    served = []
    for i in range(12):
        exchange = opened(upstream, (A, B, C), i, "q")
        served.append(exchange.backend.name)
        if exchange.backend is B:
            exchange.broke()
    assert (health.state_of(A), health.state_of(B)) == (OUT_OF_SERVICE, OUT_OF_SERVICE)
    assert served[-1] == "c"


@pytest.mark.parametrize("failure, out", [
    (ProtocolFailure("closed before answering", nothing_received=True), True),  # a reset before any answer
    (ConnectFailed("TLS handshake failed"), True),  # kiln.http1's word for a TLS failure
    (ProtocolFailure("closed mid-answer"), False),  # an answer that broke: counted by rate, over clients
], ids=["reset-before-answering", "tls", "cut-mid-answer"])
def test_a_backend_that_fails_itself_is_taken_out_and_a_broken_answer_alone_does_not(failure, out):
    """§5: connections refused or reset, TLS failures and timeouts before the first byte are the
    backend's own failures; an answer that broke says as much about the request."""
    upstream, health, _ = client({"http://a": failure, "http://b": (200, b"{}")})
    for i in range(3):
        assert asyncio.run(upstream.open(model(A, B), "/chat/completions", {"n": i}, stream=True)).backend == B
    assert health.state_of(A) == (OUT_OF_SERVICE if out else IN_SERVICE)


@pytest.mark.parametrize("failure", [Timeout("the request could not be sent in time"), ConnectTimeout("no")],
                         ids=["not-reading", "connect"])
def test_a_buffered_request_the_backend_never_read_is_the_backends_failure(failure):
    """Only a wait for a buffered answer's headers is the request's doing too (its generation's
    length): a backend that does not read the request, or cannot be reached, has failed."""
    upstream, health, _ = client({"http://a": failure, "http://b": (200, b"{}")})
    for i in range(3):
        assert asyncio.run(upstream.open(model(A, B), "/chat/completions", {"n": i}, stream=False)).backend == B
    assert health.state_of(A) == OUT_OF_SERVICE


def test_a_buffered_answer_not_in_time_is_a_failed_answer_not_the_backends_failure():
    upstream, health, ended = client({"http://a": "hang", "http://b": (200, b"{}")})
    for i in range(3):  # one org's long generations: each spends the total on a
        with pytest.raises(UpstreamFailed):
            asyncio.run(upstream.open(model(A, B, total=0.05), "/chat/completions", {"n": i}, stream=False,
                                      client="org-a"))
    assert health.state_of(A) == IN_SERVICE and ended == ["total"] * 3




def test_a_buffered_probe_that_gets_no_answer_keeps_the_hung_backend_out():
    """A backend out for not answering (streams' first-byte timeouts) was put back in service by
    a buffered probe that waited the whole total for headers that never came ("a probe was
    answered, if with a failure"): every buffered request then went to it first, waited the
    total and got 502, the healthy backend never tried. No answer is no answer: out again."""
    upstream, health, _ = client({"http://a": "hang", "http://b": (200, b"{}")}, failure_threshold=3, cooldown=0.01)
    for i in range(3):
        assert asyncio.run(upstream.open(model(A, B, first_byte=0.02), "/chat/completions", {"n": i},
                                         stream=True)).backend == B
    assert health.state_of(A) == OUT_OF_SERVICE
    asyncio.run(asyncio.sleep(0.02))  # its cooldown is over: the next request probes it
    with pytest.raises(UpstreamFailed):
        asyncio.run(upstream.open(model(A, B, total=0.05), "/chat/completions", {"n": 9}, stream=False))
    assert health.state_of(A) == OUT_OF_SERVICE  # its probe failed: out for twice the cooldown
    assert asyncio.run(upstream.open(model(A, B, total=0.05), "/chat/completions", {"n": 10},
                                     stream=False)).backend == B


def test_a_probe_left_too_little_of_the_total_to_tell_says_nothing_of_its_backend():
    """A backend out for first-byte timeouts, recovered: a buffered request whose first backend
    took most of the total left its probe a sliver, and the probe's timeout kept the healthy
    backend out for twice the cooldown. It is released: the next request probes it."""
    upstream, health, _ = client({"http://a": (0, 200, b"{}"), "http://b": "hang"}, failure_threshold=1, cooldown=0.01)
    asyncio.run(upstream.open(model(B, A, first_byte=0.02), "/chat/completions", {"n": 0}, stream=True))
    assert health.state_of(B) == OUT_OF_SERVICE
    asyncio.run(asyncio.sleep(0.02))
    upstream.http.answers.update({"http://a": (0.25, 500, b"{}"), "http://b": (0.06, 200, b"{}")})
    with pytest.raises(UpstreamFailed):
        asyncio.run(upstream.open(model(A, B, total=0.3), "/chat/completions", {"n": 1}, stream=False))
    assert health.state_of(B) == PROBING  # not out again: the next request tries it
    upstream.http.answers["http://a"] = (0.25, 500, b"{}")
    assert asyncio.run(upstream.open(model(B, A, total=0.3), "/chat/completions", {"n": 2}, stream=False)).backend == B
    assert health.state_of(B) == IN_SERVICE


def test_no_other_request_probes_a_backend_while_a_buffered_probe_waits_for_its_answer():
    """A buffered probe may wait the whole total; the probe's turn lasted a cooldown, so in a
    process serving requests at once each cooldown another buffered request probed the hung
    backend, waited the total and got 502, and the first probe's failure, no longer the probe's,
    was ignored: the backend never stayed out."""
    upstream, health, _ = client({"http://a": "hang", "http://b": (0, 200, b"{}")}, failure_threshold=1, cooldown=0.05)

    async def scenario():
        await upstream.open(model(A, B, first_byte=0.02), "/chat/completions", {"n": -1}, stream=True)
        await asyncio.sleep(0.06)

        async def one(i):
            try:
                await upstream.open(model(A, B, total=0.5), "/chat/completions", {"n": i}, stream=False)
                return "served"
            except UpstreamFailed:
                return "502"

        requests = []
        for i in range(20):  # a buffered request every 0.06 s
            requests.append(asyncio.create_task(one(i)))
            await asyncio.sleep(0.06)
        return await asyncio.gather(*requests)

    answers = asyncio.run(scenario())
    assert answers.count("502") <= 2, answers  # a probe, failed, then out for twice the cooldown: one more

@pytest.mark.parametrize("connect", [0.05, 1.0], ids=["connect-timeout-first", "first-byte-bound-first"])
def test_a_backend_no_connection_is_made_to_is_unreachable_whichever_bound_ends_the_wait(connect):
    """§5: a model whose every backend is unreachable (refused, TLS, connect timeout) and out
    of service answers 503. A stream's attempt is bounded by the first byte's time too: with a
    connect timeout longer than it, a connection never made ended as a first-byte timeout, and
    the backend, though never reached, was tried for every request of a model it is the last of."""
    upstream, health, _ = client({"http://a": "no connection", "http://b": (200, b"{}")}, failure_threshold=3)
    pair = model(A, B, connect=connect, first_byte=0.1, total=5)
    for i in range(3):
        assert asyncio.run(upstream.open(pair, "/chat/completions", {"n": i}, stream=True)).backend == B
    assert health.state_of(A) == OUT_OF_SERVICE
    assert health.candidates("solo", (A,)) == ([], True)  # unreachable: not tried, 503


def test_a_backend_that_took_the_request_and_did_not_answer_in_time_is_not_unreachable():
    upstream, health, _ = client({"http://a": "hang", "http://b": (200, b"{}")}, failure_threshold=3)
    for i in range(3):
        assert asyncio.run(upstream.open(model(A, B, first_byte=0.05), "/chat/completions", {"n": i},
                                         stream=True)).backend == B
    assert health.state_of(A) == OUT_OF_SERVICE
    assert health.candidates("solo", (A,)) == ([A], True)  # reached: tried in a panic
