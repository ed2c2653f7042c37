"""Which backends are in service, as this process sees them (contract §5, "backend health").

A failed request says as much about the request as about the backend, so failures are
counted by cause:

- **The backend itself failed** (connection refused or reset before any answer, a TLS
  failure, a stream's headers not in time): `failure_threshold` of these in a row take the
  backend out of service. Any HTTP answer starts the count again.
- **The backend answered 5xx** (or broke after its 2xx: a cut stream, a body over its
  bound; or a buffered answer's headers did not come within the request's total, which
  come only when its generation is done, however long the request asked it to be): never
  enough on its own. Over the last `error_window` seconds, the backend goes out
  only when at least `error_min_requests` distinct requests were answered, at least
  `error_rate` of them failed, and the failed ones came from at least `error_min_clients`
  clients (orgs), the rate holding too whichever one org's requests are left out (one org's
  failing requests and a stray failure of another's take out no backend that serves the
  others well; the answers remembered, at most 1 024, are pruned from the org that holds
  the most). A request is known by its client and a hash of its body, so the openai
  SDK's retries of one call (or any resend of the same body) count once. A request that two
  backends or more answered with a failure, and none served, is the request's own failure
  and counts on none of them (kiln.upstream tells the answers of a request's attempts once it
  knows): a model's failover backend sees only the requests that failed before it, and two
  orgs' poisoned requests would take it out, leaving the others no failover. Where another
  backend served the request, each failure counts on its backend; where that backend then
  broke its answer, the break counts on none (the failover's view again), the failures
  before it stand.

A backend out of service is skipped for a cooldown (`cooldown` seconds, doubled at each
ejection in a row up to `max_cooldown`); then it is *probing*: one request at a time tries it.
Any answer puts it back in service: a success, and a 5xx too, which says no more of the
backend than any other request's (the rate rule decides again; taken out again soon, its
cooldown is still doubled). A failure of the backend itself takes it out again. (A 2xx is an
answer when its headers come: a stream cut after them counts later, by rate.) A request sent
before the backend went out that fails, during its cooldown or after, changes nothing: only
the probe's own answer decides. A model's last backend in
service is never ejected (Envoy's `max_ejection_percent` / panic threshold): its requests are
tried and get 502 if it fails. If every backend of a model is out anyway (a backend shared by
models, taken out as another model's), those taken out for their answers, or for failures
after they took the connection, are tried by every request (a panic: they answer, a model is
not taken away by another model's requests; a panic's try that fails changes nothing, but a
connection it could not make); those taken out as unreachable (their connections refused,
failed in TLS or not made in time, each time) are not, and the model answers 503
`no_backend_available` (§5).

State is per process (a Lambda execution environment, or `kiln dev`): every state change is
logged (`"event": "backend_state"`) and sent as the `BackendInService` metric (1 in service,
0 out), dimensions `model` and `backend`. Operators take a backend out for good in the
catalog (`"enabled": false`).
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from typing import Callable, Iterable

from .catalog import Backend

__all__ = ["BackendHealth", "HealthPolicy", "IN_SERVICE", "OUT_OF_SERVICE", "PROBING", "Probe"]

log = logging.getLogger("kiln.health")

IN_SERVICE = "in_service"
OUT_OF_SERVICE = "out_of_service"
PROBING = "probing"

# distinct requests remembered per backend, at most (the window is also bounded in time)
_MAX_REMEMBERED = 1024


class HealthPolicy:
    """The thresholds (KILN_BACKEND_* settings; README and docs/operations.md say why)."""

    __slots__ = ("failure_threshold", "cooldown", "max_cooldown", "error_window", "error_min_requests",
                 "error_rate", "error_min_clients")

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        cooldown: float = 10.0,
        max_cooldown: float = 120.0,
        error_window: float = 60.0,
        error_min_requests: int = 20,
        error_rate: float = 0.5,
        error_min_clients: int = 2,
    ) -> None:
        self.failure_threshold = failure_threshold
        self.cooldown = cooldown
        self.max_cooldown = max(max_cooldown, cooldown)
        self.error_window = error_window
        self.error_min_requests = error_min_requests
        self.error_rate = error_rate
        self.error_min_clients = error_min_clients


class _State:
    __slots__ = ("backend", "models", "transport_failures", "failures_unreachable", "answers", "out_until",
                 "ejections", "trial_until", "prober", "reason", "unreachable")

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.models: set[str] = set()
        self.transport_failures = 0
        self.failures_unreachable = False  # every transport failure in the count was a connection not made
        # request fingerprint -> (when, client, failed), oldest first
        self.answers: dict[str, tuple[float, str, bool]] = {}
        self.out_until: float | None = None  # set while out of service or probing
        self.ejections = 0  # in a row, for the growing cooldown
        self.trial_until = 0.0  # a probe is in flight until then
        self.prober: Probe | None = None  # the attempt probing it
        self.reason = ""
        self.unreachable = False  # out of service for connections it did not take (§5's 503), not its answers


StateListener = Callable[[str, Backend, str, str], None]  # (model id, backend, state, reason)


class Probe:
    """The one attempt allowed on a backend out of service once its cooldown is over (`claim`):
    its answer, and no other request's, decides (two attempts of the same request, an SDK's
    resend of one body, are two attempts)."""

    __slots__ = ()


class BackendHealth:
    def __init__(
        self,
        policy: HealthPolicy | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: StateListener | None = None,
    ) -> None:
        self.policy = policy or HealthPolicy()
        self._clock = clock
        self._states: dict[tuple[str, str], _State] = {}
        self.on_change = on_change or log_state_change

    # -- choosing ---------------------------------------------------------------------------

    def _state(self, backend: Backend, model_id: str | None = None) -> _State:
        key = (backend.name, backend.url)
        state = self._states.get(key)
        if state is None:
            state = self._states[key] = _State(backend)
        if model_id is not None:
            state.models.add(model_id)
        return state

    def state_of(self, backend: Backend) -> str:
        state = self._states.get((backend.name, backend.url))
        if state is None or state.out_until is None:
            return IN_SERVICE
        return OUT_OF_SERVICE if self._clock() < state.out_until else PROBING

    def candidates(self, model_id: str, backends: Iterable[Backend]) -> tuple[list[Backend], bool]:
        """The backends a request may try, in order, and whether this is a panic: those in
        service, and those whose cooldown is over (each tried by one request at a time); or,
        when none of them is (a backend shared by models, taken out as another model's), those
        out for their answers, not as unreachable, a panic, where every one is tried by every
        request: better a try than a model gone. None at all: 503 no_backend_available."""
        backends = list(backends)
        now = self._clock()
        chosen = []
        for backend in backends:
            state = self._state(backend, model_id)
            if state.out_until is None:
                chosen.append(backend)
            elif now >= state.out_until and now >= state.trial_until:
                chosen.append(backend)
        if chosen:
            return chosen, False
        return [backend for backend in backends if not self._state(backend).unreachable], True

    def claim(self, backend: Backend, *, panic: bool = False, lasting: float = 0.0) -> "bool | Probe":
        """Just before a request tries `backend`: False if another request is probing it (in a
        panic, never: the request tries it whatever its state, and its outcome counts); the
        attempt's Probe if it is the one that probes it (hand it to `answered` and `released`).
        `lasting`: the longest the attempt may wait for its answer (a buffered one, what is left
        of the total), for which no other request probes it."""
        state = self._state(backend)
        if state.out_until is None or panic:
            return True
        now = self._clock()
        if now < state.out_until or now < state.trial_until:
            return False
        # one probe at a time; if it never reports (cancelled), another may go after a cooldown
        state.trial_until = now + max(self.policy.cooldown, lasting)
        state.prober = Probe()
        return state.prober

    def released(self, backend: Backend, probe: "Probe | None" = None) -> None:
        """The attempt on `backend` ended without an outcome (the request was cancelled): if it
        was the probe, another request may probe it at once."""
        state = self._states.get((backend.name, backend.url))
        if state is not None and probe is not None and probe is state.prober:
            state.trial_until, state.prober = 0.0, None

    # -- outcomes ---------------------------------------------------------------------------

    def transport_failed(self, model_id: str, backend: Backend, models_backends: Iterable[Backend], *,
                         unreachable: bool = True, probe: "Probe | None" = None, panic: bool = False) -> None:
        """Refused, reset before answering, TLS failure, timeout before the first byte;
        `unreachable` when no connection was made (refused, TLS, connect timeout): a backend out
        for those alone is not tried in a panic (§5's 503). While the backend is out, only the
        probe's failure (`probe`) or a panic's takes it out again: a request sent before it went
        out, timing out later, says nothing new, and took the decision from the probe (its
        cooldown doubled, up to the most, with no probe sent)."""
        state = self._state(backend, model_id)
        if state.out_until is not None and (probe is None or probe is not state.prober) and not (
                panic and unreachable):
            # out already: a request sent before it went out says nothing new, nor does a panic's
            # try that reached it (it was out for such failures, or its answers); only a panic's
            # connection not made marks it unreachable
            return
        state.trial_until = 0.0
        state.failures_unreachable = unreachable and (state.failures_unreachable or not state.transport_failures)
        state.transport_failures += 1
        if state.out_until is not None or state.transport_failures >= self.policy.failure_threshold:
            failures = state.transport_failures
            self._eject(model_id, state, models_backends,
                        f"{failures} transport failures in a row" if failures > 1 else "a transport failure",
                        unreachable=state.failures_unreachable)

    def answered(self, model_id: str, backend: Backend, request: str, client: str, *, failed: bool,
                 models_backends: Iterable[Backend], probe: "Probe | None" = None, counted: bool = True) -> None:
        """The backend answered the request `request` (a fingerprint) of `client`: `failed` for
        a 5xx, or a 2xx it could not finish (cut, silent, over a bound); `probe`: the attempt's,
        if `claim` gave it one. `counted` False: the failure is the request's own (two backends
        or more failed it and none served it, as kiln.upstream tells): it counts neither way."""
        state = self._state(backend, model_id)
        the_probes = state.out_until is not None and probe is not None and probe is state.prober
        if state.out_until is None or the_probes:
            state.trial_until, state.prober = 0.0, None
        state.transport_failures = 0
        now = self._clock()
        answers = state.answers
        answers.pop(request, None)  # a retry of the same request counts once, with its last outcome
        if counted:
            answers[request] = (now, client, failed)
        horizon = now - self.policy.error_window
        while answers:
            oldest = next(iter(answers))
            if answers[oldest][0] >= horizon:
                break
            del answers[oldest]
        if len(answers) > _MAX_REMEMBERED:
            # the oldest answer of the org that holds the most: one org's flood of requests
            # would otherwise push every other org's answers out of the window it is judged in
            most = Counter(entry[1] for entry in answers.values()).most_common(1)[0][0]
            del answers[next(fingerprint for fingerprint, entry in answers.items() if entry[1] == most)]
        if state.out_until is not None:
            if not failed:
                self._restore(model_id, state, "a request succeeded")
            elif the_probes:
                # the probe answered 5xx: the backend answers, and one request's answer neither
                # takes a backend out nor keeps it out; the rate rule decides again, and the streak
                # is kept (out again soon: twice the cooldown)
                self._restore(model_id, state, "a probe was answered, if with a failure: the rate rule decides",
                              streak=state.ejections)
            # else: another request's failure (one sent before the backend went out, or a panic's):
            # it says nothing new, and the probe, if one is under way, goes on deciding
            return
        if not failed:
            state.ejections = 0  # served in service: the next ejection is a first one again
            return
        if not counted:
            return
        failures = [entry for entry in answers.values() if entry[2]]
        policy = self.policy
        if (
            len(answers) >= policy.error_min_requests
            and len(failures) >= policy.error_rate * len(answers)
            and len({entry[1] for entry in failures}) >= policy.error_min_clients
            and (policy.error_min_clients < 2 or self._failing_without_any_one_org(answers.values()))
        ):
            self._eject(model_id, state, models_backends,
                        f"{len(failures)} of {len(answers)} distinct requests failed in {policy.error_window:g} s")

    def _failing_without_any_one_org(self, answers: Iterable[tuple[float, str, bool]]) -> bool:
        """Whether the backend fails at the rate whichever one org's requests are left out: one
        org's failing requests, with any single failure of another org's, would otherwise take
        the backend out while it serves the others well (§5: one client cannot take a model
        away from the others). Leaving out an org that failed nothing only raises the rate."""
        answered: Counter[str] = Counter()
        failed: Counter[str] = Counter()
        for _, client, failure in answers:
            answered[client] += 1
            failed[client] += failure
        total, total_failed, rate = sum(answered.values()), sum(failed.values()), self.policy.error_rate
        return all(total_failed - failed[client] >= rate * (total - answered[client]) for client in failed
                   if failed[client])

    def forget(self, backend: Backend, request: str) -> None:
        """`backend` forgets what it answered `request` (it counts neither way)."""
        state = self._states.get((backend.name, backend.url))
        if state is not None:
            state.answers.pop(request, None)

    # -- changes ----------------------------------------------------------------------------

    def _eject(self, model_id: str, state: _State, models_backends: Iterable[Backend], reason: str, *,
               unreachable: bool = False) -> None:
        others = [b for b in models_backends if (b.name, b.url) != (state.backend.name, state.backend.url)]
        if state.out_until is None and not any(self.state_of(b) == IN_SERVICE for b in others):
            if state.reason != "last":
                state.reason = "last"
                log.warning(json.dumps({"event": "backend_kept", "model": model_id, "backend": state.backend.name,
                                        "reason": f"{reason}; kept: the model's last backend in service"}))
            return
        policy = self.policy
        was_out = state.out_until is not None
        state.ejections += 1
        cooldown = min(policy.cooldown * 2 ** (state.ejections - 1), policy.max_cooldown)
        state.out_until = self._clock() + cooldown
        state.trial_until, state.prober = 0.0, None
        state.transport_failures = 0
        state.answers.clear()
        state.reason = reason
        state.unreachable = unreachable
        self._changed(state, OUT_OF_SERVICE, f"{reason}{'; its probe failed' if was_out else ''}; out for {cooldown:g} s")

    def _restore(self, model_id: str, state: _State, reason: str, *, streak: int = 0) -> None:
        state.out_until = None
        state.ejections = streak
        state.trial_until, state.prober = 0.0, None
        state.reason = ""
        state.unreachable = False
        self._changed(state, IN_SERVICE, reason)

    def _changed(self, state: _State, new_state: str, reason: str) -> None:
        for model_id in sorted(state.models):
            try:
                self.on_change(model_id, state.backend, new_state, reason)
            except Exception:  # noqa: BLE001 - reporting must never fail a request
                log.exception("could not report a backend state change")

    # -- reporting --------------------------------------------------------------------------

    def snapshot(self) -> list[dict]:
        """Every backend this process has used, with its state (for `kiln admin backends`)."""
        now = self._clock()
        rows = []
        for state in self._states.values():
            current = self.state_of(state.backend)
            row = {"backend": state.backend.name, "url": state.backend.url, "models": sorted(state.models),
                   "state": current, "transport_failures": state.transport_failures,
                   "recent_requests": len(state.answers),
                   "recent_failures": sum(1 for entry in state.answers.values() if entry[2])}
            if current != IN_SERVICE and state.out_until is not None:
                row["out_for_seconds"] = round(max(0.0, state.out_until - now), 1)
                row["reason"] = state.reason
            rows.append(row)
        return rows

    def out_of_service(self) -> list[str]:
        return [state.backend.name for state in self._states.values() if self.state_of(state.backend) == OUT_OF_SERVICE]


def log_state_change(model_id: str, backend: Backend, state: str, reason: str) -> None:
    """The default listener: one log line, and the BackendInService metric (EMF)."""
    from .telemetry import metric

    log.warning(json.dumps({"event": "backend_state", "model": model_id, "backend": backend.name, "state": state,
                            "reason": reason}))
    metric("BackendInService", 1 if state == IN_SERVICE else 0, model=model_id, backend=backend.name)
