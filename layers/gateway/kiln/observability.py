"""One structured log line and one set of EMF metrics per request, from ASGI middleware.

Under the Lambda Web Adapter there is no handler to decorate, so this wraps the app: it
times the request, sees the status and the first body byte go out, and when the response
is done writes what the handlers noted on the request's `RequestRecord`. It never logs
keys, prompts or completions: only ids, names, numbers and error codes.

Every line logged while a request is handled (its request line, and whatever the gateway's
modules log meanwhile, settles included) carries the invocation's Lambda request id, and
API Gateway's: the Web Adapter passes them in the `x-amzn-lambda-context` and
`x-amzn-request-context` headers, Mangum in the ASGI scope. They join a log line to the
API's access log and to Lambda's own REPORT line.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import sys
import time
from contextvars import ContextVar
from typing import Any, TextIO

from .jsonio import compact_encoder, compact_text, loads_strict
from .store.keys import KEY_PREFIX
from .store.usage import UsageEvent
from .telemetry import telemetry_settings

__all__ = ["ObservabilityMiddleware", "Observer", "RequestIdFilter", "RequestRecord", "record_of", "request_ids"]

_UPSTREAM_FAILURES = ("upstream_error", "stream_interrupted")

# the ids of the invocation being handled, for every log line written meanwhile
_REQUEST_IDS: ContextVar[dict[str, str]] = ContextVar("kiln_request_ids", default={})  # noqa: B039 - never mutated
_LAMBDA_CONTEXT = b"x-amzn-lambda-context"
_REQUEST_CONTEXT = b"x-amzn-request-context"


# the longest id kept: AWS's are UUIDs (36 characters)
MAX_ID = 128


def request_ids(scope: dict) -> dict[str, str]:
    """`lambda_request_id` and `api_request_id` of the invocation behind an ASGI request."""
    ids: dict[str, Any] = {}
    context = scope.get("aws.context")  # Mangum (buffered mode)
    if context is not None:
        ids["lambda_request_id"] = getattr(context, "aws_request_id", None)
        event = scope.get("aws.event") or {}
        ids["api_request_id"] = (event.get("requestContext") or {}).get("requestId")
    else:  # the Web Adapter (streaming mode); a header sent twice counts as its last
        headers = dict(scope.get("headers") or ())
        lambda_context, request_context = headers.get(_LAMBDA_CONTEXT), headers.get(_REQUEST_CONTEXT)
        if lambda_context is not None:
            ids["lambda_request_id"] = _json_field(lambda_context, "request_id")
        if request_context is not None:
            ids["api_request_id"] = _json_field(request_context, "requestId")
    return {key: value for key, value in ids.items() if isinstance(value, str) and 0 < len(value) <= MAX_ID}


def _json_field(raw: bytes, name: str) -> Any:
    try:
        document = loads_strict(raw)  # ValueError for anything malformed, nesting too deep included
    except ValueError:
        return None
    return document.get(name) if isinstance(document, dict) else None


class RequestIdFilter(logging.Filter):
    """Adds the current invocation's ids to every record that passes (as extra keys)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _REQUEST_IDS.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


class RequestRecord:
    """What the handlers learn about a request, for its log line and metrics."""

    __slots__ = ("method", "path", "started", "finished", "status", "first_byte_ms", "org_id", "model",
                 "endpoint", "error_code", "upstream_code", "usage", "backend_failures", "ids")

    def __init__(self, method: str, path: str, ids: dict[str, str] | None = None) -> None:
        self.method = method
        self.path = path
        self.ids = ids or {}
        self.started = time.monotonic()
        self.finished: float | None = None  # the response is over (set by the middleware)
        self.status: int | None = None
        self.first_byte_ms: int | None = None
        self.org_id: str | None = None
        self.model: str | None = None
        self.endpoint: str | None = None
        self.error_code: str | None = None  # the gateway's own code of the error answered
        self.upstream_code: str | None = None  # a model server's own code, if a short word
        self.usage: UsageEvent | None = None
        self.backend_failures = 0

    def as_log(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "method": self.method,
            "path": loggable_path(self.path),
            "status": self.status,
            "latency_ms": int(((self.finished or time.monotonic()) - self.started) * 1000),
            "org_id": self.org_id,
            "model": self.model,
            "error_code": self.error_code,
            "upstream_code": self.upstream_code,
            **self.ids,
        }
        if self.usage is not None:
            usage = self.usage
            entry.update(
                generation_id=usage.gen_id,
                usage_status=usage.status,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cost=str(usage.cost),
                usage_source=usage.usage_source,
                ttfb_ms=usage.ttfb_ms,
                upstream=usage.upstream,
                streamed=usage.streamed,
            )
        return {key: value for key, value in entry.items() if value is not None}


