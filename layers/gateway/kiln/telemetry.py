"""Metrics that belong to no single request's record: a backend changing state, a request
ended by one of its model's timeouts. Written as one CloudWatch EMF line on stdout (Lambda
sends stdout to CloudWatch Logs, which reads EMF lines as metrics), like the request metrics
of `kiln.observability`, and off when POWERTOOLS_METRICS_DISABLED is set (`kiln dev`)."""

from __future__ import annotations

import json
import os
import sys
import time

__all__ = ["metric", "metric_line"]


def metric_line(name: str, value: float, unit: str = "Count", **dimensions: str) -> str:
    namespace = os.environ.get("POWERTOOLS_METRICS_NAMESPACE", "Kiln")
    service = os.environ.get("POWERTOOLS_SERVICE_NAME", "kiln")
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
    if os.environ.get("POWERTOOLS_METRICS_DISABLED", "").lower() in ("1", "true"):
        return
    sys.stdout.write(metric_line(name, value, unit, **dimensions) + "\n")
    sys.stdout.flush()
