"""OpenAPI descriptions of the request bodies and error answers (documentation and fuzzing).

They describe what clients send; the gateway itself validates only what contract §3 says
(`kiln.normalize`) and forwards everything else untouched, so they stay permissive.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ERROR_RESPONSES", "SELF_SERVICE", "chat_body", "completion_body", "responses_body"]

_COMMON: dict[str, Any] = {
    "model": {"type": "string", "description": "A model id of GET /v1/models."},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1},
    "seed": {"type": "integer"},
    "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
}

_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
        "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "tool_call_id": {"type": "string"},
    },
}

_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name", "description"],
            "properties": {"name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}},
        },
    },
}


def _body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def chat_body() -> dict[str, Any]:
    return _body(
        {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                **_COMMON,
                "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
                "tools": {"type": "array", "items": _TOOL},
                "tool_choice": {"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}]},
                "response_format": {"type": "object", "properties": {"type": {"type": "string"}}},
                "parallel_tool_calls": {"type": "boolean"},
                "reasoning_effort": {"type": "string", "enum": ["low", "medium", "high"]},
                "ignore_eos": {"type": "boolean"},
            },
        }
    )


def completion_body() -> dict[str, Any]:
    return _body(
        {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {
                **_COMMON,
                "prompt": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                "echo": {"type": "boolean"},
                "ignore_eos": {"type": "boolean"},
            },
        }
    )


def responses_body() -> dict[str, Any]:
    return _body(
        {
            "type": "object",
            "required": ["model"],
            "properties": {
                "model": _COMMON["model"],
                "stream": _COMMON["stream"],
                "input": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                "instructions": {"type": "string"},
                "max_output_tokens": {"type": "integer", "minimum": 1},
                "temperature": _COMMON["temperature"],
                "top_p": _COMMON["top_p"],
                "tools": {"type": "array", "items": {"type": "object"}},
                "tool_choice": {"anyOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}]},
                "text": {"type": "object", "properties": {"format": {"type": "object"}}},
                "store": {"type": "boolean"},
                "previous_response_id": {"type": "string"},
            },
        }
    )


_ERROR = {
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "required": ["error"],
                "properties": {
                    "error": {
                        "type": "object",
                        "required": ["message", "type", "param", "code"],
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        },
                    }
                },
            }
        }
    }
}

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"description": description, **_ERROR}
    for status, description in {
        400: "invalid request (contract §3)",
        401: "missing, unknown or revoked key",
        402: "out of credits",
        403: "organization disabled",
        404: "unknown model or generation",
        413: "body too large",
        429: "the org's requests in flight are at its limit",
        503: "maintenance, no backend, or storage unavailable",
    }.items()
}


# -- the self-service routes (contract §10) --------------------------------------------------

_KEY_ATTRIBUTES: dict[str, Any] = {
    "type": "object",
    "properties": {
        "label": {"type": ["string", "null"], "maxLength": 100},
        "role": {"type": "string", "enum": ["inference", "management"]},
        "models": {"type": ["array", "null"], "minItems": 1, "items": {"type": "string"}},
        "concurrency": {"type": ["integer", "null"], "minimum": 1},
        "spend_limit": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "string"}, {"type": "null"}],
                        "description": "USD per spend_period, a number or a decimal string"},
        "spend_period": {"type": "string", "enum": ["day", "week", "month", "total"]},
    },
}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


# by route name (kiln.endpoints): what each route takes besides its path
SELF_SERVICE: dict[str, dict[str, Any]] = {
    "usage.retrieve": {
        "parameters": [
            _query("since", {"type": "string"}, "RFC 3339 date or date-time, inclusive (default: until − 30 days)"),
            _query("until", {"type": "string"}, "RFC 3339 date or date-time, exclusive (default: now)"),
            _query("group_by", {"type": "string", "enum": ["day", "model", "key"]}, "one row per day (default), model or key"),
        ]
    },
    "keys.list": {
        "parameters": [
            _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}, "keys in the page (default 100)"),
            _query("after", {"type": "string"}, "the last key id of the page before (its last_id)"),
        ]
    },
    "keys.create": _body(_KEY_ATTRIBUTES),
    "keys.update": _body(_KEY_ATTRIBUTES),
}
