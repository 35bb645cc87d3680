"""Every gRPC handler (KVTransfer, KVCache, KVCacheAdmin, WorkerControl, FacilitiesControl)
fed random bytes and forged messages (out-of-range ids, huge lengths, NaNs, unknown names)
and calls with a wrong token: each answer is a clear status, never UNKNOWN or INTERNAL (a
crash of ours) nor a hang, and a good call succeeds afterwards.

The servers run for real: the KV-transfer and KV-cache servers and the facilities service
(on the test NATS) on an event loop in a thread of this process, the worker in a stack
process (fake engine); the fuzzing client is gRPC's blocking one.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import pytest
import torch
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenyard.bus.embedded import free_port
from tokenyard.grpc_security import CALLERS, OPERATOR, fresh_tokens, peers_text
from tokenyard.kv.layout import KVLayout, layout_to_proto
from tokenyard.kv.transfer import KVTransferServer
from tokenyard.services.facilities.service import serve as serve_facilities
from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.kvcache.server import serve as serve_kvcache
from tokenyard.services.kvcache.settings import KVCacheSettings
from tokenyard.services.launch.stack import StackConfig
from tokenyard.v1 import control_pb2, kv_pb2

TOKENS = fresh_tokens()  # the in-process servers know them all (TOKENYARD_GRPC_PEERS)
ADMIN = "fuzz-admin-token"
LAYOUT = KVLayout("tiny", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
HELD = "held-request"

# A clear refusal; UNKNOWN and INTERNAL mean a handler crashed, the rest a hang or a death.
CLEAR = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
CALL_TIMEOUT_S = 20.0


class LoopThread:
    """An event loop in a thread, for servers the blocking fuzz client calls into."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass(frozen=True)
class Target:
    service: str  # full name, e.g. tokenyard.v1.KVCache
    endpoint: str
    token: str  # what a good call carries
    tokens: dict[str, str]  # every identity's token as this server knows them


@pytest.fixture(scope="module")
def targets(
    nats_url: str, example_inventory: Path, launch_stack, tmp_path_factory
) -> Iterator[dict[str, Target]]:
    control_port = free_port()
    config = StackConfig(
        prefill=1,
        decode=0,
        engine="fake",
        gateway=False,
        kvcache=False,
        facilities=False,
        telemetry=False,
        worker_env={"TOKENYARD_WORKER_CONTROL_PORT": str(control_port)},
    )
    loop = LoopThread()
    stop = asyncio.Event()
    facilities = FacilitiesSettings(
        nats_url=nats_url,
        data_dir=tmp_path_factory.mktemp("facilities"),
        inventory_path=example_inventory,
        admin_token=ADMIN,
        port=free_port(),
        grpc_port=free_port(),
        tick_s=0.5,
    )
    with (
        launch_stack(config) as stack,
        mock.patch.dict(os.environ, {"TOKENYARD_GRPC_PEERS": peers_text(TOKENS)}),
    ):
        transfer = KVTransferServer(
            torch.zeros(LAYOUT.pool_shape(8)),
            LAYOUT,
            on_release=lambda _rid: None,
            allowed=["grpc"],
        )
        transfer_endpoint = loop.run(transfer.start())
        transfer.offer(HELD, [0, 1])
        cache = loop.run(
            serve_kvcache(KVCacheSettings(port=0, ram_bytes=1 << 20, shutdown_grace_s=0))
        )
        facilities_task = asyncio.run_coroutine_threadsafe(
            serve_facilities(facilities, stop), loop.loop
        )
        worker = f"127.0.0.1:{control_port}"
        _wait_serving(
            worker,
            stack.grpc_token,
            "tokenyard.v1.WorkerControl/Status",
            control_pb2.WorkerStatusRequest(),
        )
        fac = f"127.0.0.1:{facilities.grpc_port}"
        _wait_serving(
            fac, ADMIN, "tokenyard.v1.FacilitiesControl/ListRacks", control_pb2.ListRacksRequest()
        )
        yield {
            "tokenyard.v1.KVTransfer": Target(
                "tokenyard.v1.KVTransfer", transfer_endpoint, TOKENS["decode"], TOKENS
            ),
            "tokenyard.v1.KVCache": Target(
                "tokenyard.v1.KVCache", cache.endpoint, TOKENS["decode"], TOKENS
            ),
            "tokenyard.v1.KVCacheAdmin": Target(
                "tokenyard.v1.KVCacheAdmin", cache.endpoint, TOKENS[OPERATOR], TOKENS
            ),
            "tokenyard.v1.WorkerControl": Target(
                "tokenyard.v1.WorkerControl", worker, stack.grpc_token, stack.grpc_tokens
            ),
            "tokenyard.v1.FacilitiesControl": Target(
                "tokenyard.v1.FacilitiesControl", fac, ADMIN, TOKENS
            ),
        }
        loop.loop.call_soon_threadsafe(stop.set)
        facilities_task.result(30)
        loop.run(cache.stop())
        loop.run(transfer.stop())
    loop.close()


