"""Timestamps as stored: ISO 8601 UTC with milliseconds, which sort as time."""

from __future__ import annotations

import time
from datetime import datetime, timezone

__all__ = ["iso_ms", "now"]


def now() -> float:
    return time.time()


def iso_ms(epoch_seconds: float) -> str:
    moment = datetime.fromtimestamp(epoch_seconds, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"
