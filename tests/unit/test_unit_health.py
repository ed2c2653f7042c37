"""kiln.health: backends out of service by cause and by volume, never the last one (contract §5)."""

from __future__ import annotations

import json

from kiln.catalog import Backend
from kiln.health import _MAX_REMEMBERED, IN_SERVICE, OUT_OF_SERVICE, PROBING, BackendHealth, HealthPolicy
from kiln.telemetry import metric_line

A, B = Backend("a", "http://a/v1"), Backend("b", "http://b/v1")
PAIR = (A, B)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def health(**policy):
    clock, changes = Clock(), []
    made = BackendHealth(HealthPolicy(**policy), clock=clock,
                         on_change=lambda model, backend, state, reason: changes.append((backend.name, state)))
    made.candidates("m", PAIR)
    return made, clock, changes


def answer(h, backend, request, client, failed=True, probe=None):
    h.answered("m", backend, request, client, failed=failed, models_backends=PAIR, probe=probe)


def test_transport_failures_in_a_row_eject_and_any_answer_resets_the_count():
    h, _, changes = health(failure_threshold=3)
    h.transport_failed("m", A, PAIR)
    h.transport_failed("m", A, PAIR)
    answer(h, A, "r1", "org1", failed=True)  # a 5xx is an answer: the connection works
    h.transport_failed("m", A, PAIR)
    h.transport_failed("m", A, PAIR)
    assert h.state_of(A) == IN_SERVICE
    h.transport_failed("m", A, PAIR)
    assert h.state_of(A) == OUT_OF_SERVICE and changes == [("a", OUT_OF_SERVICE)]
    assert h.candidates("m", PAIR) == ([B], False)


def test_the_last_backend_in_service_is_never_ejected():
    h, _, changes = health(failure_threshold=1)
    h.transport_failed("m", A, PAIR)
    for _ in range(10):
        h.transport_failed("m", B, PAIR)
    assert (h.state_of(A), h.state_of(B)) == (OUT_OF_SERVICE, IN_SERVICE)
    assert changes == [("a", OUT_OF_SERVICE)]
    only = (A,)
    fresh = BackendHealth(HealthPolicy(failure_threshold=1))
    for _ in range(10):
        fresh.transport_failed("m", A, only)
    assert fresh.state_of(A) == IN_SERVICE and fresh.candidates("m", only) == ([A], False)


def test_5xx_never_eject_alone_retries_count_once_and_one_client_is_not_enough():
    h, _, changes = health(error_min_requests=4, error_rate=0.5, error_min_clients=2)
    for _ in range(50):  # one request, retried and retried
        answer(h, A, "same", "org1")
    for i in range(10):  # one org's distinct requests, all failing
        answer(h, A, f"r{i}", "org1")
    assert h.state_of(A) == IN_SERVICE and changes == []
    answer(h, A, "other", "org2")  # a second org fails too: many distinct requests, high rate
    assert h.state_of(A) == OUT_OF_SERVICE


def test_one_orgs_failures_and_a_stray_failure_of_another_do_not_eject_a_backend_serving_the_others():
    """One org's requests crafted to fail, and any single failure of another org's, met the rule
    (many distinct requests, the rate, two orgs): the backend went out while it served every
    other org well. The rate must hold without the org whose requests failed most."""
    h, _, changes = health(error_min_requests=4, error_rate=0.5, error_min_clients=2)
    for i in range(22):
        answer(h, A, f"crafted{i}", "hostile")
    for i in range(20):
        answer(h, A, f"fine{i}", f"org{i % 4}", failed=False)
    answer(h, A, "stray", "org1")
    assert h.state_of(A) == IN_SERVICE and changes == []
    for i in range(20):  # the backend fails the others too: out
        answer(h, A, f"bad{i}", f"org{i % 4}")
    assert h.state_of(A) == OUT_OF_SERVICE


def test_one_orgs_flood_does_not_push_the_others_answers_out_of_what_is_remembered():
    """The answers remembered are bounded (1 024): one org sending a thousand failing requests
    in the window pushed the others' successes out, oldest first, and one stray failure of
    another org's was then 1 of 1 without it: out."""
    h, _, changes = health(error_min_requests=4, error_rate=0.5, error_min_clients=2)
    for i in range(40):
        answer(h, A, f"fine{i}", f"org{i % 4}", failed=False)
    for i in range(_MAX_REMEMBERED + 100):
        answer(h, A, f"crafted{i}", "hostile")
    answer(h, A, "stray", "org1")
    assert h.state_of(A) == IN_SERVICE and changes == []
    assert len(h._states[(A.name, A.url)].answers) == _MAX_REMEMBERED


