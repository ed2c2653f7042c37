"""Timestamps as stored: ISO 8601 UTC with milliseconds, which sort as time."""

from __future__ import annotations

import math
import time
from datetime import datetime, timezone

__all__ = ["epoch_of", "iso_ms", "now", "to_the_ms", "stored_time"]


def now() -> float:
    return time.time()


def to_the_ms(epoch_seconds: float) -> float:
    """The moment cut to its millisecond, as it is stored: a float a rounding error below a
    millisecond is that millisecond (cutting twice cuts nothing more)."""
    return math.floor(epoch_seconds * 1000 + 1e-3) / 1000


def iso_ms(epoch_seconds: float) -> str:
    return stored_time(datetime.fromtimestamp(epoch_seconds, timezone.utc))


def stored_time(moment: datetime) -> str:
    """A moment in the stored form. The year has its four digits whatever it is (strftime's
    %Y does not pad years before 1000 on every platform): stored times sort as time."""
    moment = moment.astimezone(timezone.utc)
    return (f"{moment.year:04d}-{moment.month:02d}-{moment.day:02d}T{moment.hour:02d}:{moment.minute:02d}:"
            f"{moment.second:02d}.{moment.microsecond // 1000:03d}Z")


def epoch_of(stored: str) -> float:
    """The epoch seconds of a stored timestamp (iso_ms's inverse)."""
    return datetime.fromisoformat(stored.replace("Z", "+00:00")).timestamp()
