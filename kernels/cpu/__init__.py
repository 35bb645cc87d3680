"""CPU kernels in C++, built on first use with torch's extension loader and cached on disk.

`ops()` returns the built module, or None where it cannot be built (no compiler, no ninja)
or where TOKENYARD_CPU_KERNELS=0; callers then take the pure-torch twin, which the tests
compare these kernels against. The first build takes about a minute on two cores; later
processes load the cached object in well under a second.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_lock = threading.Lock()
_state: dict[str, ModuleType | None] = {}


def enabled() -> bool:
    return os.environ.get("TOKENYARD_CPU_KERNELS", "1") not in ("0", "false", "no", "")


def ops() -> ModuleType | None:
    """The kernels' module, or None: use the torch twins. Decided once per process."""
    try:
        return _state["ops"]  # the hot path: called several times per layer per step
    except KeyError:
        pass
    with _lock:
        if "ops" not in _state:
            _state["ops"] = _build() if enabled() else None
        return _state["ops"]


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags: the kernels are built with -march=native, so a
    cache shared between machines (a container image) must not hand one CPU another's build."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.machine()
    return hashlib.blake2b(flags.encode(), digest_size=4).hexdigest()


def _build() -> ModuleType | None:
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name=f"tokenyard_cpu_kernels_{_cpu_tag()}",
            cpp_sources=[_SOURCE.read_text()],
            functions=["write_kv", "decode_attention", "add_rms_norm", "rotary", "silu_and_mul",
                       "int8_linear"],
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a sandbox without a writable cache
        log.warning("CPU kernels unavailable, using the torch path: %s", str(exc).splitlines()[0] if str(exc) else exc)
        return None