def _wait_serving(
    endpoint: str, token: str, path: str, request: Message, timeout: float = 60
) -> None:
    with grpc.insecure_channel(endpoint) as channel:
        grpc.channel_ready_future(channel).result(timeout)
        call = channel.unary_unary(f"/{path}")
        call(
            request.SerializeToString(), metadata=_auth(token), timeout=timeout, wait_for_ready=True
        )


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


# --- the methods and their messages ------------------------------------------------------

SERVICES = [
    kv_pb2.DESCRIPTOR.services_by_name["KVTransfer"],
    kv_pb2.DESCRIPTOR.services_by_name["KVCache"],
    control_pb2.DESCRIPTOR.services_by_name["KVCacheAdmin"],
    control_pb2.DESCRIPTOR.services_by_name["WorkerControl"],
    control_pb2.DESCRIPTOR.services_by_name["FacilitiesControl"],
]
METHODS: list[MethodDescriptor] = [m for s in SERVICES for m in s.methods]
# A good call per service, to show it still serves.
GOOD = {
    "tokenyard.v1.KVTransfer": ("Release", kv_pb2.ReleaseRequest(request_id="nobody")),
    "tokenyard.v1.KVCache": ("Stats", kv_pb2.StatsRequest()),
    "tokenyard.v1.KVCacheAdmin": ("Stats", kv_pb2.StatsRequest()),
    "tokenyard.v1.WorkerControl": ("Status", control_pb2.WorkerStatusRequest()),
    "tokenyard.v1.FacilitiesControl": ("ListRacks", control_pb2.ListRacksRequest()),
}
# Names the servers know, so forged messages reach past the first look-up.
KNOWN = [
    HELD,
    "rack-a",
    "rack-b",
    "pump_failure",
    "power_cap",
    "float32",
    "tiny",
    LAYOUT.hash_version,
]

T = FieldDescriptor
INTS = {
    T.TYPE_INT32: (-(2**31), 2**31 - 1),
    T.TYPE_SINT32: (-(2**31), 2**31 - 1),
    T.TYPE_INT64: (-(2**63), 2**63 - 1),
    T.TYPE_UINT32: (0, 2**32 - 1),
    T.TYPE_FIXED32: (0, 2**32 - 1),
    T.TYPE_UINT64: (0, 2**64 - 1),
    T.TYPE_FIXED64: (0, 2**64 - 1),
}


