"""Rows out: an aligned table for people, JSON or CSV for scripts."""

from __future__ import annotations

import csv
import io
import json
from decimal import Decimal
from typing import Any, Callable, Sequence

from kiln.jsonio import decimal_text
from kiln.shown import escaped

__all__ = ["FORMATS", "render"]

FORMATS = ("table", "json", "csv")


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, Decimal):
        return decimal_text(value)
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def _shown(text: str) -> str:
    """A cell of a table as a person reads it: nothing in it passes for other text or rows (a
    character that would is shown as its escape; emoji sequences as they are)."""
    return escaped(text)


# What a spreadsheet opening a CSV file runs as a formula when a cell starts with it.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _csv_cell(value: Any) -> str:
    """A cell as text; a text (a key's label, say: the customer's) that a spreadsheet would run
    as a formula gets a leading ' so that it opens as the text it is. Numbers are left as they are."""
    if value is None:
        return ""
    text = _text(value)
    if isinstance(value, str) and text.startswith(_FORMULA_STARTS):
        return "'" + text
    return text


def _json_value(value: Any) -> Any:
    return decimal_text(value) if isinstance(value, Decimal) else value


def render(rows: Sequence[dict[str, Any]], columns: Sequence[str], fmt: str, out: Callable[[str], None]) -> None:
    """Write `rows` (dicts) with `columns`, in `fmt`. JSON keeps Decimals exact, as strings."""
    if fmt == "json":
        out(json.dumps([{c: _json_value(row.get(c)) for c in columns} for row in rows], indent=2))
    elif fmt == "csv":
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(columns)
        for row in rows:
            writer.writerow([_csv_cell(row.get(c)) for c in columns])
        # at the writer's line ends only: str.splitlines would also cut a cell at the separators
        # a CSV writer leaves unquoted (U+2028, U+0085, VT, FF), which no CSV reader ends a row on
        for line in buffer.getvalue().removesuffix("\n").split("\n"):
            out(line)
    else:
        cells = [[c.upper().replace("_", " ") for c in columns]] + [[_shown(_text(row.get(c))) for c in columns]
                                                                     for row in rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
        for line in cells:
            out("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
