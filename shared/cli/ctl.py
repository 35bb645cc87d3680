"""`tokenyard ctl`: the internal control APIs (gRPC) from a shell.

    tokenyard ctl worker status 127.0.0.1:41234
    tokenyard ctl worker drain 127.0.0.1:41234 --reason "kernel upgrade" --wait 60
    tokenyard ctl worker undrain 127.0.0.1:41234
    tokenyard ctl kvcache stats 127.0.0.1:50070
    tokenyard ctl kvcache clear 127.0.0.1:50070
    tokenyard ctl kvcache evict 127.0.0.1:50070 --layout '{"model_id": ...}' --hash 9f3c...
    tokenyard ctl facilities racks
    tokenyard ctl facilities fault rack-a power_cap --power-cap-kw 20
    tokenyard ctl facilities clear rack-a
    tokenyard ctl facilities drain rack-a --reason "coolant work"
    tokenyard ctl facilities undrain rack-a

A worker's control address is in its log and its heartbeats (control_endpoint). The operator's
gRPC token is --token, else TOKENYARD_GRPC_TOKEN, else the running `tokenyard up`'s (it saves
its token and addresses for ctl: tokenyard.cli.running); facilities changes need the admin token
(--admin-token, else TOKENYARD_FACILITIES_ADMIN_TOKEN, else the running `up`'s), and the
facilities address defaults to the running `up`'s too. TLS comes from TOKENYARD_GRPC_TLS_*.
Answers are printed as JSON; a refused call prints its gRPC status and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from tokenyard.cli import running
from tokenyard.facilities.faults import FAULT_KINDS
from tokenyard.grpc_security import GrpcSecurity, open_channel
from tokenyard.kv.layout import KVLayout, layout_to_proto
from tokenyard.v1 import control_pb2 as cpb
from tokenyard.v1 import control_pb2_grpc, kv_pb2

DEFAULT_FACILITIES = "127.0.0.1:50075"
TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--token",
        help="the operator's gRPC token "
        "(default: $TOKENYARD_GRPC_TOKEN, else the running `tokenyard up`'s)",
    )
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per call")
    targets = parser.add_subparsers(dest="target", required=True)

    worker = targets.add_parser("worker", help="drain, undrain or ask a worker").add_subparsers(
        dest="action", required=True
    )
    for action in ("status", "drain", "undrain"):
        p = worker.add_parser(action)
        p.add_argument("addr", help="the worker's control endpoint, host:port")
        if action == "drain":
            p.add_argument("--reason", default="", help="kept in the worker's status and log")
            p.add_argument(
                "--wait", type=float, default=0.0, help="seconds to wait for DRAINED (max 600)"
            )

    kvcache = targets.add_parser("kvcache", help="the KV-cache service").add_subparsers(
        dest="action", required=True
    )
    for action in ("stats", "clear", "evict"):
        p = kvcache.add_parser(action)
        p.add_argument("addr", help="the KV-cache service, host:port")
        if action == "evict":
            p.add_argument("--layout", required=True, help="the KV layout as JSON (KVLayout)")
            p.add_argument(
                "--hash", action="append", required=True, help="a block hash in hex; repeat"
            )

    facilities = targets.add_parser("facilities", help="racks of the facilities service")
    facilities.add_argument(
        "--addr",
        help=f"its gRPC address (default: the running `tokenyard up`'s, else {DEFAULT_FACILITIES})",
    )
    facilities.add_argument(
        "--admin-token",
        help="the admin token (default: $TOKENYARD_FACILITIES_ADMIN_TOKEN, else the running "
        "`tokenyard up`'s)",
    )
    fac = facilities.add_subparsers(dest="action", required=True)
    fac.add_parser("racks", help="every rack's state, faults and cap")
    fault = fac.add_parser("fault", help="inject a fault")
    fault.add_argument("rack")
    fault.add_argument("kind", choices=FAULT_KINDS)
    fault.add_argument("--power-cap-kw", type=float, default=0.0)
    for action in ("clear", "undrain"):
        fac.add_parser(action).add_argument("rack")
    drain = fac.add_parser("drain", help="drain a rack whatever its readings say")
    drain.add_argument("rack")
    drain.add_argument("--reason", default="")


Call = Callable[[grpc.aio.Channel], Awaitable[Message]]


def worker_call(args: argparse.Namespace) -> Call:
    async def call(channel: grpc.aio.Channel) -> Message:
        stub = control_pb2_grpc.WorkerControlStub(channel)
        if args.action == "drain":
            # The wait happens on the worker: give the call that much longer.
            request = cpb.WorkerDrainRequest(reason=args.reason, wait_s=args.wait)
            return await stub.Drain(request, timeout=args.timeout + args.wait)
        if args.action == "undrain":
            return await stub.Undrain(cpb.WorkerUndrainRequest(), timeout=args.timeout)
        return await stub.Status(cpb.WorkerStatusRequest(), timeout=args.timeout)

    return call


def kvcache_call(args: argparse.Namespace) -> Call:
    async def call(channel: grpc.aio.Channel) -> Message:
        stub = control_pb2_grpc.KVCacheAdminStub(channel)
        if args.action == "clear":
            return await stub.Clear(cpb.ClearRequest(), timeout=args.timeout)
        if args.action == "evict":
            layout = layout_to_proto(KVLayout(**json.loads(args.layout)))
            hashes = [int(h, 16) for h in args.hash]
            request = cpb.EvictPrefixRequest(layout=layout, hashes=hashes)
            return await stub.EvictPrefix(request, timeout=args.timeout)
        return await stub.Stats(kv_pb2.StatsRequest(), timeout=args.timeout)

    return call


def facilities_call(args: argparse.Namespace) -> Call:
    async def call(channel: grpc.aio.Channel) -> Message:
        stub = control_pb2_grpc.FacilitiesControlStub(channel)
        t = args.timeout
        if args.action == "fault":
            request = cpb.SetFaultRequest(
                rack=args.rack, kind=args.kind, power_cap_kw=args.power_cap_kw
            )
            return await stub.SetFault(request, timeout=t)
        if args.action == "clear":
            return await stub.ClearFaults(cpb.RackRequest(rack=args.rack), timeout=t)
        if args.action == "drain":
            request = cpb.DrainRackRequest(rack=args.rack, reason=args.reason)
            return await stub.DrainRack(request, timeout=t)
        if args.action == "undrain":
            return await stub.UndrainRack(cpb.RackRequest(rack=args.rack), timeout=t)
        return await stub.ListRacks(cpb.ListRacksRequest(), timeout=t)

    return call


def security_for(args: argparse.Namespace, saved: dict[str, str] | None = None) -> GrpcSecurity:
    """The call's credentials: the options, else the environment, else the running `up`'s."""
    saved = running.load() if saved is None else saved
    overrides: dict[str, Any] = {}
    token = args.token or os.environ.get("TOKENYARD_GRPC_TOKEN") or saved.get("grpc_token")
    if token:
        overrides["token"] = token
    if args.target == "facilities":
        admin = (
            args.admin_token
            or os.environ.get("TOKENYARD_FACILITIES_ADMIN_TOKEN")
            or saved.get("facilities_admin_token")
        )
        if admin:  # it opens reads too; the facilities service checks it per call
            overrides["token"] = admin
    return GrpcSecurity(**overrides)


def address_for(args: argparse.Namespace, saved: dict[str, str]) -> str:
    if args.target != "facilities" or args.addr:
        return str(args.addr)
    return saved.get("facilities_control") or DEFAULT_FACILITIES


async def call(addr: str, security: GrpcSecurity, do: Call) -> Message:
    channel = open_channel(addr, [], security)
    try:
        return await do(channel)
    finally:
        await channel.close()


def run(args: argparse.Namespace) -> int:
    calls = {"worker": worker_call, "kvcache": kvcache_call, "facilities": facilities_call}
    saved = running.load()
    security, addr = security_for(args, saved), address_for(args, saved)
    try:
        reply = asyncio.run(call(addr, security, calls[args.target](args)))
    except grpc.aio.AioRpcError as exc:
        print(f"tokenyard ctl: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (ValueError, TypeError) as exc:  # a bad --layout or --hash
        print(f"tokenyard ctl: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2))
    return 0