def scalar(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    if field.type in INTS:
        lo, hi = INTS[field.type]
        return st.one_of(st.sampled_from([lo, hi, 0, 1, 2, 7]), st.integers(lo, hi))
    if field.type in (T.TYPE_DOUBLE, T.TYPE_FLOAT):
        return st.floats(width=64 if field.type == T.TYPE_DOUBLE else 32)
    if field.type == T.TYPE_BOOL:
        return st.booleans()
    if field.type == T.TYPE_STRING:
        return st.one_of(st.sampled_from(KNOWN), st.text(max_size=64))
    if field.type == T.TYPE_BYTES:
        return st.one_of(st.binary(max_size=256), st.just(bytes(LAYOUT.block_nbytes)))
    if field.type == T.TYPE_ENUM:
        return st.integers(-5, 10)
    assert field.type == T.TYPE_MESSAGE, field.type
    return forged(message_factory.GetMessageClass(field.message_type), depth + 1)


def forged(cls: type[Message], depth: int = 0) -> st.SearchStrategy[Message]:
    """Messages of `cls` with any subset of fields set to edge values, lists up to 8 long."""
    if depth > 2:
        return st.just(cls())
    fields: dict[str, st.SearchStrategy[Any]] = {}
    for field in cls.DESCRIPTOR.fields:
        value = scalar(field, depth)
        fields[field.name] = st.lists(value, max_size=8) if field.is_repeated else value
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


def invoke(target: Target, method: MethodDescriptor, payload: bytes, token: str) -> grpc.StatusCode:
    """Call `method` with raw request bytes; the status it ends with."""
    path = f"/{target.service}/{method.name}"
    with grpc.insecure_channel(target.endpoint) as channel:
        kw = {"metadata": _auth(token), "timeout": CALL_TIMEOUT_S}
        try:
            if method.client_streaming and method.server_streaming:
                for _ in channel.stream_stream(path)(iter([payload]), **kw):
                    pass
            elif method.client_streaming:
                channel.stream_unary(path)(iter([payload]), **kw)
            elif method.server_streaming:
                for _ in channel.unary_stream(path)(payload, **kw):
                    pass
            else:
                channel.unary_unary(path)(payload, **kw)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def still_serving(target: Target) -> None:
    name, request = GOOD[target.service]
    method = next(
        m for s in SERVICES for m in s.methods if s.full_name == target.service and m.name == name
    )
    assert invoke(target, method, request.SerializeToString(), target.token) == grpc.StatusCode.OK


FUZZ = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
IDS = [f"{m.containing_service.name}.{m.name}" for m in METHODS]


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS, ids=IDS)
@FUZZ
@given(payload=st.binary(max_size=512))
def test_random_bytes_get_a_clear_status(targets, method, payload):
    target = targets[method.containing_service.full_name]
    code = invoke(target, method, payload, target.token)
    assert code in CLEAR, f"{method.full_name}({payload!r}) -> {code}"
    still_serving(target)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS, ids=IDS)
@FUZZ
@given(data=st.data())
def test_forged_messages_get_a_clear_status(targets, method, data):
    target = targets[method.containing_service.full_name]
    request = data.draw(forged(message_factory.GetMessageClass(method.input_type)))
    code = invoke(target, method, request.SerializeToString(), target.token)
    assert code in CLEAR, f"{method.full_name}({request}) -> {code}"
    still_serving(target)


@pytest.mark.parametrize("method", METHODS, ids=IDS)
@pytest.mark.parametrize("token", ["", "a-wrong-token"])
def test_a_wrong_token_is_unauthenticated(targets, method, token):
    target = targets[method.containing_service.full_name]
    request = message_factory.GetMessageClass(method.input_type)()
    assert (
        invoke(target, method, request.SerializeToString(), token)
        == grpc.StatusCode.UNAUTHENTICATED
    )
    still_serving(target)


@pytest.mark.parametrize("method", METHODS, ids=IDS)
def test_an_identity_with_no_business_there_is_refused(targets, method):
    """Each known identity that CALLERS does not list for the service is refused: never OK."""
    service = method.containing_service.full_name
    target = targets[service]
    request = message_factory.GetMessageClass(method.input_type)().SerializeToString()
    outsiders = sorted(set(target.tokens) - CALLERS[service])
    assert outsiders  # every service has identities that may not call it
    for identity in outsiders:
        code = invoke(target, method, request, target.tokens[identity])
        # Facilities changes are the admin token's alone: a gRPC identity there is a stranger.
        changes_racks = service.endswith("FacilitiesControl") and method.name != "ListRacks"
        expected = (
            grpc.StatusCode.UNAUTHENTICATED if changes_racks else grpc.StatusCode.PERMISSION_DENIED
        )
        assert code == expected, f"{identity} -> {method.full_name}: {code}"
    still_serving(target)


