"""Request values as the model servers read them.

vLLM's OpenAI server parses a request with pydantic in its lax mode: `"4"`, `4.0` and `" 4 "`
are the integer 4, and `1`, `"yes"`, `"on"` and `"True"` are true. Where the gateway bounds
what a request can cost (its `n` choices) or refuses what a model cannot do (`ignore_eos`), or
decides whether the client asked for something (`include_usage`), it reads the request as they
do, or a client could spell its way around the rule.

The exact JSON types are read here; any other value by pydantic-core itself (in the layer
already, under FastAPI), imported on the first such value only: a process that never sees one
never pays for the import.
"""

from __future__ import annotations

from functools import cache
from typing import Any

__all__ = ["server_bool", "server_int"]


def server_int(value: Any) -> int | None:
    """The integer a lax pydantic field reads `value` as; None where it refuses it."""
    if type(value) is int:
        return value
    if value is None:
        return None
    return _read(_validators()[0], value)


def server_bool(value: Any) -> bool | None:
    """The boolean a lax pydantic field reads `value` as; None where it refuses it."""
    if value is True or value is False:
        return value
    if value is None:
        return None
    return _read(_validators()[1], value)


def _read(validator: Any, value: Any) -> Any:
    try:
        return validator.validate_python(value)
    except ValueError:  # pydantic-core's ValidationError: a value the server answers with its own 400
        return None


@cache
def _validators() -> tuple[Any, Any]:
    from pydantic_core import SchemaValidator, core_schema

    return SchemaValidator(core_schema.int_schema()), SchemaValidator(core_schema.bool_schema())
