"""Fault injection for the reliability suite; its sizes come from the environment."""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest
from botocore.exceptions import ClientError

# Kept bounded so the whole CI stays well under 15 minutes; raise them for a longer soak.
STORM_ROUNDS = int(os.environ.get("KILN_TEST_STORM_ROUNDS", "50"))
STORM_CONCURRENCY = int(os.environ.get("KILN_TEST_STORM_CONCURRENCY", "32"))
LEDGER_REQUESTS = int(os.environ.get("KILN_TEST_LEDGER_REQUESTS", "1000"))


class StorageFaults:
    """Makes chosen DynamoDB calls of the gateway fail, as a throttled or broken DynamoDB would."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._handlers: list[tuple[str, Callable]] = []

    def fail(self, operation: str, *, code: str = "ProvisionedThroughputExceededException",
             when: Callable[[dict], bool] = lambda params: True, times: int | None = None) -> list[int]:
        """Fail `operation` calls whose parameters match `when` (`times` of them, or all)."""
        calls: list[int] = []

        def handler(params: dict, **_: Any) -> None:
            if not when(params):
                return
            calls.append(1)
            if times is None or len(calls) <= times:
                raise ClientError({"Error": {"Code": code, "Message": "injected by the test"}}, operation)

        event = f"provide-client-params.dynamodb.{operation}"
        self._client.meta.events.register(event, handler)
        self._handlers.append((event, handler))
        return calls

    def clear(self) -> None:
        for event, handler in self._handlers:
            self._client.meta.events.unregister(event, handler)
        self._handlers.clear()


@pytest.fixture
def storage_faults(stack):
    faults = StorageFaults(stack.tables.client)
    yield faults
    faults.clear()


def involves_org(org_id: str) -> Callable[[dict], bool]:
    """A predicate on DynamoDB call parameters: does the call touch this org's item?"""
    needle = f'"{org_id}"'
    return lambda params: needle in repr(params).replace("'", '"')
