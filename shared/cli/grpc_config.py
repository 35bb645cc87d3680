"""`tokenyard grpc-config`: fresh gRPC tokens of a deployment, one per identity
(tokenyard.grpc_security), and the peers setting that lets servers recognise them.

    tokenyard grpc-config --format env >> .env                     # compose reads .env
    tokenyard grpc-config --format secret | kubectl apply -f -     # Secret tokenyard-internal

A deployment's worker pools are `prefill` and `decode`; `operator` is for `tokenyard ctl`.
Servers get only the peers line (digests), each pool only its own token.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from tokenyard.grpc_security import OPERATOR, fresh_tokens, peers_text

IDENTITIES = ("prefill", "decode", OPERATOR)
SECRET = "tokenyard-internal"  # the Kubernetes Secret the manifests read
PEERS_KEY = "peers"
PEERS_VARIABLE = "TOKENYARD_GRPC_PEERS"


def secret_key(identity: str) -> str:
    """The key of an identity's token in Secret `tokenyard-internal`."""
    return f"{identity}-token"


def token_variable(identity: str) -> str:
    """The .env variable compose gives a pool as its TOKENYARD_GRPC_TOKEN."""
    return f"TOKENYARD_GRPC_{identity.upper()}_TOKEN"


def env_text(tokens: dict[str, str]) -> str:
    lines = [f"{token_variable(name)}={token}" for name, token in tokens.items()]
    return "\n".join([*lines, f"{PEERS_VARIABLE}={peers_text(tokens)}"]) + "\n"


def secret_text(tokens: dict[str, str]) -> str:
    data = {secret_key(name): token for name, token in tokens.items()}
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": SECRET,
            "namespace": "tokenyard",
            "labels": {"app.kubernetes.io/part-of": "tokenyard"},
        },
        "type": "Opaque",
        "stringData": {**data, PEERS_KEY: peers_text(tokens)},
    }
    return yaml.safe_dump(secret, sort_keys=False)


FORMATS = {"env": env_text, "secret": secret_text}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=sorted(FORMATS),
        default="env",
        help="env: lines for .env (docker compose); secret: a Kubernetes Secret (default env)",
    )


def run(args: argparse.Namespace) -> int:
    sys.stdout.write(FORMATS[args.format](fresh_tokens(IDENTITIES)))
    return 0
