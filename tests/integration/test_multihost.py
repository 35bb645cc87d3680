"""Two workers that reach each other only by their own addresses, as on two hosts.

The prefill worker binds 127.0.0.2 and keeps its KV pool out of shared memory (as on a host
of its own); the decode worker binds 127.0.0.3; NATS listens on 127.0.0.4. The prefill
worker must advertise the address it bound (never 127.0.0.1 or 0.0.0.0), the decode worker
must pull the prompt's KV from there over a network transport (Mooncake or gRPC, never
shared memory), and the answer must be the offline engine's greedy answer.
"""

from __future__ import annotations

import ipaddress
import os
import re
import struct

import pytest
from worker_client import Heartbeats, Request, connect, wait_disaggregated

from tokenyard.bus.embedded import EmbeddedNats
from tokenyard.services.launch.stack import StackConfig
from tokenyard.v1 import serving_pb2 as pb

pytestmark = pytest.mark.slow

PREFILL_HOST, DECODE_HOST, NATS_HOST = "127.0.0.2", "127.0.0.3", "127.0.0.4"
PROMPT = "Describe a lighthouse keeper's day, hour by hour, in plain words. " * 5
MAX_TOKENS = 12


def listening_addresses(pid: int, port: int) -> set[str]:
    """The addresses on which process `pid` listens on TCP `port` (/proc/net/tcp and tcp6;
    an IPv4-mapped IPv6 address as its IPv4 form, a wildcard as 0.0.0.0 or ::)."""
    fds = f"/proc/{pid}/fd"
    inodes = set()
    for fd in os.listdir(fds):
        target = os.readlink(f"{fds}/{fd}") if os.path.islink(f"{fds}/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as rows:
            for line in rows.readlines()[1:]:
                fields = line.split()
                address, port_hex = fields[1].split(":")
                if fields[3] == "0A" and int(port_hex, 16) == port and fields[9] in inodes:
                    found.add(kernel_address(address))
    return found


def kernel_address(hex_address: str) -> str:
    """/proc/net's hex address: 32-bit words in host (little-endian) order."""
    raw = b"".join(
        struct.pack("<I", int(hex_address[i : i + 8], 16)) for i in range(0, len(hex_address), 8)
    )
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw))
    v6 = ipaddress.IPv6Address(raw)
    return str(v6.ipv4_mapped or v6)


@pytest.fixture(scope="module")
def stack(launch_stack):
    with EmbeddedNats(host=NATS_HOST) as nats:
        config = StackConfig(
            prefill=0,
            decode=0,
            nats_url=nats.url,
            gateway=False,
            kvcache=False,
            facilities=False,
            router_env={"TOKENYARD_ROUTER_DISAGGREGATION": "always"},
            worker_env={
                "TOKENYARD_WORKER_KV_CACHE_BYTES": str(64 << 20),
                "TOKENYARD_WORKER_NUM_THREADS": "1",
            },
        )
        with launch_stack(config) as s:
            s.add_worker(
                "prefill",
                worker_id="prefill-a",
                env={
                    "TOKENYARD_WORKER_HOST": PREFILL_HOST,
                    "TOKENYARD_WORKER_KV_SHARED_MEMORY": "false",
                },
            )
            s.add_worker("decode", worker_id="decode-b", env={"TOKENYARD_WORKER_HOST": DECODE_HOST})
            yield s


async def test_handoff_moves_kv_between_two_addresses(stack, make_engine):
    from tokenyard import SamplingParams

    engine = make_engine(kv_cache_bytes=64 << 20)
    prompt = engine.tokenizer.encode(PROMPT)
    bus = await connect(stack.nats_url)
    beats = await Heartbeats().start(bus)
    assert await beats.wait_for(lambda b: {"prefill-a", "decode-b"} <= set(b), 240), (
        stack.describe_failures()
    )
    prefill = beats.latest["prefill-a"]
    assert prefill.host == PREFILL_HOST
    assert prefill.kv_endpoint.startswith(f"{PREFILL_HOST}:")
    assert beats.latest["decode-b"].host == DECODE_HOST
    kv_port = int(prefill.kv_endpoint.rsplit(":", 1)[1])
    # Bound to its own address only (not 127.0.0.1, not 0.0.0.0). Asked of the kernel for
    # the worker's own sockets: a connect to 127.0.0.1 can reach another process's listener
    # that happens to have the same port number.
    worker_pid = next(p.pid for p in stack.procs if p.name == "prefill-a")
    assert listening_addresses(worker_pid, kv_port) == {PREFILL_HOST}

    await wait_disaggregated(bus, prompt)
    params = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, top_p=1.0, ignore_eos=True)
    req = Request(bus, prompt, params)
    assert (await req.submit()).placement.disaggregated
    result = await req.wait(120)
    await bus.close()
    assert result.chunks[0].worker_id == "prefill-a" and result.last.worker_id == "decode-b"

    # The decode worker pulled the prompt's blocks over the network, and did not recompute.
    log = (stack.log_dir / "decode-b.log").read_text()
    pulls = re.findall(rf"KV pull {req.rid}: (\d+) blocks, [\d.]+ MB via (\w+)", log)
    assert pulls, log[-3000:]
    blocks, transport = int(pulls[0][0]), pulls[0][1]
    assert transport in ("mooncake", "grpc"), transport
    print(f"KV hand-off between {PREFILL_HOST} and {DECODE_HOST}: {blocks} blocks via {transport}")
    assert blocks == -(-len(prompt) // 16)  # every block the prompt fills, the last partly
    assert f"KV pull {req.rid} from" not in log  # the failure line ("... failed; recomputing")

    # ...and those blocks were the right ones: the answer is the offline greedy answer.
    want = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    engine.add_request("offline", prompt, want)
    offline = engine.seqs["offline"]
    while engine.has_unfinished():
        engine.step()
    assert result.token_ids == offline.output_token_ids
