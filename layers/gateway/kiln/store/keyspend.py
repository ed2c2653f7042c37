"""A key's own limits, and its spend against its limit, kept on its org's item (contract §10).

Admission stays one conditional write and settlement one transaction because everything
a key's limits need lives on the org item that both already write, in top-level
attributes of its own (DynamoDB's ADD and DELETE, which need no prior read and no
pre-created parent, work only on top-level attributes):

- `key_leases:<key id>`: a string set of the generation ids the key has in flight. The
  admission ADDs its id (a set: a retried admission adds nothing twice), the settle or the
  reclaim DELETEs it, and a key's concurrency is the condition `size(...) < limit`.
  DynamoDB removes a set that becomes empty, so only keys with requests in flight have one.
- `key_spend:<key id>:<period>`: for a key with a spend limit only, what it has spent in the
  current period of its `spend_period` (`2026-12-01`, `2026-W49`, `2026-12` or `total`). The
  admission's condition reads it, the lease records its name, and the settle (or reclaim)
  ADDs the request's cost to that figure. Keys without a limit keep nothing on the item,
  so the org item does not grow with the number of keys an org uses.
- `key_period:<key id>`: the kind of period the key counts its spend in now (`day`, `week`,
  `month`, `total`), for a key with a limit; key management writes it when a limit is set or
  its period changes, and removes it with the limit (kiln.store.keyring). A gateway whose
  auth cache still holds the key as it was admits with its old limits, so its lease names no
  figure, or one of another period: the settle is conditioned on this marker being absent or
  what its lease assumed, and when it is not, adds the cost to the figure the marker says
  (`counted_in`). A key whose limit was set at its creation has no marker until its limit or
  period is changed: its leases' figures are the ones.

Periods are UTC: a day starts at 00:00, a week on Monday (ISO weeks), a month on its 1st;
`total` never resets. A request counts in the period it was admitted in, as its usage
event's `created_at` does. The limit is soft by the requests in flight: their cost is known
only when they settle, so a key can end a period above its limit by at most what those
cost. Figures of periods that are over are removed in the background after an admission
sees them; a revoked key's, or one whose limit is removed, by key management (and those that
a request in flight at that change makes again, by the next call that may set a limit). A key's
spend without a limit is read from its tally (kiln.store.tally).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from functools import lru_cache
from typing import Any

__all__ = [
    "PERIODS",
    "KeyLimits",
    "counted_in",
    "figures_of",
    "kind_of_figure",
    "marker_attribute",
    "marker_of",
    "leases_attribute",
    "period_start",
    "period_kind",
    "period_name",
    "period_over",
    "periods_at",
    "resets_at",
    "spend_attribute",
    "spend_attributes_by_key",
    "spend_in",
    "stale_spend_attributes",
    "PERIOD_GRACE_SECONDS",
]

PERIODS = ("day", "week", "month", "total")
# How long after its period ends a spend figure is kept: a gateway (or an operator's tool) whose
# clock runs behind still admits and settles in that period, and reads the figure there.
PERIOD_GRACE_SECONDS = 3600.0
LEASES_PREFIX = "key_leases:"
SPEND_PREFIX = "key_spend:"
MARKER_PREFIX = "key_period:"


@dataclass(frozen=True)
class KeyLimits:
    """A key's own limits; None: the org's (concurrency) or none (spend)."""

    concurrency: int | None = None
    spend_limit: Decimal | None = None
    spend_period: str = "total"

    @property
    def any(self) -> bool:
        return self.concurrency is not None or self.spend_limit is not None

    def figure(self, key_id: str, moment: float) -> str | None:
        """The org item's attribute that holds this key's spend against its limit at `moment`
        (None: no spend limit, no figure)."""
        if self.spend_limit is None:
            return None
        return spend_attribute(key_id, period_name(self.spend_period, moment))


def _utc(moment: float) -> datetime:
    return datetime.fromtimestamp(moment, timezone.utc)


def period_name(period: str, moment: float) -> str:
    """The name of the `period` (day, week, month, total) that holds `moment`."""
    name = _names_on(_utc(moment).date()).get(period)
    if name is None:
        raise ValueError(f"spend_period is one of {', '.join(PERIODS)}")
    return name


@lru_cache(maxsize=16)
def _names_on(day: date) -> dict[str, str]:
    """Each period's name on one UTC day: worked out once a day, not on every admission and settle."""
    year, week, _ = day.isocalendar()
    return {"day": day.strftime("%Y-%m-%d"), "week": f"{year}-W{week:02d}", "month": day.strftime("%Y-%m"),
            "total": "total"}


