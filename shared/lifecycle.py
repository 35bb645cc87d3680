"""How every service process runs: settings checked at start (a configuration error exits
CONFIG_EXIT, which the launcher never restarts), until SIGINT or SIGTERM, then a graceful stop;
and its heap handed back to the OS after loading or a busy spell."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

# A service's exit code for "cannot run as configured" (sysexits' EX_CONFIG): a restart would
# fail the same way, so the launcher gives up at once and shows the reason.
CONFIG_EXIT = 78
# How long a service may take to wind down after SIGINT/SIGTERM before it exits anyway.
STOP_GRACE_S = 30.0

S = TypeVar("S", bound=BaseSettings)


def exit_for_config(service: str, reason: str) -> NoReturn:
    """Exit CONFIG_EXIT with one plain line of reason, the last line of stderr (the
    launcher's log file), where the launcher's give-up message quotes it."""
    sys.stderr.write(f"{service}: {reason}\n")
    sys.stderr.flush()
    raise SystemExit(CONFIG_EXIT)


def settings_or_exit(cls: type[S], service: str, **values: Any) -> S:
    """The service's settings from its environment, or CONFIG_EXIT naming the first bad one
    (every error goes to stderr before it)."""
    try:
        return cls(**values)
    except ValidationError as exc:
        sys.stderr.write(f"{exc}\n")
        first = exc.errors()[0]
        prefix = str(cls.model_config.get("env_prefix", ""))
        name = "_".join(str(part) for part in first["loc"]).upper()
        exit_for_config(service, f"bad setting {prefix}{name}: {first['msg']}")


def run_until_signalled(
    serve: Callable[[asyncio.Event], Awaitable[None]], grace_s: float = STOP_GRACE_S
) -> None:
    """Run `serve(stop)` on a fresh event loop; SIGINT/SIGTERM set `stop`, and `serve` is
    expected to wind down (drain NATS, stop servers) once it is set.

    A wind-down that has not ended `grace_s` after the signal exits the process with code 1:
    a service whose launcher died (the parent-death signal) must not wait forever on a NATS
    server or a peer that died with it."""

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        serving = asyncio.ensure_future(serve(stop))
        signalled = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if not serving.done():
            done, _ = await asyncio.wait({serving}, timeout=grace_s)
            if not done:
                sys.stderr.write(f"not stopped {grace_s:.0f} s after the signal: exiting\n")
                sys.stderr.flush()
                os._exit(1)  # NOTE: a thread stuck in a call would also block a normal exit
        await serving

    asyncio.run(run())


def trim_heap() -> None:
    """Return the free memory of glibc's heaps to the OS (glibc keeps what was freed).

    Loading dequantizes every weight to fp32 before the model casts and quantizes its own
    copies (a bf16 + int4 worker kept about 300 MiB more resident without a trim), and steps
    allocate and free activations of every size (a busy worker kept about 80 MiB more after a
    minute). Cheap: under a millisecond here."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL("libc.so.6").malloc_trim(0)
