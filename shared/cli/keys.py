"""`tokenyard keys create|list|revoke`: API keys in the gateway's key database.

    tokenyard keys create alice --rpm 60 --tpm 20000   # prints the key once
    tokenyard keys list
    tokenyard keys revoke 3f2a9c1d

The database is --db-url, else TOKENYARD_GATEWAY_KEYS_DB_URL, else a SQLite file under
~/.tokenyard (the one `tokenyard up` gives its gateway). The key store is the gateway's
(tokenyard.services.gateway.keys), imported when the command runs: the library imports no
service at import time.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tokenyard.db import default_url

DEFAULT_DATA_DIR = Path("~/.tokenyard")


def default_keys_url() -> str:
    return os.environ.get("TOKENYARD_GATEWAY_KEYS_DB_URL") or default_url(
        DEFAULT_DATA_DIR, "keys.db"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db-url", help="the key database (default: ~/.tokenyard/keys.db)")
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="make a key and print it (shown only once)")
    create.add_argument("name", help="who the key is for")
    create.add_argument("--tenant", help="keys of one tenant share a KV-cache salt (default: name)")
    create.add_argument("--rpm", type=_positive, help="requests per minute (default: no limit)")
    create.add_argument("--tpm", type=_positive, help="tokens per minute (default: no limit)")
    sub.add_parser("list", help="list keys (never their secrets)")
    revoke = sub.add_parser("revoke", help="revoke a key by its prefix")
    revoke.add_argument("prefix", help="the 8 characters after 'ty-'")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def run(args: argparse.Namespace) -> int:
    from tokenyard.services.gateway.keys import KeyStore

    store = KeyStore.open(args.db_url or default_keys_url())
    if args.action == "create":
        key, info = store.create(args.name, args.tenant, args.rpm, args.tpm)
        print(key)
        print(f"# prefix {info.prefix}, tenant {info.tenant}: store it now, it is not kept")
        return 0
    if args.action == "list":
        print(f"{'PREFIX':10} {'NAME':20} {'TENANT':20} {'RPM':>6} {'TPM':>8}  CREATED  STATUS")
        for row in store.list():
            status = f"revoked {row.revoked_at:%Y-%m-%d}" if row.revoked_at else "active"
            print(
                f"{row.prefix:10} {row.name[:20]:20} {row.tenant[:20]:20} "
                f"{row.requests_per_minute or '-':>6} {row.tokens_per_minute or '-':>8}  "
                f"{row.created_at:%Y-%m-%d}  {status}"
            )
        return 0
    if store.revoke(args.prefix):
        print(f"revoked {args.prefix}")
        return 0
    print(f"no active key with prefix {args.prefix}")
    return 1
