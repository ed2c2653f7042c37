"""How a switch written by hand says on or off: a catalog backend's `enabled`, the maintenance
switch's. JSON's true and false, and what people type for them."""

from __future__ import annotations

from typing import Any

__all__ = ["spelled"]

_WORDS = {
    "true": True, "false": False, "on": True, "off": False, "yes": True, "no": False, "y": True, "n": False,
    "enabled": True, "disabled": False, "none": False, "null": False,
}


def spelled(value: Any) -> bool | None:
    """True or False for a JSON boolean, the number 0 or 1 (or its text), and the words above in
    any case with spaces around; None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _WORDS:
            return _WORDS[text]
        try:
            number = float(text)
        except ValueError:
            return None
        return bool(number) if number in (0, 1) else None
    return None
