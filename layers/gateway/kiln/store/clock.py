"""Timestamps as stored: ISO 8601 UTC with milliseconds, which sort as time."""

from __future__ import annotations

import time
from datetime import datetime, timezone

__all__ = ["epoch_of", "iso_ms", "now"]


def now() -> float:
    return time.time()


def iso_ms(epoch_seconds: float) -> str:
    moment = datetime.fromtimestamp(epoch_seconds, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def epoch_of(stored: str) -> float:
    """The epoch seconds of a stored timestamp (iso_ms's inverse)."""
    return datetime.fromisoformat(stored.replace("Z", "+00:00")).timestamp()
