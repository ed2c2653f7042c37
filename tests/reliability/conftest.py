"""The reliability suite's fault injection and sizes (from the environment).

Storage-heavy tests run twice: on the embedded AWS as it is (`plain`), and on its DynamoDB
fault mode (`faults`, `kiln emulator --faults`), which behaves as DynamoDB does under
contention: transactions that take time and conflict with writes that meet them, conflicts
at a rate, throttling, answers lost after the write was applied.
"""

from __future__ import annotations

import json
import os
from typing import Callable

import pytest

from support import EmulatorProcess, LedgerCheck, stacks_on

# Kept bounded so the whole CI stays well under 15 minutes; raise them for a longer soak.
STORM_ROUNDS = int(os.environ.get("KILN_TEST_STORM_ROUNDS", "50"))
STORM_CONCURRENCY = int(os.environ.get("KILN_TEST_STORM_CONCURRENCY", "32"))
LEDGER_REQUESTS = int(os.environ.get("KILN_TEST_LEDGER_REQUESTS", "1000"))
# The fault mode of the `faults` runs: half of all writes to an org item meet a conflicting
# transaction, each transaction holds its items 5 ms, 2 % throttled, 2 % of answers lost.
STORAGE_FAULTS = os.environ.get(
    "KILN_TEST_STORAGE_FAULTS", "conflict=0.5,throttle=0.02,lost=0.02,txn_ms=5,seed=7,scope=gateway"
)
# Under faults every storage call may take several tries: those runs are this much smaller.
FAULTS_SHRINK = int(os.environ.get("KILN_TEST_FAULTS_SHRINK", "5"))


def sized(storage: str, count: int) -> int:
    """`count` for the plain runs, a fraction of it under faults."""
    return count if storage == "plain" else max(1, count // FAULTS_SHRINK)


@pytest.fixture
def ledger(stack) -> LedgerCheck:
    """A rich org of its own, its key (`ledger.key`) and the invariants its requests must keep."""
    org_id, key = stack.org(credits="100000000")
    check = LedgerCheck(stack, org_id)
    check.key = key
    return check


@pytest.fixture
def storage_faults(stack):
    """Failures injected into the gateway's DynamoDB calls (see support.StorageFaults)."""
    yield stack.faults
    stack.faults.clear()


@pytest.fixture(scope="session")
def faulty_aws():
    """`kiln emulator --faults STORAGE_FAULTS` in its own process, for the whole session."""
    emulator = EmulatorProcess(faults=STORAGE_FAULTS)
    yield emulator
    emulator.stop()


@pytest.fixture(params=["plain", "faults"])
def storage(request) -> str:
    """Which DynamoDB the test runs on: the emulator as it is, or under its fault mode."""
    return request.param


@pytest.fixture
def storage_stack_factory(storage, request, mock):
    """Like stack_factory, on the DynamoDB `storage` names."""
    aws = request.getfixturevalue("aws" if storage == "plain" else "faulty_aws")
    yield from stacks_on(aws.url, mock)


def involves_org(org_id: str) -> Callable[[dict], bool]:
    """A predicate on a DynamoDB call's payload: does it touch this org's item?"""
    needle = f'"{org_id}"'
    return lambda payload: needle in json.dumps(payload)
