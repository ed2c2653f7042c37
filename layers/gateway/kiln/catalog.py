"""The model catalog: what can be called, what it costs, what it can do, where it runs.

The catalog is data (a JSON document in an SSM parameter, or a file locally); request
handling asks it about capabilities and never tests model names itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field, fields, replace
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from functools import lru_cache
from typing import Any, Iterable, Mapping
from urllib.parse import quote, urlsplit, urlunsplit

from .jsonio import decimal_places, decimal_text, loads_strict
from .shown import first_hidden
from .truth import spelled

__all__ = ["Backend", "Capabilities", "Catalog", "CatalogError", "Limits", "ModelEntry", "Pricing", "Timeouts"]

log = logging.getLogger("kiln.catalog")

PER_MILLION = Decimal(1_000_000)

# Bounds that keep every bill a number DynamoDB stores (contract §4) with room to spare: the
# usage bounds (context length × choices × prompts) times the dearest price stay far below
# DynamoDB's 1E+126, the cheapest token at the cheapest price far above its 1E-130. Real
# prices (USD per 1M tokens) and context lengths sit many orders of magnitude inside them.
MAX_PRICE = Decimal(1_000_000)  # $1 a token
MIN_PRICE = Decimal("1e-9")  # other than 0 (free)
# A price's finest digit, MIN_PRICE's: a cost then has at most 15 decimal places (USD), so that
# credits minus a cost, as DynamoDB computes it on the org item, needs far fewer than the 38
# significant digits a DynamoDB number holds, and every debit is exactly the cost recorded.
PRICE_DECIMALS = 9
_PRICE_STEP = Decimal(1).scaleb(-PRICE_DECIMALS)
# a price as kiln admin writes it: ASCII digits, a point, an exponent
_PRICE_TEXT = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
MAX_CONTEXT_LENGTH = 1_000_000_000
# A model's id is held by each lease of a request for it, on its org's one item, which DynamoDB
# bounds at 400 KB: 500 requests in flight (kiln.settings.MAX_ORG_CONCURRENCY) of an id of this
# many bytes, with the most keys with a limit an org may have, keep it below three quarters of
# that (about 270 KB). Ids of 8 000 characters (which the catalog's parameter holds) filled it at
# 47 requests in flight: the 48th admission, and every renewal, refused.
MAX_MODEL_ID_BYTES = 256
# The longest any upstream timeout may be: under the streaming functions' own timeout (contract
# §8), with room left in it for the settle (its retry budget, 10 s by default) and a stream's last
# keep-alive interval: a `total` of 900 s had the function killed before its request settled.
FUNCTION_TIMEOUT_SECONDS = 900.0
SETTLE_ROOM_SECONDS = 30.0
MAX_TIMEOUT_SECONDS = FUNCTION_TIMEOUT_SECONDS - SETTLE_ROOM_SECONDS

_MODEL_KEYS = frozenset(("id", "owned_by", "created", "context_length", "pricing", "capabilities", "timeouts",
                         "limits", "backends"))
_BACKEND_KEYS = frozenset(("name", "url", "model", "api_key_env", "enabled"))
_PRICING_KEYS = frozenset(("input", "output", "cached_input"))
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_DOCUMENT_KEYS = frozenset(("models",))


class CatalogError(ValueError):
    """The catalog document is malformed; the message names the offending field."""


@dataclass(frozen=True)
class Pricing:
    """USD per million tokens, as operators write prices."""

    input: Decimal
    output: Decimal
    cached_input: Decimal | None = None

    def per_token(self) -> dict[str, str]:
        prices = {
            "prompt": decimal_text(self.input / PER_MILLION),
            "completion": decimal_text(self.output / PER_MILLION),
        }
        if self.cached_input is not None:
            prices["cached"] = decimal_text(self.cached_input / PER_MILLION)
        return prices


@dataclass(frozen=True)
class Capabilities:
    # tool_choice "required" or a named function
    forced_tool_choice: bool = False
    # response_format json_object / json_schema
    json_response_format: bool = False
    # ignore_eos on chat requests
    ignore_eos: bool = True

    def as_dict(self) -> dict[str, bool]:
        return {
            "forced_tool_choice": self.forced_tool_choice,
            "json_response_format": self.json_response_format,
            "ignore_eos": self.ignore_eos,
        }


@dataclass(frozen=True)
class Timeouts:
    """Seconds. The whole request, failover included, fits in `total`, and `total` stays under
    the function timeout (900 s) with room to settle (870 s at most, as written): docs/operations.md
    has the reasoning and the worst cases."""

    # TCP (and TLS) to one backend; past it, the next backend is tried
    connect: float = 5.0
    # until a backend's response headers arrive (a buffered answer: until its whole body,
    # within `total`); past it, the next backend is tried
    first_byte: float = 30.0
    # longest silence between two reads once the headers are in (a long prefill is silent)
    idle: float = 120.0
    # the whole request from the first attempt to the last byte, every backend included
    total: float = 600.0


@dataclass(frozen=True)
class Limits:
    """Bytes an upstream answer may take (contract §5); beyond one the answer is a 502 (before
    the stream) or the error event (after)."""

    # the status line and every header, together
    header_bytes: int = 64 * 1024
    # a buffered (non-streamed) body; error bodies are read to 64 KiB at most
    body_bytes: int = 16 * 1024 * 1024
    # one SSE event, up to its blank line
    event_bytes: int = 1024 * 1024


@dataclass(frozen=True)
class Backend:
    name: str
    url: str
    upstream_model: str | None = None
    api_key_env: str | None = None
    enabled: bool = True

    def api_key(self) -> str | None:
        """The key in its variable, without the blanks around it (a key written to the variable
        from a file keeps the file's newline, which no header can carry); None if unset or blank."""
        value = os.environ.get(self.api_key_env) if self.api_key_env else None
        if value is None:
            return None
        return value.strip() or None


@dataclass(frozen=True)
class ModelEntry:
    id: str
    owned_by: str
    created: int
    context_length: int
    pricing: Pricing
    capabilities: Capabilities = field(default_factory=Capabilities)
    timeouts: Timeouts = field(default_factory=Timeouts)
    limits: Limits = field(default_factory=Limits)
    backends: tuple[Backend, ...] = ()

    def available_backends(self) -> tuple[Backend, ...]:
        return tuple(backend for backend in self.backends if backend.enabled)

    def public(self) -> dict[str, Any]:
        """The /v1/models object: never backends, URLs or keys."""
        return {
            "id": self.id,
            "object": "model",
            "created": self.created,
            "owned_by": self.owned_by,
            "context_length": self.context_length,
            "pricing": self.pricing.per_token(),
            "capabilities": self.capabilities.as_dict(),
        }


class Catalog:
    def __init__(self, models: Iterable[ModelEntry]) -> None:
        self._models: dict[str, ModelEntry] = {}
        for model in models:
            if model.id in self._models:
                raise CatalogError(f"model {model.id!r} appears twice")
            self._models[model.id] = model

    def get(self, model_id: str) -> ModelEntry | None:
        return self._models.get(model_id)

    def __iter__(self):
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)

    @classmethod
    def from_json(cls, raw: bytes | str, *, written: bool = False) -> "Catalog":
        try:
            document = loads_strict(raw.encode() if isinstance(raw, str) else raw)
        except ValueError as exc:
            raise CatalogError(f"catalog is not valid JSON: {exc}") from None
        if written:
            _refuse_repeated_names(raw)
        return cls.from_document(document, written=written)

    @classmethod
    def from_document(cls, document: Any, *, written: bool = False) -> "Catalog":
        """The catalog in `document`.

        What no request could be billed or sent for is refused either way: a price or context
        length outside the bounds that keep every bill a number DynamoDB stores, a timeout of
        0, a backend URL the HTTP client cannot call, a value of a type that means nothing.
        A catalog being `written` (kiln admin) is held to everything the docs say: a field the
        catalog does not know (a misspelt "timeout" would be a silent default), timeouts above
        the function's 900 s, a URL with a query or outside ASCII, values that are not of their
        type. A catalog being read (the gateway) is served as an older or newer writer made it:
        those are left alone, read as they always were."""
        if not isinstance(document, Mapping) or not isinstance(document.get("models"), list):
            raise CatalogError('catalog must be an object with a "models" array')
        if written:
            _known_keys(document, _DOCUMENT_KEYS, "catalog")
        return cls(_parse_model(entry, index, written) for index, entry in enumerate(document["models"]))

    def with_backend_url(self, url: str) -> "Catalog":
        """Every model served by one OpenAI-compatible server (the local stack's --upstream-url)."""
        return Catalog(replace(model, backends=(Backend(name="local", url=url),)) for model in self)