def test_which_of_two_orgs_that_failed_alike_failed_first_does_not_decide():
    outcomes = []
    for x_first in (True, False):
        h, _, _ = health(error_min_requests=4, error_rate=0.5, error_min_clients=2)
        for i in range(12):
            answer(h, A, f"y-ok{i}", "y", failed=False)
        order = ["x", "y"] if x_first else ["y", "x"]
        for org in order:
            for i in range(10):
                answer(h, A, f"{org}-bad{i}", org)
        outcomes.append(h.state_of(A))
    assert outcomes == [IN_SERVICE, IN_SERVICE]  # without x: y's 10 of 22 is under the rate


def test_a_request_failed_by_two_backends_counts_on_neither():
    """§5: a failover backend is tried only by requests that failed before it, so its own
    rate would be 100 % of them. Requests of two orgs that every backend answers 500 (the
    request's fault) take out neither the first backend nor the one that serves everyone
    else when the first fails; a request the second serves still counts on the first."""
    h, _, changes = health(error_min_requests=4, error_rate=0.5, error_min_clients=2)
    for i in range(20):  # as kiln.upstream tells them: failed by both, served by neither
        for backend in PAIR:
            h.answered("m", backend, f"poison{i}", f"org{i % 2}", failed=True, models_backends=PAIR, counted=False)
    assert (h.state_of(A), h.state_of(B), changes) == (IN_SERVICE, IN_SERVICE, [])
    assert [row["recent_failures"] for row in h.snapshot()] == [0, 0]
    for i in range(4):  # A fails them, B serves them: A's failures, not the requests'
        answer(h, A, f"q{i}", f"org{i % 2}")
        h.answered("m", B, f"q{i}", f"org{i % 2}", failed=False, models_backends=PAIR)
    assert (h.state_of(A), h.state_of(B)) == (OUT_OF_SERVICE, IN_SERVICE)


def test_5xx_below_the_rate_or_outside_the_window_do_not_eject():
    h, clock, _ = health(error_min_requests=4, error_rate=0.5, error_min_clients=1, error_window=60)
    for i in range(6):
        answer(h, A, f"ok{i}", "org1", failed=False)
    for i in range(5):
        answer(h, A, f"bad{i}", f"org{i}")
    assert h.state_of(A) == IN_SERVICE  # 5 of 11
    clock.now += 61  # the window moved on: what is left is too little volume
    answer(h, A, "late", "org9")
    assert h.state_of(A) == IN_SERVICE


def test_after_the_cooldown_one_probe_at_a_time_decides_and_the_cooldown_grows():
    h, clock, changes = health(failure_threshold=1, cooldown=10, max_cooldown=25)
    h.transport_failed("m", A, PAIR)
    clock.now += 10
    assert h.state_of(A) == PROBING and h.candidates("m", PAIR) == ([A, B], False)
    probe = h.claim(A)
    assert probe and not h.claim(A)  # the second request does not probe at the same time
    h.transport_failed("m", A, PAIR, probe=probe)  # the probe failed: out again, for twice as long
    clock.now += 10
    assert h.state_of(A) == OUT_OF_SERVICE
    clock.now += 10
    probe = h.claim(A)
    h.released(A, probe)  # that request was cancelled: another may probe at once
    probe = h.claim(A)
    h.transport_failed("m", A, PAIR, probe=probe)
    clock.now += 25  # capped at max_cooldown
    assert h.claim(A)
    answer(h, A, "probe", "org1", failed=False)
    assert h.state_of(A) == IN_SERVICE
    assert changes == [("a", OUT_OF_SERVICE)] * 3 + [("a", IN_SERVICE)]  # each failed probe said so


def test_a_probe_answered_with_a_failure_puts_the_backend_back_and_the_rate_rule_decides_again():
    """§5: one request's 5xx never takes a backend out, nor keeps it out: a probe answered 5xx
    (or a 2xx it could not finish) shows the backend answers. It is back in service, its streak
    of ejections kept: taken out again soon by the rate rule, its cooldown is doubled; a request
    served while in service ends the streak."""
    h, clock, changes = health(failure_threshold=1, cooldown=10, max_cooldown=100, error_min_requests=2,
                               error_min_clients=2)
    h.transport_failed("m", A, PAIR)
    clock.now += 10
    probe = h.claim(A)
    answer(h, A, "poison", "org1", probe=probe)  # one org's request the server answers 500 for
    assert h.state_of(A) == IN_SERVICE and h.candidates("m", PAIR) == ([A, B], False)
    answer(h, A, "r2", "org2")  # it answers 5xx to many: the rate rule takes it out again…
    assert h.state_of(A) == OUT_OF_SERVICE
    answer(h, A, "sent before", "org2")  # a request sent before that, failing in the cooldown: nothing new
    assert h.state_of(A) == OUT_OF_SERVICE
    clock.now += 10
    assert h.state_of(A) == OUT_OF_SERVICE  # …for twice the cooldown, as a second ejection in a row
    clock.now += 10
    assert h.claim(A)
    answer(h, A, "probe", "org1", failed=False)
    assert h.state_of(A) == IN_SERVICE
    answer(h, A, "x1", "org1")
    answer(h, A, "x2", "org2")
    clock.now += 10  # a success in between ended the streak: the first cooldown again
    assert h.state_of(A) == PROBING
    assert changes == [("a", OUT_OF_SERVICE), ("a", IN_SERVICE), ("a", OUT_OF_SERVICE), ("a", IN_SERVICE),
                       ("a", OUT_OF_SERVICE)]


