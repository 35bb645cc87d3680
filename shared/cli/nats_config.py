"""`tokenyard nats-config`: the NATS users of a deployment (tokenyard.bus.nats_config).

    tokenyard nats-config > infra/nats/users.conf                     # compose mounts it
    tokenyard nats-config --format configmap > infra/k8s/base/nats-users.yaml
    tokenyard nats-config --format env >> .env                        # fresh passwords
    tokenyard nats-config --format secret | kubectl apply -f -        # the same, as a Secret

Rerun the first two after a permission changes in tokenyard.bus.auth: a test keeps the
checked-in files equal to their output.
"""

from __future__ import annotations

import argparse
import sys

from tokenyard.bus.nats_config import config_text, configmap_text, env_text, secret_text

FORMATS = {"conf": config_text, "configmap": configmap_text, "env": env_text, "secret": secret_text}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=sorted(FORMATS),
        default="conf",
        help="conf: nats-server's users and permissions (passwords from the environment); "
        "configmap: the same as a Kubernetes ConfigMap; env: fresh passwords for .env; "
        "secret: fresh passwords as a Kubernetes Secret (default conf)",
    )


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(FORMATS[args.format]())
    return 0
