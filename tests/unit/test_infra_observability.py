"""infra/ observability configs agree with the code: the Grafana dashboard asks only for
metrics the services define, and Prometheus scrapes the ports the settings default to."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tokenyard.services.facilities.settings import FacilitiesSettings
from tokenyard.services.kvcache.settings import DEFAULT_OPS_PORT as KVCACHE_OPS
from tokenyard.services.router.settings import DEFAULT_OPS_PORT as ROUTER_OPS
from tokenyard.services.telemetry.settings import DEFAULT_PORT as TELEMETRY_PORT
from tokenyard.services.worker.settings import DEFAULT_OPS_PORT as WORKER_OPS

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = re.compile(r"_(total|bucket|count|sum)$")


def source_text() -> str:
    files = [*ROOT.glob("shared/**/*.py"), *ROOT.glob("services/**/*.py")]
    return "\n".join(p.read_text() for p in files)


def test_the_dashboard_and_alerts_use_only_defined_metrics():
    dashboard = json.loads((ROOT / "infra/grafana/dashboards/tokenyard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    alerts = yaml.safe_load((ROOT / "infra/prometheus/alerts.yml").read_text())
    exprs += [r["expr"] for g in alerts["groups"] for r in g["rules"]]
    names = {SUFFIXES.sub("", n) for e in exprs for n in re.findall(r"tokenyard[:_][a-z0-9_:]+", e)}
    assert len(names) >= 20
    code = source_text()
    undefined = sorted(n for n in names if f'"{n}"' not in code)
    assert undefined == []


def test_prometheus_scrapes_the_default_ports():
    config = yaml.safe_load((ROOT / "infra/prometheus/prometheus.yml").read_text())
    ports: dict[str, int] = {}
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            ports[job["job_name"]] = int(static["targets"][0].rsplit(":", 1)[1])
        for dns in job.get("dns_sd_configs", []):
            ports[job["job_name"]] = int(dns["port"])
    facilities_port = FacilitiesSettings.model_fields["port"].default
    assert ports["router"] == ROUTER_OPS
    assert ports["prefill"] == ports["decode"] == WORKER_OPS
    assert ports["kvcache"] == KVCACHE_OPS
    assert ports["telemetry"] == TELEMETRY_PORT
    assert ports["facilities"] == facilities_port


def test_prometheus_keeps_the_workers_series_once():
    """The gateway re-exposes the workers' tokenyard:* series; Prometheus scrapes the workers
    themselves, so it drops the gateway's copies (else every fleet sum doubles)."""
    config = yaml.safe_load((ROOT / "infra/prometheus/prometheus.yml").read_text())
    gateway = next(j for j in config["scrape_configs"] if j["job_name"] == "gateway")
    drops = [
        r["regex"]
        for r in gateway.get("metric_relabel_configs", [])
        if r.get("action") == "drop" and r.get("source_labels") == ["__name__"]
    ]
    assert len(drops) == 1, gateway
    for name in ("tokenyard:generation_tokens_total", "tokenyard:num_requests_running"):
        assert re.fullmatch(drops[0], name)
    assert not re.fullmatch(drops[0], "tokenyard_gateway_requests_total")