def test_only_the_probes_own_failure_decides_not_a_request_sent_before_the_backend_went_out():
    """A request sent before the backend went out, failing after its cooldown (a slow stream cut
    late) while the probe is under way, put it back in service and let a second request probe
    it at once. Only the probe's answer decides; another's changes nothing."""
    h, clock, changes = health(cooldown=10, error_min_requests=2, error_min_clients=2)
    answer(h, A, "r1", "org1")
    answer(h, A, "r2", "org2")
    assert h.state_of(A) == OUT_OF_SERVICE
    clock.now += 10.5
    probe = h.claim(A)
    clock.now += 0.5
    answer(h, A, "sent before", "org1")  # failing now: not the probe
    answer(h, A, "probe", "org2")  # the same request sent before (an SDK's resend): not the probe either
    h.released(A)  # another request cancelled: the probe's claim stands
    assert h.state_of(A) == PROBING and not h.claim(A)  # the probe still decides
    answer(h, A, "probe", "org2", probe=probe)  # the probe's own 5xx: back, the rate rule decides again
    assert h.state_of(A) == IN_SERVICE
    assert changes == [("a", OUT_OF_SERVICE), ("a", IN_SERVICE)]


def test_a_probe_that_fails_again_is_reported_each_time():
    """A backend taken out again by its failed probe is a change of state (probing → out) the
    log line and the metric say, with its new cooldown; it was silent."""
    h, clock, changes = health(failure_threshold=1, cooldown=10)
    h.transport_failed("m", A, PAIR)
    clock.now += 10
    h.transport_failed("m", A, PAIR, probe=h.claim(A))
    assert changes == [("a", OUT_OF_SERVICE), ("a", OUT_OF_SERVICE)]


def test_a_transport_failure_of_a_request_sent_before_the_backend_went_out_changes_nothing():
    """A stream sent before the backend went out timed out on its first byte during the cooldown
    or the probe: it took the backend out again, cooldown doubled, and the probe's own answer was
    then ignored; a few such, and the cooldown was at its most with no probe ever sent. Only the
    probe's failure, or a panic's (a model with nothing else, trying it anyway), counts now."""
    h, clock, changes = health(failure_threshold=1, cooldown=10, max_cooldown=120)
    h.transport_failed("m", A, PAIR)
    h.transport_failed("m", A, PAIR)  # sent before: timing out in the cooldown
    clock.now += 10
    probe = h.claim(A)
    h.transport_failed("m", A, PAIR)  # and during the probe
    assert h.state_of(A) == PROBING and not h.claim(A)
    answer(h, A, "probe", "org1", probe=probe)  # the probe's 5xx decides: back in service
    assert h.state_of(A) == IN_SERVICE and changes == [("a", OUT_OF_SERVICE), ("a", IN_SERVICE)]
    h, _, _ = health(error_min_requests=2, error_min_clients=2)
    answer(h, A, "r1", "org1")
    answer(h, A, "r2", "org2")  # out for its answers…
    assert h.candidates("n", (A,)) == ([A], True)  # …but n has nothing else: a panic tries it
    h.transport_failed("n", A, (A,))  # a request sent before: nothing
    assert h.candidates("n", (A,)) == ([A], True)
    h.transport_failed("n", A, (A,), panic=True)  # the panic's own refusal: out as unreachable
    assert h.candidates("n", (A,)) == ([], True)


def test_a_probe_that_never_reports_does_not_keep_the_backend_out_forever():
    h, clock, _ = health(failure_threshold=1, cooldown=5)
    h.transport_failed("m", A, PAIR)
    clock.now += 5
    assert h.claim(A)
    clock.now += 5
    assert h.claim(A)


