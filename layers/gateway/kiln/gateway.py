"""The gateway's long-lived services, made once per process and shared by every request.

Everything that talks to the outside world (DynamoDB, SSM, the model servers) is built
here from the settings or handed in, so that tests and the local stack can point them
elsewhere without patching. All of it runs on the event loop: the storage client is
asynchronous (`kiln.aws`), so no request waits for a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

from .auth import Authenticator
from .aws import AwsClient, AwsError, tried_once
from .catalog import Catalog
from .errors import GatewayError, InvalidApiKey, StorageUnavailable
from .health import BackendHealth, HealthPolicy
from .http1 import HttpClient
from .jsonio import decimal_text, dumps
from .maintenance import MaintenanceFlag, parse_flag
from .parameters import CachedParameter, ParameterUnavailable
from .settings import Settings
from .store import Lease, StorageError, UsageEvent, ledger_of
from .store.errors import RecordNotFound, is_transient, translate_storage_error
from .store.storage import DynamoStorage
from .tls import client_context
from .upstream import UpstreamClient
from .upstream_key import UpstreamKey, parse_key

__all__ = ["UNSETTLED", "Gateway"]

UNSETTLED = "usage_unsettled"
CLOSE_MARGIN_SECONDS = 5.0  # what closing waits for settles beyond one settle's retry budget

T = TypeVar("T")
log = logging.getLogger("kiln.gateway")
unsettled_log = logging.getLogger("kiln.unsettled")


class Gateway:
    def __init__(
        self,
        settings: Settings,
        *,
        aws: AwsClient | None = None,
        upstream: UpstreamClient | None = None,
        catalog: Catalog | None = None,
        clock: Callable[[], float] = time.time,
        admits: bool = True,
    ) -> None:
        """`admits`: whether the function serving through it admits requests (a model
        endpoint's). One that does not, whose role may not write an org's leases, leaves a
        disabled org's dead leases for a function that does to reclaim."""
        self.settings = settings
        self.clock = clock
        # one HTTP/1.1 client (one set of pools, one TLS context) for AWS and the model servers
        self.http = HttpClient(ssl_context=client_context)
        self.aws = aws or AwsClient(region=settings.region, endpoint_url=settings.aws_endpoint_url, http=self.http)
        self.upstream = upstream or UpstreamClient(
            http=self.http,
            health=BackendHealth(HealthPolicy(
                failure_threshold=settings.backend_failure_threshold,
                cooldown=settings.backend_cooldown_seconds,
                max_cooldown=settings.backend_max_cooldown_seconds,
                error_window=settings.backend_error_window_seconds,
                error_min_requests=settings.backend_error_min_requests,
                error_rate=settings.backend_error_rate,
                error_min_clients=settings.backend_error_min_clients,
            )),
        )
        self.ledger = ledger_of(self.aws, settings, clock=clock)
        self.unsettled = 0  # requests admitted and not settled yet (kiln.exchange), which aclose waits for
        self._ssm_once = tried_once(self.aws)
        # the one storage interface of the request path (keys, orgs through the ledger, usage)
        self.store = DynamoStorage(
            self.aws,
            keys_table=settings.keys_table,
            orgs_table=settings.orgs_table,
            usage_table=settings.usage_table,
            ledger=self.ledger,
            reclaims=admits,
        )
        self.auth = Authenticator(self.store, cache_seconds=settings.auth_cache_seconds)
        # The switch fails open (an unreadable one counts as off), so it is read as before any
        # change to how parameters are read: each read tried by the AWS client itself, and read
        # again by the next request after a failed one (no back-off that would keep it off).
        # A first read is bounded by its budget, the switch's too: an SSM that takes the
        # connection and never answers holds a new environment's request no longer (a refresh
        # is waited for briefly, kiln.parameters).
        read_timeout = settings.parameter_first_read_seconds or None
        self._maintenance = CachedParameter(
            settings.maintenance_parameter,
            lambda: self._read_parameter(settings.maintenance_parameter, once=False),
            parse_flag,
            max_age=settings.maintenance_cache_seconds,
            read_timeout=read_timeout,
            back_off_first_reads=False,
            unreadable_event="maintenance_unreadable",
        )
        if catalog is not None:
            fetch_catalog: Callable[[], Awaitable[str | None]] = _constant(None)
            parse_catalog: Callable[[str | None], Catalog] = lambda _raw: catalog  # noqa: E731 - a fixed catalog
        elif settings.catalog_file:
            fetch_catalog = lambda: asyncio.to_thread(_read_file, settings.catalog_file)  # noqa: E731
            parse_catalog = _parse_catalog
        else:
            fetch_catalog = lambda: self._read_parameter(settings.catalog_parameter)  # noqa: E731
            parse_catalog = _parse_catalog
        self._catalog = CachedParameter(
            settings.catalog_file or settings.catalog_parameter,
            fetch_catalog,
            parse_catalog,
            max_age=settings.catalog_cache_seconds,
            first_read_budget=settings.parameter_first_read_seconds,
            read_timeout=read_timeout,
            unreadable_event="catalog_unreadable",
        )
        # the model servers' key, from a SecureString when one is named (kiln.upstream_key)
        key_parameter = settings.upstream_api_key_parameter
        self._upstream_key = None if key_parameter is None else UpstreamKey(CachedParameter(
            key_parameter,
            lambda: self._read_parameter(key_parameter, decrypt=True),
            parse_key,
            max_age=settings.upstream_api_key_cache_seconds,
            first_read_budget=settings.parameter_first_read_seconds,
            read_timeout=read_timeout,
            unreadable_event="upstream_key_unreadable",
        ))

    @classmethod
    def from_env(cls, *, admits: bool = True) -> "Gateway":
        return cls(Settings.from_env(), admits=admits)

    # -- storage ---------------------------------------------------------------------------

    async def storage(self, call: Awaitable[T]) -> T:
        """Await a storage call; any storage failure becomes a clear 503. The caller's org found
        gone (its item deleted while its key is in the auth cache) is no failure: the key is no
        key of any org, 401 as at authentication."""
        try:
            return await call
        except GatewayError:
            raise
        except RecordNotFound as exc:
            if exc.kind == "org":
                raise InvalidApiKey() from None
            raise
        except Exception as exc:
            mapped = translate_storage_error(exc)
            if isinstance(mapped, StorageError):
                log.error(json.dumps({"event": "storage_error", "detail": str(mapped)}))
                raise mapped.as_gateway_error() from exc
            raise

    # -- parameters ------------------------------------------------------------------------

    async def _read_parameter(self, name: str, *, decrypt: bool = False, once: bool = True) -> str | None:
        """One SSM parameter's value (a SecureString's decrypted); None if it does not exist.
        `once`: tried once (the cache backs off itself, kiln.parameters, and SSM's quota is
        shared), else as the AWS client tries every call."""
        try:
            payload = {"Name": name, "WithDecryption": True} if decrypt else {"Name": name}
            answer = await (self._ssm_once if once else self.aws).ssm("GetParameter", payload)
        except AwsError as exc:
            if exc.code == "ParameterNotFound":
                return None
            raise
        return answer["Parameter"]["Value"]

    def warm(self, authorization: str | None, *, catalog: bool = True) -> bool:
        """The maintenance flag, the key behind `authorization` and (with `catalog`) the catalog
        are all in memory: a request's checks need no I/O."""
        if not self._maintenance.fresh or not self.auth.answers_at_once(authorization):
            return False
        if not catalog:
            return True
        return self._catalog.fresh and (self._upstream_key is None or self._upstream_key.fresh)

    async def maintenance(self) -> MaintenanceFlag:
        try:
            return await self._maintenance.get()
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
            catalog = await self._catalog.get()
        except ParameterUnavailable as exc:
            log.error(json.dumps({"event": "catalog_unreadable", "detail": str(exc)}))
            raise StorageUnavailable("The model catalog is unavailable; retry with exponential backoff.") from exc
        if self._upstream_key is None:
            return catalog
        try:
            return await self._upstream_key.bind(catalog)
        except ParameterUnavailable as exc:
            # never call a model server without its key: it would answer 401 for our mistake
            log.error(json.dumps({"event": "upstream_key_unreadable", "detail": str(exc)}))
            raise StorageUnavailable("The model servers' credentials are unavailable; retry with exponential backoff.") from exc

    # -- settlement ------------------------------------------------------------------------

    async def settle(self, lease: Lease, event: UsageEvent) -> str:
        """Settle; if storage keeps failing, the full event goes to the log, never lost, and a
        settle refused only by conflicts, throttling or an outage goes on in the background.

        The log record (`"event": "usage_unsettled"`, the whole usage event under `usage`, and
        the key's spend figure its lease named under `spend_figure`) is what `kiln admin
        replay-usage` reads back to settle it later. Its cost is written as a string of the
        exact decimal: a log formatter that parses the message as JSON (Powertools does) would
        turn a number into a float and lose digits.

        `aclose` waits for the requests admitted to settle; one cancelled all the same (a loop
        torn down with it) leaves its record too.
        """
        try:
            return await self.ledger.settle(lease, event)
        except asyncio.CancelledError:
            self._keep_unsettled(lease, event, "cancelled before its settle ended")
            raise
        except Exception as exc:  # noqa: BLE001 - whatever happened, keep the event
            self._keep_unsettled(lease, event, f"{type(exc).__name__}: {exc}")
            if is_transient(exc):  # refusals that say nothing of it: it goes on in the background
                self.ledger.settle_later(lease, event)
            return "unsettled"

    @staticmethod
    def _keep_unsettled(lease: Lease, event: UsageEvent, reason: str) -> None:
        usage = {**event.as_dict(), "cost": decimal_text(event.cost)}
        record = {"event": UNSETTLED, "reason": reason, "usage": usage, "spend_figure": lease.spend_figure}
        unsettled_log.error(dumps(record).decode())

    async def aclose(self) -> None:
        """Close, once the requests admitted have settled (a server that stops cancels its
        requests and closes the app at once: each then settles in a task of its own,
        kiln.shielded), or a settle's retry budget and more has passed."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.settings.storage_retry_seconds + CLOSE_MARGIN_SECONDS
        while self.unsettled and loop.time() < give_up:
            await asyncio.sleep(0.01)
        await self.ledger.drain()
        await self.upstream.aclose()
        await self.aws.aclose()
        await self.http.aclose()


def _constant(value: Any) -> Callable[[], Awaitable[Any]]:
    async def fetch() -> Any:
        return value

    return fetch


def _read_file(path: str) -> str:
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def _parse_catalog(raw: str | None) -> Catalog:
    if raw is None:
        raise ValueError("the catalog parameter does not exist")
    return Catalog.from_json(raw)
