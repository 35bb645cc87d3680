"""Every service's settings class by its environment prefix: the deploy tests check that each
TOKENYARD_* variable a compose file or manifest sets is a real setting."""

from __future__ import annotations

from tokenyard.grpc_security import GrpcSecurity
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.gateway.settings import GatewaySettings
from tokenyard.services.kvcache.settings import KVCacheSettings
from tokenyard.services.router.settings import RouterSettings
from tokenyard.services.telemetry.settings import TelemetrySettings
from tokenyard.services.worker.settings import WorkerSettings

SETTINGS = {
    "TOKENYARD_GATEWAY_": GatewaySettings,
    "TOKENYARD_ROUTER_": RouterSettings,
    "TOKENYARD_WORKER_": WorkerSettings,
    "TOKENYARD_KVCACHE_": KVCacheSettings,
    "TOKENYARD_FACILITIES_": FacilitiesSettings,
    "TOKENYARD_TELEMETRY_": TelemetrySettings,
    "TOKENYARD_GRPC_": GrpcSecurity,
}
