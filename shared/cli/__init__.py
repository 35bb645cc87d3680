"""The `tokenyard` command. Each sub-command is one module of this package, listed once here.

A sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``: the
command-line surface (arguments, printing); what it runs lives in its own package (the
launcher in tokenyard.services.launch, the simulator in tokenyard.sim, ...).
"""

from __future__ import annotations

import argparse
import importlib
from types import ModuleType

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tokenyard.cli.generate", "generate text offline with the engine"),
    "up": ("tokenyard.cli.up", "run the whole stack on this machine"),
    "bench": ("tokenyard.cli.bench", "benchmark an OpenAI-compatible server"),
    "keys": ("tokenyard.cli.keys", "create, list and revoke the gateway's API keys"),
    "nats-config": (
        "tokenyard.cli.nats_config",
        "NATS users and permissions for compose and Kubernetes; fresh passwords",
    ),
    "grpc-config": (
        "tokenyard.cli.grpc_config",
        "gRPC tokens per identity for compose and Kubernetes, and the servers' peers line",
    ),
    "plan": ("tokenyard.cli.plan", "size a fleet: GPUs, racks and kW for a model and workload"),
    "simulate": ("tokenyard.cli.simulate", "simulate a fleet under load with the router's policy"),
    "ctl": ("tokenyard.cli.ctl", "drain workers, fault racks, inspect the KV cache (gRPC control)"),
}


def load_command(name: str) -> ModuleType:
    """The sub-command's module; SystemExit with the reason when it cannot be imported."""
    module_name = COMMANDS[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise SystemExit(
            f"tokenyard {name}: cannot import {module_name} ({exc}); "
            "the installation is incomplete: reinstall tokenyard (make setup)"
        ) from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenyard")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {name: load_command(name) for name in COMMANDS}
    for name, module in modules.items():
        module.add_arguments(sub.add_parser(name, help=COMMANDS[name][1]))
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args))
