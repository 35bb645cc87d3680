"""Which address a service tells its peers to reach it at.

A service binds one address and advertises another when the bound one means nothing to a
peer: ``0.0.0.0`` (every interface, as in a container) is where to listen, never where to
connect. The rule, in order:

1. the operator's advertise setting (in Kubernetes, the pod IP from the downward API);
2. the bound address itself, when it names one interface (``127.0.0.2``, ``10.1.2.3``);
3. for a wildcard bind, this host's own address: what its hostname resolves to (a
   container's or a pod's IP, from /etc/hosts), else the source address of its default
   route, else loopback (a host with no network at all is its own only peer).
"""

from __future__ import annotations

import ipaddress
import socket
from functools import cache

WILDCARDS = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
# A documentation address (TEST-NET-1): connecting a UDP socket to it only asks the kernel
# which source address its route would use; no packet is ever sent.
_ROUTE_PROBE = ("192.0.2.1", 9)


def is_wildcard(host: str) -> bool:
    return host.strip() in WILDCARDS


def advertise_address(bind_host: str, advertise: str = "") -> str:
    """The address peers should connect to, for a server bound to ``bind_host``."""
    if advertise:
        if is_wildcard(advertise):
            raise ValueError(f"cannot advertise the wildcard address {advertise!r}")
        return advertise
    if not is_wildcard(bind_host):
        return bind_host
    return host_address()


def host_endpoint(host: str, port: int) -> str:
    """``host:port``, with an IPv6 literal in brackets as gRPC and URLs want it."""
    try:
        if ipaddress.ip_address(host).version == 6:
            return f"[{host}]:{port}"
    except ValueError:  # a name, not a literal
        pass
    return f"{host}:{port}"


@cache
def host_address() -> str:
    """This host's address as its peers see it (see the module docstring, step 3)."""
    return _hostname_address() or _default_route_address() or "127.0.0.1"


def _hostname_address() -> str | None:
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return None
    return None if ipaddress.ip_address(address).is_loopback else address


def _default_route_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(_ROUTE_PROBE)
            address = str(probe.getsockname()[0])
    except OSError:  # no route at all
        return None
    return None if is_wildcard(address) else address
