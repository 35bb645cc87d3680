"""gRPC with mutual TLS: a throwaway CA signs a server and a client certificate; the
KV-cache service (KVCache and KVCacheAdmin) and a worker's control server then answer only
clients that show a certificate from that CA."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tokenyard.grpc_security import GrpcSecurity, open_channel
from tokenyard.kv.hashing import prefix_block_hashes
from tokenyard.kv.layout import KVLayout
from tokenyard.kv.store.client import KVCacheClient, KVCacheError
from tokenyard.kv.transfer import KVTransferClient, KVTransferError, KVTransferServer
from tokenyard.services.kvcache.server import serve
from tokenyard.services.kvcache.settings import KVCacheSettings
from tokenyard.v1 import control_pb2_grpc, kv_pb2

LAYOUT = KVLayout("tiny", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


@dataclass
class Pki:
    ca: Path
    server: tuple[Path, Path]  # cert, key
    client: tuple[Path, Path]
    rogue: tuple[Path, Path]  # a client certificate from another CA
    node: tuple[Path, Path]  # one identity for both ends, as a worker has


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(
    path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> tuple[Path, Path]:
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    path.with_suffix(".key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path.with_suffix(".crt"), path.with_suffix(".key")


def _ca(cn: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(_name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey], cn: str, *usage: x509.ObjectIdentifier
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(ca[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage(list(usage)), critical=False)
        .sign(ca[1], hashes.SHA256())
    )
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca = _ca("tokenyard test CA")
    (d / "ca.crt").write_bytes(ca[0].public_bytes(serialization.Encoding.PEM))
    other = _ca("someone else's CA")
    return Pki(
        ca=d / "ca.crt",
        server=_write(d / "server", *_leaf(ca, "kvcache", ExtendedKeyUsageOID.SERVER_AUTH)),
        client=_write(d / "client", *_leaf(ca, "worker", ExtendedKeyUsageOID.CLIENT_AUTH)),
        rogue=_write(d / "rogue", *_leaf(other, "rogue", ExtendedKeyUsageOID.CLIENT_AUTH)),
        node=_write(
            d / "node",
            *_leaf(ca, "worker", ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
        ),
    )


def security(pki: Pki, pair: tuple[Path, Path] | None, *, ca: bool = True) -> GrpcSecurity:
    cert, key = pair or ("", "")
    return GrpcSecurity(tls_cert=str(cert), tls_key=str(key), tls_ca=str(pki.ca) if ca else "")


@pytest.fixture
async def mtls_kvcache(pki):
    server = await serve(
        KVCacheSettings(port=0, ram_bytes=1 << 20, shutdown_grace_s=0), security(pki, pki.server)
    )
    yield server
    await server.stop()


async def test_a_client_with_a_certificate_from_the_ca_is_served(pki, mtls_kvcache):
    hashes = prefix_block_hashes(list(range(8)), LAYOUT.block_size)
    src = torch.randn(LAYOUT.pool_shape(4))
    client_tls = security(pki, pki.client)
    async with KVCacheClient(mtls_kvcache.endpoint, security=client_tls) as worker:
        assert await worker.put_blocks(LAYOUT, hashes, src, [0, 1]) == 2
        dst = torch.zeros(LAYOUT.pool_shape(4))
        assert await worker.get_prefix(LAYOUT, hashes, dst, [2, 3]) == 2
        assert torch.equal(dst[2:], src[:2])
    channel = open_channel(mtls_kvcache.endpoint, [], client_tls)
    stats = await control_pb2_grpc.KVCacheAdminStub(channel).Stats(kv_pb2.StatsRequest())
    assert stats.hits == 2
    await channel.close()


@pytest.mark.parametrize("who", ["no certificate", "another CA's certificate", "plaintext"])
async def test_a_client_without_a_good_certificate_is_refused(pki, mtls_kvcache, who):
    client_tls = {
        "no certificate": security(pki, None),
        "another CA's certificate": security(pki, pki.rogue),
        "plaintext": GrpcSecurity(),
    }[who]
    async with KVCacheClient(mtls_kvcache.endpoint, timeout_s=5, security=client_tls) as c:
        with pytest.raises(KVCacheError, match="UNAVAILABLE"):
            await c.contains(LAYOUT, [1, 2])
    # ...and the server still serves a good client afterwards.
    async with KVCacheClient(mtls_kvcache.endpoint, security=security(pki, pki.client)) as ok:
        assert await ok.contains(LAYOUT, [1, 2]) == 0


async def test_a_client_refuses_a_server_its_ca_did_not_sign(pki, tmp_path):
    # The server shows the rogue CA's certificate; the client trusts only the test CA.
    server = await serve(
        KVCacheSettings(port=0, ram_bytes=1 << 20, shutdown_grace_s=0),
        GrpcSecurity(tls_cert=str(pki.rogue[0]), tls_key=str(pki.rogue[1])),
    )
    try:
        async with KVCacheClient(
            server.endpoint, timeout_s=5, security=security(pki, pki.client)
        ) as c:
            with pytest.raises(KVCacheError, match="UNAVAILABLE"):
                await c.contains(LAYOUT, [1])
    finally:
        await server.stop()


def test_tls_is_off_by_default():
    assert not GrpcSecurity().tls and GrpcSecurity().tls_ca == ""


async def test_kv_transfer_between_workers_over_mutual_tls(pki, monkeypatch):
    """Workers take TLS from TOKENYARD_GRPC_TLS_*, one certificate for both ends."""
    monkeypatch.setenv("TOKENYARD_GRPC_TLS_CERT", str(pki.node[0]))
    monkeypatch.setenv("TOKENYARD_GRPC_TLS_KEY", str(pki.node[1]))
    monkeypatch.setenv("TOKENYARD_GRPC_TLS_CA", str(pki.ca))
    src = torch.randn(LAYOUT.pool_shape(4))
    released: list[str] = []
    sender = KVTransferServer(src, LAYOUT, on_release=released.append, allowed=["grpc"])
    endpoint = await sender.start()
    try:
        sender.offer("r1", [0, 1])
        dst = torch.zeros(LAYOUT.pool_shape(4))
        async with KVTransferClient(dst, LAYOUT, allowed=["grpc"]) as receiver:
            result = await receiver.pull(endpoint, "r1", [0, 1], [2, 3])
        assert result.transport == "grpc" and released == ["r1"]
        assert torch.equal(dst[2:], src[:2])

        # A receiver without the certificate cannot even ask.
        sender.offer("r2", [0, 1])
        monkeypatch.delenv("TOKENYARD_GRPC_TLS_CERT")
        monkeypatch.delenv("TOKENYARD_GRPC_TLS_KEY")
        async with KVTransferClient(dst, LAYOUT, allowed=["grpc"]) as stranger:
            with pytest.raises(KVTransferError, match="UNAVAILABLE"):
                await stranger.pull(endpoint, "r2", [0, 1], [2, 3])
    finally:
        await sender.stop()
