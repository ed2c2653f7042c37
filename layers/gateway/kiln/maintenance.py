"""The maintenance switch (contract §6): a JSON flag in SSM, e.g.

    {"enabled": true, "until": "2026-12-01T03:00:00Z", "message": "Upgrading model servers."}
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime

from .errors import Maintenance
from .isotime import from_iso
from .truth import spelled

__all__ = ["MaintenanceFlag", "parse_flag"]

DEFAULT_MESSAGE = "The service is down for maintenance. Retry after the time in the Retry-After header."


@dataclass(frozen=True)
class MaintenanceFlag:
    enabled: bool = False
    until: datetime | None = None
    message: str | None = None

    def to_json(self) -> str:
        document: dict = {"enabled": self.enabled}
        if self.until is not None:
            # isoformat writes the year in four digits (strftime's %Y does not below year 1000),
            # and a fraction of a second where there is one: Retry-After must not name the second before
            document["until"] = self.until.astimezone(timezone.utc).replace(tzinfo=None).isoformat() + "Z"
        if self.message:
            document["message"] = self.message
        return json.dumps(document, ensure_ascii=False)  # a message as written: UTF-8, not escaped

    def error(self, default_retry_after: int, now: datetime | None = None) -> Maintenance:
        """The 503 to answer while enabled. Retry-After is the HTTP-date of `until`; once
        `until` has passed (or without one) it is a number of seconds."""
        now = now or datetime.now(timezone.utc)
        if self.until is not None and self.until > now:
            retry_after = format_datetime(_whole_second_at_or_after(self.until.astimezone(timezone.utc)), usegmt=True)
        else:
            retry_after = str(default_retry_after)
        return Maintenance(self.message or DEFAULT_MESSAGE, retry_after)


def _whole_second_at_or_after(moment: datetime) -> datetime:
    """An HTTP-date names whole seconds: `moment`'s, or the next one's where it has a fraction
    (a client that waits as told must not come back before it). The last second there is
    (9999-12-31T23:59:59) has no next one: it is named."""
    if not moment.microsecond:
        return moment
    try:
        return moment.replace(microsecond=0) + timedelta(seconds=1)
    except OverflowError:
        return moment.replace(microsecond=0)


def parse_until(text: str) -> datetime:
    """ISO 8601, held in UTC (the zone of every answer that names it); a time without a zone
    is taken as UTC. ValueError for a time with no UTC date (past year 9999 or before year 1)."""
    moment = from_iso(text)
    if moment.tzinfo is None:
        return moment.replace(tzinfo=timezone.utc)
    try:
        return moment.astimezone(timezone.utc)
    except OverflowError:
        raise ValueError(f"{text!r} has no date in UTC (years 1 to 9999)") from None


def _switch(value: object) -> bool:
    """On or off as written by hand: null (or no enabled) is off; a spelling of neither is a
    malformed switch (read as off, "true" would be the switch ignored; read as malformed,
    "false" would keep a warm environment on its last value, on)."""
    if value is None:
        return False
    meant = spelled(value)
    if meant is None:
        raise ValueError(f'the maintenance parameter\'s "enabled" must be true or false, not {value!r}'[:200])
    return meant


def parse_flag(raw: str | None) -> MaintenanceFlag:
    """A missing parameter means no maintenance; a malformed one is an error (keeps the last value)."""
    if raw is None or not raw.strip():
        return MaintenanceFlag()
    document = json.loads(raw)
    if not isinstance(document, dict):
        raise ValueError("the maintenance parameter must be a JSON object")
    enabled = _switch(document.get("enabled"))
    until = document.get("until")
    if until is not None and not isinstance(until, str):
        # a number (epoch seconds?) was dropped and the switch served on with no until, where
        # an until written as text and not a time makes the switch unreadable: both are
        raise ValueError(f'the maintenance parameter\'s "until" must be an ISO 8601 time, not {until!r}'[:200])
    message = document.get("message")
    return MaintenanceFlag(
        enabled=enabled,
        until=parse_until(until) if until else None,
        message=message if isinstance(message, str) and message else None,
    )