def period_kind(name: str) -> str:
    """The kind of a period from its name: 2026-12-01 day, 2026-W49 week, 2026-12 month, total."""
    if name == "total":
        return "total"
    if "-W" in name:
        return "week"
    return "day" if name.count("-") == 2 else "month"


def periods_at(moment: float) -> tuple[str, ...]:
    return tuple(_names_on(_utc(moment).date()).values())


def resets_at(period: str, moment: float) -> datetime | None:
    """When the `period` that holds `moment` ends (None for `total`)."""
    when = _utc(moment)
    day = when.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day + timedelta(days=1)
    if period == "week":
        return day + timedelta(days=7 - day.weekday())
    if period == "month":
        first = day.replace(day=1)
        return (first + timedelta(days=32)).replace(day=1)
    if period == "total":
        return None
    raise ValueError(f"spend_period is one of {', '.join(PERIODS)}")


def period_start(period: str, moment: float) -> datetime | None:
    """When the `period` that holds `moment` began (None for `total`: the key's whole life)."""
    when = _utc(moment)
    day = when.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day
    if period == "week":
        return day - timedelta(days=day.weekday())
    if period == "month":
        return day.replace(day=1)
    if period == "total":
        return None
    raise ValueError(f"spend_period is one of {', '.join(PERIODS)}")


def leases_attribute(key_id: str) -> str:
    return f"{LEASES_PREFIX}{key_id}"


def spend_attribute(key_id: str, name: str) -> str:
    return f"{SPEND_PREFIX}{key_id}:{name}"


def spend_in(item: dict[str, Any], key_id: str, period: str, moment: float) -> Decimal:
    """What the key has spent in the `period` holding `moment`, from an org item (wire form)."""
    raw = item.get(spend_attribute(key_id, period_name(period, moment)), {}).get("N")
    return Decimal(raw) if raw is not None else Decimal(0)


def marker_attribute(key_id: str) -> str:
    return f"{MARKER_PREFIX}{key_id}"


def marker_of(item: dict[str, Any], key_id: str) -> str | None:
    """The key's marker on an org item (wire form): its kind of period, or None (no marker)."""
    return item.get(marker_attribute(key_id), {}).get("S")


def kind_of_figure(figure: str | None) -> str | None:
    """The marker a lease naming `figure` assumes: its period's kind (None: no figure, no marker)."""
    return period_kind(figure.rpartition(":")[2]) if figure is not None else None


def counted_in(item: dict[str, Any], key_id: str, admitted: float, named: str | None) -> tuple[str, ...]:
    """The figures a request admitted at `admitted` adds its cost to, its lease naming `named`,
    from its org item as read: the figure of the period the key's marker says, in the
    request's own period; with no marker, the lease's."""
    marker = marker_of(item, key_id)
    if marker is None:
        return (named,) if named is not None else ()
    if marker not in PERIODS:
        return ()  # not a marker key management writes: no figure it could say
    return (spend_attribute(key_id, period_name(marker, admitted)),)


def spend_attributes_by_key(item: dict[str, Any]) -> dict[str, list[str]]:
    """Key id -> its spend figures and marker on an org item (its set of leases is not one)."""
    found: dict[str, list[str]] = {}
    for name in item:
        if name.startswith(SPEND_PREFIX):
            key_id = name[len(SPEND_PREFIX):].partition(":")[0]
        elif name.startswith(MARKER_PREFIX):
            key_id = name[len(MARKER_PREFIX):]
        else:
            continue
        found.setdefault(key_id, []).append(name)
    return found


def figures_of(item: dict[str, Any], key_id: str) -> list[str]:
    """Every spend figure of this key on an org item (wire form or attribute names)."""
    prefix = f"{SPEND_PREFIX}{key_id}:"
    return [name for name in item if name.startswith(prefix)]


def stale_spend_attributes(item: dict[str, Any], moment: float) -> list[str]:
    """The spend figures of periods that are over (kept by no limit any more)."""
    figures = [name for name in item if name.startswith(SPEND_PREFIX)]
    if not figures:
        return []  # most orgs: no key with a limit, and no date to work out
    return [name for name in figures if period_over(name, moment)]


def period_over(figure: str, moment: float) -> bool:
    """Whether the period of a spend figure (its attribute name) ended more than
    PERIOD_GRACE_SECONDS before `moment`. A later period than the one holding `moment` never
    is: a gateway whose clock runs ahead already counts in it."""
    name = figure.rpartition(":")[2]
    kind = period_kind(name)
    # names of one kind sort as their periods do: 2026-12-31 < 2027-01-01, 2026-W53 < 2027-W01
    return kind != "total" and name < period_name(kind, moment - PERIOD_GRACE_SECONDS)
