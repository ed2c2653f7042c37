"""DynamoDB attribute values for the items the request path reads and writes.

The pynamodb models in `records` are the schema of record (operators' tools and tests use
them); this is the same encoding without pynamodb, for the lean client on the request path.
A test checks that both encode every usage event identically.
"""

from __future__ import annotations

from dataclasses import fields
from decimal import Decimal
from typing import Any

from ..jsonio import decimal_text

__all__ = ["decode", "encode", "from_item", "to_item"]


def encode(value: Any) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"BOOL": value}
    if isinstance(value, (int, Decimal)):
        return {"N": decimal_text(Decimal(value))}
    if isinstance(value, str):
        return {"S": value}
    if isinstance(value, dict):
        return {"M": {key: encode(item) for key, item in value.items() if item is not None}}
    raise TypeError(f"cannot store a {type(value).__name__}")


def decode(value: dict[str, Any]) -> Any:
    (kind, data), = value.items()
    if kind == "S":
        return data
    if kind == "N":
        number = Decimal(data)
        return int(number) if number == number.to_integral_value() and "." not in data and "E" not in data.upper() else number
    if kind == "BOOL":
        return data
    if kind == "M":
        return {key: decode(item) for key, item in data.items()}
    if kind == "NULL":
        return None
    if kind == "L":
        return [decode(item) for item in data]
    raise TypeError(f"unexpected attribute type {kind}")


def to_item(record: Any) -> dict[str, dict[str, Any]]:
    """A dataclass as an item: None fields left out, as pynamodb leaves out null attributes."""
    return {f.name: encode(getattr(record, f.name)) for f in fields(record) if getattr(record, f.name) is not None}


def from_item(item: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: decode(value) for name, value in item.items()}
