"""DynamoDB storage: keys, orgs with their leases and credits, usage events.

The request path uses the ledger and the usage events over the lean client (`kiln.aws`);
the pynamodb models (`records`: `bind`, `Tables`) serve operators' tools and are imported
only when asked for.
"""

from typing import Any

from .errors import (
    AlreadyRevoked,
    ConditionFailed,
    RecordExists,
    RecordNotFound,
    StorageError,
    TransactionCancelled,
    TransientStorageError,
    UnstorableValue,
)
from .ledger import Lease, Ledger, Progress, ledger_of, new_generation_id, with_ledger
from .renewal import LeaseKeeper
from .retry import RetryPolicy
from .usage import STATUSES, UsageEvent

__all__ = [
    "AlreadyRevoked",
    "ConditionFailed",
    "Lease",
    "LeaseKeeper",
    "Ledger",
    "Progress",
    "RecordExists",
    "RecordNotFound",
    "RetryPolicy",
    "STATUSES",
    "StorageError",
    "Tables",
    "TransactionCancelled",
    "TransientStorageError",
    "UnstorableValue",
    "UsageEvent",
    "bind",
    "ledger_of",
    "new_generation_id",
    "with_ledger",
]


def __getattr__(name: str) -> Any:
    if name in ("bind", "Tables"):
        from . import records

        return getattr(records, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