# the path is the client's text: what is shaped like a key is not logged, and it is cut short.
# A key is its prefix and 43 URL-safe characters drawn at random, the secret itself. A run of
# such characters is not logged where it follows the prefix however spelled (capitals,
# underscores, no dashes), or where it is 40 or more long and holds what random text does and
# words do not: 10 letters and digits in a row, of both cases and a digit (all but 3 secrets in
# 1 000; model ids such as …-Instruct-2501-quantized_w8a8 are words, logged whole).
_SHORTEST_SECRET = 40
_URL_SAFE_RUN = re.compile(r"[A-Za-z0-9_-]{%d,}" % _SHORTEST_SECRET)
_AFTER_PREFIX = re.compile(r"(?<![A-Za-z0-9])(?i:sk[-_]*kiln[-_]*)[A-Za-z0-9_-]{20,}")
_ALNUM_STRETCH = re.compile(r"[A-Za-z0-9]{10,}")
MAX_LOGGED_PATH = 256
# the endpoint of a request no route took (an unknown URL): one metric, whatever the path
UNMATCHED = "unmatched"


def _random_looking(run: str) -> bool:
    return any(not stretch.isdigit() and not stretch.isalpha() and not stretch.islower() and not stretch.isupper()
               for stretch in _ALNUM_STRETCH.findall(run))


def _unless_words(found: re.Match[str]) -> str:
    run = found.group()
    return "[redacted]" if _random_looking(run) else run


def loggable_path(path: str) -> str:
    """A request's path as logged: a key's secret in it redacted, at most MAX_LOGGED_PATH characters."""
    if "kiln" in path.lower():
        path = _AFTER_PREFIX.sub(KEY_PREFIX + "[redacted]", path)
    if len(path) >= _SHORTEST_SECRET:
        path = _URL_SAFE_RUN.sub(_unless_words, path)
    return path if len(path) <= MAX_LOGGED_PATH else path[:MAX_LOGGED_PATH] + "…"


def record_of(scope_or_request: Any) -> RequestRecord:
    """The request's record (a throwaway one when the app runs without the middleware)."""
    scope = getattr(scope_or_request, "scope", scope_or_request)
    return scope.get("state", {}).get("kiln_record") or RequestRecord("-", "-")