# Each ends in a clear status (a lookup of 100,000 missing hashes is simply a miss: OK).
HUGE = [
    (
        "tokenyard.v1.KVTransfer",
        "Describe",
        kv_pb2.DescribeRequest(
            request_id=HELD,
            layout=layout_to_proto(LAYOUT),
            src_block_ids=list(range(20_000)),
            want_checksums=True,
        ),
    ),
    (
        "tokenyard.v1.KVTransfer",
        "ReadBlocks",
        kv_pb2.ReadBlocksRequest(
            request_id=HELD, src_block_ids=[0, 2**32 - 1], chunk_bytes=2**32 - 1
        ),
    ),
    (
        "tokenyard.v1.KVTransfer",
        "ReadBlocks",
        kv_pb2.ReadBlocksRequest(request_id=HELD, src_block_ids=[0, 1, 0, 1] * 1000, chunk_bytes=1),
    ),
    (
        "tokenyard.v1.KVTransfer",
        "ReadBlocks",
        kv_pb2.ReadBlocksRequest(request_id=HELD, src_block_ids=[0, 1], chunk_bytes=1),
    ),
    (
        "tokenyard.v1.KVCache",
        "Get",
        kv_pb2.GetRequest(layout=layout_to_proto(LAYOUT), hashes=list(range(100_000))),
    ),
    (
        "tokenyard.v1.KVCache",
        "Put",
        kv_pb2.PutBlock(layout=layout_to_proto(LAYOUT), hash=1, data=bytes(8 << 20)),
    ),
    (
        "tokenyard.v1.KVCache",
        "Contains",
        kv_pb2.ContainsRequest(
            layout=kv_pb2.KVLayoutDesc(
                model_id="x",
                dtype="float32",
                block_size=2**32 - 1,
                num_layers=2**32 - 1,
                num_kv_heads=2**32 - 1,
                head_dim=2**32 - 1,
                hash_version=LAYOUT.hash_version,
            ),
            hashes=[1],
        ),
    ),
    (
        "tokenyard.v1.KVCacheAdmin",
        "EvictPrefix",
        control_pb2.EvictPrefixRequest(layout=layout_to_proto(LAYOUT), hashes=list(range(100_000))),
    ),
    (
        "tokenyard.v1.WorkerControl",
        "Drain",
        control_pb2.WorkerDrainRequest(reason="x" * 100_000, wait_s=float("nan")),
    ),
    (
        "tokenyard.v1.FacilitiesControl",
        "DrainRack",
        control_pb2.DrainRackRequest(rack="rack-a", reason="x" * 100_000),
    ),
    (
        "tokenyard.v1.FacilitiesControl",
        "SetFault",
        control_pb2.SetFaultRequest(rack="rack-a", kind="power_cap", power_cap_kw=float("inf")),
    ),
]


@pytest.mark.parametrize(
    ("service", "name", "request_"), HUGE, ids=[f"{s.rsplit('.', 1)[1]}.{n}" for s, n, _ in HUGE]
)
def test_huge_and_out_of_range_requests(targets, service, name, request_):
    target = targets[service]
    method = next(
        m for m in METHODS if m.containing_service.full_name == service and m.name == name
    )
    code = invoke(target, method, request_.SerializeToString(), target.token)
    assert code in CLEAR, f"{service}.{name} -> {code}"
    if name in REFUSED:
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{service}.{name} -> {code}"
    still_serving(target)


# These are plainly wrong requests, refused as such.
REFUSED = {"Put", "Drain", "DrainRack", "SetFault"}
