"""Expiring leases with fencing tokens: the public API.

store = await open_store("sqlite:///jobs.db")   # or postgresql://..., http://gateway
async with hold(store, "job-42", owner="worker-a", ttl=30.0) as lease:
    ...  # renewed in the background; cancelled with LeaseLost when lost
"""

from .errors import JobCompleted, LeaseError, LeaseHeld, LeaseLost, StoreUnavailable
from .hold import HeldLease, Hold, hold
from .model import Lease, LeaseRef, Reason, default_owner
from .store import LeaseStore, open_store
from .writer import (
    BadWrite,
    DuplicateWrite,
    FencedWriter,
    GatewayRejected,
    GatewayUnavailable,
    StaleWrite,
    WriteResult,
    derive_key,
)

__all__ = [
    "BadWrite",
    "DuplicateWrite",
    "FencedWriter",
    "GatewayRejected",
    "GatewayUnavailable",
    "HeldLease",
    "Hold",
    "JobCompleted",
    "Lease",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "LeaseRef",
    "LeaseStore",
    "Reason",
    "StaleWrite",
    "StoreUnavailable",
    "WriteResult",
    "default_owner",
    "derive_key",
    "hold",
    "open_store",
]
