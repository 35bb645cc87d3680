"""The KV-cache service's control API (KVCacheAdmin): stats, clear, evict a prefix.

Served beside KVCache on the same gRPC server, to the operator's identity only
(tokenyard.grpc_security.CALLERS).
"""

from __future__ import annotations

import logging

import grpc

from tokenyard.kv.store.tiered import TieredStore, block_key, layout_key
from tokenyard.services.kvcache.handlers import checked_layout, stats_reply
from tokenyard.v1 import control_pb2, control_pb2_grpc, kv_pb2

log = logging.getLogger(__name__)


class KVCacheAdminHandler(control_pb2_grpc.KVCacheAdminServicer):
    def __init__(self, store: TieredStore):
        self.store = store

    async def Stats(
        self, request: kv_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kv_pb2.StatsReply:
        return stats_reply(self.store)

    async def Clear(
        self, request: control_pb2.ClearRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.ClearReply:
        blocks, nbytes = await self.store.clear()
        log.warning("KV cache cleared by an operator: %d blocks, %d bytes", blocks, nbytes)
        return control_pb2.ClearReply(blocks=blocks, bytes=nbytes)

    async def EvictPrefix(
        self, request: control_pb2.EvictPrefixRequest, context: grpc.aio.ServicerContext
    ) -> control_pb2.EvictPrefixReply:
        digest = layout_key(await checked_layout(request.layout, context))
        evicted = 0
        for h in request.hashes:
            evicted += await self.store.evict(block_key(digest, h))
        log.info("KV cache: %d of %d blocks evicted", evicted, len(request.hashes))
        return control_pb2.EvictPrefixReply(num_evicted=evicted)
