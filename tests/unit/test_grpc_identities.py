"""gRPC identities as pure logic: the peers setting, telling a token's identity, who may call
what, and the tokens `tokenyard grpc-config` makes for a deployment."""

from __future__ import annotations

import pytest
import yaml
from pydantic import ValidationError

from tokenyard.cli import grpc_config
from tokenyard.grpc_security import (
    CALLERS,
    IDENTITIES,
    OPERATOR,
    GrpcConfigError,
    GrpcSecurity,
    allowed,
    fresh_tokens,
    identify,
    parse_peers,
    peers_text,
    server_interceptors,
    token_digest,
)
from tokenyard.v1 import control_pb2, kv_pb2


def test_a_token_is_known_by_its_identity_and_no_other():
    tokens = fresh_tokens()
    assert set(tokens) == set(IDENTITIES) and len(set(tokens.values())) == len(tokens)
    peers = parse_peers(peers_text(tokens))
    assert set(peers.values()) == {token_digest(t) for t in tokens.values()}
    assert not any(t in peers_text(tokens) for t in tokens.values())  # digests only
    for name, token in tokens.items():
        assert identify(peers, token) == name
    assert identify(peers, "not-a-token") is None
    assert identify(peers, "") is None
    assert identify({}, tokens[OPERATOR]) is None


@pytest.mark.parametrize(
    "text",
    [
        "decode",
        "decode:abc",
        f"Decode:{'0' * 64}",
        f"decode:{'g' * 64}",
        f"decode:{'0' * 64},decode:{'1' * 64}",  # one identity twice
        f"decode:{'0' * 64},prefill:{'0' * 64}",  # one token for two identities
    ],
)
def test_a_malformed_peers_setting_fails_at_start(text):
    with pytest.raises(ValidationError, match="peers"):
        GrpcSecurity(peers=text)


def test_a_token_without_peers_is_refused_rather_than_served_open():
    with pytest.raises(GrpcConfigError, match="TOKENYARD_GRPC_PEERS"):
        server_interceptors(GrpcSecurity(token="a-token"))
    assert len(server_interceptors(GrpcSecurity())) == 1  # open: only the decoding check
    peers = peers_text(fresh_tokens())
    assert len(server_interceptors(GrpcSecurity(peers=peers))) == 2


def test_each_service_names_exactly_who_may_call_it():
    services = [
        *kv_pb2.DESCRIPTOR.services_by_name.values(),
        *control_pb2.DESCRIPTOR.services_by_name.values(),
    ]
    assert {s.full_name for s in services} == set(CALLERS)
    assert CALLERS["tokenyard.v1.KVTransfer"] == {"decode", "both"}  # who pulls KV
    # The router asks what the shared cache holds of a prompt, and nothing else.
    assert CALLERS["tokenyard.v1.KVCache"] == {"prefill", "decode", "both", "router"}
    assert allowed("router", "/tokenyard.v1.KVCache/Contains")
    for method in ("Put", "Get", "Stats"):
        assert not allowed("router", f"/tokenyard.v1.KVCache/{method}")
        assert allowed("prefill", f"/tokenyard.v1.KVCache/{method}")
    assert not allowed("router", "/tokenyard.v1.KVTransfer/Pull")
    for control in ("KVCacheAdmin", "WorkerControl", "FacilitiesControl"):
        assert CALLERS[f"tokenyard.v1.{control}"] == {OPERATOR}


@pytest.mark.parametrize("fmt", ["env", "secret"])
def test_grpc_config_gives_each_pool_a_token_and_servers_only_digests(fmt):
    tokens = fresh_tokens(grpc_config.IDENTITIES)
    text = grpc_config.FORMATS[fmt](tokens)
    if fmt == "env":
        values = dict(line.split("=", 1) for line in text.splitlines())
        peers = values[grpc_config.PEERS_VARIABLE]
        given = {name: values[grpc_config.token_variable(name)] for name in tokens}
    else:
        secret = yaml.safe_load(text)
        assert secret["metadata"]["name"] == grpc_config.SECRET
        peers = secret["stringData"][grpc_config.PEERS_KEY]
        given = {name: secret["stringData"][grpc_config.secret_key(name)] for name in tokens}
    assert given == tokens
    assert {identify(parse_peers(peers), t) for t in tokens.values()} == {
        "prefill",
        "decode",
        OPERATOR,
    }
