"""The KV-cache service's block store (tiers) and the client workers use to reach it."""

from tokenyard.kv.store.client import KVCacheClient
from tokenyard.kv.store.tiered import TieredStore, block_key, layout_key
from tokenyard.kv.store.tiers import DiskTier, RamTier, RedisTier

__all__ = [
    "DiskTier",
    "KVCacheClient",
    "RamTier",
    "RedisTier",
    "TieredStore",
    "block_key",
    "layout_key",
]
