"""Expiring leases with fencing tokens: the public API.

store = await open_store("sqlite:///jobs.db")   # or postgresql://..., http://gateway
async with hold(store, "job-42", owner="worker-a", ttl=30.0) as lease:
    ...  # renewed in the background; cancelled with LeaseLost when lost
"""

from .errors import JobCompleted, LeaseError, LeaseHeld, LeaseLost, StoreUnavailable
from .hold import Hold, HeldLease, hold
from .model import Lease, Reason, default_owner
from .store import LeaseStore, open_store

__all__ = [
    "HeldLease",
    "Hold",
    "JobCompleted",
    "Lease",
    "LeaseError",
    "LeaseHeld",
    "LeaseLost",
    "LeaseStore",
    "Reason",
    "StoreUnavailable",
    "default_owner",
    "hold",
    "open_store",
]