def _refuse_repeated_names(raw: bytes | str) -> None:
    """A name given twice in one object of a catalog being written: JSON keeps the last, so the
    first (a price, say) would silently not be the one served."""
    import json

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        names = [name for name, _ in items]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise CatalogError(f"catalog names {repeated[0]!r} twice in one object (JSON keeps only the last)")
        return dict(items)

    json.loads(raw, object_pairs_hook=pairs)


def _parse_model(entry: Any, index: int, written: bool) -> ModelEntry:
    where = f"models[{index}]"
    if not isinstance(entry, Mapping):
        raise CatalogError(f"{where} must be an object")
    model_id = _require(entry, "id", str, where)
    if written:
        _shown(model_id, "id", where)
        if model_id != model_id.strip() or "," in model_id or model_id == "none":
            # kiln admin keys … --models takes ids comma-separated, blanks around them dropped,
            # and "none" for every model: such an id could not be named there, or named another
            raise CatalogError(f"{where}: 'id' must not begin or end with a blank, hold a comma, or be 'none' "
                               f"(kiln admin's --models could not name it)")
        if len(model_id.encode()) > MAX_MODEL_ID_BYTES:
            raise CatalogError(f"{where}: 'id' must be at most {MAX_MODEL_ID_BYTES} bytes in UTF-8 (each request in "
                               f"flight holds it on its org's item, which DynamoDB bounds at 400 KB)")
    where = f"model {model_id!r}"
    pricing = _require(entry, "pricing", Mapping, where)
    capabilities = entry.get("capabilities", {})
    timeouts = entry.get("timeouts", {})
    limits = entry.get("limits", {})
    backends = entry.get("backends", [])
    if (
        not isinstance(capabilities, Mapping)
        or not isinstance(timeouts, Mapping)
        or not isinstance(limits, Mapping)
        or not isinstance(backends, list)
    ):
        raise CatalogError(f"{where}: capabilities, timeouts and limits must be objects, backends an array")
    if written:
        _known_keys(entry, _MODEL_KEYS, where)
        _known_keys(pricing, _PRICING_KEYS, f"{where}: pricing")
        for part, kind in ((capabilities, Capabilities), (timeouts, Timeouts), (limits, Limits)):
            _known_keys(part, _names_of(kind), f"{where}: {kind.__name__.lower()}")
    for name, value in capabilities.items():
        if not isinstance(value, bool):
            raise CatalogError(f"{where}: capabilities.{name} must be true or false")
    return ModelEntry(
        id=model_id,
        owned_by=_text(entry, "owned_by", where, written) or "kiln",
        created=_created(entry.get("created", 0), where, written),
        context_length=_context_length(entry, where),
        pricing=Pricing(
            input=_price(pricing, "input", where, written),
            output=_price(pricing, "output", where, written),
            cached_input=_price(pricing, "cached_input", where, written) if "cached_input" in pricing else None,
        ),
        capabilities=Capabilities(**_known_only(capabilities, Capabilities)),
        timeouts=Timeouts(**{k: _timeout(v, f"timeouts.{k}", where, written)
                             for k, v in _known_only(timeouts, Timeouts).items()}),
        limits=Limits(**{k: _size(v, f"limits.{k}", where) for k, v in _known_only(limits, Limits).items()}),
        backends=_named_apart([_parse_backend(backend, i, where, written) for i, backend in enumerate(backends)],
                              where, written),
    )


