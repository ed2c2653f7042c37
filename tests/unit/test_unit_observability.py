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
