"""The reliability suite's fault injection and sizes (from the environment)."""

from __future__ import annotations

import json
import os
from typing import Callable

import pytest

# Kept bounded so the whole CI stays well under 15 minutes; raise them for a longer soak.
STORM_ROUNDS = int(os.environ.get("KILN_TEST_STORM_ROUNDS", "50"))
STORM_CONCURRENCY = int(os.environ.get("KILN_TEST_STORM_CONCURRENCY", "32"))
LEDGER_REQUESTS = int(os.environ.get("KILN_TEST_LEDGER_REQUESTS", "1000"))


@pytest.fixture
def storage_faults(stack):
    """Failures injected into the gateway's DynamoDB calls (see support.StorageFaults)."""
    yield stack.faults
    stack.faults.clear()


def involves_org(org_id: str) -> Callable[[dict], bool]:
    """A predicate on a DynamoDB call's payload: does it touch this org's item?"""
    needle = f'"{org_id}"'
    return lambda payload: needle in json.dumps(payload)
