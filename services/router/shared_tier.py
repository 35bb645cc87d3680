"""What the shared KV-cache service holds of a prompt, asked as the router places it.

One ``Contains`` call per request (no bytes move): the leading blocks the service holds,
under the layout the workers of that model announce in their heartbeats. The answer only
steers placement, so it must be quick or nothing: past ``timeout_s``, or on any error, it
is 0 (the workers' own caches alone decide) and the failure is logged once a minute.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import grpc

from tokenyard.grpc_security import GRPC_OPTIONS, open_channel
from tokenyard.v1 import kv_pb2, kv_pb2_grpc

log = logging.getLogger(__name__)

FAILURE_LOG_S = 60.0


class SharedTier:
    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._channel = open_channel(endpoint, GRPC_OPTIONS)
        self._stub = kv_pb2_grpc.KVCacheStub(self._channel)
        self._logged_at = -FAILURE_LOG_S

    async def leading_blocks(self, layout: kv_pb2.KVLayoutDesc, hashes: Sequence[int]) -> int:
        """How many leading ``hashes`` the service holds (0 when it cannot say in time)."""
        if not hashes:
            return 0
        request = kv_pb2.ContainsRequest(layout=layout, hashes=hashes)
        try:
            reply = await self._stub.Contains(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            now = time.monotonic()
            if now - self._logged_at >= FAILURE_LOG_S:
                self._logged_at = now
                log.warning(
                    "KV-cache service %s: %s (placing by local caches only)",
                    self.endpoint,
                    exc.code().name,
                )
            return 0
        return min(reply.num_prefix, len(hashes))

    async def close(self) -> None:
        await self._channel.close()
