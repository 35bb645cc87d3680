"""A service's run: the signal starts its wind-down, and a wind-down that hangs ends anyway."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

SERVICE = textwrap.dedent(
    """
    import asyncio, sys
    from tokenyard.lifecycle import run_until_signalled

    async def serve(stop):
        print("serving", flush=True)
        await stop.wait()
        print("winding down", flush=True)
        if sys.argv[1] == "hang":
            await asyncio.Event().wait()  # a peer that never answers

    run_until_signalled(serve, grace_s=1.0)
    """
)


def _signalled(mode: str) -> tuple[subprocess.CompletedProcess, float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVICE, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "serving\n"
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), start


def test_a_wind_down_that_ends_exits_cleanly():
    done, _ = _signalled("clean")
    assert done.returncode == 0
    assert done.stdout == "winding down\n" and done.stderr == ""


def test_a_wind_down_that_hangs_exits_after_the_grace():
    done, start = _signalled("hang")
    assert done.returncode == 1
    assert "not stopped 1 s after the signal" in done.stderr
    assert time.monotonic() - start < 20  # not forever (the grace is 1 s)
