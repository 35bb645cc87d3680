"""KV hand-off between workers: a pull over the best transport both ends allow.

``KVTransferServer`` runs in the prefill worker and holds offered blocks; a decode worker's
``KVTransferClient.pull`` negotiates inproc > shm > mooncake > grpc, copies the blocks
straight into its own pool and releases them. See docs/kv.md.
"""

from tokenyard.kv.transfer.client import KVTransferClient
from tokenyard.kv.transfer.common import KVTransferError, TransferResult
from tokenyard.kv.transfer.negotiate import TRANSPORTS
from tokenyard.kv.transfer.server import FaultInjection, KVTransferServer
from tokenyard.kv.transfer.settings import KVTransferSettings
from tokenyard.kv.transfer.shm import allocate_shared_pool, free_shared_pool

__all__ = [
    "TRANSPORTS",
    "FaultInjection",
    "KVTransferClient",
    "KVTransferError",
    "KVTransferServer",
    "KVTransferSettings",
    "TransferResult",
    "allocate_shared_pool",
    "free_shared_pool",
]
