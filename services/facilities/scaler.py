"""A KEDA external scaler (proto/tokenyard/v1/externalscaler.proto) over the autoscaler's
desired replica counts (autoscale.ReplicaAdvisor).

A ScaledObject's trigger names the pool in its metadata (`role: prefill` or `decode`). The
metric is the desired count itself and its target size 1, so the HPA under KEDA computes
replicas = ceil(desired / 1) = desired. IsActive is true while the pool should run at all
(desired > 0): KEDA scales to zero only when the ScaledObject's minReplicaCount allows it.

The numbers are read-only and not secret, and KEDA presents no Tokenyard token: the server
is open, on its own port (`scaler_port`); keep it inside the cluster (a NetworkPolicy).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from tokenyard.autoscale.policy import ROLES
from tokenyard.grpc_security import RejectUndecodable, add_port
from tokenyard.services.facilities.autoscale import ReplicaAdvisor
from tokenyard.v1 import externalscaler_pb2 as pb
from tokenyard.v1 import externalscaler_pb2_grpc

METRIC_PREFIX = "tokenyard-desired-"
STREAM_EVERY_S = 5.0


def metric_name(role: str) -> str:
    return f"{METRIC_PREFIX}{role}"


class ExternalScaler(externalscaler_pb2_grpc.ExternalScalerServicer):
    def __init__(self, advisor: ReplicaAdvisor) -> None:
        self.advisor = advisor

    async def _role(self, ref: pb.ScaledObjectRef, context: grpc.aio.ServicerContext) -> str:
        role = ref.scalerMetadata.get("role", "")
        if role not in ROLES:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the trigger's metadata must name a role ({' or '.join(ROLES)}), not {role!r}",
            )
        return role

    async def IsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> pb.IsActiveResponse:
        role = await self._role(request, context)
        return pb.IsActiveResponse(result=self.advisor.count(role) > 0)

    async def StreamIsActive(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.IsActiveResponse]:
        role = await self._role(request, context)
        while True:
            yield pb.IsActiveResponse(result=self.advisor.count(role) > 0)
            await asyncio.sleep(STREAM_EVERY_S)

    async def GetMetricSpec(
        self, request: pb.ScaledObjectRef, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricSpecResponse:
        role = await self._role(request, context)
        spec = pb.MetricSpec(metricName=metric_name(role), targetSize=1, targetSizeFloat=1.0)
        return pb.GetMetricSpecResponse(metricSpecs=[spec])

    async def GetMetrics(
        self, request: pb.GetMetricsRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetMetricsResponse:
        role = await self._role(request.scaledObjectRef, context)
        n = self.advisor.count(role)
        value = pb.MetricValue(metricName=metric_name(role), metricValue=n, metricValueFloat=n)
        return pb.GetMetricsResponse(metricValues=[value])


class ExternalScalerServer:
    def __init__(self, advisor: ReplicaAdvisor, host: str, port: int) -> None:
        self.advisor, self.host, self.port = advisor, host, port
        self.endpoint = ""
        self._server: grpc.aio.Server | None = None

    async def start(self) -> str:
        self._server = grpc.aio.server(interceptors=[RejectUndecodable()])
        externalscaler_pb2_grpc.add_ExternalScalerServicer_to_server(
            ExternalScaler(self.advisor), self._server
        )
        port = add_port(self._server, f"{self.host}:{self.port}")
        if port == 0:
            raise OSError(f"the KEDA external scaler cannot bind {self.host}:{self.port}")
        await self._server.start()
        self.endpoint = f"{self.host}:{port}"
        return self.endpoint

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)
