"""The facilities service's Prometheus metrics: each rack's latest reading and state,
read from the monitor at scrape time (labels rack and site)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenyard.facilities.policy import State
from tokenyard.services.facilities.monitor import RackMonitor

# Reading field -> (metric name, help)
READINGS = {
    "power_kw": ("tokenyard:rack_power_kw", "Rack power draw, kW"),
    "supply_c": ("tokenyard:rack_coolant_supply_celsius", "Coolant supply temperature, °C"),
    "return_c": ("tokenyard:rack_coolant_return_celsius", "Coolant return temperature, °C"),
    "flow_lpm": ("tokenyard:rack_coolant_flow_lpm", "Coolant flow, litres per minute"),
}


class RackCollector(Collector):
    def __init__(self, monitor: RackMonitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        site = self.monitor.inventory.site
        families = {
            field: GaugeMetricFamily(name, help_, labels=["rack", "site"])
            for field, (name, help_) in READINGS.items()
        }
        state = GaugeMetricFamily(
            "tokenyard:rack_state",
            "1 for the rack's current state",
            labels=["rack", "site", "state"],
        )
        cap = GaugeMetricFamily(
            "tokenyard:rack_power_cap_kw", "Rack power cap, kW", labels=["rack", "site"]
        )
        for name, rack in self.monitor.racks.items():
            for s in State:
                state.add_metric([name, site, s.label], 1.0 if rack.status.state == s else 0.0)
            if rack.limits.power_cap_kw is not None:
                cap.add_metric([name, site], rack.limits.power_cap_kw)
            if rack.latest is None:
                continue
            for field, family in families.items():
                value = getattr(rack.latest, field)
                if value is not None:
                    family.add_metric([name, site], value)
        yield from families.values()
        yield state
        yield cap
