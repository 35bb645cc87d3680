"""The KV-cache service's block store (tiers). Workers reach the service through
``tokenyard.kv.store.client.KVCacheClient``, kept out of this package's imports: it needs
torch, which the service itself does without."""

from tokenyard.kv.store.tiered import TieredStore, block_key, layout_key
from tokenyard.kv.store.tiers import DiskTier, RamTier, RedisTier

__all__ = [
    "DiskTier",
    "RamTier",
    "RedisTier",
    "TieredStore",
    "block_key",
    "layout_key",
]
