"""Advertised addresses: a peer is never told to dial 0.0.0.0."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from tokenyard.kv.transfer.common import host_id
from tokenyard.net import advertise_address, host_address, host_endpoint, is_wildcard
from tokenyard.services.worker.settings import WorkerSettings


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", ""])
def test_wildcard_binds_advertise_this_hosts_own_address(host):
    advertised = advertise_address(host)
    assert not is_wildcard(advertised)
    assert advertised == host_address()
    ipaddress.ip_address(advertised)  # a literal address, not a name


def test_a_bound_interface_is_its_own_advertised_address():
    assert advertise_address("127.0.0.2") == "127.0.0.2"
    assert advertise_address("10.1.2.3") == "10.1.2.3"


def test_the_setting_wins_and_may_not_be_a_wildcard():
    assert advertise_address("0.0.0.0", "prefill-0.prefill.tokenyard.svc") == (
        "prefill-0.prefill.tokenyard.svc"
    )
    with pytest.raises(ValueError, match="wildcard"):
        advertise_address("127.0.0.1", "0.0.0.0")


def test_ipv6_endpoints_are_bracketed():
    assert host_endpoint("::1", 50051) == "[::1]:50051"
    assert host_endpoint("10.0.0.7", 50051) == "10.0.0.7:50051"
    assert host_endpoint("kvcache", 50070) == "kvcache:50070"


def test_worker_settings_advertise(monkeypatch):
    monkeypatch.setenv("TOKENYARD_WORKER_HOST", "0.0.0.0")
    assert WorkerSettings().advertised_host == host_address()
    monkeypatch.setenv("TOKENYARD_WORKER_ADVERTISE_HOST", "10.4.0.12")
    assert WorkerSettings().advertised_host == "10.4.0.12"
    monkeypatch.setenv("TOKENYARD_WORKER_ADVERTISE_HOST", "0.0.0.0")
    with pytest.raises(ValueError, match="advertise_host"):
        WorkerSettings()


def test_host_id_names_this_kernel_and_this_dev_shm():
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert host_id().startswith(boot)
