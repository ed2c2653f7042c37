"""The per-request record (kiln/observability.py): what its log line says about the request."""

from __future__ import annotations

import asyncio

from kiln import observability


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_the_first_requests_latency_leaves_out_the_telemetry_set_up_after_it(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(observability, "time", clock)
    lines: list[dict] = []

    class _Recorder:  # what the Observer would log (a real one would take over the shared "kiln" logger)
        def emit(self, record: observability.RequestRecord) -> None:
            lines.append(record.as_log())

    def slow_observer() -> _Recorder:
        clock.now += 5.0  # setting up the logger and metrics, once the answer is out
        return _Recorder()

    monkeypatch.setattr(observability, "Observer", slow_observer)

    async def app(scope, receive, send):
        clock.now += 0.25  # the request itself
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def discard(message):
        return None

    middleware = observability.ObservabilityMiddleware(app)
    asyncio.run(middleware({"type": "http", "method": "GET", "path": "/v1/models"}, None, discard))
    (line,) = lines
    assert line["latency_ms"] == 250


# -- the Lambda request id on every log line ---------------------------------------------------

LAMBDA_CONTEXT = {"request_id": "8f7e2b1c-0d3a-4b5c-9e6f-1a2b3c4d5e6f", "deadline": 1764600000000,
                  "invoked_function_arn": "arn:aws:lambda:us-east-1:123456789012:function:kiln-chat"}
REQUEST_CONTEXT = {"requestId": "c0ffee00-1111-2222-3333-444455556666", "stage": "prod"}


def _web_adapter_scope(path: str = "/v1/models", lambda_context=LAMBDA_CONTEXT, request_context=REQUEST_CONTEXT):
    import json

    headers = [(b"content-type", b"application/json")]
    if lambda_context is not None:
        headers.append((b"x-amzn-lambda-context", json.dumps(lambda_context).encode()))
    if request_context is not None:
        headers.append((b"x-amzn-request-context", json.dumps(request_context).encode()))
    return {"type": "http", "method": "GET", "path": path, "headers": headers}


def test_the_ids_come_from_the_web_adapters_headers():
    assert observability.request_ids(_web_adapter_scope()) == {
        "lambda_request_id": LAMBDA_CONTEXT["request_id"], "api_request_id": REQUEST_CONTEXT["requestId"]}


def test_the_ids_come_from_mangums_scope_in_buffered_mode():
    class Context:
        aws_request_id = "b1b2b3b4-0000-1111-2222-333344445555"

    scope = {"type": "http", "headers": [], "aws.context": Context(),
             "aws.event": {"requestContext": {"requestId": "api-req-1"}}}
    assert observability.request_ids(scope) == {"lambda_request_id": Context.aws_request_id,
                                                "api_request_id": "api-req-1"}


def test_a_request_without_or_with_broken_headers_has_no_ids_and_is_served():
    assert observability.request_ids(_web_adapter_scope(lambda_context=None, request_context=None)) == {}
    scope = _web_adapter_scope()
    scope["headers"] = [(b"x-amzn-lambda-context", b"{not json"), (b"x-amzn-request-context", b"[1]")]
    assert observability.request_ids(scope) == {}
    scope["headers"] = [(b"x-amzn-lambda-context", b"[" * 5000), (b"x-amzn-request-context", b'{"a":' * 3000)]
    assert observability.request_ids(scope) == {}  # nested past any parser: no ids, not a 500


def test_an_id_longer_than_any_aws_writes_is_not_put_on_every_line():
    """Only the Web Adapter sets these headers in AWS; wherever another proxy passed a client's
    on, an id of 100 000 characters would be written into each of the request's log lines."""
    scope = _web_adapter_scope(lambda_context={**LAMBDA_CONTEXT, "request_id": "x" * 100_000},
                               request_context={**REQUEST_CONTEXT, "requestId": "y" * 129})
    assert observability.request_ids(scope) == {}


def _serve(middleware, scope):
    async def discard(message):
        return None

    async def run():
        await middleware(scope, None, discard)
        await asyncio.sleep(0.01)  # let work spawned by the request finish

    asyncio.run(run())


def test_every_line_logged_during_a_request_carries_its_ids_and_lines_after_it_do_not():
    import logging

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep()
    handler.addFilter(observability.RequestIdFilter())
    log = logging.getLogger("kiln-test-request-ids")
    log.propagate, log.level = False, logging.INFO
    log.addHandler(handler)

    class _Recorder:
        def emit(self, record):
            log.info("request")

    async def app(scope, receive, send):
        log.warning("while handling")
        asyncio.get_running_loop().create_task(_later())  # e.g. a settle that outlives the answer
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def _later():
        await asyncio.sleep(0)
        log.error("settled after the answer")

    try:
        _serve(observability.ObservabilityMiddleware(app, observer=_Recorder()), _web_adapter_scope())
        log.info("between requests")
    finally:
        log.removeHandler(handler)
    by_message = {record.getMessage(): record for record in records}
    for message in ("while handling", "request", "settled after the answer"):
        assert by_message[message].lambda_request_id == LAMBDA_CONTEXT["request_id"], message
        assert by_message[message].api_request_id == REQUEST_CONTEXT["requestId"], message
    assert not hasattr(by_message["between requests"], "lambda_request_id")


def test_the_gateways_log_lines_carry_the_lambda_request_id_as_written():
    """Through the real Observer (Powertools' JSON formatter), a line of any kiln.* logger."""
    import json
    import logging
    import secrets

    from support import TELEMETRY, observer

    marker = f"probe-{secrets.token_hex(4)}"
    context = {**LAMBDA_CONTEXT, "request_id": f"req-{secrets.token_hex(6)}"}

    async def app(scope, receive, send):
        logging.getLogger("kiln.gateway").warning("%s", marker)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    _serve(observability.ObservabilityMiddleware(app, observer=observer()), _web_adapter_scope(lambda_context=context))
    lines = [json.loads(line) for line in TELEMETRY.text().splitlines() if context["request_id"] in line]
    probe = [line for line in lines if line.get("message") == marker]
    request = [line for line in lines if line.get("message") == "request"]
    assert len(probe) == 1 and probe[0]["lambda_request_id"] == context["request_id"]
    assert len(request) == 1 and request[0]["api_request_id"] == REQUEST_CONTEXT["requestId"]


def test_each_requests_metrics_document_holds_only_its_own_values(monkeypatch):
    """The Observer keeps its metric sets from one request to the next: each is emptied after its document."""
    import io
    import json

    import aws_lambda_powertools

    class _Quiet:  # a real Logger would take over the shared "kiln" logger; only the EMF documents here
        def __init__(self, **_: object) -> None:
            pass

        def log(self, *_: object, **__: object) -> None:
            pass

        def isEnabledFor(self, level: int) -> bool:  # noqa: N802 - logging's name
            return True

    monkeypatch.setattr(aws_lambda_powertools, "Logger", _Quiet)
    stream = io.StringIO()
    observer = observability.Observer(stream=stream, metrics_enabled=True)
    for status, latency, code in ((200, 7, None), (503, 9, "storage_unavailable"), (200, 11, None)):
        record = observability.RequestRecord("POST", "/v1/chat/completions")
        record.status, record.endpoint, record.error_code = status, "chat.completions", code
        record.finished = record.started + (latency + 0.5) / 1000
        observer.emit(record)
    documents = [json.loads(line) for line in stream.getvalue().splitlines()]
    requests = [d for d in documents if "Requests" in d]
    errors = [d for d in documents if "Errors" in d]
    assert [d["Latency"] for d in requests] == [[7.0], [9.0], [11.0]]
    assert [d["Errors5xx"] for d in requests] == [[0.0], [1.0], [0.0]]
    assert all(d["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["service"], ["service", "endpoint"]] for d in requests)
    assert [(d["code"], d["Errors"]) for d in errors] == [("storage_unavailable", [1.0])]
    assert errors[0]["_aws"]["CloudWatchMetrics"][0]["Dimensions"] == [["service"], ["service", "code"]]


def test_a_requests_emf_document_is_the_one_powertools_add_metric_would_make(monkeypatch):
    """The metrics are serialized by Powertools from names and units it checked once: the
    document is the one its own add_metric path makes, and a request costs one flush."""
    import io
    import json
    from decimal import Decimal

    from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit

    from kiln.store.usage import UsageEvent

    class _Counted(io.StringIO):
        flushes = 0

        def flush(self) -> None:
            _Counted.flushes += 1
            super().flush()

    # a logger of its own: Powertools gives a logger's handlers to the first Logger made for its name
    from types import SimpleNamespace

    monkeypatch.setattr(observability, "telemetry_settings", lambda: SimpleNamespace(
        metrics_namespace="Kiln", service_name="kiln-one-flush", metrics_disabled=False))
    stream = _Counted()
    observer = observability.Observer(stream=stream, metrics_enabled=True)
    assert observer.service == "kiln-one-flush"
    record = observability.RequestRecord("POST", "/v1/chat/completions")
    record.status, record.endpoint, record.finished = 200, "chat.completions", record.started + 0.0123
    record.usage = UsageEvent("gen-1", "org-1", "2026-12-01T00:00:00.000Z", "key-1", "m", "chat.completions", True,
                              "success", Decimal("0.00042"), 200, 10, 12, usage_source="estimated", ttfb_ms=3)
    observer.emit(record)
    assert _Counted.flushes == 1
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    ours = next(line for line in lines if "_aws" in line)
    assert next(line for line in lines if line.get("message") == "request")["generation_id"] == "gen-1"

    reference = EphemeralMetrics(namespace=observer.namespace, service=observer.service)
    reference.add_dimensions(service=observer.service, endpoint="chat.completions")
    for name, unit, value in (("Requests", MetricUnit.Count, 1), ("Latency", MetricUnit.Milliseconds, 12),
                              ("Errors5xx", MetricUnit.Count, 0), ("RateLimited", MetricUnit.Count, 0),
                              ("UpstreamFailures", MetricUnit.Count, 0), ("TimeToFirstByte", MetricUnit.Milliseconds, 3),
                              ("PromptTokens", MetricUnit.Count, 10), ("CompletionTokens", MetricUnit.Count, 12),
                              ("CostUSD", MetricUnit.NoUnit, 0.00042), ("UsageEstimated", MetricUnit.Count, 1)):
        reference.add_metric(name=name, unit=unit, value=value)
    expected = json.loads(json.dumps(reference.serialize_metric_set()))
    ours["_aws"].pop("Timestamp")
    expected["_aws"].pop("Timestamp")
    assert ours == expected


# -- the request line: Powertools' own, written without the logging module -------------------


def _powertools_line(service: str, level: int, entry: dict, **logger_options) -> dict:
    """The line Powertools' Logger writes for `entry`, as `service` (from a Logger of a name of
    its own: Powertools gives a logger's handlers to the first Logger made for its name)."""
    import io
    import json
    import logging

    from aws_lambda_powertools import Logger

    stream = io.StringIO()
    Logger(service=f"{service}-reference", logger_handler=logging.StreamHandler(stream), **logger_options).log(
        level, "request", extra=entry)
    (line,) = stream.getvalue().splitlines()
    return {**json.loads(line), "service": service}


def _observer(monkeypatch, service: str, **logger_options):
    import io
    from types import SimpleNamespace

    monkeypatch.setattr(observability, "telemetry_settings", lambda: SimpleNamespace(
        metrics_namespace="Kiln", service_name=service, metrics_disabled=True))
    stream = io.StringIO()
    return observability.Observer(stream=stream, metrics_enabled=False), stream


def _request_record(status: int = 200, code: str | None = None, usage: bool = True):
    from decimal import Decimal

    from kiln.store.usage import UsageEvent

    record = observability.RequestRecord("POST", "/v1/chat/completions",
                                         {"lambda_request_id": "req-1", "api_request_id": "api-1"})
    record.status, record.org_id, record.model, record.endpoint = status, "org-1", "m", "chat.completions"
    record.error_code, record.finished = code, record.started + 0.0123
    if usage:
        record.usage = UsageEvent("gen-1", "org-1", "2026-12-01T00:00:00.000Z", "key-1", "m", "chat.completions",
                                  True, "success", Decimal("0.00042"), 200, 10, 12, usage_source="reported",
                                  ttfb_ms=3, upstream="primary")
    return record


def test_the_request_line_is_the_one_powertools_logger_writes(monkeypatch):
    import json
    import re

    monkeypatch.setenv("_X_AMZN_TRACE_ID", "Root=1-5759e988-bd862e3fe1be46a994272793;Parent=53995c3f42cd8ad8;Sampled=1")
    cases = [(_request_record(), "INFO"), (_request_record(503, "storage_unavailable", usage=False), "ERROR"),
             (_request_record(429, "rate_limited"), "INFO")]
    for index, (record, level) in enumerate(cases):
        observer, stream = _observer(monkeypatch, f"kiln-line-{index}")
        observer.emit(record)
        (ours,) = [json.loads(line) for line in stream.getvalue().splitlines()]
        theirs = _powertools_line(f"kiln-line-{index}", getattr(__import__("logging"), level), record.as_log())
        assert ours["level"] == level and ours["xray_trace_id"] == "1-5759e988-bd862e3fe1be46a994272793"
        assert re.fullmatch(r"emit:\d+", ours.pop("location")) and theirs.pop("location")
        pattern = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}[+-]\d{4}"
        assert re.fullmatch(pattern, ours.pop("timestamp")) and re.fullmatch(pattern, theirs.pop("timestamp"))
        assert ours == theirs
        assert list(ours)[:3] == ["level", "message", "service"]  # the formatter's order, then the entry's


def test_the_request_line_follows_the_loggers_level_and_appended_keys(monkeypatch):
    import json

    monkeypatch.setenv("POWERTOOLS_LOG_LEVEL", "WARNING")
    observer, stream = _observer(monkeypatch, "kiln-line-level")
    observer.emit(_request_record())  # INFO: below the Logger's level
    assert stream.getvalue() == ""
    observer.logger.append_keys(region="eu-west-1")
    observer.emit(_request_record(502, "upstream_error"))
    (line,) = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert line["level"] == "ERROR" and line["region"] == "eu-west-1" and line["status"] == 502


def test_a_format_key_the_line_cannot_fill_leaves_the_line_to_the_logger(monkeypatch):
    import json

    observer, stream = _observer(monkeypatch, "kiln-line-module")
    observer.logger.append_keys(location="%(module)s:%(lineno)d", pid="%(process)d")  # only a reserved key's is a format
    observer.emit(_request_record())
    lines = [json.loads(text) for text in stream.getvalue().splitlines()]
    assert len(lines) == 1 and lines[0]["generation_id"] == "gen-1"
    assert lines[0]["location"].startswith("observability:") and lines[0]["pid"] == "%(process)d"


def test_the_request_lines_timestamp_is_the_formatters_at_every_millisecond(monkeypatch):
    """Each second's text is worked out once; every instant still reads as Powertools writes it."""
    observer, _ = _observer(monkeypatch, "kiln-line-time")
    line = observer._line  # noqa: SLF001 - the line's own timestamp, against the formatter's
    formatter = observer.logger.registered_formatter
    for now in (1764600000.0, 1764600000.0004, 1764600000.9996, 1764600001.5, 1764600001.001, 1764686399.999,
                1764686400.0):
        assert line._timestamp(formatter, now) == formatter.formatTime(observability._Created(now)), now  # noqa: SLF001


def test_an_unexpected_error_logs_its_path_as_the_request_log_does(caplog):
    """A gateway that cannot be made fails the request with a 500 and a log line of its path:
    a key's secret pasted into the path is not in it."""
    import logging
    import secrets

    import httpx

    from kiln.endpoints import MODELS
    from kiln.web import create_app, routes_of

    def broken():
        raise RuntimeError("no gateway here")

    app = create_app(routes_of(MODELS), gateway=broken, observer=observability.Observer())
    pasted = "sk-kiln-" + secrets.token_urlsafe(32)

    async def call():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kiln") as client:
            return await client.get(f"/v1/models/{pasted}")

    with caplog.at_level(logging.ERROR):
        response = asyncio.run(call())
    assert response.status_code in (404, 500)
    assert "unexpected error" in caplog.text and pasted[8:] not in caplog.text


def test_a_logged_path_keeps_model_ids_and_loses_any_part_of_a_key():
    import secrets

    body = "abcdefghij" * 3
    assert observability.loggable_path(f"/v1/keys/sk-kiln-{body}") == "/v1/keys/sk-kiln-[redacted]"  # short of 40 too
    assert observability.loggable_path(f"/v1/keys/SK_KILN{body}") == "/v1/keys/sk-kiln-[redacted]"
    for model_path in ("/v1/models/Helsinki-NLP/opus-mt-sk-en-finetuned-legal-domain",
                       "/v1/models/kiln-standin-bare-with-a-long-variant",
                       "/v1/models/deepseek-ai/DeepSeek-R1-Distill-Llama-70B-abliterated"):
        assert observability.loggable_path(model_path) == model_path
    secret = secrets.token_urlsafe(32)
    assert secret[:12] not in observability.loggable_path(f"/v1/generations/sk-kiln{secret}")