def _named_apart(backends: list[Backend], where: str, written: bool) -> tuple[Backend, ...]:
    """A model's backends, each with a name of its own: a backend's health (out of service, its
    cooldown) and its metrics are kept by its name, and two of one name were taken out and
    counted as one. Refused where written; a catalog stored by other means has the later one
    renamed (`name#index`), and served."""
    named: list[Backend] = []
    taken: set[str] = set()
    for index, backend in enumerate(backends):
        if backend.name in taken:
            if written:
                raise CatalogError(f"{where} backends[{index}]: the name {backend.name!r} is another backend's "
                                   f"(each has its own health and metrics)")
            name = backend.name
            while name in taken:
                name = f"{name}#{index}"
            log.warning(json.dumps({"event": "catalog_backend_renamed", "where": f"{where} backends[{index}]",
                                    "to": name}))
            backend = replace(backend, name=name)
        taken.add(backend.name)
        named.append(backend)
    return tuple(named)


def _known_only(values: Mapping[str, Any], kind: type) -> dict[str, Any]:
    """The names `kind` has (a written catalog has no other: refused before this)."""
    names = _names_of(kind)
    return {name: value for name, value in values.items() if name in names}


@lru_cache(maxsize=None)
def _names_of(kind: type) -> frozenset[str]:
    return frozenset(f.name for f in fields(kind))


