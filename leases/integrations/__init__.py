"""Job queues running their tasks under leases: `leases.integrations.celery`
(`sinkgate[celery]`) and `leases.integrations.arq` (`sinkgate[arq]`), both over
`TaskGate` (any queue, async) and `run_sync` (synchronous task bodies).

Nothing here imports a queue library; the adapters do, and only when imported.
"""

from .gate import TaskGate, TaskRun, Verdict, job_id_from, verdict
from .sync import SyncRun, SyncWriter, close_sync, run_sync

__all__ = [
    "SyncRun",
    "SyncWriter",
    "TaskGate",
    "TaskRun",
    "Verdict",
    "close_sync",
    "job_id_from",
    "run_sync",
    "verdict",
]
