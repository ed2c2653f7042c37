"""Upstream faults: each answered per contract §5/§7, with the slot released and the usage recorded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from typing import Callable

import pytest

from kiln.settings import Settings
from kiln_ops.mock_upstream import MockUpstream
from kiln_ops.serve import ServerThread, free_port
from support import TELEMETRY, LedgerCheck, catalog_for_tests, data_events, dead_url, wait_for_events

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "x"}]

# fault → (model, extra body, expected status, expected usage status, what the client sees)
FAULTS = {
    "connection refused": ("all-down-model", {}, 502, "upstream_error", "plain"),
    "500": ("qwen3-32b", {"mock": {"status": 500}}, 502, "upstream_error", "plain"),
    "plain-text 500": ("qwen3-32b", {"mock": {"status": 500, "plain_text": True}}, 502, "upstream_error", "plain"),
    "400 passthrough": ("qwen3-32b", {"mock": {"status": 400, "message": "context too long"}}, 400, "upstream_rejected", "json"),
    "timeout before the first byte": ("hung-model", {"stream": True}, 502, "upstream_error", "plain"),
    "cut mid-stream": ("qwen3-32b", {"stream": True, "mock": {"cut_after": 4}}, 200, "stream_interrupted", "error-event"),
    "no backend": ("no-backend-model", {}, 503, "no_backend_available", "json"),
    "failover to a second backend": ("failover-model", {}, 200, "success", "json"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_is_answered_per_contract_and_settled(stack, fault):
    model, extra, status, usage_status, shape = FAULTS[fault]
    org_id, key = stack.org()
    response = stack.post(CHAT, {"model": model, "messages": MESSAGES, **extra}, key)
    assert response.status_code == status
    if shape == "plain":
        assert response.headers["content-type"].startswith("text/plain") and response.text.strip()
    elif shape == "error-event":
        chunks = data_events(response.text)
        assert chunks[-1]["error"]["code"] == "upstream_error" and "[DONE]" not in chunks
    elif status >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    (event,) = stack.events(org_id)
    assert event.gen_id == response.headers["X-Neocloud-Generation-Id"]
    assert event.status == usage_status
    assert stack.org_info(org_id).in_flight == 0


def test_a_slow_first_token_gets_keepalives_and_nothing_times_out_early(stack_factory):
    stack = stack_factory(keepalive_seconds=0.2)
    _, key = stack.org()
    # headers at once, first token after 1.5 s: far beyond a 0.5 s first-byte timeout, within the idle one
    document = catalog_for_tests(stack.mock.url)
    thinking = next(m for m in document["models"] if m["id"] == "qwen3-32b")
    stack.ssm.put_parameter(
        Name=stack.settings.catalog_parameter, Overwrite=True, Type="String", Tier="Advanced",
        Value=json.dumps({"models": [{**thinking, "timeouts": {"first_byte": 0.5, "idle": 5, "total": 30}}]}),
    )
    response = stack.post(CHAT, {"model": "qwen3-32b", "messages": MESSAGES, "stream": True, "mock": {"ttft_ms": 1500}}, key)
    assert response.status_code == 200
    assert response.text.count(": keepalive") >= 5
    assert data_events(response.text)[-1] == "[DONE]"


def test_an_event_trickled_slower_than_the_keepalive_still_gets_keepalives(stack_factory):
    """The upstream is never silent (a byte every 50 ms) but no event is whole for 1.5 s: the
    client is sent `: keepalive` whenever it has had nothing for the interval, never a part of
    the event, then the event whole."""
    import socket
    import threading

    event = b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"qwen3-32b",' \
            b'"choices":[{"index":0,"delta":{"content":"slow"},"finish_reason":null}]}\n\n'
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(head)
            step = max(1, len(event) // 30)
            for i in range(0, len(event), step):
                piece = event[i:i + step]
                conn.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                time.sleep(0.05)
            done = b"data: [DONE]\n\n"
            conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            conn.recv(65536)

    threading.Thread(target=serve, daemon=True).start()
    stack = stack_factory(keepalive_seconds=0.3)
    org_id, key = stack.org()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1"
    trickle = model("qwen3-32b", [{"name": "trickle", "url": url}], timeouts={"first_byte": 2, "idle": 5, "total": 30})
    stack.ssm.put_parameter(Name=stack.settings.catalog_parameter, Overwrite=True, Type="String", Tier="Advanced",
                            Value=json.dumps({"models": [trickle]}))
    arrivals = []
    started = time.monotonic()
    with stack.http.stream("POST", CHAT, json={"model": "qwen3-32b", "messages": MESSAGES, "stream": True},
                           headers={"Authorization": f"Bearer {key}"}) as response:
        for piece in response.iter_raw():
            arrivals.append((time.monotonic() - started, piece))
    listener.close()
    text = b"".join(piece for _, piece in arrivals).decode()
    assert text.count(": keepalive") >= 3
    assert data_events(text)[0]["choices"][0]["delta"]["content"] == "slow" and data_events(text)[-1] == "[DONE]"
    assert max(b[0] - a[0] for a, b in zip(arrivals, arrivals[1:], strict=False)) < 0.6  # never silent for two intervals
    (event_record,) = stack.events(org_id)
    assert event_record.status == "success" and stack.org_info(org_id).in_flight == 0


def test_a_refusing_backend_is_ejected_but_the_last_one_in_service_is_always_tried(stack_factory):
    stack = stack_factory(backend_failure_threshold=2, backend_cooldown_seconds=0.5)
    org_id, key = stack.org()
    health = stack.gateway.upstream.health
    body = {"model": "all-down-model", "messages": MESSAGES}  # "dead" refuses, "sick" answers 500
    assert [stack.post(CHAT, body, key).status_code for _ in range(2)] == [502, 502]
    # "dead" refused twice: out of service. "sick" answered (500s never eject alone) and is the
    # model's last backend in service: its requests are still tried, and get 502
    assert health.out_of_service() == ["dead"]
    skipped = stack.post(CHAT, body, key)
    assert skipped.status_code == 502 and skipped.headers["content-type"].startswith("text/plain")
    time.sleep(0.6)
    assert stack.post(CHAT, body, key).status_code == 502  # after the cooldown: "dead" probed again
    errors = [e.error for e in sorted(stack.events(org_id), key=lambda e: e.created_at)]
    assert errors == ["dead: connection failed; sick: HTTP 500"] * 2 + ["sick: HTTP 500",
                                                                        "dead: connection failed; sick: HTTP 500"]
    assert stack.org_info(org_id).in_flight == 0


def test_one_failing_backend_is_skipped_while_the_other_serves(stack_factory):
    stack = stack_factory(backend_failure_threshold=1, backend_cooldown_seconds=60)
    _, key = stack.org()
    mark = len(TELEMETRY.text())
    for _ in range(3):  # failover-model: a backend that refuses connections, then the mock
        response = stack.post(CHAT, {"model": "failover-model", "messages": MESSAGES}, key)
        assert response.status_code == 200
    assert stack.gateway.upstream.health.out_of_service() == ["dead"]
    # only the first request tried the dead backend; the others went straight to the live one
    failures = [json.loads(line)["UpstreamFailures"] for line in TELEMETRY.text()[mark:].splitlines()
                if '"UpstreamFailures"' in line]
    assert failures == [[1.0], [0.0], [0.0]]


# -- health by cause and by volume (contract §5) ------------------------------------------


def production_health(stack_factory, mock, *models, **overrides):
    """A stack whose backend health has the production defaults (the test stacks turn it off),
    serving the test catalog plus `models`."""
    defaults = Settings()
    settings = {name: getattr(defaults, name) for name in (
        "backend_failure_threshold", "backend_cooldown_seconds", "backend_max_cooldown_seconds",
        "backend_error_window_seconds", "backend_error_min_requests", "backend_error_rate",
        "backend_error_min_clients")}
    document = catalog_for_tests(mock.url)
    document["models"] += list(models)
    stack = stack_factory(catalog=document, **{**settings, **overrides})
    changes = StateChanges()
    stack.gateway.upstream.health.on_change = changes
    return stack, changes


class StateChanges(list):
    """(model, backend, state) of each change the gateway reports (log line and metric)."""

    def __call__(self, model_id, backend, state, reason):
        self.append((model_id, backend.name, state))


def upstream_failures(mark):
    """Backends that failed, per request logged since `mark` (the UpstreamFailures metric)."""
    return [int(json.loads(line)["UpstreamFailures"][0]) for line in TELEMETRY.text()[mark:].splitlines()
            if '"UpstreamFailures"' in line]


def model(model_id, backends, **extra):
    return {"id": model_id, "owned_by": "kiln-tests", "created": 1, "context_length": 4096,
            "pricing": {"input": "1", "output": "2"}, "backends": backends, **extra}


def failing(org_key_pairs, stack, model_id, count, *, distinct=True):
    """`count` requests the model server answers 500 because of what they contain."""
    statuses = []
    for i in range(count):
        _, key = org_key_pairs[i % len(org_key_pairs)]
        content = f"crashes the server {i if distinct else 0}"
        statuses.append(stack.post(CHAT, {"model": model_id, "messages": [{"role": "user", "content": content}],
                                          "mock": {"status": 500}}, key).status_code)
    return statuses


@pytest.mark.parametrize("count", [3, 10])
def test_another_org_is_served_right_after_one_orgs_request_specific_500s(stack_factory, mock, count):
    stack, changes = production_health(stack_factory, mock)
    org_a, org_b = stack.org(), stack.org()
    # qwen3-32b has one backend, as in the default catalog
    assert failing([org_a], stack, "qwen3-32b", count) == [502] * count
    response = stack.post(CHAT, {"model": "qwen3-32b", "messages": MESSAGES}, org_b[1])
    assert response.status_code == 200
    assert changes == []
    assert stack.org_info(org_a[0]).in_flight == stack.org_info(org_b[0]).in_flight == 0


def test_the_openai_sdks_retries_of_one_failing_call_count_once(stack_factory, mock):
    openai = pytest.importorskip("openai")
    pair = model("pair-model", [{"name": "a", "url": mock.url}, {"name": "b", "url": mock.url}])
    stack, changes = production_health(stack_factory, mock, pair, backend_error_min_requests=2,
                                       backend_error_min_clients=1)
    org_a, org_b = stack.org(), stack.org()
    client = openai.OpenAI(base_url=stack.base_url, api_key=org_a[1], max_retries=2)
    with pytest.raises(openai.InternalServerError):  # 502 after its 3 attempts, each tried on a and b
        client.chat.completions.create(model="pair-model", messages=MESSAGES, extra_body={"mock": {"status": 500}})
    # three attempts, one request: below even a minimum of 2 distinct requests
    assert changes == []
    response = stack.post(CHAT, {"model": "pair-model", "messages": MESSAGES}, org_b[1])
    assert response.status_code == 200
    (event,) = stack.events(org_b[0])
    assert event.upstream == "a"


def test_requests_every_backend_fails_take_neither_out_so_the_failover_stays_for_the_others(stack_factory, mock):
    """§5: a third org's 12 requests served by a, then two orgs' 8 requests that every model
    server answers 500 (their content's fault), each tried on a, then on b, the failover,
    which sees no other request. a's rate stays under half (8 of 20); b's was 100 % and b went
    out, so the third org would get 502 the moment a failed. A request every backend it was
    tried on failed counts on none of them: both stay in service."""
    pair = model("poisoned-pair", [{"name": "a", "url": mock.url}, {"name": "b", "url": mock.url.replace("127.0.0.1",
                                                                                                         "localhost")}])
    stack, changes = production_health(stack_factory, mock, pair, backend_error_min_requests=4)
    poisoners, bystander = [stack.org(), stack.org()], stack.org()
    for i in range(12):
        response = stack.post(CHAT, {"model": "poisoned-pair", "messages": [{"role": "user", "content": f"q{i}"}]},
                              bystander[1])
        assert response.status_code == 200
    assert failing(poisoners, stack, "poisoned-pair", 8) == [502] * 8  # each tried on a, then b
    assert changes == []
    states = {row["backend"]: (row["state"], row["recent_failures"]) for row in stack.gateway.upstream.health.snapshot()
              if "poisoned-pair" in row["models"]}
    assert states == {"a": ("in_service", 0), "b": ("in_service", 0)}
    assert {event.upstream for event in stack.events(bystander[0])} == {"a"}


def test_5xx_from_many_distinct_requests_of_several_orgs_do_eject_a_backend_while_another_serves(stack_factory, mock):
    base = mock.url.rsplit("/v1", 1)[0]
    pair = model("sick-pair-model", [{"name": "sick", "url": f"{base}/x/status=503/v1"}, {"name": "b", "url": mock.url}])
    stack, changes = production_health(stack_factory, mock, pair, backend_error_min_requests=4,
                                       backend_cooldown_seconds=60)
    orgs = [stack.org(), stack.org()]
    for i in range(4):  # each served by b after sick's 503: the clients see 200
        response = stack.post(CHAT, {"model": "sick-pair-model", "messages": [{"role": "user", "content": f"q{i}"}]},
                              orgs[i % 2][1])
        assert response.status_code == 200
    assert changes == [("sick-pair-model", "sick", "out_of_service")]
    mark = len(TELEMETRY.text())
    assert stack.post(CHAT, {"model": "sick-pair-model", "messages": MESSAGES}, orgs[0][1]).status_code == 200
    assert upstream_failures(mark) == [0]  # sick no longer tried


def test_requests_sent_before_a_backend_went_out_do_not_put_it_back_when_they_fail(stack_factory, mock):
    """A backend that answers 500 after a second, 8 requests of 2 orgs at once: the rate rule
    takes it out at the 4th failure, and the 4 requests still in flight on it, failing a moment
    later, put it back in service (then out again): a backend always failing slowly was tried by
    nearly every request. It stays out for its cooldown; the next request is not sent to it."""
    from concurrent.futures import ThreadPoolExecutor

    base = mock.url.rsplit("/v1", 1)[0]
    pair = model("slow-sick-model", [{"name": "sick", "url": f"{base}/x/status=500,headers_delay_ms=1000/v1"},
                                     {"name": "b", "url": mock.url}])
    stack, changes = production_health(stack_factory, mock, pair, backend_error_min_requests=4,
                                       backend_cooldown_seconds=60)
    orgs = [stack.org(), stack.org()]

    def one(i):
        return stack.post(CHAT, {"model": "slow-sick-model", "messages": [{"role": "user", "content": f"q{i}"}]},
                          orgs[i % 2][1]).status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(8))) == [200] * 8  # each served by b after sick's 500
    assert changes == [("slow-sick-model", "sick", "out_of_service")]
    mark = len(TELEMETRY.text())
    assert one(100) == 200
    assert upstream_failures(mark) == [0]  # sick not tried


def test_a_backend_refusing_connections_is_skipped_then_comes_back_after_it_recovers(stack_factory, mock):
    port = free_port()
    pair = model("recovering-model", [{"name": "flaky", "url": f"http://127.0.0.1:{port}/v1"},
                                      {"name": "b", "url": mock.url}])
    # a cooldown the three requests after the third refusal fit in on a loaded machine (at 0.5 s
    # the sixth once came after it, and probed flaky)
    stack, changes = production_health(stack_factory, mock, pair, backend_cooldown_seconds=3.0)
    org_id, key = stack.org()
    body = {"model": "recovering-model", "messages": MESSAGES}
    mark = len(TELEMETRY.text())
    for _ in range(6):
        assert stack.post(CHAT, body, key).status_code == 200  # b serves throughout
    # the default threshold: three refusals, then flaky is skipped
    assert upstream_failures(mark) == [1, 1, 1, 0, 0, 0]
    assert changes == [("recovering-model", "flaky", "out_of_service")]
    assert stack.gateway.upstream.health.out_of_service() == ["flaky"]
    server = ServerThread(MockUpstream(), port=port).start()  # flaky recovers
    try:
        time.sleep(3.1)
        served_by = []
        for _ in range(3):
            assert stack.post(CHAT, body, key).status_code == 200
            served_by.append(sorted(stack.events(org_id), key=lambda e: e.created_at)[-1].upstream)
        assert served_by == ["flaky"] * 3  # the first request after the cooldown probed it: back in service
        assert changes[-1] == ("recovering-model", "flaky", "in_service")
    finally:
        server.stop()


def test_one_orgs_request_answered_500_as_the_probe_does_not_keep_a_recovered_backend_out(stack_factory, mock):
    """§5: a 5xx answered to one request never takes a backend out on its own. The request that
    probed a recovered backend after its cooldown was another org's, one the server answers 500
    for what it holds: the backend was taken out again, its cooldown doubled, and one such request
    per cooldown (up to 2 minutes) kept it from every org for as long as it was sent."""
    port = free_port()
    pair = model("probed-model", [{"name": "flaky", "url": f"http://127.0.0.1:{port}/v1"},
                                  {"name": "b", "url": mock.url}])
    stack, changes = production_health(stack_factory, mock, pair, backend_cooldown_seconds=0.5)
    (_, poisoner), (org_id, key) = stack.org(), stack.org()
    body = {"model": "probed-model", "messages": MESSAGES}
    for _ in range(3):  # flaky refuses connections: out of service
        assert stack.post(CHAT, body, key).status_code == 200
    assert changes == [("probed-model", "flaky", "out_of_service")]
    server = ServerThread(MockUpstream(), port=port).start()  # flaky recovers
    try:
        time.sleep(0.6)
        poisoned = stack.post(CHAT, {**body, "mock": {"status": 500}}, poisoner)  # the probe: 500 from both
        assert poisoned.status_code == 502
        served_by = []
        for _ in range(3):
            assert stack.post(CHAT, body, key).status_code == 200
            served_by.append(sorted(stack.events(org_id), key=lambda e: e.created_at)[-1].upstream)
        assert served_by == ["flaky"] * 3, changes
        assert changes[-1] == ("probed-model", "flaky", "in_service")
        assert stack.gateway.upstream.health.out_of_service() == []
    finally:
        server.stop()


def test_with_its_only_backend_refusing_connections_a_model_answers_502_not_503(stack_factory, mock):
    lonely = model("lonely-model", [{"name": "dead", "url": dead_url()}])
    stack, changes = production_health(stack_factory, mock, lonely)
    org_id, key = stack.org()
    for _ in range(6):  # twice the threshold: the only backend is never taken out
        response = stack.post(CHAT, {"model": "lonely-model", "messages": MESSAGES}, key)
        assert response.status_code == 502 and response.headers["content-type"].startswith("text/plain")
    assert changes == []
    assert [e.status for e in stack.events(org_id)] == ["upstream_error"] * 6
    assert stack.org_info(org_id).in_flight == 0


def test_requests_ended_by_each_timeout_are_counted_by_kind(stack_factory, mock):
    base = mock.url.rsplit("/v1", 1)[0]
    endless = model("endless-model", [{"name": "b", "url": f"{base}/x/endless=1,token_delay_ms=20/v1"}],
                    timeouts={"total": 0.5})
    stack, _ = production_health(stack_factory, mock, endless)
    ended = []
    stack.gateway.upstream.timed_out = lambda model_id, kind: ended.append((model_id, kind))
    org_id, key = stack.org()
    cases = [
        ("hung-model", {"stream": True}, 502),  # no headers within first_byte (0.3 s)
        ("hung-then-ok-model", {}, 502),  # buffered: the request's total (1 s) spent on the hung backend
        ("idle-model", {"stream": True, "mock": {"ttft_ms": 1500}}, 200),  # silent past idle (0.3 s)
        ("endless-model", {"stream": True}, 200),  # streaming past total (0.5 s)
    ]
    for model_id, extra, status in cases:
        assert stack.post(CHAT, {"model": model_id, "messages": MESSAGES, **extra}, key).status_code == status
    assert ended == [("hung-model", "first_byte"), ("hung-then-ok-model", "total"), ("idle-model", "idle"),
                     ("endless-model", "total")]
    assert stack.org_info(org_id).in_flight == 0


class RawUpstream:
    """A model server on a loopback port that answers every request with `answer(conn, request)`:
    exactly the bytes the test wants, when it wants."""

    def __init__(self, answer: Callable[[socket.socket, bytes], None]) -> None:
        self.answer = answer
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.requests = 0
        self.heads: list[bytes] = []  # each request's head, as it came
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                data = b""
                while b"\r\n\r\n" not in data:
                    more = conn.recv(65536)
                    if not more:
                        return
                    data += more
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    more = conn.recv(65536)
                    if not more:
                        return
                    body += more
                self.requests += 1
                self.heads.append(head)
                self.answer(conn, body)
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self.listener.close()


@contextlib.contextmanager
def served_by(answer: Callable[[socket.socket, bytes], None], stack_factory, mock, timeouts: dict):
    """A stack whose `raw-model` has one backend, a RawUpstream answering with `answer`, and
    these timeouts: (stack, a key of a new org, that org's LedgerCheck)."""
    upstream = RawUpstream(answer)
    try:
        raw = model("raw-model", [{"name": "raw", "url": upstream.url}], timeouts=timeouts)
        stack = stack_factory(catalog={**catalog_for_tests(mock.url), "models": [raw]})
        org_id, key = stack.org()
        yield stack, key, LedgerCheck(stack, org_id)
    finally:
        upstream.close()


def test_a_5xx_whose_body_never_comes_does_not_hold_the_request_past_the_models_total_time(stack_factory, mock):
    """A backend answers `503` with `Content-Length: 1000` and then sends nothing more: the
    model's `total` bounds the whole request, every backend tried included, error bodies too
    (their own 5 s bound would hold the request 5 s more per backend)."""
    def sick(conn: socket.socket, body: bytes) -> None:
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"error\":")
        time.sleep(3)

    with served_by(sick, stack_factory, mock, {"connect": 1, "first_byte": 0.5, "idle": 30, "total": 0.5}) as (
            stack, key, ledger):
        started = time.monotonic()
        response = ledger.saw(stack.post(CHAT, {"model": "raw-model", "messages": MESSAGES}, key))
        elapsed = time.monotonic() - started
        assert response.status_code == 502
        ledger.check()
        assert elapsed < 2.0, f"a model with a total of 0.5 s answered after {elapsed:.1f} s"


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_buffered_answer_whose_body_goes_silent_is_a_502_never_a_success(stack_factory, mock, framing):
    """§5: a 200 whose body stops coming (its Content-Length not reached, or no last chunk) is a
    failed answer once the model's idle time passes, however the event loop's timers round:
    the client gets 502, the event records the failure, nothing is billed as a success."""
    answer = json.dumps({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()
    head = (f"Content-Length: {len(answer) + 10}\r\n\r\n".encode() + answer if framing == "content-length"
            else b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(answer):x}\r\n".encode() + answer + b"\r\n")

    def stalls(conn: socket.socket, body: bytes) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + head)
        time.sleep(2)

    with served_by(stalls, stack_factory, mock, {"connect": 1, "first_byte": 5, "idle": 0.2, "total": 5}) as (
            stack, key, ledger):
        statuses = [ledger.saw(stack.post(CHAT, {"model": "raw-model", "messages": MESSAGES}, key)).status_code
                    for _ in range(5)]
        assert statuses == [502] * 5
        events = ledger.check()
        assert [event.status for event in events] == ["upstream_error"] * 5


def test_one_orgs_long_buffered_generations_do_not_take_a_healthy_backend_out_of_service(stack_factory, mock):
    """§5: one client cannot take a model away from the others. A buffered answer's headers come
    when its generation is done, so running out of the total waiting for them is the request's
    doing (its max_tokens) as much as the backend's: counted as failed answers, by rate over
    clients, never as the backend's own failures, three of which in a row would take it out."""
    pair = model("pair-model", [{"name": "a", "url": mock.url}, {"name": "b", "url": mock.url}],
                 timeouts={"connect": 1, "first_byte": 30, "idle": 30, "total": 0.6})
    stack, changes = production_health(stack_factory, mock, pair)
    org_a, org_b = stack.org(), stack.org()
    for i in range(3):  # a long generation: the healthy mock answers after 1.5 s
        slow = {"model": "pair-model", "messages": [{"role": "user", "content": f"long {i}"}],
                "mock": {"ttft_ms": 1500}}
        assert stack.post(CHAT, slow, org_a[1]).status_code == 502
    assert stack.post(CHAT, {"model": "pair-model", "messages": MESSAGES}, org_b[1]).status_code == 200
    assert changes == [], f"one org's own slow requests changed the backends' state for all: {changes}"


def _read_slowly(stack, key: str, body: dict, wait: float) -> bytes:
    """A stream's client that reads its headers, then nothing for `wait` seconds, then the rest:
    the stream's body."""
    content = json.dumps(body).encode()
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.socket() as client:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect((host, int(port)))
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + key.encode()
                       + b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                       % (len(content), content))
        received = client.recv(12)
        time.sleep(wait)
        client.settimeout(10)
        while not received.endswith(b"\r\n0\r\n\r\n"):
            piece = client.recv(65536)
            if not piece:
                break
            received += piece
    rest, body = received.split(b"\r\n\r\n", 1)[1], b""
    while rest:  # the chunked body, unframed
        size, rest = rest.split(b"\r\n", 1)
        body, rest = body + rest[:int(size, 16)], rest[int(size, 16) + 2:]
    return body


async def _seven_megabytes_at_once(scope, receive, send):
    """A model server whose stream is 7 MB, written at once: more than the sockets between the
    gateway and a client hold, so the gateway waits on a client that reads slowly."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "pair-model",
             "choices": [{"index": 0, "delta": {"content": "word " * 120_000}, "finish_reason": None}]}
    last = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 1000, "total_tokens": 1004}}
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for event in [chunk] * 12 + [last]:
        await send({"type": "http.response.body", "body": b"data: %s\n\n" % json.dumps(event).encode(),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def test_clients_that_read_their_streams_slowly_do_not_take_a_healthy_backend_out_of_service(stack_factory, mock):
    """§5: one client cannot take a model away from the others. Two orgs' clients that read their
    streams slower than the model's total time allows, while the backend sent all it had at
    once: the streams end with the error event, billed for what was relayed, and the time the
    gateway waited on the clients is not the backend's. It was counted as the backend's failure:
    at 100 % over two clients, the healthy backend went out for every org."""
    server = ServerThread(_seven_megabytes_at_once).start()
    try:
        pair = model("pair-model", [{"name": "a", "url": f"{server.url}/v1"}, {"name": "b", "url": mock.url}],
                     timeouts={"connect": 1, "first_byte": 5, "idle": 5, "total": 1.0})
        stack, changes = production_health(stack_factory, mock, pair, backend_error_min_requests=4)
        orgs = [stack.org(), stack.org()]
        answers: list[bytes] = []
        readers = [threading.Thread(target=lambda i=i: answers.append(_read_slowly(stack, orgs[i % 2][1], {
            "model": "pair-model", "messages": [{"role": "user", "content": f"q{i}"}], "stream": True}, 2.0)))
            for i in range(4)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        for org_id, _ in orgs:
            events = wait_for_events(stack, org_id, 2)
            assert [(event.status, event.error) for event in events] == [
                ("client_disconnected", "the client did not read the stream within the model's total time")] * 2
            assert all(event.completion_tokens > 0 for event in events)
            assert stack.org_info(org_id).in_flight == 0
        # the client, still there, is told why its stream ended
        assert all(data_events(answer.decode(errors="replace"))[-1]["error"]["message"]
                   == "The stream was ended: it was not read within the model's total time." for answer in answers)
        assert changes == [], f"clients that read slowly changed the backend's state for all: {changes}"
        rows = {row["backend"]: row for row in stack.gateway.upstream.health.snapshot() if "pair-model" in row["models"]}
        assert rows["a"]["recent_failures"] == 0 and rows["a"]["state"] == "in_service"
    finally:
        server.stop()


async def _never_answers(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await asyncio.sleep(60)


@pytest.mark.parametrize("failover", [False, True])
def test_a_client_that_reads_nothing_is_cut_at_the_requests_deadline_failover_included(stack_factory, mock, failover):
    """§5: the model's total covers every backend tried. A client that reads nothing was cut at
    the serving backend's attempt plus the total: after failovers, past the function's own
    timeout at the catalog's longest total, the request then never settled."""
    hang = ServerThread(_never_answers).start()
    big = ServerThread(_seven_megabytes_at_once).start()
    try:
        first = [{"name": "a", "url": f"{hang.url}/v1"}] if failover else []
        pair = model("pair-model", [*first, {"name": "b", "url": f"{big.url}/v1"}],
                     timeouts={"connect": 1, "first_byte": 1.5, "idle": 5, "total": 2.5})
        stack, _ = production_health(stack_factory, mock, pair, keepalive_seconds=0.5)
        org_id, key = stack.org()
        _read_slowly(stack, key, {"model": "pair-model", "messages": MESSAGES, "stream": True}, 5.0)
        (event,) = wait_for_events(stack, org_id, 1)
        # the request's deadline and the client's last keep-alive interval, its settle's time besides
        assert event.status == "client_disconnected" and event.duration_ms <= 3300, (event.status, event.duration_ms)
    finally:
        hang.stop()
        big.stop()


@pytest.mark.parametrize("case", ["after a failover", "a client that paused once"])
def test_a_stream_its_backend_never_ends_is_the_backends_failure_whatever_its_client_did(stack_factory, mock, case):
    """The other side of the test above: a backend that streams without end fails the request,
    however its client read. Two ways it was put on the client instead, the backend told
    nothing: served after a failover (the time spent on the first backend counted as the
    client's), and a client that held one write for a while early on, then read at once.
    (A client slower than such a backend to the end is what the stream waited on when it
    was cut: that one is the client's, the backend told nothing either way.)"""
    hang = ServerThread(_never_answers).start()
    try:
        first = [{"name": "a", "url": f"{hang.url}/v1"}] if case == "after a failover" else []
        pair = model("pair-model", [*first, {"name": "b", "url": mock.url}],
                     timeouts={"connect": 1, "first_byte": 1, "idle": 5, "total": 2.5})
        stack, _ = production_health(stack_factory, mock, pair)
        org_id, key = stack.org()
        body = {"model": "pair-model", "messages": MESSAGES, "stream": True,
                "mock": {"endless": True, "token_delay_ms": 2}}  # faster than the client, once it reads
        if first:
            text = stack.post(CHAT, body, key).text
        else:
            text = _read_slowly(stack, key, body, 1.0).decode(errors="replace")
        (event,) = wait_for_events(stack, org_id, 1)
        assert (event.status, event.error) == ("stream_interrupted", "exceeded the model's total time")
        assert data_events(text)[-1]["error"]["message"] == "The model backend failed while streaming the response."
        rows = {row["backend"]: row for row in stack.gateway.upstream.health.snapshot() if "pair-model" in row["models"]}
        assert rows["b"]["recent_failures"] == 1
    finally:
        hang.stop()


def test_a_shared_backend_taken_out_for_one_model_is_still_tried_for_a_model_it_is_the_last_of(stack_factory, mock):
    """§5: a model's last backend in service is never taken out, its requests are tried. A
    backend shared by two models, taken out as pair-model's (its 5xx to two orgs' distinct
    requests, which b served), is still tried for solo-model, whose only backend it is, and
    serves it (the request asks the mock for a plain answer over the backend's 500s)."""
    base = mock.url.rsplit("/v1", 1)[0]
    shared = {"name": "a", "url": f"{base}/x/status=500/v1"}
    pair = model("pair-model", [shared, {"name": "b", "url": mock.url}])
    solo = model("solo-model", [shared])
    stack, changes = production_health(stack_factory, mock, pair, solo, backend_error_min_requests=4,
                                       backend_cooldown_seconds=60)
    orgs = [stack.org(), stack.org()]
    for i in range(4):
        body = {"model": "pair-model", "messages": [{"role": "user", "content": f"crash {i}"}]}
        assert stack.post(CHAT, body, orgs[i % 2][1]).status_code == 200  # a's 500, then b's answer
    assert ("pair-model", "a", "out_of_service") in changes
    org_id, key = stack.org()
    response = stack.post(CHAT, {"model": "solo-model", "messages": MESSAGES, "mock": {"status": 200}}, key)
    assert response.status_code == 200, (response.status_code, response.text)
    (event,) = stack.events(org_id)
    assert event.upstream == "a"


def test_a_shared_backend_taken_out_as_unreachable_leaves_the_model_it_is_the_last_of_503(stack_factory, mock):
    """§5: a model whose every backend is unreachable and marked out of service answers 503
    `no_backend_available` (a backend shared by two models, taken out as the other's)."""
    dead = dead_url()
    pair = model("pair-model", [{"name": "dead", "url": dead}, {"name": "b", "url": mock.url}])
    solo = model("solo-model", [{"name": "dead", "url": dead}])
    stack, changes = production_health(stack_factory, mock, pair, solo, backend_cooldown_seconds=60)
    org_id, key = stack.org()
    for i in range(3):  # refused each time, served by b
        body = {"model": "pair-model", "messages": [{"role": "user", "content": f"hi {i}"}]}
        assert stack.post(CHAT, body, key).status_code == 200
    assert ("pair-model", "dead", "out_of_service") in changes
    ledger = LedgerCheck(stack, org_id)
    response = ledger.saw(stack.post(CHAT, {"model": "solo-model", "messages": MESSAGES}, key))
    assert (response.status_code, response.json()["error"]["code"]) == (503, "no_backend_available")
    ledger.check()


def test_a_shared_backend_out_for_first_byte_timeouts_is_still_tried_for_a_model_it_is_the_last_of(
        stack_factory, mock):
    """§5: 503 `no_backend_available` is for a model whose every backend is unreachable
    (refused, TLS, connect timeout). A backend whose streams time out before their first byte
    answers its connections: taken out as pair-model's, it is still tried for solo-model,
    whose only backend it is, and serves it."""
    answer = json.dumps({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()

    def streams_hang(conn: socket.socket, body: bytes) -> None:
        if json.loads(body).get("stream"):
            time.sleep(1.5)  # past the first byte's bound
            return
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(answer)}\r\n\r\n".encode() + answer)

    upstream = RawUpstream(streams_hang)
    try:
        timeouts = {"connect": 1, "first_byte": 0.3, "idle": 5, "total": 10}
        pair = model("pair-model", [{"name": "slow", "url": upstream.url}, {"name": "b", "url": mock.url}],
                     timeouts=timeouts)
        solo = model("solo-model", [{"name": "slow", "url": upstream.url}], timeouts=timeouts)
        stack, changes = production_health(stack_factory, mock, pair, solo, backend_cooldown_seconds=60)
        org_id, key = stack.org()
        ledger = LedgerCheck(stack, org_id)
        for i in range(3):  # no first byte in time from slow each time, served by b
            body = {"model": "pair-model", "stream": True, "messages": [{"role": "user", "content": f"hi {i}"}]}
            assert ledger.saw(stack.post(CHAT, body, key)).status_code == 200
        assert ("pair-model", "slow", "out_of_service") in changes
        response = ledger.saw(stack.post(CHAT, {"model": "solo-model", "messages": MESSAGES}, key))
        assert response.status_code == 200, (response.status_code, response.text)
        ledger.check()
    finally:
        upstream.close()


@pytest.mark.parametrize("bad_url", ["http://a..b.example.com/v1", "http://ex\u0000ample.com/v1",
                                     "http://127.0.0.1:9/\u30e2\u30c7\u30eb"])
def test_a_backend_url_no_request_can_be_sent_to_fails_over_not_500(stack_factory, mock, bad_url):
    """A stored catalog's backend whose URL no resolver or request line takes (an empty DNS
    label, a NUL in the host, a path outside latin-1) made every request of its model a 500,
    the next backend never tried: it is a backend that cannot be reached."""
    catalog = catalog_for_tests(mock.url)
    model = next(entry for entry in catalog["models"] if entry["id"] == "qwen3-32b")
    model["backends"] = [{"name": "bad", "url": bad_url}, *model["backends"]]
    stack = stack_factory(catalog=catalog)
    org_id, key = stack.org()
    ledger = LedgerCheck(stack, org_id)
    for stream in (False, True):
        response = ledger.saw(stack.post("/v1/chat/completions", {"model": "qwen3-32b", "stream": stream,
                                                                   "messages": [{"role": "user", "content": "hi"}]}, key))
        assert response.status_code == 200, response.text
    ledger.check()


@pytest.mark.parametrize("status", [b"204 No Content", b"205 Reset Content"])
def test_a_2xx_that_has_no_body_is_no_answer_the_next_backend_serves_and_alone_it_is_a_502(
        stack_factory, mock, status):
    """A backend (a proxy in front of it, misconfigured) answers a completion 204: a status that
    has no body. A streamed request took it for its stream: 200 to the client, then the error
    event, billed the prompt's estimate as `stream_interrupted`; a buffered one was 502. Neither
    tried the next backend. It is no answer to either: the next backend serves, and where there is
    none, both are 502 before any stream, settled `upstream_error` and billed nothing."""
    def empty(conn: socket.socket, body: bytes) -> None:
        conn.sendall(b"HTTP/1.1 " + status + b"\r\nConnection: close\r\n\r\n")

    mark = len(TELEMETRY.text())
    assert _no_answer_is_passed_over_and_alone_a_502(stack_factory, mock, empty) == 4
    assert TELEMETRY.text()[mark:].count(f'"x: HTTP {status.split()[0].decode()}"') == 2  # the alone ones


def _no_answer_is_passed_over_and_alone_a_502(stack_factory, mock, answer) -> int:
    """A backend `x` that answers as `answer` does, first of a pair and alone, buffered and
    streamed: the pair's next backend serves, alone it is a 502 before any stream, settled
    `upstream_error` and billed nothing. The requests `x` was sent."""
    upstream = RawUpstream(answer)
    try:
        pair = model("pair-model", [{"name": "x", "url": upstream.url}, {"name": "b", "url": mock.url}])
        alone = model("alone-model", [{"name": "x", "url": upstream.url}])
        stack = stack_factory(catalog={**catalog_for_tests(mock.url), "models": [pair, alone]})
        org_id, key = stack.org()
        ledger = LedgerCheck(stack, org_id)
        for stream in (False, True):
            served = ledger.saw(stack.post(CHAT, {"model": "pair-model", "messages": MESSAGES, "stream": stream}, key))
            assert served.status_code == 200, served.text
            assert "error" not in served.text and (not stream or data_events(served.text)[-1] == "[DONE]")
            refused = ledger.saw(stack.post(CHAT, {"model": "alone-model", "messages": MESSAGES, "stream": stream}, key))
            assert refused.status_code == 502 and refused.headers["content-type"].startswith("text/plain"), refused.text
        events = {event.gen_id: event for event in ledger.check()}
        assert [events[gen_id].status for gen_id in ledger.gen_ids] == ["success", "upstream_error"] * 2
        assert [events[gen_id].upstream for gen_id in ledger.gen_ids][::2] == ["b", "b"]
        assert all(events[gen_id].cost == 0 for gen_id in ledger.gen_ids[1::2])
        return upstream.requests
    finally:
        upstream.close()


@pytest.mark.parametrize("coding", [b"gzip", b"br", b"deflate, gzip", b"identity\r\nContent-Encoding: gzip",
                                    b"\r\nContent-Encoding: x-gzip"],
                         ids=["gzip", "br", "two", "identity-then-gzip", "empty-then-x-gzip"])
def test_a_2xx_in_a_content_coding_is_no_answer_the_next_backend_serves_and_alone_it_is_a_502(
        stack_factory, mock, coding):
    """The gateway asks for no content coding (it relays the bytes as they come), yet a backend
    (a proxy in front of it) compresses its 200 all the same. A stream took it for its stream:
    200 to the client, then the error event, billed the prompt's estimate. It is no answer the
    gateway or the client can read: the next backend serves, and where there is none it is a 502
    before any stream, billed nothing, as a buffered one already was."""
    import gzip

    def compressed(conn: socket.socket, body: bytes) -> None:
        stream = json.loads(body).get("stream")
        answer = gzip.compress(b'data: {"choices": []}\n\n' if stream else b'{"choices": []}')
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: " + (b"text/event-stream" if stream else b"application/json")
                     + b"\r\nContent-Encoding: " + coding + b"\r\nConnection: close\r\n"
                     + b"Content-Length: %d\r\n\r\n" % len(answer) + answer)

    assert _no_answer_is_passed_over_and_alone_a_502(stack_factory, mock, compressed) == 4


@pytest.mark.parametrize("coding", [b"identity", b"none", b"identity, identity", b"IDENTITY", b""])
def test_a_2xx_that_names_no_content_coding_is_served(stack_factory, mock, coding):
    """`Content-Encoding: none` is how many servers keep a proxy from compressing an SSE stream
    (Next.js, Node): such an answer, or one naming identity however written, is plain, and was
    taken for a coded one, a 502, its backend counted as failing."""
    def plain(conn: socket.socket, body: bytes) -> None:
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}
        answer = b"data: %s\n\ndata: [DONE]\n\n" % json.dumps(chunk).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: " + coding
                     + b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(answer) + answer)

    upstream = RawUpstream(plain)
    try:
        stack = stack_factory(catalog={**catalog_for_tests(mock.url),
                                       "models": [model("alone-model", [{"name": "plain", "url": upstream.url}])]})
        org_id, key = stack.org()
        ledger = LedgerCheck(stack, org_id)
        served = ledger.saw(stack.post(CHAT, {"model": "alone-model", "messages": MESSAGES, "stream": True}, key))
        assert served.status_code == 200 and data_events(served.text)[-1] == "[DONE]", served.text
        assert [event.status for event in ledger.check()] == ["success"]
    finally:
        upstream.close()