def _number(value: Any, name: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise CatalogError(f"{where}: {name} must be a non-negative number")
    return float(value)


# the latest `created` a written catalog takes: 9999-12-31T23:59:59Z, a Unix time any client reads exactly
MAX_CREATED = 253_402_300_799


def _created(value: Any, where: str, written: bool) -> int:
    """A model's Unix time of creation (/v1/models): written, a whole number up to MAX_CREATED
    (1.5 was served as 1, 10^30 as a number JavaScript cannot read exactly); read, as it always
    was, but for one past MAX_CREATED, served as 0."""
    if written and (type(value) is not int or not 0 <= value <= MAX_CREATED):
        raise CatalogError(f"{where}: created must be a whole Unix time from 0 to {MAX_CREATED} (seconds)")
    seconds = _number(value, "created", where)
    return int(seconds) if seconds <= MAX_CREATED else 0


def _timeout(value: Any, name: str, where: str, written: bool) -> float:
    seconds = _number(value, name, where)
    if not 0 < seconds < float("inf"):
        raise CatalogError(f"{where}: {name} must be above 0 seconds")
    if written and seconds > MAX_TIMEOUT_SECONDS:
        raise CatalogError(f"{where}: {name} must be at most {MAX_TIMEOUT_SECONDS:g} seconds (the function's own "
                           f"timeout, {FUNCTION_TIMEOUT_SECONDS:g} s, less {SETTLE_ROOM_SECONDS:g} s to settle)")
    return seconds


def _context_length(entry: Mapping, where: str) -> int:
    value = _require(entry, "context_length", int, where)
    if not 1 <= value <= MAX_CONTEXT_LENGTH:
        raise CatalogError(f"{where}: context_length must be from 1 to {MAX_CONTEXT_LENGTH:,} tokens")
    return value


def _known_keys(entry: Mapping, known: frozenset[str], where: str) -> None:
    unknown = sorted(str(key) for key in entry if key not in known)
    if unknown:
        raise CatalogError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")


def _size(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CatalogError(f"{where}: {name} must be a positive whole number of bytes")
    return value


def _enabled(entry: Mapping, where: str, written: bool) -> bool:
    value = entry.get("enabled", True)
    if isinstance(value, bool):
        return value
    if written:
        raise CatalogError(f"{where}: enabled must be true or false")
    meant = spelled(value)  # "false", "off", "disabled" (bool() made each of them on)
    return meant if meant is not None else bool(value)  # anything else as it was always read


def _parse_backend(entry: Any, index: int, where: str, written: bool) -> Backend:
    where = f"{where} backends[{index}]"
    if not isinstance(entry, Mapping):
        raise CatalogError(f"{where} must be an object")
    if written:
        _known_keys(entry, _BACKEND_KEYS, where)
    api_key_env = entry.get("api_key_env")
    if api_key_env is not None and not (isinstance(api_key_env, str) and (not written or _ENV_NAME.fullmatch(api_key_env))):
        raise CatalogError(f"{where}: 'api_key_env' must be the name of an environment variable")
    return Backend(
        name=_text(entry, "name", where, written) or f"backend-{index}",
        url=_backend_url(_require(entry, "url", str, where).rstrip("/"), where, written),
        upstream_model=_text(entry, "model", where, written),
        api_key_env=api_key_env,
        enabled=_enabled(entry, where, written),
    )


def _backend_url(url: str, where: str, written: bool) -> str:
    """An http(s) URL the HTTP client can call: a host, a port if any in range. One written is
    also one it calls as written: no query or fragment (the endpoint's path is appended),
    nothing that needs escaping. One read has its path and query outside ASCII (or a space or
    a control character) percent-escaped, as a browser escapes them; its host is left as
    written (kiln.http1 calls no host outside ASCII)."""
    if not url.startswith(("http://", "https://")):
        raise CatalogError(f"{where}: url must start with http:// or https://")
    problem = None
    if written and _needs_escaping(url):
        problem = "has a space, a control character or a character outside ASCII"
    else:
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 - raises ValueError when out of range
            if not parts.hostname:
                problem = "has no host"
            elif written and (parts.query or parts.fragment or url.endswith(("?", "#"))):
                problem = "has a query or a fragment"
            elif written and ("@" in parts.netloc):
                problem = "has user info, which is never sent (the key goes in api_key_env)"
            elif written:
                parts.hostname.encode("idna")  # an empty or over-long label: no resolver takes it
            else:
                if "@" in parts.netloc:
                    # never sent, and shown wherever the URL is (kiln admin backends, the state
                    # endpoint): a password left in it is dropped, not carried about
                    parts = parts._replace(netloc=parts.netloc.rpartition("@")[2])
                    url = urlunsplit(parts)
                    log.warning(json.dumps({"event": "catalog_url_user_info_dropped", "where": where}))
                if _needs_escaping(parts.path + parts.query):
                    url = _escaped(parts)
        except (ValueError, UnicodeError) as exc:
            problem = str(exc) or type(exc).__name__
    if problem:
        raise CatalogError(f"{where}: {_named(url, problem)}")
    return url


def _named(url: str, problem: str) -> str:
    """A refused URL and what is wrong with it, named without what may be a password (up to
    its last "@", whatever it holds: one pasted with a "#" or a "/" in it is one too), which
    would otherwise reach the log with the error, in the URL or in the problem's own words."""
    scheme, separator, rest = url.partition("://")
    info, at, after = rest.rpartition("@")
    if not at:
        return f"url {url!r} {problem}"
    if any(part in problem for part in re.split(r"[:@/?#]", info) if part):
        problem = "is not a URL the HTTP client can call"
    return f"url {scheme + separator + after!r} (its user info left out) {problem}"


def _needs_escaping(text: str) -> bool:
    """A space, a control character (DEL included) or a character outside ASCII."""
    return any(ord(c) <= 0x20 or ord(c) >= 0x7F for c in text)


def _escaped(parts: Any) -> str:
    """A URL whose path or query is outside ASCII (or holds a space or a control character) as a
    browser sends it: those percent-escaped. Its host is left as written: one outside ASCII is
    not guessed at (IDNA's two standards map some names to different hosts), and the HTTP
    client fails it as a connection that cannot be made."""
    keep = "/%:@!$&'()*+,;=-._~"
    path = quote(parts.path, safe=keep)
    query = f"?{quote(parts.query, safe=keep + '?')}" if parts.query else ""
    return f"{parts.scheme}://{parts.netloc}{path}{query}"


def _text(entry: Mapping, key: str, where: str, written: bool) -> str | None:
    """An optional text field (null: not set); one read that is not text is read as its text,
    as it always was."""
    value = entry.get(key)
    if value is None or isinstance(value, str):
        if written and value is not None:
            _shown(value, key, where)
        return value
    if written:
        raise CatalogError(f"{where}: {key!r} must be a string")
    return str(value)


def _shown(value: str, key: str, where: str) -> None:
    """A name kiln admin writes: not empty, nothing in it that would pass for other text."""
    if not value.strip():
        raise CatalogError(f"{where}: {key!r} must not be empty")
    hidden = first_hidden(value)  # shown in kiln admin's tables and CSV, and /v1/models
    if hidden is not None:
        raise CatalogError(f"{where}: {key!r} must not hold control or invisible characters; it holds "
                           f"U+{ord(hidden):04X}")


def _require(entry: Mapping, key: str, kind: type, where: str) -> Any:
    value = entry.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise CatalogError(f"{where}: {key!r} is required ({kind.__name__})")
    return value


def _price(pricing: Mapping, key: str, where: str, written: bool) -> Decimal:
    raw = pricing.get(key)
    if written and isinstance(raw, str) and not _PRICE_TEXT.fullmatch(raw):
        # Decimal() takes "1_000", " 5 ", "-0" and digits of any script: a price is written
        # as kiln admin's amounts are, in ASCII digits, unsigned
        raise CatalogError(f"{where}: pricing.{key} must be written in ASCII digits, with no sign, "
                           f"separator or blank (USD per 1M tokens), e.g. \"0.035\"")
    try:
        # Prices are written as strings ("0.035") so that no float ever touches them.
        value = Decimal(str(raw)) if isinstance(raw, (str, int)) and not isinstance(raw, bool) else None
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite() or value < 0:
        raise CatalogError(f"{where}: pricing.{key} must be a non-negative decimal string (USD per 1M tokens)")
    if value > MAX_PRICE or 0 < value < MIN_PRICE:
        raise CatalogError(f"{where}: pricing.{key} must be 0 or from {MIN_PRICE} to {MAX_PRICE} (USD per 1M tokens)")
    if value.is_zero():
        value = Decimal(0)  # -0 is free, as 0 is
    if decimal_places(value) > PRICE_DECIMALS:
        if written:
            raise CatalogError(f"{where}: pricing.{key} must have at most {PRICE_DECIMALS} decimal places (USD per 1M "
                               f"tokens): the costs made from it must stay exact in the ledger")
        # a catalog stored by other means: its costs would need more digits than an org's credits
        # less them can hold (the debit rounded, or refused, and the ledger no longer adds up)
        rounded = value.quantize(_PRICE_STEP, rounding=ROUND_HALF_EVEN)
        log.warning(json.dumps({"event": "catalog_price_rounded", "where": where, "field": f"pricing.{key}",
                                "to": str(rounded)}))
        value = rounded
    return value
