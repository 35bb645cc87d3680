"""What a running `tokenyard up` leaves for `tokenyard ctl`: its control token and addresses.

`up` writes one JSON file (mode 0600: it holds the stack's tokens) in the user's runtime
directory and removes it on stop; `ctl` reads it when no token or address is given, so
`tokenyard ctl facilities racks` works against the local stack as it is.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def path() -> Path:
    """$TOKENYARD_RUN_FILE, else tokenyard/up.json in $XDG_RUNTIME_DIR (else ~/.cache)."""
    configured = os.environ.get("TOKENYARD_RUN_FILE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_RUNTIME_DIR") or Path.home() / ".cache"
    return Path(base) / "tokenyard" / "up.json"


def save(values: dict[str, str]) -> Path:
    target = path()
    target.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        os.fchmod(out.fileno(), 0o600)  # a file left by an older run keeps its mode otherwise
        json.dump(values, out, indent=2)
    return target


def load() -> dict[str, str]:
    """The running stack's values; empty when none is running (or it left no file)."""
    try:
        return dict(json.loads(path().read_text()))
    except (OSError, ValueError):
        return {}


def remove(values: dict[str, str]) -> None:
    """Remove the file if it is still this stack's (another `up` may have replaced it)."""
    if load() == values:
        with contextlib.suppress(OSError):
            path().unlink()
