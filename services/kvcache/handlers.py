"""gRPC handlers of the KV-cache service over a TieredStore."""

from __future__ import annotations

import logging

import grpc
from opentelemetry import trace

from tokenyard.grpc_security import caller
from tokenyard.kv.checksum import crc32
from tokenyard.kv.hashing import HASH_SPEC_VERSION
from tokenyard.kv.layout import KV_DTYPES, KVLayout, layout_from_proto
from tokenyard.kv.store.tiered import Put, TieredStore, block_key, layout_key
from tokenyard.tracing import grpc_context, tracer
from tokenyard.v1 import kv_pb2, kv_pb2_grpc


def refusal(layout: KVLayout) -> str | None:
    """Why the service will not take blocks of this layout, or None."""
    if layout.hash_version != HASH_SPEC_VERSION:
        return f"block hash spec {layout.hash_version!r} != this service's {HASH_SPEC_VERSION!r}"
    if layout.dtype not in KV_DTYPES:
        return f"unknown KV dtype {layout.dtype!r}"
    if min(layout.block_size, layout.num_layers, layout.num_kv_heads, layout.head_dim) <= 0:
        return f"degenerate KV layout {layout}"
    return None


_tracer = tracer("tokenyard.kvcache")
log = logging.getLogger(__name__)


async def checked_layout(desc: kv_pb2.KVLayoutDesc, context) -> KVLayout:
    """The call's layout, or the call aborted with the reason it is refused."""
    layout = layout_from_proto(desc)
    why = refusal(layout)
    if why is not None:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
    return layout


class KVCacheHandler(kv_pb2_grpc.KVCacheServicer):
    def __init__(self, store: TieredStore):
        self.store = store

    async def _layout(self, desc: kv_pb2.KVLayoutDesc, context) -> KVLayout:
        return await checked_layout(desc, context)

    async def Put(self, request_iterator, context):
        layout: KVLayout | None = None
        digest = ""
        outcomes = {Put.STORED: 0, Put.SAME: 0, Put.REFUSED: 0}
        async for block in request_iterator:
            if layout is None:
                layout = await self._layout(block.layout, context)
                digest = layout_key(layout)
            elif block.HasField("layout") and (
                why := layout.mismatch(layout_from_proto(block.layout))
            ):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT, f"layout changed mid-stream: {why}"
                )
            if len(block.data) != layout.block_nbytes:
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"block {block.hash:016x} has {len(block.data)} bytes; layout says {layout.block_nbytes}",
                )
            if crc32(block.data) != block.crc32:
                await context.abort(
                    grpc.StatusCode.DATA_LOSS, f"block {block.hash:016x} failed its crc32"
                )
            outcomes[await self.store.put(block_key(digest, block.hash), block.data)] += 1
        if outcomes[Put.REFUSED]:
            # Honest workers can differ in the last bits (another batch, another kernel), or
            # a writer tries to replace a block others read: either way the first one stays.
            log.warning(
                "KV cache: %d blocks from %s differ from the blocks held under their hashes; "
                "kept the held ones",
                outcomes[Put.REFUSED],
                caller() or "an unauthenticated caller",
            )
        return kv_pb2.PutReply(
            num_stored=outcomes[Put.STORED] + outcomes[Put.SAME],
            num_refused=outcomes[Put.REFUSED],
        )

    async def Get(self, request, context):
        digest = layout_key(await self._layout(request.layout, context))
        with _tracer.start_as_current_span(
            "kvcache.get", context=grpc_context(context), kind=trace.SpanKind.SERVER
        ) as span:
            found = 0
            for index, h in enumerate(request.hashes):
                data = await self.store.get(block_key(digest, h))
                if data is None:
                    break
                found += 1
                yield kv_pb2.CachedBlock(index=index, hash=h, data=data, crc32=crc32(data))
            span.set_attributes({"kv.blocks_asked": len(request.hashes), "kv.blocks_hit": found})

    async def Contains(self, request, context):
        digest = layout_key(await self._layout(request.layout, context))
        n = 0
        for h in request.hashes:
            if not await self.store.contains(block_key(digest, h)):
                break
            n += 1
        return kv_pb2.ContainsReply(num_prefix=n)

    async def Stats(self, request, context):
        return stats_reply(self.store)


def stats_reply(store: TieredStore) -> kv_pb2.StatsReply:
    return kv_pb2.StatsReply(
        hits=store.hits,
        misses=store.misses,
        evictions=store.dropped,
        tiers=[
            kv_pb2.TierStats(
                name=t.name,
                bytes=t.index.nbytes,
                blocks=len(t.index.sizes),
                hits=t.counters.hits,
                misses=t.counters.misses,
                evictions=t.counters.evictions,
                capacity_bytes=t.index.capacity_bytes,
            )
            for t in store.tiers
        ],
    )
