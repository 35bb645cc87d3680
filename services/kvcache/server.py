"""Build the tiers from settings and serve them over gRPC (``serve`` is what `tokenyard up`
and ``__main__`` call)."""

from __future__ import annotations

import logging

import grpc

from tokenyard.grpc_security import GRPC_OPTIONS, GrpcSecurity, add_port, server_interceptors
from tokenyard.kv.store.tiered import TieredStore
from tokenyard.kv.store.tiers import DiskTier, RamTier, RedisTier, Tier
from tokenyard.services.kvcache.admin import KVCacheAdminHandler
from tokenyard.services.kvcache.handlers import KVCacheHandler
from tokenyard.services.kvcache.settings import KVCacheSettings
from tokenyard.v1 import control_pb2_grpc, kv_pb2_grpc

log = logging.getLogger(__name__)


def build_store(settings: KVCacheSettings) -> TieredStore:
    tiers: list[Tier] = [RamTier(settings.ram_bytes)]
    if settings.redis_url:
        tiers.append(
            RedisTier(
                settings.redis_url,
                settings.redis_bytes,
                prefix=settings.redis_prefix,
                ttl_s=settings.redis_ttl_s,
            )
        )
    if settings.disk_dir:
        tiers.append(DiskTier(settings.disk_dir, settings.disk_bytes))
    return TieredStore(tiers)


class KVCacheServer:
    """A running KV-cache service: ``endpoint`` to give clients, ``stop()`` to end it."""

    def __init__(self, server: grpc.aio.Server, store: TieredStore, endpoint: str, grace: float):
        self.server, self.store, self.endpoint, self._grace = server, store, endpoint, grace

    async def stop(self, grace: float | None = None) -> None:
        await self.server.stop(self._grace if grace is None else grace)
        await self.store.close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def serve(settings: KVCacheSettings, security: GrpcSecurity | None = None) -> KVCacheServer:
    """Start the service (KVCache and its KVCacheAdmin); returns once it accepts calls."""
    store = build_store(settings)
    security = security or GrpcSecurity()
    server = grpc.aio.server(options=GRPC_OPTIONS, interceptors=server_interceptors(security))
    kv_pb2_grpc.add_KVCacheServicer_to_server(KVCacheHandler(store), server)
    control_pb2_grpc.add_KVCacheAdminServicer_to_server(KVCacheAdminHandler(store), server)
    port = add_port(server, f"{settings.host}:{settings.port}", security)
    if port == 0:
        raise OSError(f"KV cache cannot bind {settings.host}:{settings.port}")
    await server.start()
    endpoint = f"{settings.host}:{port}"
    log.info("KV cache at %s, tiers %s", endpoint, [t.name for t in store.tiers])
    return KVCacheServer(server, store, endpoint, settings.shutdown_grace_s)
