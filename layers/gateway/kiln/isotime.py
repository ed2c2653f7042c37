"""Times written by people (operators' flags and options, clients' query parameters): Python's
reading of ISO 8601, held to the standard where Python reads on."""

from __future__ import annotations

import re
from datetime import datetime

__all__ = ["from_iso"]

# an offset as the standard writes it: ±hh, ±hh:mm or ±hhmm (seconds, and their fraction, as
# Python takes them)
_OFFSET = re.compile(r"[+-]\d\d(?::?(\d\d)(?::?(\d\d)(?:[.,]\d+)?)?)?")


def from_iso(text: str) -> datetime:
    """`datetime.fromisoformat` of `text`, Z for UTC; ValueError for an offset whose minutes or
    seconds pass 59, which Python carries into the next hour (+00:99 read as +01:39), or that
    is in a form Python reads on (+00:99.5, +00:60,5, a fourth part): a time other than the one
    written. The offset is what follows the last sign: a time of day holds none."""
    text = text.replace("Z", "+00:00")
    moment = datetime.fromisoformat(text)
    if moment.tzinfo is not None:
        offset = _OFFSET.fullmatch(text[max(text.rfind("+"), text.rfind("-")):])
        if offset is None or max(int(part) for part in offset.groups("0")) > 59:
            raise ValueError(f"{text!r} has an offset in no standard form, or minutes or seconds past 59")
    return moment
