"""Typed settings, read once from the environment; a bad value fails loudly at start-up.

Each setting is declared once, below: its default, what it means, and how it is checked.
Its environment variable is ``KILN_`` + its name in upper case unless the declaration names
another. `Settings.from_env` reads every declaration the same way, `to_env` writes them
back, and `markdown_table()` renders them as the README's configuration table (a test holds
the README to it).
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Mapping

__all__ = ["Settings", "SettingsError", "markdown_table"]


class SettingsError(ValueError):
    """An environment variable holds a value the gateway cannot use."""


def setting(
    default: Any,
    doc: str,
    *,
    env: str | None = None,
    also: tuple[str, ...] = (),
    minimum: float | None = None,
    maximum: float | None = None,
    share: bool = False,
    shown: str | None = None,
) -> Any:
    """One setting: `env` overrides the variable's name, `also` names fallbacks read in order,
    `minimum` and `maximum` bound a number, `share` asks for 0 < value <= 1, `shown` is the README's default."""
    metadata = {"doc": doc, "env": env, "also": also, "minimum": minimum, "maximum": maximum, "share": share,
                "shown": shown}
    return field(default=default, metadata=metadata)


# The most requests an org may have in flight. Each holds a lease of about 250 bytes on the org's
# item, whose DynamoDB limit is 400 KB; after a crash the expired leases stay until reclaimed
# while new ones are taken, so the item must hold twice the limit: 1 000 leases, about 250 KB.
# (The functions' reserved concurrency, 440 in all by default, is lower still.)
MAX_ORG_CONCURRENCY = 500