def test_a_4xx_that_echoes_its_request_headers_does_not_hand_the_client_the_upstream_key(
        stack_factory, mock, monkeypatch):
    """A model server writes the headers it was sent into its 400 (some proxies and debug
    servers do): the client is told its message, without the key the gateway sent it, which
    is the operator's; a code or param no client could branch on, of any size, is none."""
    secret = "upstream-" + "k3y/+" * 8
    monkeypatch.setenv("KILN_TEST_UPSTREAM_KEY", secret)
    upstream = None

    def echoing(conn: socket.socket, body: bytes) -> None:
        headers = upstream.heads[-1].decode()
        payload = json.dumps({"error": {"message": "rejected; headers were " + json.dumps(headers) * 200,
                                        "param": "p" * 300_000, "code": "c" * 900_000}})
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload.encode())

    upstream = RawUpstream(echoing)
    try:
        keyed = model("raw-model", [{"name": "raw", "url": upstream.url, "api_key_env": "KILN_TEST_UPSTREAM_KEY"}])
        stack = stack_factory(catalog={**catalog_for_tests(mock.url), "models": [keyed]})
        org_id, key = stack.org()
        ledger = LedgerCheck(stack, org_id)
        for body in ({"model": "raw-model", "messages": [{"role": "user", "content": "hi"}]},
                     {"model": "raw-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}):
            response = stack.post("/v1/chat/completions", body, key)
            ledger.saw(response)
            assert response.status_code == 400
            error = response.json()["error"]
            assert f"authorization: Bearer {secret}".lower() in upstream.heads[-1].decode().lower()
            assert secret not in response.text and "[redacted]" in error["message"]
            assert len(error["message"]) == 2000 and error["param"] is None and error["code"] is None
        ledger.check()
    finally:
        upstream.close()


SPELLED_KEY = "upk_T3st/Key+With=Slash_0123456789"


def _answering(upstream_ref: list, status: str, content_type: str, body: Callable[[str], bytes]):
    """A RawUpstream answer: `body(the request's head)`, whole, then the connection closed."""
    def answer(conn: socket.socket, _: bytes) -> None:
        payload = body(upstream_ref[0].heads[-1].decode())
        conn.sendall(f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\nconnection: close\r\n"
                     f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
    return answer


@contextlib.contextmanager
def keyed_upstream(stack_factory, mock, monkeypatch, key: str, status: str, content_type: str,
                   body: Callable[[str], bytes]):
    """A stack whose `raw-model` is served by a RawUpstream sent `key`: (stack, a key of a new org, its LedgerCheck)."""
    monkeypatch.setenv("KILN_TEST_UPSTREAM_KEY", key)
    ref: list = []
    upstream = RawUpstream(_answering(ref, status, content_type, body))
    ref.append(upstream)
    try:
        keyed = model("raw-model", [{"name": "raw", "url": upstream.url, "api_key_env": "KILN_TEST_UPSTREAM_KEY"}])
        stack = stack_factory(catalog={**catalog_for_tests(mock.url), "models": [keyed]})
        org_id, secret = stack.org()
        yield stack, secret, LedgerCheck(stack, org_id)
    finally:
        upstream.close()


@pytest.mark.parametrize("spelling", [
    lambda key: ("plain text: authorization: Bearer " + key.replace("/", "\\/")).encode(),
    lambda key: json.dumps({"error": {"message": json.dumps({"headers": {"authorization": "Bearer " + key}})}}).encode(),
    lambda key: json.dumps({"error": {"message": "GET /?auth=Bearer%20" + __import__("urllib.parse").parse.quote(key, safe="")}}).encode(),
    lambda key: ("GET /?auth=" + re.sub(r"%[0-9A-F]{2}", lambda escape: escape.group().lower(),
                                        __import__("urllib.parse").parse.quote(key))).encode(),
], ids=["escaped-slash-text", "json-in-json", "percent-encoded", "percent-encoded-lower-slash-kept"])
def test_a_4xx_that_echoes_the_upstream_key_in_another_spelling_does_not_hand_it_over(
        stack_factory, mock, monkeypatch, spelling):
    with keyed_upstream(stack_factory, mock, monkeypatch, SPELLED_KEY, "400 Bad Request", "application/json",
                        lambda head: spelling(SPELLED_KEY)) as (stack, key, ledger):
        response = ledger.saw(stack.post("/v1/chat/completions", {"model": "raw-model", "messages": [
            {"role": "user", "content": "hi"}]}, key))
        assert response.status_code == 400 and "[redacted]" in response.text
        for part in SPELLED_KEY.split("/"):
            assert part not in response.text.replace("\\", "")
        ledger.check()


def test_a_placeholder_key_too_short_to_be_a_secret_leaves_the_message_as_written(stack_factory, mock, monkeypatch):
    """vLLM without auth is often sent `EMPTY`, or a letter: taken out of a message, it would
    mangle its words, and the code clients branch on."""
    body = json.dumps({"error": {"message": "max_tokens too large", "code": "context_length_exceeded",
                                 "param": "max_tokens"}}).encode()
    with keyed_upstream(stack_factory, mock, monkeypatch, "x", "400 Bad Request", "application/json",
                        lambda head: body) as (stack, key, ledger):
        response = ledger.saw(stack.post("/v1/chat/completions", {"model": "raw-model", "messages": [
            {"role": "user", "content": "hi"}]}, key))
        assert response.json()["error"] == {"message": "max_tokens too large", "type": "invalid_request_error",
                                            "param": "max_tokens", "code": "context_length_exceeded"}
        ledger.check()


def _failed_response(key: str) -> dict:
    return {"id": "resp_f1", "object": "response", "created_at": 1700000000, "model": "raw-model", "status": "failed",
            "error": {"code": "server_error", "message": f"backend said: authorization: Bearer {key}"},
            "output": [], "usage": {"input_tokens": 8, "output_tokens": 0, "total_tokens": 8}}


@pytest.mark.parametrize("secret", [SPELLED_KEY, "17650870"], ids=["key", "digits-also-in-a-number"])
@pytest.mark.parametrize("stream", [False, True], ids=["buffered", "streamed"])
def test_a_failed_response_that_echoes_the_upstream_key_does_not_hand_it_over(stack_factory, mock, monkeypatch, stream,
                                                                                secret):
    """A Responses answer of status `failed` carries the model server's error text to the client,
    as a 4xx does: the key the gateway sent it is taken out there too, from its texts only (a key
    of digits that a number also holds leaves the number, and the JSON, as they are)."""
    def answer(head: str) -> bytes:
        failed = {**_failed_response(secret), "created_at": 1765087012}
        if not stream:
            return json.dumps(failed).encode()
        events = [("response.created", {**failed, "status": "in_progress", "error": None, "usage": None}),
                  ("response.failed", failed)]
        return b"".join(f"event: {name}\ndata: {json.dumps({'type': name, 'sequence_number': n, 'response': r})}\n\n".encode()
                        for n, (name, r) in enumerate(events))

    content_type = "text/event-stream" if stream else "application/json"
    with keyed_upstream(stack_factory, mock, monkeypatch, secret, "200 OK", content_type, answer) as (
            stack, key, ledger):
        response = ledger.saw(stack.post("/v1/responses", {"model": "raw-model", "input": "hi", "stream": stream}, key))
        assert response.status_code == 200 and "backend said" in response.text
        final = json.loads(response.text if not stream else response.text.strip().split("\ndata: ")[-1])
        final = final if not stream else final["response"]
        assert final["error"]["message"] == "backend said: authorization: Bearer [redacted]"
        assert final["created_at"] == 1765087012
        (event,) = ledger.check()
        assert event.status == "upstream_error"
