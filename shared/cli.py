"""The `tokenyard` command. Each sub-command lives in its own module, listed once here.

A sub-command module exposes ``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("tokenyard.engine.generate_cli", "generate text offline with the engine"),
    "up": ("tokenyard.services.up", "run the whole stack on this machine"),
    "bench": ("tokenyard.bench.cli", "benchmark an OpenAI-compatible server"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenyard")
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:  # a real missing dependency: say so
                raise
            continue  # that sub-command is not part of this build
        module.add_arguments(sub.add_parser(name, help=help_text))
        modules[name] = module
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args))


if __name__ == "__main__":
    sys.exit(main())
