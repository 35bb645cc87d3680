"""What a worker uses to reach the KV-cache service: offload blocks, fetch a cached prefix.

Bytes go straight between the engine's pool and the gRPC messages: ``put_blocks`` reads
each block's bytes out of the pool, ``get_prefix`` writes each arriving block into its
destination block.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc
import numpy as np
import torch

from tokenyard.grpc_security import GRPC_OPTIONS, GrpcSecurity, open_channel
from tokenyard.kv.checksum import crc32
from tokenyard.kv.layout import KVLayout, layout_to_proto
from tokenyard.kv.transfer.common import check_pool, pool_bytes
from tokenyard.tracing import grpc_metadata
from tokenyard.v1 import kv_pb2, kv_pb2_grpc


class KVCacheError(RuntimeError):
    """The KV-cache service refused or mangled a call; the worker computes instead."""


class KVCacheClient:
    def __init__(
        self, endpoint: str, *, timeout_s: float = 10.0, security: GrpcSecurity | None = None
    ):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        # The token and TLS settings: TOKENYARD_GRPC_* unless given.
        self._channel = open_channel(endpoint, GRPC_OPTIONS, security)
        self._stub = kv_pb2_grpc.KVCacheStub(self._channel)

    async def put_blocks(
        self, layout: KVLayout, hashes: Sequence[int], pool: torch.Tensor, block_ids: Sequence[int]
    ) -> int:
        """Store ``pool[block_ids[i]]`` under ``hashes[i]``; returns how many were stored."""
        check_pool(pool, layout)
        if len(hashes) != len(block_ids):
            raise ValueError(f"{len(hashes)} hashes for {len(block_ids)} blocks")
        if not hashes:
            return 0
        flat = pool_bytes(pool).numpy()
        nb = layout.block_nbytes
        desc = layout_to_proto(layout)

        async def blocks() -> AsyncIterator[kv_pb2.PutBlock]:
            for h, b in zip(hashes, block_ids, strict=True):
                data = flat[b * nb : (b + 1) * nb].tobytes()
                yield kv_pb2.PutBlock(layout=desc, hash=h, data=data, crc32=crc32(data))

        try:
            reply = await self._stub.Put(blocks(), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise KVCacheError(f"KV cache Put: {exc.code().name}: {exc.details()}") from exc
        return reply.num_stored

    async def get_prefix(
        self,
        layout: KVLayout,
        hashes: Sequence[int],
        pool: torch.Tensor,
        dst_block_ids: Sequence[int],
    ) -> int:
        """Fetch the longest cached prefix of ``hashes`` into ``pool[dst_block_ids]``;
        returns how many leading blocks landed (0 on a miss)."""
        check_pool(pool, layout)
        if len(hashes) != len(dst_block_ids):
            raise ValueError(f"{len(hashes)} hashes for {len(dst_block_ids)} destination blocks")
        if not hashes:
            return 0
        flat = pool_bytes(pool).numpy()
        nb = layout.block_nbytes
        request = kv_pb2.GetRequest(layout=layout_to_proto(layout), hashes=hashes)
        landed = 0
        try:
            async for block in self._stub.Get(
                request, timeout=self.timeout_s, metadata=grpc_metadata()
            ):
                if block.index != landed or len(block.data) != nb:
                    raise KVCacheError(f"unexpected block {block.index} ({len(block.data)} bytes)")
                if crc32(block.data) != block.crc32:
                    raise KVCacheError(f"corrupt KV block {block.index} from the cache")
                d = dst_block_ids[landed]
                flat[d * nb : (d + 1) * nb] = np.frombuffer(block.data, dtype=np.uint8)
                landed += 1
        except grpc.aio.AioRpcError as exc:
            raise KVCacheError(f"KV cache Get: {exc.code().name}: {exc.details()}") from exc
        return landed

    async def contains(self, layout: KVLayout, hashes: Sequence[int]) -> int:
        """How many leading hashes the cache holds (no bytes move)."""
        request = kv_pb2.ContainsRequest(layout=layout_to_proto(layout), hashes=hashes)
        try:
            return (await self._stub.Contains(request, timeout=self.timeout_s)).num_prefix
        except grpc.aio.AioRpcError as exc:
            raise KVCacheError(f"KV cache Contains: {exc.code().name}: {exc.details()}") from exc

    async def stats(self) -> kv_pb2.StatsReply:
        return await self._stub.Stats(kv_pb2.StatsRequest(), timeout=self.timeout_s)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> KVCacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
