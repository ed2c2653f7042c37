"""Typed settings, read once from the environment; a bad value fails loudly at start-up."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Mapping

__all__ = ["Settings", "SettingsError"]


class SettingsError(ValueError):
    """An environment variable holds a value the gateway cannot use."""


def _text(env: Mapping[str, str], name: str, default: str) -> str:
    value = env.get(name, default).strip()
    if not value:
        raise SettingsError(f"{name} must not be empty")
    return value


def _optional_text(env: Mapping[str, str], name: str) -> str | None:
    value = env.get(name, "").strip()
    return value or None


def _number(env: Mapping[str, str], name: str, default: float, *, minimum: float = 0.0) -> float:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name} must be a number, got {raw!r}") from None
    if not value >= minimum:
        raise SettingsError(f"{name} must be >= {minimum}, got {raw!r}")
    return value


def _integer(env: Mapping[str, str], name: str, default: int, *, minimum: int = 0) -> int:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise SettingsError(f"{name} must be >= {minimum}, got {raw!r}")
    return value


def _rate(env: Mapping[str, str], name: str, default: float) -> float:
    value = _number(env, name, default, minimum=0.0)
    if not 0.0 < value <= 1.0:
        raise SettingsError(f"{name} must be a share above 0 and at most 1, got {env.get(name)!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """Everything the gateway reads from its environment.

    Names mirror the environment variables (``KILN_`` + upper case) so that
    `template.yaml`, the local stack and the docs all speak of the same thing.
    """

    keys_table: str = "kiln-keys"
    orgs_table: str = "kiln-orgs"
    usage_table: str = "kiln-usage"
    maintenance_parameter: str = "/kiln/maintenance"
    catalog_parameter: str = "/kiln/catalog"
    # A catalog file replaces the SSM catalog parameter (tests, the local stack).
    catalog_file: str | None = None
    region: str = "us-east-1"
    # Points DynamoDB and SSM at an emulator; None means real AWS.
    aws_endpoint_url: str | None = None

    maintenance_cache_seconds: float = 5.0
    catalog_cache_seconds: float = 60.0
    auth_cache_seconds: float = 10.0
    # The model servers' bearer token: the name of an SSM SecureString (kiln.upstream_key),
    # never the key itself; unset, KILN_UPSTREAM_API_KEY is read from the environment.
    upstream_api_key_parameter: str | None = None
    upstream_api_key_cache_seconds: float = 300.0
    # a new environment retries its first read of a parameter this long before giving up (503)
    parameter_first_read_seconds: float = 3.0
    # A request's lease lives this long unless renewed; a running request renews it every
    # lease_renew_seconds, so a dead gateway's slots are free again within the TTL.
    lease_ttl_seconds: float = 60.0
    lease_renew_seconds: float = 20.0
    keepalive_seconds: float = 5.0
    max_body_bytes: int = 6 * 1024 * 1024
    maintenance_retry_after_seconds: int = 60
    # the ledger's writes retry conflicts, throttling, 5xx and lost answers within this budget
    storage_retry_attempts: int = 20
    storage_retry_seconds: float = 5.0
    default_concurrency: int = 8
    # usage events expire (DynamoDB TTL) this many days after the request; 0 keeps them
    usage_retention_days: int = 0
    # Backend health (kiln.health; README and docs/operations.md say why these values).
    # transport failures in a row (refused, reset, TLS, no headers in time) that eject a backend…
    backend_failure_threshold: int = 3
    # …for this long (doubled at each ejection in a row, up to the max), then one request probes it
    backend_cooldown_seconds: float = 10.0
    backend_max_cooldown_seconds: float = 120.0
    # 5xx answers eject only by rate: over this window, at least this many distinct requests
    # answered, at least this share of them failed, from at least this many clients (orgs)
    backend_error_window_seconds: float = 60.0
    backend_error_min_requests: int = 20
    backend_error_rate: float = 0.5
    backend_error_min_clients: int = 2

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Settings":
        env = os.environ if env is None else env
        defaults = cls()
        region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or defaults.region
        lease_ttl = _number(env, "KILN_LEASE_TTL_SECONDS", defaults.lease_ttl_seconds, minimum=0.001)
        lease_renew = _number(env, "KILN_LEASE_RENEW_SECONDS", defaults.lease_renew_seconds, minimum=0.001)
        if not lease_renew < lease_ttl:
            raise SettingsError(
                f"KILN_LEASE_RENEW_SECONDS ({lease_renew:g}) must be less than KILN_LEASE_TTL_SECONDS ({lease_ttl:g})"
            )
        return cls(
            keys_table=_text(env, "KILN_KEYS_TABLE", defaults.keys_table),
            orgs_table=_text(env, "KILN_ORGS_TABLE", defaults.orgs_table),
            usage_table=_text(env, "KILN_USAGE_TABLE", defaults.usage_table),
            maintenance_parameter=_text(env, "KILN_MAINTENANCE_PARAMETER", defaults.maintenance_parameter),
            catalog_parameter=_text(env, "KILN_CATALOG_PARAMETER", defaults.catalog_parameter),
            catalog_file=_optional_text(env, "KILN_CATALOG_FILE"),
            region=region,
            aws_endpoint_url=_optional_text(env, "KILN_AWS_ENDPOINT_URL") or _optional_text(env, "AWS_ENDPOINT_URL"),
            maintenance_cache_seconds=_number(env, "KILN_MAINTENANCE_CACHE_SECONDS", defaults.maintenance_cache_seconds),
            catalog_cache_seconds=_number(env, "KILN_CATALOG_CACHE_SECONDS", defaults.catalog_cache_seconds),
            auth_cache_seconds=_number(env, "KILN_AUTH_CACHE_SECONDS", defaults.auth_cache_seconds),
            upstream_api_key_parameter=_optional_text(env, "KILN_UPSTREAM_API_KEY_PARAMETER"),
            upstream_api_key_cache_seconds=_number(
                env, "KILN_UPSTREAM_API_KEY_CACHE_SECONDS", defaults.upstream_api_key_cache_seconds
            ),
            parameter_first_read_seconds=_number(
                env, "KILN_PARAMETER_FIRST_READ_SECONDS", defaults.parameter_first_read_seconds
            ),
            lease_ttl_seconds=lease_ttl,
            lease_renew_seconds=lease_renew,
            keepalive_seconds=_number(env, "KILN_KEEPALIVE_SECONDS", defaults.keepalive_seconds, minimum=0.001),
            max_body_bytes=_integer(env, "KILN_MAX_BODY_BYTES", defaults.max_body_bytes, minimum=1),
            maintenance_retry_after_seconds=_integer(
                env, "KILN_MAINTENANCE_RETRY_AFTER_SECONDS", defaults.maintenance_retry_after_seconds
            ),
            storage_retry_attempts=_integer(env, "KILN_STORAGE_RETRY_ATTEMPTS", defaults.storage_retry_attempts, minimum=1),
            storage_retry_seconds=_number(env, "KILN_STORAGE_RETRY_SECONDS", defaults.storage_retry_seconds),
            default_concurrency=_integer(env, "KILN_DEFAULT_CONCURRENCY", defaults.default_concurrency, minimum=1),
            usage_retention_days=_integer(env, "KILN_USAGE_RETENTION_DAYS", defaults.usage_retention_days),
            backend_failure_threshold=_integer(
                env, "KILN_BACKEND_FAILURE_THRESHOLD", defaults.backend_failure_threshold, minimum=1
            ),
            backend_cooldown_seconds=_number(env, "KILN_BACKEND_COOLDOWN_SECONDS", defaults.backend_cooldown_seconds),
            backend_max_cooldown_seconds=_number(
                env, "KILN_BACKEND_MAX_COOLDOWN_SECONDS", defaults.backend_max_cooldown_seconds
            ),
            backend_error_window_seconds=_number(
                env, "KILN_BACKEND_ERROR_WINDOW_SECONDS", defaults.backend_error_window_seconds, minimum=0.001
            ),
            backend_error_min_requests=_integer(
                env, "KILN_BACKEND_ERROR_MIN_REQUESTS", defaults.backend_error_min_requests, minimum=1
            ),
            backend_error_rate=_rate(env, "KILN_BACKEND_ERROR_RATE", defaults.backend_error_rate),
            backend_error_min_clients=_integer(
                env, "KILN_BACKEND_ERROR_MIN_CLIENTS", defaults.backend_error_min_clients, minimum=1
            ),
        )

    def to_env(self) -> dict[str, str]:
        """The environment that reproduces these settings (for child processes and exports)."""
        env: dict[str, str] = {}
        for field in fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            name = "AWS_REGION" if field.name == "region" else f"KILN_{field.name.upper()}"
            env[name] = str(value)
        return env
