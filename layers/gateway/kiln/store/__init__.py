"""DynamoDB storage: keys, orgs with their leases and credits, usage events."""

from .errors import AlreadyRevoked, ConditionFailed, RecordExists, RecordNotFound, StorageError, TransactionConflict
from .ledger import Lease, Ledger, new_generation_id
from .records import Tables, bind
from .usage import STATUSES, UsageEvent

__all__ = [
    "AlreadyRevoked",
    "ConditionFailed",
    "Lease",
    "Ledger",
    "RecordExists",
    "RecordNotFound",
    "STATUSES",
    "StorageError",
    "Tables",
    "TransactionConflict",
    "UsageEvent",
    "bind",
    "new_generation_id",
]