def test_every_backend_out_of_service_for_its_answers_means_all_are_tried():
    h, clock, _ = health(error_min_requests=2, error_min_clients=2)
    shared = (A,)
    answer(h, A, "r1", "org1")
    answer(h, A, "r2", "org2")  # out, for its answers as a backend of m…
    assert h.state_of(A) == OUT_OF_SERVICE
    assert h.candidates("n", shared) == ([A], True)  # …but n has nothing else: it is tried anyway,
    assert not h.claim(A) and h.claim(A, panic=True) and h.claim(A, panic=True)  # by every request
    answer(h, A, "n's", "org1", failed=False)  # and what comes of it counts
    assert h.state_of(A) == IN_SERVICE


def test_every_backend_out_of_service_as_unreachable_means_none_is_tried():
    """§5: every backend unreachable and marked out of service is 503 no_backend_available."""
    h, clock, _ = health(failure_threshold=1, cooldown=10)
    h.transport_failed("m", A, PAIR)  # refused: out as a backend of m
    assert h.candidates("n", (A,)) == ([], True)
    clock.now += 10  # its cooldown over, it is probed as ever
    assert h.candidates("n", (A,)) == ([A], False)


def test_a_shared_backend_out_for_failures_that_reached_it_is_still_tried_for_a_model_it_is_the_last_of():
    """§5: 503 no_backend_available only when every backend is unreachable (refused, TLS, connect
    timeout). A backend taken out as m's for resets and first-byte timeouts answers its
    connections: for n, whose only backend it is, every request tries it (a panic), and gets 502 if
    it fails; a streak mixing refusals with such failures does not make it unreachable either."""
    for kinds in ((False, False, False), (True, False, True)):
        h, _, _ = health(failure_threshold=3)
        for unreachable in kinds:
            h.transport_failed("m", A, PAIR, unreachable=unreachable)
        assert h.state_of(A) == OUT_OF_SERVICE
        assert h.candidates("n", (A,)) == ([A], True), kinds
    h, clock, _ = health(failure_threshold=1, cooldown=10)
    h.transport_failed("m", A, PAIR, unreachable=False)
    clock.now += 10
    h.transport_failed("m", A, PAIR, probe=h.claim(A))  # its probe refused: unreachable now
    assert h.candidates("n", (A,)) == ([], True)


def test_a_panics_failed_try_of_a_backend_it_reached_changes_nothing():
    """A backend out for resets or first-byte timeouts is tried in a panic by a model it is the
    last of. Each such try that failed the same way ejected it again: its cooldown doubled to
    the most within a few requests, and each was reported as a new state change. Only a
    panic's connection not made says something new: the backend is unreachable."""
    h, clock, changes = health(failure_threshold=3, cooldown=10, max_cooldown=120)
    for _ in range(3):
        h.transport_failed("m", A, PAIR, unreachable=False)
    out_for = h.snapshot()[0]["out_for_seconds"]
    for _ in range(10):
        assert h.candidates("n", (A,)) == ([A], True)
        h.transport_failed("n", A, (A,), unreachable=False, panic=True)
    assert changes == [("a", OUT_OF_SERVICE)] and h.snapshot()[0]["out_for_seconds"] == out_for
    h.transport_failed("n", A, (A,), unreachable=True, panic=True)
    assert h.candidates("n", (A,)) == ([], True)
    assert changes[1:] == [("a", OUT_OF_SERVICE)] * 2  # a change, told to each model it serves


def test_the_snapshot_and_the_metric_say_each_backends_state():
    h, _, _ = health(failure_threshold=1)
    h.transport_failed("m", A, PAIR)
    rows = {row["backend"]: row for row in h.snapshot()}
    assert rows["a"]["state"] == OUT_OF_SERVICE and rows["a"]["models"] == ["m"]
    assert rows["a"]["reason"] == "a transport failure"  # not "1 transport failures in a row"
    assert rows["b"]["state"] == IN_SERVICE
    line = json.loads(metric_line("BackendInService", 0, model="m", backend="a"))
    assert line["BackendInService"] == 0 and line["model"] == "m" and line["backend"] == "a"
    assert line["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["service", "model", "backend"]]


def test_the_health_settings_are_read_loudly_and_round_trip():
    import pytest

    from kiln.settings import Settings, SettingsError

    settings = Settings.from_env({"KILN_BACKEND_ERROR_RATE": "0.25", "KILN_BACKEND_ERROR_MIN_CLIENTS": "3"})
    assert (settings.backend_error_rate, settings.backend_error_min_clients) == (0.25, 3)
    assert Settings.from_env(settings.to_env()) == settings
    for name, value in [("KILN_BACKEND_ERROR_RATE", "0"), ("KILN_BACKEND_ERROR_RATE", "1.5"),
                        ("KILN_BACKEND_ERROR_MIN_REQUESTS", "0"), ("KILN_BACKEND_ERROR_WINDOW_SECONDS", "0")]:
        with pytest.raises(SettingsError, match=name):
            Settings.from_env({name: value})
