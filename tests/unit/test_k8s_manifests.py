"""infra/k8s: every manifest of every overlay valid against the Kubernetes API schemas
(kubernetes-validate, strict) or, for KEDA's ScaledObject, against its CRD's schema; and
wired the way docs/deploy.md says."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kustomize_render import containers, render
from service_settings import SETTINGS

from tokenyard.bus import auth
from tokenyard.bus.embedded import nats_server_binary
from tokenyard.bus.nats_config import CONFIG_FILE, SECRET, secret_key

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"
OVERLAYS = ["cpu", "gpu"]
KUBERNETES_VERSION = "1.30.0"  # the oldest release the manifests promise to work on
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): Path(__file__).parent
    / "schemas"
    / "keda-scaledobject-v1alpha1.json"
}
SERVICES = {"gateway", "router", "prefill", "decode", "kvcache", "facilities", "telemetry"}
ADAPTER = K8S / "prometheus-adapter"


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S / "overlays" / request.param)


def by(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_every_manifest_is_valid(overlay):
    _, docs = overlay
    for doc in docs:
        schema = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if schema is not None:
            jsonschema.validate(doc, json.loads(schema.read_text()))
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_a_broken_manifest_is_caught():
    """The validators above do reject: a misspelt field in a Deployment and a ScaledObject."""
    deployment = by(render(K8S / "base"), "Deployment")["gateway"]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    scaled = by(render(K8S / "base"), "ScaledObject")["prefill"]
    scaled["spec"]["minReplicas"] = 1
    schema = json.loads(CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")].read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(scaled, schema)


def test_every_service_runs_with_probes_and_resources(overlay):
    _, docs = overlay
    workloads = by(docs, "Deployment") | by(docs, "StatefulSet")
    assert set(workloads) >= SERVICES | {"nats", "redis"}
    for name, doc in workloads.items():
        assert doc["metadata"]["namespace"] == "tokenyard"
        for c in containers(doc):
            assert c["resources"]["requests"], (name, c["name"])
            assert c.get("readinessProbe") and c.get("livenessProbe"), (name, c["name"])
        if name in SERVICES:
            main = containers(doc)[0]
            assert main["readinessProbe"]["httpGet"]["path"] == "/ready", name
            assert main["livenessProbe"]["httpGet"]["path"] == "/health", name


def test_every_tokenyard_setting_exists(overlay):
    _, docs = overlay
    for doc in by(docs, "Deployment").values():
        for name in env_of(containers(doc)[0]):
            if name.startswith("TOKENYARD_KV_TRANSFER_"):
                continue
            if name.startswith("TOKENYARD_"):
                prefix = next(p for p in SETTINGS if name.startswith(p))
                field = name.removeprefix(prefix).lower()
                assert field in SETTINGS[prefix].model_fields, f"{name} is no setting"


def test_nats_is_a_three_node_jetstream_cluster(overlay):
    _, docs = overlay
    nats = by(docs, "StatefulSet")["nats"]
    assert nats["spec"]["replicas"] == 3
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    conf = by(docs, "ConfigMap")["nats-config"]["data"]["nats.conf"]
    assert "jetstream" in conf and conf.count("nats-headless:6222") == 3
    assert by(docs, "PodDisruptionBudget")["nats"]["spec"]["maxUnavailable"] == 1
    # Whoever creates the work queue asks for three copies of it.
    for name in ("gateway", "prefill"):
        env = env_of(containers(by(docs, "Deployment")[name])[0])
        assert next(v["value"] for k, v in env.items() if k.endswith("JETSTREAM_REPLICAS")) == "3"


def test_workers_advertise_their_pod_ip_and_scale_independently(overlay):
    name, docs = overlay
    deployments = by(docs, "Deployment")
    for role in ("prefill", "decode"):
        worker = containers(deployments[role])[0]
        env = env_of(worker)
        assert env["TOKENYARD_WORKER_ROLE"]["value"] == role
        assert env["TOKENYARD_WORKER_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == (
            "status.podIP"
        )
        assert env["TOKENYARD_WORKER_KVCACHE_ENDPOINT"]["value"] == "kvcache:50070"
        gpus = worker["resources"].get("limits", {}).get("nvidia.com/gpu")
        assert (gpus == "1") if name == "gpu" else gpus is None
    assert by(docs, "ScaledObject")["prefill"]["spec"]["scaleTargetRef"]["name"] == "prefill"
    trigger = by(docs, "ScaledObject")["prefill"]["spec"]["triggers"][0]
    assert 'stream_name="TY_PREFILL"' in trigger["metadata"]["query"]
    hpa = by(docs, "HorizontalPodAutoscaler")["decode"]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "decode"
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "tokenyard_num_requests_waiting"


def test_budgets_select_real_pods(overlay):
    _, docs = overlay
    pods = [d["spec"]["template"] for d in docs if "template" in d.get("spec", {})]
    labels = [pod["metadata"]["labels"] for pod in pods]
    for name, pdb in by(docs, "PodDisruptionBudget").items():
        want = pdb["spec"]["selector"]["matchLabels"].items()
        assert any(want <= pod.items() for pod in labels), name


def test_only_the_gateway_is_reachable_from_outside(overlay):
    _, docs = overlay
    assert all(
        s["spec"].get("type", "ClusterIP") == "ClusterIP" for s in by(docs, "Service").values()
    )
    ingress = by(docs, "Ingress")["gateway"]["spec"]["rules"][0]["http"]["paths"]
    assert {p["backend"]["service"]["name"] for p in ingress} == {"gateway"}
    policies = by(docs, "NetworkPolicy")
    assert policies["default-deny-ingress"]["spec"] == {
        "podSelector": {},
        "policyTypes": ["Ingress"],
    }
    # Every rule that admits traffic from anywhere (no `from`) selects the gateway alone.
    for name, policy in policies.items():
        for rule in policy["spec"].get("ingress", []):
            if not rule.get("from"):
                assert policy["spec"]["podSelector"] == {
                    "matchLabels": {"app.kubernetes.io/name": "gateway"}
                }, name


def test_kustomizations_only_use_what_the_renderer_knows():
    for path in K8S.rglob("kustomization.yaml"):
        assert yaml.safe_load(path.read_text())["kind"] == "Kustomization"


def test_nats_clients_log_in_as_their_own_user_with_a_password_from_the_secret(overlay):
    _, docs = overlay
    users = {u.name for u in auth.deployment_users()}
    for name, doc in by(docs, "Deployment").items():
        if name in ("kvcache", "redis"):  # no NATS
            continue
        env = containers(doc)[0]["env"]
        names = [e["name"] for e in env]
        url = next(e["value"] for e in env if e["name"].endswith("_NATS_URL"))
        # Kubernetes expands $(VAR) only from variables defined before it.
        assert url == f"nats://{name}:$(NATS_PASSWORD)@nats:4222", name
        assert names.index("NATS_PASSWORD") < names.index(next(n for n in names if "NATS_URL" in n))
        ref = env[names.index("NATS_PASSWORD")]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": SECRET, "key": secret_key(name)} and name in users


def test_nats_reads_the_generated_users_and_every_password(overlay):
    _, docs = overlay
    nats = by(docs, "StatefulSet")["nats"]
    sources = next(v for v in nats["spec"]["template"]["spec"]["volumes"] if v["name"] == "config")
    maps = [s["configMap"]["name"] for s in sources["projected"]["sources"]]
    assert maps == ["nats-config", "nats-users"]
    users_conf = by(docs, "ConfigMap")["nats-users"]["data"][CONFIG_FILE]
    assert users_conf == auth.deployment_config(auth.deployment_users())
    assert f"include ./{CONFIG_FILE}" in by(docs, "ConfigMap")["nats-config"]["data"]["nats.conf"]
    env = env_of(containers(nats)[0])
    for user in auth.deployment_users():
        ref = env[auth.password_variable(user.name)]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": SECRET, "key": secret_key(user.name)}
        assert "optional" not in ref  # no Secret, no NATS: never one without passwords


def test_nats_server_accepts_the_cluster_config_with_its_users(tmp_path):
    docs = render(K8S / "base")
    configs = by(docs, "ConfigMap")
    for name in ("nats-config", "nats-users"):
        for file, text in configs[name]["data"].items():
            (tmp_path / file).write_text(text)
    env = {auth.password_variable(u.name): auth.new_password() for u in auth.deployment_users()}
    argv = [nats_server_binary(), "-t", "-c", str(tmp_path / "nats.conf")]
    ok = subprocess.run(argv, capture_output=True, text=True, env={**env, "POD_NAME": "nats-0"})
    assert ok.returncode == 0, ok.stderr
    # A missing password stops the server: the test above is not vacuous.
    del env[auth.password_variable("decode")]
    bad = subprocess.run(argv, capture_output=True, text=True, env={**env, "POD_NAME": "nats-0"})
    assert bad.returncode != 0 and "TOKENYARD_NATS_DECODE_PASSWORD" in bad.stderr


def test_prometheus_adapter_is_valid_and_serves_the_decode_hpa_its_metric():
    docs = render(ADAPTER)
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    api = by(docs, "APIService")["v1beta1.custom.metrics.k8s.io"]["spec"]
    service = by(docs, "Service")[api["service"]["name"]]
    assert service["metadata"]["namespace"] == api["service"]["namespace"]
    adapter = by(docs, "Deployment")["prometheus-adapter"]
    pod = adapter["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    main = containers(adapter)[0]
    assert main["readinessProbe"] and main["livenessProbe"]
    assert pod["spec"]["serviceAccountName"] == "prometheus-adapter"
    # The RoleBinding that reads the API server's authentication settings stays in kube-system.
    assert by(docs, "RoleBinding")["prometheus-adapter-auth-reader"]["metadata"]["namespace"] == (
        "kube-system"
    )
    # --config is the mounted ConfigMap, whose rules name the metric the HPA asks for.
    config = next(a.split("=", 1)[1] for a in main["args"] if a.startswith("--config="))
    mount = next(m for m in main["volumeMounts"] if config.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    data = by(docs, "ConfigMap")[volume["configMap"]["name"]]["data"]
    rules = yaml.safe_load(data[config.rsplit("/", 1)[1]])["rules"]
    served = {r["name"]["as"]: r["seriesQuery"] for r in rules}
    hpa = by(render(K8S / "base"), "HorizontalPodAutoscaler")["decode"]["spec"]
    wanted = hpa["metrics"][0]["pods"]["metric"]["name"]
    series = re.match(r"([\w:]+)\{", served[wanted]).group(1)
    worker_metrics = (K8S.parents[1] / "services" / "worker" / "metrics.py").read_text()
    assert f'"{series}"' in worker_metrics


def test_power_autoscaling_scales_both_pools_through_the_facilities_scaler():
    """infra/k8s/power-autoscaling: valid ScaledObjects whose external trigger reaches the
    port the facilities service serves its KEDA scaler on, one per pool."""
    docs = render(K8S / "power-autoscaling")
    schema = json.loads(CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")].read_text())
    facilities = render(K8S / "base")
    service = by(facilities, "Service")["facilities"]["spec"]["ports"]
    scaler_port = next(p["port"] for p in service if p["name"] == "scaler")
    env = env_of(containers(by(facilities, "Deployment")["facilities"])[0])
    assert env["TOKENYARD_FACILITIES_SCALER_PORT"]["value"] == str(scaler_port)
    objects = by(docs, "ScaledObject")
    assert set(objects) == {"prefill", "decode"}
    for role, scaled in objects.items():
        jsonschema.validate(scaled, schema)
        assert scaled["spec"]["scaleTargetRef"]["name"] == role
        (trigger,) = scaled["spec"]["triggers"]
        assert trigger["type"] == "external"
        assert trigger["metadata"] == {
            "scalerAddress": f"facilities.tokenyard.svc:{scaler_port}",
            "role": role,
        }
    for doc in docs:
        if doc["kind"] != "ScaledObject":
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    policy = by(docs, "NetworkPolicy")["scaler-from-keda"]["spec"]["ingress"][0]
    assert policy["ports"] == [{"protocol": "TCP", "port": scaler_port}]