class Observer:
    """Powertools' JSON logger and EMF metrics, made once per process, written to one stream
    (stdout: Lambda sends it to CloudWatch Logs, which reads the EMF records as metrics).

    A request's documents and its line are written as Powertools writes them, in one write
    and one flush, without Powertools' per-call work: the EMF declarations are serialized
    once per shape (`_metrics_document`), the line without a LogRecord (`_LogLine`)."""

    def __init__(self, *, stream: TextIO | None = None, metrics_enabled: bool | None = None) -> None:
        from aws_lambda_powertools import Logger

        self._stream = stream or sys.stdout
        handler = logging.StreamHandler(self._stream)
        handler.addFilter(RequestIdFilter())  # on the handler: it sees the records of kiln.* loggers too
        settings = telemetry_settings()
        self.namespace, self.service = settings.metrics_namespace, settings.service_name
        self.logger = Logger(service=self.service, logger_handler=handler)
        self.metrics_enabled = (not settings.metrics_disabled) if metrics_enabled is None else metrics_enabled
        # One metric set per kind of EMF document, made on first use and emptied after each
        # document (emit runs whole on the event loop: no two requests share one at a time).
        # Making one per request would list every CloudWatch unit again each time.
        self._metric_sets: dict[str, Any] = {}
        self._declarations: dict[tuple[str, tuple[str, ...], tuple[str, ...]], str] = {}
        self._line = _LogLine(self.logger)

    def _metric_set(self, kind: str) -> Any:
        metrics = self._metric_sets.get(kind)
        if metrics is None:
            from aws_lambda_powertools.metrics import EphemeralMetrics

            metrics = self._metric_sets[kind] = EphemeralMetrics(namespace=self.namespace, service=self.service)
        return metrics

    def emit(self, record: RequestRecord) -> None:
        entry = record.as_log()
        level = logging.ERROR if (record.status or 0) >= 500 else logging.INFO
        documents = self._metrics(record, entry["latency_ms"]) if self.metrics_enabled else []
        line = self._line.render(level, "request", entry) if self.logger.isEnabledFor(level) else ""
        if line is not None:
            documents.append(line)
        if documents:  # one write to the stream per request
            self._stream.write("".join(documents))
            self._stream.flush()
        if line is None:
            self.logger.log(level, "request", extra=entry)

    def _metrics(self, record: RequestRecord, latency_ms: int) -> list[str]:
        status = record.status or 500
        usage = record.usage
        failures = record.backend_failures + (1 if usage is not None and usage.status in _UPSTREAM_FAILURES else 0)
        values: dict[str, float] = {
            "Requests": 1,
            "Latency": latency_ms,
            "Errors5xx": 1 if status >= 500 else 0,
            "RateLimited": 1 if status == 429 else 0,
            "UpstreamFailures": failures,
        }
        if usage is not None:
            if usage.ttfb_ms is not None:
                values["TimeToFirstByte"] = usage.ttfb_ms
            values["PromptTokens"] = usage.prompt_tokens or 0
            values["CompletionTokens"] = usage.completion_tokens or 0
            values["CostUSD"] = float(usage.cost)
            values["UsageEstimated"] = 1 if usage.usage_source == "estimated" else 0
        # published twice: per service (what the alarms watch) and per service and endpoint
        documents = [self._metrics_document("request", values, endpoint=record.endpoint or UNMATCHED)]
        if record.error_code:
            documents.append(self._metrics_document("error", {"Errors": 1}, code=record.error_code))
        return documents

    def _metrics_document(self, kind: str, values: dict[str, float], **dimensions: str) -> str:
        """One EMF document line. Its `CloudWatchMetrics` part (namespace, dimension sets, the
        metrics' names and units) depends only on which metrics and dimensions it has: Powertools
        serializes that once per combination, from names and units it checked once
        (`_checked_units`); each request adds only its timestamp and values."""
        shape = (kind, tuple(values), tuple(dimensions))
        declaration = self._declarations.get(shape)
        if declaration is None:
            declaration = self._declarations[shape] = json.dumps(
                self._declaration(kind, values, dimensions), separators=(",", ":"))
        members: dict[str, Any] = {"service": self.service, **dimensions}
        for name, value in values.items():
            members[name] = [float(value)]
        # {"_aws":{...}, then the dimensions' and the metrics' members}: the latter are written
        # as one object, whose opening brace gives way to the _aws member
        return (f'{{"_aws":{{"Timestamp":{int(time.time() * 1000)},"CloudWatchMetrics":{declaration}}},'
                f'{compact_text(members, ascii_only=True)[1:]}\n')

    def _declaration(self, kind: str, values: dict[str, float], dimensions: dict[str, str]) -> list[Any]:
        metrics = self._metric_set(kind)
        try:
            metrics.add_dimensions(service=self.service, **dimensions)
            document = metrics.serialize_metric_set(metrics={
                name: {"Unit": _checked_units()[name], "StorageResolution": 60, "Value": [float(value)]}
                for name, value in values.items()
            })
        finally:
            metrics.clear_metrics()
        return document["_aws"]["CloudWatchMetrics"]


class _LogLine:
    """A log line as the Logger's Powertools formatter writes it, without the logging module's
    per-record work (a LogRecord, the caller's frame walk, the handler's lock and filters).

    The keys the formatter is configured with come first, in its order (level, location,
    message, timestamp, service, and any key appended to the Logger since), then the entry's,
    then the X-Ray trace id; keys whose value is None are left out, and the line is serialized
    by the formatter's own serializer, its timestamp by its own `formatTime`. A format key this
    cannot fill (another format over a LogRecord's attributes) leaves the line to the Logger.

    Two of the formatter's steps are done here as it does them, for less: with its default
    serializer (json.dumps, str for anything else, compact, UTF-8), the same encoder made once;
    with its default time format, each second's text worked out once."""

    _LEVEL, _LOCATION, _TIME = "%(levelname)s", "%(funcName)s:%(lineno)d", "%(asctime)s"

    def __init__(self, logger: Any) -> None:
        formatter = getattr(logger, "registered_formatter", None)
        usable = isinstance(getattr(formatter, "log_format", None), dict) and callable(
            getattr(formatter, "json_serializer", None))
        self._formatter = formatter if usable else None
        from aws_lambda_powertools.logging.formatter import RESERVED_LOG_ATTRS

        self._reserved = frozenset(RESERVED_LOG_ATTRS)  # the keys whose values it fills from a LogRecord
        serializer = getattr(formatter, "json_serializer", None)
        # the serializer's own settings, when they are Powertools' defaults: an encoder made once does the same
        self._default_serializer = serializer if _is_default_serializer(serializer) else None
        self._encode = compact_encoder(ascii_only=False, default=str)
        self._second: tuple[int, str, str] | None = None  # (second, its text before and after the milliseconds)

    def render(self, level: int, message: str, entry: dict[str, Any]) -> str | None:
        """The line for `entry` (no value of it None), logged by the caller at `level`; None when
        only the Logger can write it."""
        formatter = self._formatter
        if formatter is None:
            return None
        line: dict[str, Any] = {}
        for key, value in formatter.log_format.items():
            if key == "message":
                value = message
            elif value is None:
                if key in entry:
                    line[key] = None  # its place in the formatter's order: the entry's value takes it
                continue
            elif value and key in self._reserved:  # a format over the LogRecord's attributes
                if value == self._LEVEL:
                    value = logging.getLevelName(level)
                elif value == self._LOCATION:
                    caller = sys._getframe(1)
                    value = f"{caller.f_code.co_name}:{caller.f_lineno}"
                elif value == self._TIME:
                    value = self._timestamp(formatter, time.time())
                else:
                    return None
            line[key] = value
        line.update(entry)
        trace = os.environ.get("_X_AMZN_TRACE_ID") if formatter.log_format.get("xray_trace_id", "") is not None else None
        if trace:
            line["xray_trace_id"] = trace.split(";")[0].replace("Root=", "")
        serializer = formatter.json_serializer
        return (self._encode(line) if serializer is self._default_serializer else serializer(line)) + "\n"

    def _timestamp(self, formatter: Any, now: float) -> str:
        """`formatter.formatTime` of a record made at `now`."""
        if (formatter.datefmt or formatter.use_rfc3339_iso8601 or formatter.converter is not time.localtime
                or formatter.default_time_format != _DEFAULT_TIME_FORMAT):
            return formatter.formatTime(_Created(now))
        created = _Created(now)
        second = int(now)
        cached = self._second
        if cached is None or cached[0] != second:
            moment = time.localtime(now)
            before, after = _DEFAULT_TIME_FORMAT.split("%F")
            cached = self._second = (second, time.strftime(before, moment), time.strftime(after, moment))
        return f"{cached[1]}{int(created.msecs):03d}{cached[2]}"