@dataclass(frozen=True)
class Settings:
    """Everything the gateway reads from its environment."""

    keys_table: str = setting("kiln-keys", "DynamoDB table of the API keys (hashed)")
    orgs_table: str = setting("kiln-orgs", "DynamoDB table of the orgs: credits, limits, leases")
    usage_table: str = setting("kiln-usage", "DynamoDB table of the usage events (and of the keys' spend tallies)")
    maintenance_parameter: str = setting("/kiln/maintenance", "SSM parameter of the maintenance flag")
    catalog_parameter: str = setting("/kiln/catalog", "SSM parameter of the model catalog")
    catalog_file: str | None = setting(None, "a catalog file instead of the SSM parameter (tests, the local stack)")
    region: str = setting("us-east-1", "the AWS region", env="AWS_REGION", also=("AWS_DEFAULT_REGION",))
    aws_endpoint_url: str | None = setting(
        None, "DynamoDB and SSM at an emulator instead of AWS", also=("AWS_ENDPOINT_URL",)
    )
    maintenance_cache_seconds: float = setting(
        5.0,
        "how long the maintenance flag is cached (the template deploys 60: SSM's 40 TPS, "
        "[docs/deploy.md](docs/deploy.md#ssm-reads))",
    )
    catalog_cache_seconds: float = setting(60.0, "how long the catalog is cached (deployed: 300)")
    upstream_api_key_parameter: str | None = setting(
        None,
        "SSM SecureString holding the bearer token for backends whose catalog entry says "
        '`"api_key_env": "KILN_UPSTREAM_API_KEY"`; unset, that variable itself is read',
    )
    upstream_api_key_cache_seconds: float = setting(
        300.0, "how long that key is cached (a rotation reaches every environment within it)"
    )
    parameter_first_read_seconds: float = setting(
        3.0,
        "how long a new environment retries its first read of the catalog and the key (with back-off) "
        "before answering 503; its first read of the maintenance switch is cut at it too (read as off)",
    )
    auth_cache_seconds: float = setting(10.0, "how long a key lookup is cached (a revoked key works at most this long)")
    lease_ttl_seconds: float = setting(
        60.0,
        "a request's lease expires this long after its admission or last renewal: a dead gateway's "
        "slots are free again within it (at most 90: the contract's bound)",
        minimum=0.001,
        maximum=90,
    )
    lease_renew_seconds: float = setting(
        20.0,
        "a running request renews its lease this often (at most half the TTL); a request shorter "
        "than this costs no renewal",
        minimum=0.001,
    )
    keepalive_seconds: float = setting(5.0, "`: keepalive` interval while the upstream is silent", minimum=0.001)
    max_body_bytes: int = setting(6 * 1024 * 1024, "request body limit (413 above; so is a request whose Lambda "
                                  "event, its body JSON-escaped and its headers, would be over 6 MiB)", minimum=1)
    maintenance_retry_after_seconds: int = setting(60, "`Retry-After` when maintenance has no `until`")
    storage_retry_attempts: int = setting(
        50,
        "attempts of each ledger write (admission, renewal, settle, reclaim) refused by a transaction "
        "conflict, throttling, a 5xx or a lost answer, with jittered exponential backoff (10 ms doubling, "
        "capped at 250 ms)…",
        minimum=1,
    )
    storage_retry_seconds: float = setting(
        10.0,
        "…and the time they may take in all; then 503 `storage_unavailable` (admission) or the event "
        "logged for replay (settle)",
    )
    answer_deadline_seconds: float = setting(
        25.0,
        "the longest a request that calls no model (models, generations, self-service, keys) takes "
        "before it answers 503 `storage_unavailable`, under the 29 s of API Gateway and of its function "
        "(less where Lambda has less left of the invocation, 3 s kept for the answer)",
        minimum=0.001,
    )
    default_concurrency: int = setting(8, "limit given to new orgs (at most 500: what an org's item holds leases for)",
                                       minimum=1, maximum=MAX_ORG_CONCURRENCY)
    usage_retention_days: int = setting(
        0, "usage events expire (DynamoDB TTL) after this many days; 0 keeps them (at most 36 500)",
        minimum=0, maximum=36_500,
    )
    # Backend health (kiln.health; docs/operations.md says why these values).
    backend_failure_threshold: int = setting(
        3,
        "failures of the backend itself in a row (refused, reset before answering, TLS, a stream's "
        "headers not in time) that take it out of service: three rule out one unlucky connection…",
        minimum=1,
    )
    backend_cooldown_seconds: float = setting(
        10.0, "…for this long, doubled at each ejection in a row; then one request at a time probes it…"
    )
    backend_max_cooldown_seconds: float = setting(
        120.0, "…up to this (a backend down for good is probed every 2 minutes, at the cost of one failover)"
    )
    backend_error_window_seconds: float = setting(
        60.0, "5xx answers never eject alone: over this window…", minimum=0.001
    )
    backend_error_min_requests: int = setting(
        20,
        "…at least this many distinct requests answered (a retry of the same body by the same org "
        "counts once: an SDK call's 3 attempts are one)…",
        minimum=1,
    )
    backend_error_rate: float = setting(0.5, "…at least this share of them failed…", share=True)
    backend_error_min_clients: int = setting(
        2,
        "…from at least this many orgs, the rate holding whichever one org is left out: one org's bad "
        "requests never take a backend away from the others. A model's last backend in service is never ejected "
        "([docs/operations.md](docs/operations.md#backend-health))",
        minimum=1,
    )
    # Telemetry: Powertools' own variables, read here like every other setting.
    metrics_disabled: bool = setting(
        False, "no EMF metrics on stdout", env="POWERTOOLS_METRICS_DISABLED", shown="unset (`true` under `kiln dev`)"
    )
    metrics_namespace: str = setting("Kiln", "CloudWatch namespace of the metrics", env="POWERTOOLS_METRICS_NAMESPACE")
    service_name: str = setting("kiln", "the `service` of log lines and metrics", env="POWERTOOLS_SERVICE_NAME")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        settings = cls(**{declared.name: _read(env, declared) for declared in fields(cls)})
        if not settings.lease_renew_seconds <= settings.lease_ttl_seconds / 2:
            # a renewal that fails is tried again before the lease expires (kiln.store.renewal)
            raise SettingsError(
                f"KILN_LEASE_RENEW_SECONDS ({settings.lease_renew_seconds:g}) must be at most half of "
                f"KILN_LEASE_TTL_SECONDS ({settings.lease_ttl_seconds:g}): a renewal that fails needs room to "
                "be tried again before the lease expires"
            )
        return settings

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces these settings (for child processes and exports)."""
        env: dict[str, str] = {}
        for declared in fields(self):
            value = getattr(self, declared.name)
            if value is None:
                continue
            env[variable(declared)] = ("true" if value else "false") if isinstance(value, bool) else str(value)
        return env


def variable(declared: Field) -> str:
    """The environment variable of a setting."""
    return declared.metadata["env"] or f"KILN_{declared.name.upper()}"


def _read(env: Mapping[str, str], declared: Field) -> Any:
    name = variable(declared)
    raw = next((env[key] for key in (name, *declared.metadata["also"]) if (env.get(key) or "").strip()), None)
    default = declared.default if declared.default is not MISSING else None
    kind = str(declared.type)
    if raw is None:
        if kind == "str" and name in env:
            raise SettingsError(f"{name} must not be empty")
        return default
    raw = raw.strip()
    if kind in ("str", "str | None"):
        return raw
    if kind == "bool":
        if raw.lower() in ("1", "true", "yes"):
            return True
        if raw.lower() in ("0", "false", "no"):
            return False
        raise SettingsError(f"{name} must be true or false, got {raw!r}")
    try:
        value: float = int(raw) if kind == "int" else float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be {'an integer' if kind == 'int' else 'a number'}, got {raw!r}") from None
    minimum = declared.metadata["minimum"]
    if not math.isfinite(value) or not value >= (minimum if minimum is not None else 0):
        raise SettingsError(f"{name} must be >= {minimum if minimum is not None else 0}, got {raw!r}")
    maximum = declared.metadata["maximum"]
    if maximum is not None and value > maximum:
        raise SettingsError(f"{name} must be <= {maximum}, got {raw!r}")
    if declared.metadata["share"] and not 0.0 < value <= 1.0:
        raise SettingsError(f"{name} must be a share above 0 and at most 1, got {raw!r}")
    return value


def markdown_table() -> str:
    """The README's configuration table: one row per variable, from the declarations."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for declared in fields(Settings):
        names = " / ".join(f"`{name}`" for name in (variable(declared), *declared.metadata["also"]))
        rows.append(f"| {names} | {_shown(declared)} | {declared.metadata['doc']} |")
    return "\n".join(rows)


def _shown(declared: Field) -> str:
    if declared.metadata["shown"]:
        return declared.metadata["shown"]
    default = declared.default
    if default is None:
        return "unset"
    if isinstance(default, str):
        return f"`{default}`"
    return f"{default:g}" if isinstance(default, float) else str(default)
