"""The gateway's long-lived services, made once per process and shared by every request.

Everything that talks to the outside world (DynamoDB tables, SSM, the model servers) is
built here from the settings or handed in, so that tests and the local stack can point
them elsewhere without patching.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, TypeVar

from .auth import Authenticator
from .catalog import Catalog
from .errors import GatewayError, StorageUnavailable
from .health import BackendHealth
from .jsonio import dumps
from .maintenance import MaintenanceFlag, parse_flag
from .parameters import CachedParameter, ParameterUnavailable
from .settings import Settings
from .store import Lease, Ledger, StorageError, Tables, UsageEvent, bind
from .store.errors import translate_storage_error
from .upstream import UpstreamClient

__all__ = ["UNSETTLED", "Gateway"]

UNSETTLED = "usage_unsettled"

T = TypeVar("T")
log = logging.getLogger("kiln.gateway")
unsettled_log = logging.getLogger("kiln.unsettled")


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        tables: Tables | None = None,
        ssm_client: Any = None,
        upstream: UpstreamClient | None = None,
        catalog: Catalog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.tables = tables or bind(settings)
        # botocore is blocking: storage and SSM calls run here, never on the event loop.
        self._executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="kiln-io")
        self._ssm_client = ssm_client
        self._parameters: Any = None
        self.upstream = upstream or UpstreamClient(
            health=BackendHealth(threshold=settings.backend_failure_threshold, cooldown=settings.backend_cooldown_seconds)
        )
        self.ledger = Ledger(
            self.tables,
            lease_ttl=settings.lease_ttl_seconds,
            settle_attempts=settings.settle_attempts,
            retention_days=settings.usage_retention_days,
            clock=clock,
        )
        self.auth = Authenticator(self.tables, cache_seconds=settings.auth_cache_seconds, run_blocking=self.storage)
        self._maintenance = CachedParameter(
            settings.maintenance_parameter,
            partial(self._read_parameter, settings.maintenance_parameter, settings.maintenance_cache_seconds),
            parse_flag,
            max_age=settings.maintenance_cache_seconds,
        )
        if catalog is not None:
            fetch_catalog: Callable[[], str | None] = lambda: None  # noqa: E731 - fixed catalog
            parse_catalog: Callable[[str | None], Catalog] = lambda _raw: catalog  # noqa: E731
        elif settings.catalog_file:
            fetch_catalog = partial(_read_file, settings.catalog_file)
            parse_catalog = _parse_catalog
        else:
            fetch_catalog = partial(self._read_parameter, settings.catalog_parameter, settings.catalog_cache_seconds)
            parse_catalog = _parse_catalog
        self._catalog = CachedParameter(
            settings.catalog_file or settings.catalog_parameter,
            fetch_catalog,
            parse_catalog,
            max_age=settings.catalog_cache_seconds,
        )

    @classmethod
    def from_env(cls) -> "Gateway":
        return cls(Settings.from_env())

    # -- blocking work, off the loop -------------------------------------------------------

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    async def storage(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A storage call off the loop; any storage failure becomes a clear 503."""
        try:
            return await self.run_blocking(fn, *args, **kwargs)
        except GatewayError:
            raise
        except StorageError as exc:
            raise exc.as_gateway_error() from exc
        except Exception as exc:
            mapped = translate_storage_error(exc)
            if isinstance(mapped, StorageError):
                log.error(json.dumps({"event": "storage_error", "detail": str(mapped)}))
                raise mapped.as_gateway_error() from exc
            raise

    # -- parameters ------------------------------------------------------------------------

    @property
    def ssm(self) -> Any:
        if self._ssm_client is None:
            import boto3

            # made from the tables' botocore session: no second session to load
            session = boto3.session.Session(botocore_session=self.tables.session)
            self._ssm_client = session.client(
                "ssm", region_name=self.settings.region, endpoint_url=self.settings.aws_endpoint_url
            )
        return self._ssm_client

    def _read_parameter(self, name: str, max_age: float) -> str | None:
        """One SSM parameter through Powertools Parameters (its cache agrees with ours); None if absent."""
        from aws_lambda_powertools.utilities.parameters import GetParameterError, SSMProvider

        if self._parameters is None:
            self._parameters = SSMProvider(boto3_client=self.ssm)
        try:
            return self._parameters.get(name, max_age=int(max_age))
        except GetParameterError as exc:
            if "ParameterNotFound" in str(exc):
                return None
            raise

    async def maintenance(self) -> MaintenanceFlag:
        try:
            return await self._maintenance.get(self.run_blocking)
        except ParameterUnavailable as exc:
            # Never answer 503 because the switch itself could not be read.
            log.error(json.dumps({"event": "maintenance_unreadable", "detail": str(exc)}))
            return MaintenanceFlag()

    async def check_maintenance(self) -> None:
        flag = await self.maintenance()
        if flag.enabled:
            raise flag.error(self.settings.maintenance_retry_after_seconds)

    async def catalog(self) -> Catalog:
        try:
            return await self._catalog.get(self.run_blocking)
        except ParameterUnavailable as exc:
            log.error(json.dumps({"event": "catalog_unreadable", "detail": str(exc)}))
            raise StorageUnavailable("The model catalog is unavailable; retry with exponential backoff.") from exc

    # -- settlement ------------------------------------------------------------------------

    async def settle(self, lease: Lease, event: UsageEvent) -> str:
        """Settle; if storage keeps failing, the full event goes to the log, never lost.

        The log record (`"event": "usage_unsettled"`, the whole usage event under `usage`) is
        what `kiln admin replay-usage` reads back to settle it later.
        """
        try:
            return await self.run_blocking(self.ledger.settle, lease, event)
        except Exception as exc:  # noqa: BLE001 - whatever happened, keep the event
            record = {"event": UNSETTLED, "reason": f"{type(exc).__name__}: {exc}", "usage": event.as_dict()}
            unsettled_log.error(dumps(record).decode())
            return "unsettled"

    async def aclose(self) -> None:
        await self.upstream.aclose()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _read_file(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _parse_catalog(raw: str | None) -> Catalog:
    if raw is None:
        raise ValueError("the catalog parameter does not exist")
    return Catalog.from_json(raw)
