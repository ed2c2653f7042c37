"""Metrics that belong to no single request's record: a backend changing state, a request
ended by one of its model's timeouts. Written as one CloudWatch EMF line on stdout (Lambda
sends stdout to CloudWatch Logs, which reads EMF lines as metrics), like the request metrics
of `kiln.observability`, and off when POWERTOOLS_METRICS_DISABLED is set (`kiln dev`)."""

from __future__ import annotations

import json
import sys
import time
from functools import cache

from .settings import Settings

__all__ = ["metric", "metric_line", "telemetry_settings"]


@cache
def telemetry_settings() -> Settings:
    """The process's settings, for telemetry (Powertools' own variables among them): read once."""
    return Settings.from_env()


def metric_line(name: str, value: float, unit: str = "Count", **dimensions: str) -> str:
    settings = telemetry_settings()
    namespace, service = settings.metrics_namespace, settings.service_name
    dims = {"service": service, **dimensions}
    document = {
        "_aws": {
            "Timestamp": int(time.time() * 1000),
            "CloudWatchMetrics": [
                {"Namespace": namespace, "Dimensions": [list(dims)], "Metrics": [{"Name": name, "Unit": unit}]}
            ],
        },
        **dims,
        name: value,
    }
    return json.dumps(document, separators=(",", ":"))


def metric(name: str, value: float, unit: str = "Count", **dimensions: str) -> None:
    if telemetry_settings().metrics_disabled:
        return
    sys.stdout.write(metric_line(name, value, unit, **dimensions) + "\n")
    sys.stdout.flush()