# Powertools' default: '2021-04-17 18:19:57,656+0200' (%F: the milliseconds)
_DEFAULT_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%F%z"


def _is_default_serializer(serializer: Any) -> bool:
    """The formatter's serializer is Powertools' default: json.dumps, str for what it cannot
    write, compact, non-ASCII as it is."""
    return (isinstance(serializer, functools.partial) and serializer.func is json.dumps and not serializer.args
            and serializer.keywords == {"default": str, "separators": (",", ":"), "indent": None,
                                        "ensure_ascii": False})


class _Created:
    """What a formatter's formatTime reads of a LogRecord."""

    __slots__ = ("created", "msecs")

    def __init__(self, created: float) -> None:
        self.created = created
        self.msecs = int((created - int(created)) * 1000) + 0.0


_UNITS: dict[str, str] = {}


def _checked_units() -> dict[str, str]:
    """Every metric the gateway emits, with its CloudWatch unit, as Powertools' add_metric
    validates and normalizes them (once per process)."""
    if not _UNITS:
        from aws_lambda_powertools.metrics import EphemeralMetrics, MetricUnit

        units = {"Requests": MetricUnit.Count, "Latency": MetricUnit.Milliseconds, "Errors5xx": MetricUnit.Count,
                 "RateLimited": MetricUnit.Count, "UpstreamFailures": MetricUnit.Count,
                 "TimeToFirstByte": MetricUnit.Milliseconds, "PromptTokens": MetricUnit.Count,
                 "CompletionTokens": MetricUnit.Count, "CostUSD": MetricUnit.NoUnit, "UsageEstimated": MetricUnit.Count,
                 "Errors": MetricUnit.Count}
        checker = EphemeralMetrics(namespace="check")
        for name, unit in units.items():
            checker.add_metric(name=name, unit=unit, value=0)
        _UNITS.update({name: metric["Unit"] for name, metric in checker.metric_set.items()})
    return _UNITS


class ObservabilityMiddleware:
    """One record per request, emitted after its answer. `quiet_paths` (the readiness check)
    pass untouched: they are not customer traffic, and a cold start's first real answer must
    not wait for the telemetry set-up that a readiness probe would otherwise trigger."""

    def __init__(self, app: Any, observer: Observer | None = None, quiet_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.observer = observer  # made after the first answer when not given
        self.quiet_paths = quiet_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in self.quiet_paths:
            return await self.app(scope, receive, send)
        record = RequestRecord(scope.get("method", "-"), scope.get("path", "-"), request_ids(scope))
        scope.setdefault("state", {})["kiln_record"] = record
        ids_token = _REQUEST_IDS.set(record.ids)

        async def observed_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body" and record.first_byte_ms is None and message.get("body"):
                record.first_byte_ms = int((time.monotonic() - record.started) * 1000)
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        finally:
            record.finished = time.monotonic()
            try:
                if self.observer is None:  # made once the first answer is out, not before it
                    self.observer = Observer()
                self.observer.emit(record)
            except Exception:  # noqa: BLE001 - telemetry must never fail a request
                logging.getLogger("kiln.observability").exception("could not emit request telemetry")
            finally:
                _REQUEST_IDS.reset(ids_token)
