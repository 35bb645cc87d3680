"""`tokenyard nats-config`: the deployment's NATS users, one source for compose and
Kubernetes, with passwords only ever in the environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tokenyard.bus import auth, nats_config, subjects
from tokenyard.bus.nats import connection_inbox_prefix
from tokenyard.cli import main

ROOT = Path(__file__).resolve().parents[2]
USERS_CONF = ROOT / "infra" / "nats" / "users.conf"
CONFIGMAP = ROOT / "infra" / "k8s" / "base" / "nats-users.yaml"


def test_the_checked_in_configs_are_what_the_command_writes(capsys):
    """After a permission changes in tokenyard.bus.auth, rerun the two commands in the
    module docstring of tokenyard.cli.nats_config."""
    assert main(["nats-config"]) == 0
    assert capsys.readouterr().out == USERS_CONF.read_text()
    assert main(["nats-config", "--format", "configmap"]) == 0
    assert capsys.readouterr().out == CONFIGMAP.read_text()


def test_the_config_holds_no_password_only_variables():
    text = USERS_CONF.read_text()
    users = auth.deployment_users()
    assert {u.name for u in users} == {
        "operator",
        "router",
        "gateway",
        "prefill",
        "decode",
        "facilities",
        "telemetry",
    }
    for user in users:
        assert f'"user": "{user.name}"' in text
        assert f'"password": ${auth.password_variable(user.name)},' in text
        assert user.password not in text
    configmap = yaml.safe_load(CONFIGMAP.read_text())
    assert configmap["data"]["users.conf"] == auth.deployment_config(users)


def test_a_pool_user_may_do_what_any_worker_of_its_role_may():
    prefill = auth.pool("prefill")
    assert prefill.name == "prefill" and prefill.replies
    assert subjects.heartbeat("prefill", "*") in prefill.publish
    assert subjects.heartbeat("decode", "*") not in prefill.publish
    assert subjects.decode_jobs("*") in prefill.subscribe
    assert subjects.drain("*") in prefill.subscribe
    assert subjects.FACILITIES_STATE_ALL not in prefill.publish


def test_fresh_passwords_are_strings_to_nats_server_and_differ_each_time():
    env = dict(line.split("=", 1) for line in nats_config.env_text().splitlines())
    again = dict(line.split("=", 1) for line in nats_config.env_text().splitlines())
    names = [auth.password_variable(u.name) for u in auth.deployment_users()]
    assert list(env) == names
    for name, password in env.items():
        assert auth.check_password(name, password) == password
        assert again[name] != password
    secret = yaml.safe_load(nats_config.secret_text())
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == nats_config.SECRET
    assert set(secret["stringData"]) == {
        nats_config.secret_key(u.name) for u in auth.deployment_users()
    }
    assert all(auth.PASSWORD.fullmatch(p) for p in secret["stringData"].values())


@pytest.mark.parametrize("password", ["0123456789abcdefgh", "true", "short1", "has space inside x"])
def test_a_password_nats_server_would_misread_is_refused(password):
    with pytest.raises(ValueError, match="starting with a letter"):
        auth.check_password("X", password)


def test_a_service_on_an_external_nats_takes_the_urls_credentials_or_its_own():
    password = auth.new_password()
    env = {auth.password_variable("decode"): password}
    assert auth.credentials_from_env("nats://h:4222", "decode", env) == (
        f"nats://decode:{password}@h:4222"
    )
    # The URL's own credentials win; without either, the URL is used as it is.
    assert auth.credentials_from_env("nats://op:pw@h:4222", "decode", env) == (
        "nats://op:pw@h:4222"
    )
    assert auth.credentials_from_env("nats://h:4222", "router", env) == "nats://h:4222"
    with pytest.raises(ValueError, match="TOKENYARD_NATS_ROUTER_PASSWORD"):
        auth.credentials_from_env(
            "nats://h:4222", "router", {"TOKENYARD_NATS_ROUTER_PASSWORD": "1234"}
        )


def test_each_user_reads_its_own_inbox_only():
    users = [*auth.deployment_users()[1:], auth.worker("decode", "decode-2"), auth.gateway("g")]
    for user in users:
        inboxes = [s for s in user.subscribe if s.startswith("_INBOX")]
        assert inboxes == [f"_INBOX.{user.name}.>"], user.name
    assert auth.pool("decode").subscribe[-1] == "_INBOX.decode.>"  # shared by the pool
    assert connection_inbox_prefix("nats://router:pw@h:4222") == "_INBOX.router"
    assert connection_inbox_prefix("nats://h:1,nats://worker-d1:pw@h:2") == "_INBOX.worker-d1"
    assert connection_inbox_prefix("nats://h:4222") == "_INBOX"  # no user: nats-py's own
    with pytest.raises(ValueError, match="inbox"):
        auth.inbox_prefix("a.b")


def test_a_worker_may_make_only_its_own_consumer_and_nobody_deletes_the_stream():
    worker = auth.worker("prefill", "p1")
    creates = [s for s in worker.publish if ".CONSUMER.CREATE." in s or "DURABLE" in s]
    assert creates == ["$JS.API.CONSUMER.CREATE.TY_PREFILL.prefill-p1.ty.prefill.jobs.p1"]
    assert not [s for s in worker.publish if ".STREAM." in s and ".INFO." not in s]
    gateway = auth.gateway_pool()
    assert [s for s in gateway.publish if ".STREAM." in s] == [
        "$JS.API.STREAM.CREATE.TY_PREFILL",
        "$JS.API.STREAM.UPDATE.TY_PREFILL",
        "$JS.API.STREAM.INFO.TY_PREFILL",
    ]
    assert not [s for s in gateway.publish if ".CONSUMER." in s]


def test_the_sender_of_a_heartbeat_or_kv_event_is_its_subject():
    assert subjects.heartbeat_sender(subjects.heartbeat("decode", "d-1")) == ("decode", "d-1")
    assert subjects.kv_events_sender(subjects.kv_events("d-1")) == "d-1"
    for other in ("ty.workers.decode.d-1.heartbeat.x", "ty.kv.events", subjects.kv_events("d")):
        assert subjects.heartbeat_sender(other) is None
    assert subjects.kv_events_sender(subjects.heartbeat("decode", "d-1")) is None


def test_a_drain_needs_the_operators_token_where_servers_know_identities():
    from tokenyard.grpc_security import GrpcSecurity, fresh_tokens, peers_text

    tokens = fresh_tokens()
    worker = GrpcSecurity(token=tokens["prefill"], peers=peers_text(tokens))
    control = "tokenyard.v1.WorkerControl"

    def allowed(headers: dict[str, str] | None) -> bool:
        return worker.may_call(auth.control_token(headers), control)

    assert allowed(auth.control_headers(tokens["operator"]))
    assert not allowed(auth.control_headers(tokens["prefill"]))  # a worker's own token
    assert not allowed(auth.control_headers("guess"))
    assert not allowed(None)
    assert not allowed({"traceparent": "00-x"})
    assert GrpcSecurity().may_call("", control)  # an open stack, as its gRPC control API
