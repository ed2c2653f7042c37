"""Times written by people (operators' flags and options, clients' query parameters): Python's
reading of ISO 8601, held to the standard where Python reads on."""

from __future__ import annotations

import re
from datetime import datetime

__all__ = ["from_iso"]

# an offset at the end of a time: ±hh:mm, ±hhmm, with seconds as Python takes them
_OFFSET = re.compile(r"[+-]\d\d:?(\d\d)(?::?(\d\d)(?:\.\d+)?)?$")


def from_iso(text: str) -> datetime:
    """`datetime.fromisoformat` of `text`, Z for UTC; ValueError for an offset whose minutes or
    seconds pass 59, which Python carries into the next hour (+00:99 read as +01:39): a time
    other than the one written."""
    text = text.replace("Z", "+00:00")
    moment = datetime.fromisoformat(text)
    offset = _OFFSET.search(text) if moment.tzinfo is not None else None
    if offset and max(int(part) for part in offset.groups("0")) > 59:
        raise ValueError(f"{text!r} has an offset with minutes or seconds past 59")
    return moment
